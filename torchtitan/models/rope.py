"""Axial rotary position embedding (RoPE) for patch grids in 2D and 3D.

In 2D this is exactly DINOv3's ``RopePositionEmbedding`` (eval behaviour and state dict):

* Patch centres are given coordinates in [-1, 1]. With ``normalize_coords="separate"`` each
  axis is normalised by its own number of patches, so a 14 x 20 grid still spans [-1, 1] on
  both axes ("min" and "max" normalise both axes by the smaller or larger size instead).
* A single ``periods`` buffer of length ``P = head_dim // (2 * ndim)`` holds geometric periods
  ``base ** (i / P)``, i = 0..P-1 (Meta writes this as ``base ** (2i / (head_dim // 2))`` with
  ``P = head_dim // 4``; the two agree in 2D). The same periods serve every axis.
* The angle of frequency i on axis a is ``2 pi * coord_a / periods[i]``. Angles are laid out
  axis-major, ``[a0 f0, a0 f1, ..., a1 f0, ...]`` (``ndim * P`` values), and then repeated
  twice along the last dimension, so that ``rope_apply`` rotates channel j together with
  channel ``j + head_dim // 2`` ("rotate half" convention).

Splitting head_dim across axes in 3D. Each axis gets ``P = head_dim // 6`` frequencies, i.e.
``2 * P`` channels of every head (P rotation pairs). When ``head_dim`` is not a multiple of
``2 * ndim`` the ``head_dim - 2 * ndim * P`` channels left over are not rotated (their angle is
zero: ``cos = 1``, ``sin = 0``). Example: head_dim 64 in 3D gives P = 10 frequencies per axis
(z, y, x), 60 rotated channels and 4 position-free channels. In 2D with head_dim divisible by
4 nothing is left over, which keeps Meta's layout exactly.

Because each rotation pair turns by an angle that is linear in one coordinate, the score
``q(p) . k(p')`` after rotation depends only on ``p - p'``: shifting every position by the
same vector leaves all attention scores unchanged.

Train-time coordinate augmentations (Meta's ``shift_coords``, ``jitter_coords``,
``rescale_coords``) are available and off by default; they only act in ``train()`` mode.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn

_ROPE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def rope_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map Meta's dtype names ("fp32", "bf16", "fp16") to torch dtypes."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _ROPE_DTYPES:
        raise ValueError(f"Unknown RoPE dtype {name!r}; expected one of {sorted(_ROPE_DTYPES)}")
    return _ROPE_DTYPES[name]


def rope_apply(x: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
    """Rotate ``x`` (B, heads, N, head_dim) by the angles whose sin/cos are given.

    ``sin``/``cos`` are (N, head_dim), shared by all samples, or (B, N, head_dim), one set of
    positions per sample (used when each sample keeps a different subset of patches).

    "Rotate half" convention: with ``x = [x_a, x_b]`` split on the last dimension,
    ``y_a = x_a cos_a - x_b sin_a`` and ``y_b = x_b cos_b + x_a sin_b``. Computed by
    :class:`_RopeRotation` in three passes over ``x`` forward and three backward (autograd of
    the textbook form takes five and seven): for q and k of a ViT-B block at batch 8 on a
    CPU, 6.6 ms instead of 10.6 ms (docs/benchmarks/model_step.md).
    """
    if sin.dim() == 3:  # per-sample positions: broadcast over heads
        sin, cos = sin.unsqueeze(1), cos.unsqueeze(1)
    # Learned angles: let autograd differentiate. Tracing (TorchScript and ONNX export) takes
    # the same plain form: a graph cannot hold a Python autograd Function.
    if sin.requires_grad or cos.requires_grad or torch.jit.is_tracing():
        return _rotate(x, sin, cos, transpose=False, inplace=False)
    return _RopeRotation.apply(x, sin, cos)


def _rotate(x: Tensor, sin: Tensor, cos: Tensor, transpose: bool, inplace: bool = True) -> Tensor:
    """The rotation (or, ``transpose=True``, its transpose, which is its inverse) of ``x``.
    ``inplace`` updates the fresh ``x * cos`` in place, half by half."""
    half = x.shape[-1] // 2
    x_a, x_b = x[..., :half], x[..., half:]
    sin_a, sin_b = sin[..., :half], sin[..., half:]
    if transpose:  # y_a = x_a cos_a + x_b sin_b, y_b = x_b cos_b - x_a sin_a
        sin_a, sin_b = -sin_b, -sin_a
    y = x * cos
    if not inplace:
        return y + torch.cat([-x_b * sin_a, x_a * sin_b], dim=-1)
    y[..., :half].addcmul_(x_b, sin_a, value=-1)
    y[..., half:].addcmul_(x_a, sin_b)
    return y


class _RopeRotation(torch.autograd.Function):
    """RoPE as one autograd node: the backward applies the transposed rotation to the
    gradient, so nothing but the (small) sin/cos tables is saved."""

    @staticmethod
    def forward(ctx, x: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
        ctx.save_for_backward(sin, cos)
        return _rotate(x, sin, cos, transpose=False)

    @staticmethod
    def backward(ctx, grad: Tensor):
        sin, cos = ctx.saved_tensors
        return _rotate(grad, sin, cos, transpose=True), None, None


class RopePositionEmbedding(nn.Module):
    """Sin/cos tables of axial RoPE for an ``ndim``-dimensional patch grid.

    Args:
        embed_dim, num_heads: model width and heads; RoPE acts per head on head_dim channels.
        ndim: 2 (y, x) or 3 (z, y, x).
        base: period base (Meta uses 100); alternatively give ``min_period`` and ``max_period``.
        normalize_coords: "separate" (each axis by its own size), "min" or "max".
        shift_coords, jitter_coords, rescale_coords: optional train-time augmentations.
        dtype: dtype in which angles are computed ("fp32" recommended).
    """

    def __init__(
        self,
        embed_dim: int,
        *,
        num_heads: int,
        ndim: int = 2,
        base: float | None = 100.0,
        min_period: float | None = None,
        max_period: float | None = None,
        normalize_coords: str = "separate",
        shift_coords: float | None = None,
        jitter_coords: float | None = None,
        rescale_coords: float | None = None,
        dtype: str | torch.dtype = "fp32",
    ):
        super().__init__()
        if ndim not in (2, 3):
            raise ValueError(f"RoPE supports ndim 2 or 3, got {ndim}")
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        head_dim = embed_dim // num_heads
        if head_dim % 2 != 0 or head_dim < 2 * ndim:
            raise ValueError(f"RoPE needs an even head_dim >= {2 * ndim}, got {head_dim}")
        both_periods = min_period is not None and max_period is not None
        if (base is None) == (not both_periods):
            raise ValueError("Give either `base` or both `min_period` and `max_period` for RoPE.")
        if normalize_coords not in ("separate", "min", "max"):
            raise ValueError(f"Unknown normalize_coords {normalize_coords!r}")

        self.ndim = ndim
        self.head_dim = head_dim
        self.num_periods = head_dim // (2 * ndim)
        self.base = base
        self.min_period = min_period
        self.max_period = max_period
        self.normalize_coords = normalize_coords
        self.shift_coords = shift_coords
        self.jitter_coords = jitter_coords
        self.rescale_coords = rescale_coords
        self.dtype = rope_dtype(dtype)  # not periods.dtype: a model-wide .to() must not change it
        # Persistent so that it lives in the state dict under Meta's key `rope_embed.periods`.
        self.register_buffer("periods", torch.empty(self.num_periods, dtype=self.dtype), persistent=True)
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    def compute_periods(self, device: torch.device | None = None) -> Tensor:
        """The geometric sequence of periods, as in Meta's ``_init_weights``."""
        P = self.num_periods
        dd = {"device": device, "dtype": self.dtype}
        if self.base is not None:
            # Written as Meta writes it (2i / (head_dim // 2) in 2D) so values match bit for bit.
            return self.base ** (2 * torch.arange(P, **dd) / (2 * P))
        ratio = self.max_period / self.min_period
        periods = ratio ** torch.linspace(0, 1, P, **dd)  # [1, max/min]
        return periods / ratio * self.max_period  # [min_period, max_period]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """(Re)compute ``periods``; needed after ``to_empty`` since buffers then hold garbage."""
        if self.periods.is_meta:  # nothing to compute (and meta arange is slow the first time)
            return
        self.periods.copy_(self.compute_periods(self.periods.device).to(self.periods.dtype))

    # ---------------------------------------------------------------- coords
    def grid_coords(self, grid_size: Sequence[int]) -> Tensor:
        """Normalised coordinates of patch centres, (N, ndim), rows in C order over the grid."""
        if len(grid_size) != self.ndim:
            raise ValueError(f"Expected a {self.ndim}D grid, got {tuple(grid_size)}")
        dd = {"device": self.periods.device, "dtype": self.dtype}
        if self.normalize_coords == "separate":
            denoms = list(grid_size)
        elif self.normalize_coords == "max":
            denoms = [max(grid_size)] * self.ndim
        else:
            denoms = [min(grid_size)] * self.ndim
        axes = [torch.arange(0.5, n, **dd) / d for n, d in zip(grid_size, denoms)]
        coords = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).flatten(0, -2)
        return 2.0 * coords - 1.0  # [0, 1] -> [-1, 1]

    def augment_coords(self, coords: Tensor) -> Tensor:
        """Meta's train-time augmentations: per-axis shift and jitter, global rescale."""
        dd = {"device": coords.device, "dtype": coords.dtype}
        if self.shift_coords is not None:
            shift = torch.empty(self.ndim, **dd).uniform_(-self.shift_coords, self.shift_coords)
            coords = coords + shift
        if self.jitter_coords is not None:
            m = math.log(self.jitter_coords)
            coords = coords * torch.empty(self.ndim, **dd).uniform_(-m, m).exp()
        if self.rescale_coords is not None:
            m = math.log(self.rescale_coords)
            coords = coords * torch.empty(1, **dd).uniform_(-m, m).exp()
        return coords

    def sincos_from_coords(self, coords: Tensor) -> tuple[Tensor, Tensor]:
        """(sin, cos), each (..., head_dim), for coordinates of shape (..., ndim)."""
        periods = self.periods.to(self.dtype)
        angles = 2 * math.pi * coords.to(self.dtype).unsqueeze(-1) / periods  # (..., ndim, P)
        angles = angles.flatten(-2)  # (..., ndim * P), axis-major like Meta
        n_free = self.head_dim // 2 - angles.shape[-1]
        if n_free > 0:  # channels not rotated when head_dim is not a multiple of 2 * ndim
            angles = torch.cat([angles, angles.new_zeros(*angles.shape[:-1], n_free)], dim=-1)
        angles = torch.cat([angles, angles], dim=-1)  # (..., head_dim): pairs (j, j + hd/2)
        return torch.sin(angles), torch.cos(angles)

    def forward(self, grid_size: Sequence[int]) -> tuple[Tensor, Tensor]:
        """(sin, cos), each (N, head_dim), for the patches of a grid, N = prod(grid_size).

        Without train-time augmentation the tables depend only on the grid and ``periods``:
        they are built once and reused (:meth:`_cached`); every step of a run has the same
        grid, and the tables of a ViT-L at 256^3 / 16 are 4096 rows of sin, cos and angles.
        """
        augmented = self.training and any(
            a is not None for a in (self.shift_coords, self.jitter_coords, self.rescale_coords))
        if augmented or not self._cacheable():
            return self._tables(grid_size, augmented)
        return self._cached(tuple(int(n) for n in grid_size))

    def _tables(self, grid_size: Sequence[int], augmented: bool) -> tuple[Tensor, Tensor]:
        coords = self.grid_coords(grid_size)
        if augmented:
            coords = self.augment_coords(coords)
        return self.sincos_from_coords(coords)

    # Tables kept per grid (at most this many grids: validation windows and crops of a few
    # sizes; a caller with ever-new grids cannot grow it without bound).
    _CACHE_SIZE = 8

    def _cacheable(self) -> bool:
        """Whether tables may be reused here: not while tracing or compiling (a traced graph
        must compute them, not close over a dict of tensors), not on the meta device."""
        return not (torch.compiler.is_compiling() or torch.jit.is_tracing()
                    or self.periods.is_meta)

    def _cached(self, grid: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """The tables of ``grid``, computed on the first call. Keyed by the grid, the device
        and the state of ``periods`` (its storage and version counter: a load_state_dict or
        reset_parameters copies into it, which bumps the version), and whether inference mode
        is on (tables made under it cannot be saved for a backward pass outside it). Kept in a
        plain dict attribute, not a buffer: nothing enters the state dict, and
        :meth:`_apply` (``.to()``, ``.cuda()``, ``to_empty()``) empties it."""
        p = self.periods
        key = (grid, p.device, p.data_ptr(), p._version, torch.is_inference_mode_enabled())
        cache = self.__dict__.setdefault("_tables_cache", {})
        tables = cache.get(key)
        if tables is None:
            if len(cache) >= self._CACHE_SIZE:
                cache.clear()
            with torch.no_grad():  # constants: no graph to the periods
                tables = cache[key] = self._tables(grid, augmented=False)
        return tables

    def _apply(self, fn, recurse: bool = True):
        self.__dict__.pop("_tables_cache", None)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        return (
            f"ndim={self.ndim}, head_dim={self.head_dim}, periods={self.num_periods}, "
            f"normalize_coords={self.normalize_coords!r}"
        )
