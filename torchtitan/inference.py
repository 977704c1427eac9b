"""Sliding-window prediction with overlapping, blended tiles.

A volume (C, D, H, W) is covered by windows of the model's input size with a given overlap;
each window's output is weighted (Gaussian: centre voxels count more than borders, where a
ViT sees less context) and the weighted sum is divided by the summed weights. 2D models run
plane by plane along z.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import product

import numpy as np
import torch


def window_starts(size: int, window: int, overlap: float) -> list[int]:
    """Start offsets covering ``[0, size)`` with windows of ``window`` overlapping by at least
    ``overlap`` (a fraction); the last window ends exactly at ``size``."""
    if size <= window:
        return [0]
    stride = max(1, int(window * (1 - overlap)))
    n = int(np.ceil((size - window) / stride)) + 1
    return [int(round(i * (size - window) / (n - 1))) for i in range(n)]


def blending_weights(window: tuple[int, ...], mode: str, sigma_scale: float = 0.125) -> torch.Tensor:
    """Per-voxel weights of one window: ``constant`` or ``gaussian`` (sigma = window/8)."""
    if mode == "constant":
        return torch.ones(window)
    if mode != "gaussian":
        raise ValueError(f"blending mode {mode!r}: use 'gaussian' or 'constant'")
    w = torch.ones(())
    for n in window:
        x = torch.arange(n, dtype=torch.float32) - (n - 1) / 2
        g = torch.exp(-0.5 * (x / max(n * sigma_scale, 1e-3)) ** 2)
        w = w[..., None] * g
    return (w / w.max()).clamp_min(1e-3)


@torch.no_grad()
def sliding_window(predict: Callable[[torch.Tensor], torch.Tensor], image: torch.Tensor,
                   window: tuple[int, ...], num_outputs: int, overlap: float = 0.25,
                   blend: str = "gaussian", batch_size: int = 4) -> torch.Tensor:
    """Predict ``image`` (C, *spatial) in windows; returns (num_outputs, *spatial) on the CPU.

    ``predict`` maps a batch (B, C, *window) to (B, num_outputs, *window). Inputs smaller than
    the window are zero-padded (and the padding cropped away again).
    """
    spatial = tuple(image.shape[1:])
    nd = len(window)
    assert len(spatial) == nd, f"image has {len(spatial)} spatial dims, window {nd}"
    pad = [max(0, w - s) for w, s in zip(window, spatial)]
    if any(pad):
        pads = []
        for p in reversed(pad):
            pads += [p // 2, p - p // 2]
        image = torch.nn.functional.pad(image, pads)
    padded = tuple(image.shape[1:])
    out = torch.zeros((num_outputs, *padded))
    norm = torch.zeros(padded)
    weight = blending_weights(window, blend)
    starts = list(product(*[window_starts(s, w, overlap) for s, w in zip(padded, window)]))
    for i in range(0, len(starts), batch_size):
        chunk = starts[i:i + batch_size]
        slices = [tuple(slice(s, s + w) for s, w in zip(st, window)) for st in chunk]
        batch = torch.stack([image[(slice(None), *sl)] for sl in slices])
        pred = predict(batch).float().cpu()
        for sl, p in zip(slices, pred):
            out[(slice(None), *sl)] += p * weight
            norm[sl] += weight
    out /= norm.clamp_min(1e-8)
    crop = tuple(slice(p // 2, p // 2 + s) for p, s in zip(pad, spatial))
    return out[(slice(None), *crop)]


def predict_volume(predict: Callable[[torch.Tensor], torch.Tensor], volume: torch.Tensor,
                   window: tuple[int, ...], num_outputs: int, overlap: float = 0.25,
                   blend: str = "gaussian", batch_size: int = 8) -> torch.Tensor:
    """Predict a (C, D, H, W) volume with a 3D model, or plane by plane with a 2D one.

    A 2D window (h, w) is run as a 3D window (1, h, w), so tiles of different planes share
    batches.
    """
    window = tuple(window)
    if len(window) == 3:
        return sliding_window(predict, volume, window, num_outputs, overlap, blend, batch_size)

    def predict_planes(batch: torch.Tensor) -> torch.Tensor:
        return predict(batch[:, :, 0]).unsqueeze(2)

    return sliding_window(predict_planes, volume, (1, *window), num_outputs, overlap, blend,
                          batch_size)


def num_predict_calls(spatial: tuple[int, ...], window: tuple[int, ...], overlap: float,
                      batch_size: int) -> int:
    """How many times :func:`predict_volume` calls ``predict`` for a (D, H, W) volume.

    Sharded models (FSDP) run collectives inside every forward, so ranks that predict
    different amounts must pad with idle forwards up to the largest count.
    """
    window = tuple(window) if len(window) == 3 else (1, *window)
    n = 1
    for s, w in zip(spatial, window):
        n *= len(window_starts(max(s, w), w, overlap))
    return -(-n // batch_size)


def _block_starts(size: int, block: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + block, size)) for lo in range(0, size, block)]


def block_shape_for_budget(shape: tuple[int, int, int], window: tuple[int, int, int],
                           num_outputs: int, max_block_bytes: float) -> tuple[int, int, int]:
    """The largest block (a multiple of the window along y and x) whose float32 output and
    weight buffers fit ``max_block_bytes``; whole planes are split before depth is."""
    per_voxel = 4 * (num_outputs + 1)
    block = list(shape)
    while np.prod(block) * per_voxel > max_block_bytes:
        ax = int(np.argmax([b / w for b, w in zip(block, window)]))
        if block[ax] <= window[ax]:
            break
        block[ax] = max(window[ax], int(np.ceil(block[ax] / 2 / window[ax])) * window[ax])
    return tuple(int(b) for b in block)  # type: ignore[return-value]


@torch.no_grad()
def predict_blockwise(predict: Callable[[torch.Tensor], torch.Tensor],
                      read_input: Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor],
                      write_block: Callable[[tuple[int, ...], tuple[int, ...], torch.Tensor], None],
                      shape: tuple[int, int, int], window: tuple[int, ...], num_outputs: int,
                      overlap: float = 0.25, blend: str = "gaussian", batch_size: int = 8,
                      block_shape: tuple[int, int, int] | None = None,
                      rank: int = 0, world_size: int = 1, progress=None) -> int:
    """Predict a (D, H, W) volume that need not fit in memory, one output block at a time.

    Windows lie on one global grid (the grid :func:`sliding_window` uses for the whole
    volume), so the blended result does not depend on the block size: each block gathers the
    windows that overlap it, reads their input on demand with ``read_input(lo, hi)`` (a
    (C, *window) tensor; the region may extend past the volume, to be padded by the reader),
    and hands the finished block to ``write_block(lo, hi, values)``. Blocks are dealt out
    round-robin to ``world_size`` ranks. Returns the number of blocks this rank wrote.
    """
    window3 = tuple(window) if len(window) == 3 else (1, *window)
    is_2d = len(window) == 2
    weight = blending_weights(window3, blend)
    starts = [window_starts(max(s, w), w, overlap) for s, w in zip(shape, window3)]
    blocks = list(product(*[_block_starts(s, b) for s, b in
                            zip(shape, block_shape or shape)]))
    done = 0
    for index, block in enumerate(blocks):
        if index % world_size != rank:
            continue
        lo = tuple(b[0] for b in block)
        hi = tuple(b[1] for b in block)
        out = torch.zeros((num_outputs, *[h - l for l, h in zip(lo, hi)]))
        norm = torch.zeros(out.shape[1:])
        mine = [[s for s in st if s < h and s + w > l]
                for st, l, h, w in zip(starts, lo, hi, window3)]
        todo = list(product(*mine))
        for i in range(0, len(todo), batch_size):
            chunk = todo[i:i + batch_size]
            batch = torch.stack([read_input(st, tuple(s + w for s, w in zip(st, window3)))
                                 for st in chunk])
            pred = predict(batch[:, :, 0]).unsqueeze(2) if is_2d else predict(batch)
            pred = pred.float().cpu()
            for st, p in zip(chunk, pred):
                # Intersection of the window with the block, in both frames.
                src = tuple(slice(max(l - s, 0), min(h - s, w))
                            for s, l, h, w in zip(st, lo, hi, window3))
                dst = tuple(slice(max(s - l, 0), max(s - l, 0) + (sl.stop - sl.start))
                            for s, l, sl in zip(st, lo, src))
                out[(slice(None), *dst)] += p[(slice(None), *src)] * weight[src]
                norm[dst] += weight[src]
        out /= norm.clamp_min(1e-8)
        write_block(lo, hi, out)
        done += 1
        if progress is not None:
            progress(1)
    return done
