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
