"""Sliding-window prediction with overlapping, blended tiles.

A volume (C, D, H, W) is covered by windows of the model's input size with a given overlap;
each window's output is weighted (Gaussian: centre voxels count more than borders, where a
model sees less context) and the weighted sum is divided by the summed weights.

One code path serves everything: :func:`sliding_window` (a volume in memory) is
:func:`predict_blockwise` (a volume read window by window, written block by block) with a
single block, so validation during training and ``predict.py`` give the same numbers.
The windows a prediction runs, and how they are batched, are a :class:`WindowPlan`: the
prediction runs the plan's batches and sharded validation counts the same batches
(``plan.num_calls``) to pad the ranks with less work, so count and forwards cannot disagree.

Options on top of the plain tiling:

- **2D models** run plane by plane: a 2D window (h, w) becomes the 3D window (1, h, w), so
  tiles of different planes share batches. With ``planes="zyx"`` a 2D model on a 3D volume
  predicts three times, on yx planes (1, h, w), zx planes (h, 1, w) and zy planes (h, w, 1),
  and the three probability volumes are averaged. That is only meaningful on an isotropic
  grid (the model was trained on yx planes at the yx voxel size); 3D models ignore it.
- **Test-time augmentation** (``tta_flips=True``) wraps ``predict``: each window is predicted
  with every combination of flips of its spatial axes (2D: 4, 3D: 8 = the whole group of
  axis flips, so the result is exactly flip-equivariant), each output is flipped back and the
  probabilities are averaged. An affinity channel flipped back describes the pair (v, v - o)
  rather than (v, v + o), so it is shifted back by its offset first (``channel_offsets``,
  :func:`realign_affinities`). The flipped copies go through the model in one forward (the
  batch grows by 4x or 8x), so the number of forwards, which sharded validation counts, does
  not change; lower ``inference.batch_size`` if that batch does not fit.

Speed: each window's output is accumulated in place (``addcmul_``) into one preallocated
buffer. Blending weights are separable (a product of one 1D profile per axis) and windows lie
on a product grid, so the summed weight at a voxel is a product of 1D sums, computed once per
axis instead of window by window. Plane windows (one voxel thick) are visited with the thin
axis fastest, so a batch holds runs of neighbouring planes: each run is read as one slab and
accumulated with one operation.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations, product

import numpy as np
import torch

from torchtitan.cellmap.affinities import (AffinitySpec, channel_offsets, config_outputs,
                                           output_channels)
from torchtitan.choices import PLANES, is_isotropic
from torchtitan.models import predict_probabilities

logger = logging.getLogger(__name__)

Predict = Callable[[torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# The grid of windows
# ---------------------------------------------------------------------------------------------


def window_starts(size: int, window: int, overlap: float) -> list[int]:
    """Start offsets covering ``[0, size)`` with windows of ``window`` overlapping by at least
    ``overlap`` (a fraction); the last window ends exactly at ``size``."""
    if size <= window:
        return [0]
    stride = max(1, int(window * (1 - overlap)))
    n = int(np.ceil((size - window) / stride)) + 1
    return [int(round(i * (size - window) / (n - 1))) for i in range(n)]


def grid_starts(size: int, window: int, overlap: float) -> list[int]:
    """:func:`window_starts`, except that an axis shorter than the window gets one window
    centred on it (a negative start; what lies outside is zero-padded or read as context)."""
    if size < window:
        return [-((window - size) // 2)]
    return window_starts(size, window, overlap)


# ---------------------------------------------------------------------------------------------
# Blending weights
# ---------------------------------------------------------------------------------------------


def blending_profile(n: int, mode: str, sigma_scale: float = 0.125) -> torch.Tensor:
    """The 1D weight profile of a window of ``n`` voxels along one axis (maximum 1).

    ``gaussian``: sigma = ``sigma_scale`` * n (n/8 by default, as MONAI's default). No floor is
    needed: at the window's edge the weight is exp(-8) ~ 3e-4 per axis, far above float32's
    underflow, so every voxel of a window keeps a positive weight.
    """
    if mode == "constant":
        return torch.ones(n)
    if mode != "gaussian":
        raise ValueError(f"blending mode {mode!r}: use 'gaussian' or 'constant'")
    x = torch.arange(n, dtype=torch.float32) - (n - 1) / 2
    g = torch.exp(-0.5 * (x / max(n * sigma_scale, 1e-3)) ** 2)
    return g / g.max()


def blending_weights(window: tuple[int, ...], mode: str, sigma_scale: float = 0.125) -> torch.Tensor:
    """Per-voxel weights of one window: the outer product of the per-axis profiles."""
    w = torch.ones(())
    for n in window:
        w = w[..., None] * blending_profile(n, mode, sigma_scale)
    return w.contiguous()


def blending_norm(size: int, window: int, starts: Sequence[int], profile: torch.Tensor) -> torch.Tensor:
    """Summed weight of every window along one axis at each position of ``[0, size)``."""
    norm = torch.zeros(size)
    for s in starts:
        lo, hi = max(s, 0), min(s + window, size)
        norm[lo:hi] += profile[lo - s:hi - s]
    return norm


# ---------------------------------------------------------------------------------------------
# Wrappers of the predict callable: test-time flips, 2D models on 3D windows
# ---------------------------------------------------------------------------------------------


def flip_combinations(ndim: int) -> list[tuple[int, ...]]:
    """Every subset of the spatial dims of a (B, C, *spatial) batch, the identity first."""
    axes = range(2, 2 + ndim)
    return [dims for r in range(ndim + 1) for dims in combinations(axes, r)]


def with_flips(predict: Predict, ndim: int) -> Predict:
    """``predict`` averaged over all 2**ndim flips of the window's spatial axes.

    The flipped copies are concatenated into one batch (one forward), each output is flipped
    back, and the probabilities are averaged. A ``predict`` with a ``channel_offsets``
    attribute (per output channel, the offset of an affinity channel, None for a class) has
    its affinity channels realigned first (:func:`realign_affinities`).
    """
    flips = flip_combinations(ndim)
    offsets = getattr(predict, "channel_offsets", None)

    def predict_flipped(batch: torch.Tensor) -> torch.Tensor:
        n = batch.shape[0]
        out = predict(torch.cat([batch.flip(dims) if dims else batch for dims in flips]))
        parts = out.split(n)
        total = None
        for dims, part in zip(flips, parts):
            part = part.flip(dims) if dims else part
            if dims and offsets:
                part = realign_affinities(part, dims, offsets, parts[0])
            total = part.float().clone() if total is None else total.add_(part)
        return total.div_(len(flips))

    return predict_flipped


def realign_affinities(part: torch.Tensor, dims, offsets, plain: torch.Tensor) -> torch.Tensor:
    """The affinity channels of an output predicted on a window flipped along ``dims`` and
    flipped back: channel ``c`` (offset ``o``) holds at voxel v the affinity between v and
    v - o (the flip reversed the offset), so it is shifted by ``o`` to hold (v, v + o) again.
    Where v + o leaves the window, and for an offset flipped along some but not all of its
    axes (a pair of voxels the channel does not describe), ``plain`` (the unflipped output)
    stands in. ``part`` is changed in place (it is a copy made by the flip)."""
    for c, o in enumerate(offsets):
        if o is None:
            continue
        moved = [a for a, v in enumerate(o) if v and 2 + a in dims]
        if not moved:
            continue
        shifted = plain[:, c].clone()
        src = [slice(None)] * (part.ndim - 2)
        dst = list(src)
        whole = len(moved) == sum(1 for v in o if v)
        for a in moved:
            step, length = int(o[a]), part.shape[2 + a]
            whole = whole and abs(step) < length
            src[a] = slice(step, length) if step > 0 else slice(0, length + step)
            dst[a] = slice(0, length - step) if step > 0 else slice(-step, length)
        if whole:
            shifted[(slice(None), *dst)] = part[(slice(None), c, *src)]
        part[:, c] = shifted
    return part


def on_planes(predict2d: Predict, axis: int) -> Predict:
    """A 2D ``predict`` as a 3D one on windows one voxel thick along ``axis`` (0=z, 1=y, 2=x):
    (B, C, 1, h, w) -> (B, K, 1, h, w), and likewise (h, 1, w) and (h, w, 1)."""

    def predict3d(batch: torch.Tensor) -> torch.Tensor:
        return predict2d(batch.select(2 + axis, 0)).unsqueeze(2 + axis)

    return predict3d


def plane_windows(window: tuple[int, int], planes: str) -> list[tuple[tuple[int, int, int], int]]:
    """The 3D windows (and their thin axis) of a 2D model: yx planes, then zx and zy ones."""
    h, w = window
    out = [((1, h, w), 0)]
    if planes == "zyx":
        out += [((h, 1, w), 1), ((h, w, 1), 2)]
    return out


_warned: set[str] = set()


def resolve_planes(planes: str, ndim: int, voxel_size: Sequence[float] | None = None) -> str:
    """Check ``planes`` against the model and grid; 3D models ignore "zyx" (logged once)."""
    if planes not in PLANES:
        raise ValueError(f"inference.planes {planes!r}: use one of {', '.join(PLANES)}")
    if planes == "zyx" and ndim == 3:
        if "3d" not in _warned:
            _warned.add("3d")
            logger.warning("inference.planes='zyx' is for 2D models; a 3D model predicts whole "
                           "3D windows, so it is ignored")
        return "z"
    if planes == "zyx" and voxel_size is not None:
        v = [float(s) for s in voxel_size]
        if not is_isotropic(v):
            raise ValueError(
                f"inference.planes='zyx' needs an isotropic grid, but data.voxel_size is {v}: a 2D "
                "model trained on yx planes would see zx and zy planes at another resolution. "
                "Use inference.planes='z' or train on an isotropic voxel size.")
    return planes


@dataclass(frozen=True)
class WindowPlan:
    """The windows a prediction of a (D, H, W) volume runs, in the batches it runs them.

    It is the one source of both the forwards and their count: :func:`_predict_block` runs
    exactly the batches :meth:`batches` yields, and :attr:`num_calls` counts those same
    batches. Sharded (FSDP) validation counts forwards before running them so that ranks
    with less work pad with idle forwards; a count derived separately from the batching could
    drift from it, and ranks that disagree hang in a collective.

    There is one tiling per 3D window: one for a 3D model or a 2D model on yx planes, three
    for a 2D model with ``planes="zyx"``. Test-time flips share each forward, so they do not
    enter the plan.
    """

    shape: tuple[int, int, int]
    windows: tuple[tuple[int, int, int], ...]  # the 3D window of each tiling
    plane_axes: tuple[int | None, ...]  # per tiling: the axis a 2D model's planes are normal to
    starts: tuple[tuple[tuple[int, ...], ...], ...]  # per tiling, per axis: the global grid
    batch_size: int

    @classmethod
    def build(cls, shape: Sequence[int], window: Sequence[int], overlap: float,
              batch_size: int, planes: str = "z",
              voxel_size: Sequence[float] | None = None) -> WindowPlan:
        """The plan of a volume of ``shape`` for a model whose input is ``window`` ((h, w)
        for a 2D model, (d, h, w) for a 3D one); ``planes`` as :func:`resolve_planes`."""
        window = tuple(int(w) for w in window)
        if len(window) not in (2, 3):
            raise ValueError(f"window {window}: expected 2 (h, w) or 3 (d, h, w) sizes")
        planes = resolve_planes(planes, len(window), voxel_size)
        shape = tuple(int(s) for s in shape)
        tilings = [(window, None)] if len(window) == 3 else plane_windows(window, planes)
        starts = tuple(tuple(tuple(grid_starts(s, w, overlap)) for s, w in zip(shape, w3))
                       for w3, _ in tilings)
        return cls(shape, tuple(w3 for w3, _ in tilings), tuple(a for _, a in tilings),
                   starts, int(batch_size))

    def batches(self, tiling: int, lo: Sequence[int], hi: Sequence[int]
                ) -> Iterator[list[tuple[int, ...]]]:
        """The window starts of each forward of tiling ``tiling`` that predicts the block
        ``[lo, hi)``: the windows of the global grid that overlap the block, ``batch_size``
        at a time.

        Plane windows (one voxel thick) are visited with the thin axis fastest, so that a
        batch holds runs of neighbouring planes. Either way the windows that cover one voxel
        come in grid order, the same for every block, so a voxel's sum does not depend on how
        the volume is cut into blocks."""
        window = self.windows[tiling]
        mine = [[s for s in st if s < h and s + w > l]
                for st, l, h, w in zip(self.starts[tiling], lo, hi, window)]
        thin = window.index(1) if 1 in window else None
        order = [a for a in range(3) if a != thin] + ([thin] if thin is not None else [])
        todo = [tuple(st[order.index(a)] for a in range(3))
                for st in product(*[mine[a] for a in order])]
        for i in range(0, len(todo), self.batch_size):
            yield todo[i:i + self.batch_size]

    def block_calls(self, lo: Sequence[int], hi: Sequence[int]) -> int:
        """How many forwards the prediction of the block ``[lo, hi)`` runs (every tiling)."""
        return sum(1 for t in range(len(self.windows)) for _ in self.batches(t, lo, hi))

    @property
    def num_calls(self) -> int:
        """How many forwards the prediction of the whole volume runs."""
        return self.block_calls((0, 0, 0), self.shape)


@dataclass
class _Tiling:
    """What one tiling of a :class:`WindowPlan` predicts with: the callable that predicts its
    windows, the per-voxel weight of a window and the per-axis summed weights."""

    window: tuple[int, int, int]
    predict: Predict
    weight: torch.Tensor  # (*window)
    norm: list[torch.Tensor]  # per axis: summed weights over the whole volume


def _tilings(predict: Predict, plan: WindowPlan, blend: str, tta_flips: bool) -> list[_Tiling]:
    """The callables and blending weights of each tiling of ``plan``."""
    if tta_flips:  # the flips of the model's own input: 2D for a 2D model
        predict = with_flips(predict, 3 if plan.plane_axes[0] is None else 2)
    out = []
    for w3, axis, starts in zip(plan.windows, plan.plane_axes, plan.starts):
        profiles = [blending_profile(w, blend) for w in w3]
        weight = blending_weights(w3, blend)
        norm = [blending_norm(s, w, st, pr)
                for s, w, st, pr in zip(plan.shape, w3, starts, profiles)]
        out.append(_Tiling(w3, predict if axis is None else on_planes(predict, axis), weight, norm))
    return out


# ---------------------------------------------------------------------------------------------
# The core: one output block from the windows that overlap it
# ---------------------------------------------------------------------------------------------


def _runs(chunk: list[tuple[int, ...]], thin: int | None) -> list[list[tuple[int, ...]]]:
    """Split a batch of window starts into runs of neighbouring planes: windows one voxel
    thick along axis ``thin`` whose starts differ only there, by one each. A run is read as
    one slab and accumulated with one operation (3D windows: every run has one window)."""
    runs: list[list[tuple[int, ...]]] = []
    for st in chunk:
        if thin is not None and runs:
            prev = runs[-1][-1]
            if st[thin] == prev[thin] + 1 and all(
                    a == b for k, (a, b) in enumerate(zip(prev, st)) if k != thin):
                runs[-1].append(st)
                continue
        runs.append([st])
    return runs


def _predict_block(plan: WindowPlan, index: int, tiling: _Tiling, read_input,
                   lo: tuple[int, ...], hi: tuple[int, ...], num_outputs: int) -> torch.Tensor:
    """Blended prediction (num_outputs, *block) of the block ``[lo, hi)`` by the tiling
    ``index`` of ``plan``: one forward per batch of :meth:`WindowPlan.batches`."""
    window = tiling.window
    weight = tiling.weight
    block = tuple(h - l for l, h in zip(lo, hi))
    out = torch.zeros((num_outputs, *block))
    thin = window.index(1) if 1 in window else None
    for chunk in plan.batches(index, lo, hi):
        runs = _runs(chunk, thin)
        windows = []
        for run in runs:
            first, n = run[0], len(run)
            # One read per run: the slab of its n planes, then one window per plane.
            stop = [s + w for s, w in zip(first, window)]
            if thin is not None:
                stop[thin] += n - 1
            slab = read_input(first, tuple(stop))
            windows += [slab] if thin is None else list(slab.split(1, dim=1 + thin))
        batch = torch.stack(windows)
        del windows
        pred = tiling.predict(batch)
        if pred.device.type != "cpu" or pred.dtype != torch.float32:
            pred = pred.float().cpu()
        k = 0
        for run in runs:
            first, n = run[0], len(run)
            p = pred[k:k + n]
            k += n
            # Intersection of the windows with the block, in window and block coordinates.
            src = tuple(slice(max(l - s, 0), min(h - s, w)) for s, l, h, w in zip(first, lo, hi, window))
            dst = [slice(s + a.start - l, s + a.stop - l) for s, l, a in zip(first, lo, src)]
            values = p[(slice(None), slice(None), *src)]
            if thin is None:
                values = values[0]  # (K, *window)
            else:  # (n, K, ...1...) -> (K, ...n...): the run's planes side by side
                values = values.squeeze(2 + thin).movedim(0, 1 + thin)
                dst[thin] = slice(dst[thin].start, dst[thin].start + n)
            # out += values * weight, in place: no temporary of the window's size.
            out[(slice(None), *dst)].addcmul_(values, weight[src])
        # Free this batch before the next forward, so the allocator can reuse its memory.
        del batch, pred, p, values
    # Divide by the summed weights: the outer product of the per-axis sums.
    nz, ny, nx = (n[l:h] for n, l, h in zip(tiling.norm, lo, hi))
    out.mul_((nz[:, None, None] * ny[None, :, None] * nx[None, None, :]).reciprocal_())
    return out


def _predict_block_all(plan: WindowPlan, tilings: list[_Tiling], read_input, lo, hi,
                       num_outputs: int) -> torch.Tensor:
    """The block predicted by every tiling, averaged (one tiling: just its prediction)."""
    out = _predict_block(plan, 0, tilings[0], read_input, lo, hi, num_outputs)
    for index in range(1, len(tilings)):
        out.add_(_predict_block(plan, index, tilings[index], read_input, lo, hi, num_outputs))
    if len(tilings) > 1:
        out.div_(len(tilings))
    return out


def _memory_reader(image: torch.Tensor):
    """``read_input`` of a (C, *spatial) tensor: zeros outside it."""
    spatial = tuple(image.shape[1:])

    def read(lo, hi):
        if all(l >= 0 and h <= s for l, h, s in zip(lo, hi, spatial)):
            return image[(slice(None), *[slice(l, h) for l, h in zip(lo, hi)])]
        out = image.new_zeros((image.shape[0], *[h - l for l, h in zip(lo, hi)]))
        src = tuple(slice(max(l, 0), min(h, s)) for l, h, s in zip(lo, hi, spatial))
        dst = tuple(slice(a.start - l, a.stop - l) for a, l in zip(src, lo))
        out[(slice(None), *dst)] = image[(slice(None), *src)]
        return out

    return read


# ---------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def sliding_window(predict: Predict, image: torch.Tensor, window: tuple[int, ...],
                   num_outputs: int, overlap: float = 0.25, blend: str = "gaussian",
                   batch_size: int = 4, tta_flips: bool = False) -> torch.Tensor:
    """Predict ``image`` (C, *spatial) in windows; returns (num_outputs, *spatial) on the CPU.

    ``predict`` maps a batch (B, C, *window) to (B, num_outputs, *window) probabilities.
    Axes shorter than the window get one centred window; the part outside is zero-padded.
    """
    window = tuple(int(w) for w in window)
    spatial = tuple(image.shape[1:])
    assert len(spatial) == len(window), f"image has {len(spatial)} spatial dims, window {len(window)}"
    if len(window) == 2:  # a 2D image: one plane of a 3D volume
        predict2d = with_flips(predict, 2) if tta_flips else predict
        return sliding_window(on_planes(predict2d, 0), image[:, None], (1, *window), num_outputs,
                              overlap, blend, batch_size)[:, 0]
    plan = WindowPlan.build(spatial, window, overlap, batch_size)
    tilings = _tilings(predict, plan, blend, tta_flips)
    return _predict_block(plan, 0, tilings[0], _memory_reader(image), (0, 0, 0), spatial,
                          num_outputs)


@torch.no_grad()
def predict_volume(predict: Predict, volume: torch.Tensor, window: tuple[int, ...],
                   num_outputs: int, overlap: float = 0.25, blend: str = "gaussian",
                   batch_size: int = 8, tta_flips: bool = False, planes: str = "z",
                   voxel_size: Sequence[float] | None = None) -> torch.Tensor:
    """Predict a (C, D, H, W) volume with a 3D model, or plane by plane with a 2D one.

    ``tta_flips``: average over the flips of each window (see the module docstring).
    ``planes``: "z" (yx planes along z) or "zyx" (2D models: also zx and zy planes, averaged;
    ``voxel_size``, when given, must be isotropic). Returns (num_outputs, D, H, W) on the CPU.
    """
    plan = WindowPlan.build(volume.shape[1:], window, overlap, batch_size, planes, voxel_size)
    return predict_planned(predict, plan, volume, num_outputs, blend, tta_flips)


@torch.no_grad()
def predict_planned(predict: Predict, plan: WindowPlan, volume: torch.Tensor, num_outputs: int,
                    blend: str = "gaussian", tta_flips: bool = False) -> torch.Tensor:
    """:func:`predict_volume` with its :class:`WindowPlan` given: it runs one forward per
    batch of ``plan``, ``plan.num_calls`` in all."""
    spatial = tuple(volume.shape[1:])
    if spatial != plan.shape:
        raise ValueError(f"a volume of shape {spatial} predicted with the plan of {plan.shape}")
    return _predict_block_all(plan, _tilings(predict, plan, blend, tta_flips),
                              _memory_reader(volume), (0, 0, 0), spatial, num_outputs)


def _block_starts(size: int, block: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + block, size)) for lo in range(0, size, block)]


def block_window(window: tuple[int, ...], planes: str = "z") -> tuple[int, int, int]:
    """The extent of the windows along each axis over every tiling (a 2D window on the
    ``planes``' planes): blocks that are multiples of it leave few windows straddling two
    blocks (predicted twice)."""
    w = tuple(window)
    if len(w) == 3:
        return w  # type: ignore[return-value]
    return (w[0], max(w), w[1]) if planes == "zyx" else (1, *w)


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
def predict_blockwise(predict: Predict,
                      read_input: Callable[[tuple[int, ...], tuple[int, ...]], torch.Tensor],
                      write_block: Callable[[tuple[int, ...], tuple[int, ...], torch.Tensor], None],
                      shape: tuple[int, int, int], window: tuple[int, ...], num_outputs: int,
                      overlap: float = 0.25, blend: str = "gaussian", batch_size: int = 8,
                      block_shape: tuple[int, int, int] | None = None,
                      rank: int = 0, world_size: int = 1, progress=None,
                      tta_flips: bool = False, planes: str = "z",
                      voxel_size: Sequence[float] | None = None,
                      indices: Sequence[int] | None = None) -> int:
    """Predict a (D, H, W) volume that need not fit in memory, one output block at a time.

    Windows lie on one global grid (the grid :func:`predict_volume` uses for the whole
    volume), so the blended result does not depend on the block size: each block gathers the
    windows that overlap it, reads their input on demand with ``read_input(lo, hi)`` (a
    (C, *window) tensor; the region may extend past the volume, to be padded or filled with
    context by the reader), and hands the finished block to ``write_block(lo, hi, values)``.
    With ``planes="zyx"`` each block is predicted by the three tilings in turn and averaged.
    Blocks are numbered in raster order (the last axis fastest); ``indices`` names the blocks
    to predict, by default those dealt out round-robin to this rank of ``world_size``. Returns
    the number of blocks this rank wrote.
    """
    shape = tuple(int(s) for s in shape)
    plan = WindowPlan.build(shape, window, overlap, batch_size, planes, voxel_size)
    tilings = _tilings(predict, plan, blend, tta_flips)
    blocks = list(product(*[_block_starts(s, b) for s, b in zip(shape, block_shape or shape)]))
    if indices is None:
        indices = range(rank, len(blocks), world_size)
    done = 0
    for index in indices:
        block = blocks[index]
        lo = tuple(b[0] for b in block)
        hi = tuple(b[1] for b in block)
        write_block(lo, hi, _predict_block_all(plan, tilings, read_input, lo, hi, num_outputs))
        done += 1
        if progress is not None:
            progress(1)
    return done


# ---------------------------------------------------------------------------------------------
# One model predicting whole volumes (validation and predict.py)
# ---------------------------------------------------------------------------------------------


@dataclass
class VolumePredictor:
    """A model's prediction of whole volumes, as validation and ``predict.py`` both run it.

    It owns the device, the predict function (the model's probabilities, under bf16 autocast
    where asked), the test-time flips and planes, the window plan (window, overlap, blending,
    batch) and the count of forwards that sharded ranks must match (:meth:`forward_count`,
    :meth:`idle_forwards`).
    """

    model: torch.nn.Module
    loss: str  # model.loss: what the outputs mean (sigmoid or softmax probabilities)
    device: torch.device
    window: tuple[int, ...]
    num_outputs: int
    in_chans: int
    overlap: float = 0.25
    blend: str = "gaussian"
    batch_size: int = 8
    tta_flips: bool = False
    planes: str = "z"
    voxel_size: tuple[float, ...] | None = None
    bf16: bool = False  # autocast the forward to bfloat16 (predict.py on GPUs)
    # per output channel: the offset of an affinity channel, None for a class (with_flips)
    channel_offsets: tuple | None = None
    inference_mode: bool = False  # cheaper than no_grad; only for a model never trained after

    @classmethod
    def from_config(cls, model: torch.nn.Module, cfg, device: torch.device, *,
                    tta_flips: bool | None = None, planes: str | None = None,
                    batch_size: int | None = None, num_outputs: int | None = None,
                    **options) -> VolumePredictor:
        """The run's ``[inference]`` window plan for ``model``; the keyword arguments override
        it (``predict.py``'s flags). ``num_outputs`` and ``channel_offsets``: the model's output
        channels and their offsets, when the caller knows them (the task, which owns its
        channel layout); by default those of the config, classes and affinities."""
        inf = cfg.inference
        if "channel_offsets" not in options:
            spec = AffinitySpec.from_config(cfg)
            outputs = output_channels(cfg.data.classes, spec)
            if spec.classes and num_outputs in (None, len(outputs)):
                options["channel_offsets"] = channel_offsets(cfg.data.classes, spec)
            num_outputs = num_outputs or len(outputs)
        elif num_outputs is None:
            num_outputs = len(config_outputs(cfg))
        return cls(model, cfg.model.loss, device, tuple(cfg.model.crop_size),
                   num_outputs, cfg.model.in_chans, overlap=inf.overlap,
                   blend=inf.blend, batch_size=batch_size or inf.batch_size,
                   tta_flips=inf.tta_flips if tta_flips is None else tta_flips,
                   planes=planes or inf.planes, voxel_size=tuple(cfg.data.voxel_size),
                   **options)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The probabilities of a batch of windows."""
        grad = torch.inference_mode() if self.inference_mode else torch.no_grad()
        # Without bf16 the caller's precision context (the trainer's autocast) stays in force.
        cast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else \
            contextlib.nullcontext()
        with grad, cast:
            return predict_probabilities(self.model(x.to(self.device)).float(), self.loss)

    def _plan(self) -> dict:
        return {"overlap": self.overlap, "blend": self.blend, "batch_size": self.batch_size,
                "tta_flips": self.tta_flips, "planes": self.planes, "voxel_size": self.voxel_size}

    def predict_volume(self, image: torch.Tensor) -> torch.Tensor:
        """(num_outputs, D, H, W) probabilities of a (C, D, H, W) volume in memory, in the
        forwards of :meth:`plan` (:meth:`forward_count` of them)."""
        return predict_planned(self, self.plan(tuple(image.shape[1:])), image, self.num_outputs,
                               self.blend, self.tta_flips)

    def predict_blockwise(self, read_input, write_block, shape: tuple[int, int, int],
                          block_shape: tuple[int, int, int], rank: int = 0, world_size: int = 1,
                          progress=None, indices=None) -> int:
        """A volume read and written block by block (see :func:`predict_blockwise`)."""
        return predict_blockwise(self, read_input, write_block, shape, self.window,
                                 self.num_outputs, block_shape=block_shape, rank=rank,
                                 world_size=world_size, progress=progress, indices=indices,
                                 **self._plan())

    def block_window(self) -> tuple[int, int, int]:
        """:func:`block_window` of this predictor's window and planes."""
        return block_window(self.window, self.planes)

    def plan(self, shape: tuple[int, ...]) -> WindowPlan:
        """The :class:`WindowPlan` of :meth:`predict_volume` for a (D, H, W) volume."""
        return WindowPlan.build(shape, self.window, self.overlap, self.batch_size, self.planes,
                                self.voxel_size)

    def forward_count(self, shape: tuple[int, ...]) -> int:
        """How many forwards :meth:`predict_volume` runs for a (D, H, W) volume: those of
        its plan, which are the batches it runs."""
        return self.plan(shape).num_calls

    def idle_forwards(self, n: int) -> None:
        """``n`` forwards of a zero batch, so that a sharded model's ranks run as many
        forwards as the busiest one (FSDP gathers weights inside each)."""
        dummy = torch.zeros((self.batch_size, self.in_chans, *self.window))
        for _ in range(n):
            self(dummy)
