"""Linear resizing of logits, and statistics of resized logits taken slab by slab.

``resize_linear`` is the bilinear / trilinear resize of the linear head's logits (and of any
head whose output is not at the requested size).

``slab_statistics`` is what the segmentation loss uses instead when it trains on the linear
head: the loss is a function of sums over voxels (``losses.py``), so it never needs the whole
full-resolution logits at once. The logits on the patch grid are resized along every axis but
the first (a small tensor: one row of patches deep), then each slab of output rows is
upsampled along the first axis, reduced to its sums and dropped. Where the loss writes out the
per-voxel derivatives of its sums (the sigmoid losses), the forward pass sends them back
through the transposed matmuls as it goes, so that the backward pass only weighs a few
tensors of the patch grid's size by the sums' gradients; otherwise the backward pass
recomputes each slab and differentiates its sums with autograd. A slab fits the CPU's cache
(or, on a GPU, is large enough to keep the device busy), so the full-resolution logits, their
gradient and the loss's per-voxel intermediates are never written to memory: for a 3D crop of
96^3 with 4 classes that is 28 MB per tensor, for 256^3 with 40 classes 2.7 GB.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

# Elements (batch x classes x voxels) of one slab of full-resolution logits: about 2 MB of
# float32 on a CPU, where a step was fastest at this size (bench/model_step.py); larger on a
# GPU, where each slab costs a few dozen kernel launches.
SLAB_ELEMENTS = {"cpu": 2**19}
SLAB_ELEMENTS_DEFAULT = 2**24

# (slab of logits, slab of targets, slab of validity) -> sums over the slab's voxels
SlabStatistics = Callable[[Tensor, Tensor | None, Tensor | None], tuple[Tensor, ...]]
# (slab of logits, of targets, of validity) -> (sums over the slab's voxels, and for each sum
# the derivative of its entry at each voxel with respect to that voxel's logit, or None where
# the sum does not depend on the logits). The derivatives have the slab's shape, and each sum
# has the slab's leading axes (B,) or (B, K): the gradient of the slab's logits is, summed
# over the sums, each sum's gradient (broadcast over the voxels) times its derivatives.
SlabDerivatives = Callable[[Tensor, Tensor | None, Tensor | None],
                           tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]]


def linear_weights(n_in: int, n_out: int, like: Tensor) -> Tensor:
    """(n_out, n_in) matrix of 1D linear interpolation with ``align_corners=False`` (PyTorch's
    and OpenCV's convention: source position (o + 0.5) * n_in / n_out - 0.5, clamped at the
    edges)."""
    src = ((torch.arange(n_out, dtype=torch.float64) + 0.5) * (n_in / n_out) - 0.5).clamp_min(0)
    i0 = src.floor().long().clamp_max(n_in - 1)
    i1 = (i0 + 1).clamp_max(n_in - 1)
    frac = src - i0
    rows = torch.arange(n_out)
    w = torch.zeros(n_out, n_in, dtype=torch.float64)
    w.index_put_((rows, i0), 1 - frac, accumulate=True)
    w.index_put_((rows, i1), frac, accumulate=True)
    return w.to(dtype=like.dtype, device=like.device)


def _resize_axis(x: Tensor, axis: int, w: Tensor) -> Tensor:
    """Apply the (n_out, n_in) matrix ``w`` along spatial ``axis`` of (B, C, *spatial)."""
    if axis == x.dim() - 3:  # the last axis
        return x @ w.t()
    n_in = x.shape[2 + axis]
    lead, trail = x.shape[:2 + axis], x.shape[3 + axis:]
    out = torch.matmul(w, x.reshape(-1, n_in, math.prod(trail)))
    return out.view(*lead, w.shape[0], *trail)


def resize_linear(x: Tensor, size: Sequence[int]) -> Tensor:
    """Bilinear / trilinear resize of (B, C, *spatial) to ``size``, ``align_corners=False``:
    the values of ``F.interpolate`` (up to float rounding), computed as one small matmul per
    axis, last axis first. Each matmul writes its result in place of the axis it resizes (no
    layout copies) and its backward is a matmul too; on the CPU this is 2-3x faster than
    ``F.interpolate`` forward + backward for the linear head's 16x upsampling of a few class
    channels."""
    for axis in range(len(size) - 1, -1, -1):
        n_in, n_out = x.shape[2 + axis], size[axis]
        if n_in != n_out:
            x = _resize_axis(x, axis, linear_weights(n_in, n_out, x))
    return x


def _rows(t: Tensor | None, start: int, stop: int) -> Tensor | None:
    """Rows ``start:stop`` of the first spatial axis of a per-voxel tensor; a tensor that
    broadcasts along that axis (size 1, e.g. a per-class validity) as it is."""
    if t is None or t.shape[2] == 1:
        return t
    return t[:, :, start:stop]


class _Slabs:
    """The slabs of output rows of resizing ``logits`` (B, K, *grid) to ``size``: each a run
    of at most a budget's rows, computed from the few grid rows its interpolation weights
    touch (two for an upsampling), so that neither the forward matmul nor the gradient's
    reads or writes the other rows."""

    def __init__(self, logits: Tensor, size: Sequence[int]):
        self.size = tuple(size)
        self.grid = tuple(logits.shape[2:])
        n_in, n_out = logits.shape[2], size[0]
        self.n_in = n_in
        per_row = logits.shape[0] * logits.shape[1] * math.prod(size[1:])
        step = max(1, SLAB_ELEMENTS.get(logits.device.type, SLAB_ELEMENTS_DEFAULT) // per_row)
        # (first row, last row + 1, first grid row read, last + 1, weights or None)
        self.bounds: list[tuple[int, int, int, int, Tensor | None]] = []
        if n_in == n_out:
            self.bounds = [(r, min(r + step, n_out), r, min(r + step, n_out), None)
                           for r in range(0, n_out, step)]
            return
        # The weights' pattern is read on the CPU (no device sync); each slab's block moves once.
        w = linear_weights(n_in, n_out, logits.new_empty((), device="cpu"))
        nonzero = w != 0
        first = nonzero.int().argmax(1).tolist()
        last = (n_in - 1 - nonzero.flip(1).int().argmax(1)).tolist()
        runs, start = [], 0  # runs of rows that read the same grid rows
        for r in range(1, n_out + 1):
            if r == n_out or (first[r], last[r]) != (first[start], last[start]):
                runs.append((start, r))
                start = r
        for a, b in runs:  # each cut into equal slabs of about ``step`` rows (1.5x at most)
            pieces = max(1, round((b - a) / step))
            cuts = [a + (b - a) * i // pieces for i in range(pieces + 1)]
            for lo_row, hi_row in zip(cuts, cuts[1:]):
                lo, hi = first[lo_row], last[lo_row] + 1
                block = w[lo_row:hi_row, lo:hi].to(logits.device)
                self.bounds.append((lo_row, hi_row, lo, hi, block))

    def rest(self, logits: Tensor) -> Tensor:
        """``logits`` resized along every axis but the first."""
        return resize_linear(logits, (self.n_in, *self.size[1:]))

    def rest_transposed(self, grad_rest: Tensor) -> Tensor:
        """The gradient of the grid's logits from that of :meth:`rest`'s output (the
        transposed matmuls)."""
        for axis in range(1, len(self.size)):
            n_in, n_out = self.grid[axis], self.size[axis]
            if n_in != n_out:
                grad_rest = _resize_axis(grad_rest, axis, linear_weights(n_in, n_out, grad_rest).t())
        return grad_rest

    @staticmethod
    def slab(rest: Tensor, bound) -> Tensor:
        """The slab's output rows, from ``rest``."""
        _, _, lo, hi, w = bound
        return rest[:, :, lo:hi] if w is None else _resize_axis(rest[:, :, lo:hi], 0, w)

    @staticmethod
    def add_gradient(grad_rest: Tensor, bound, grad: Tensor) -> None:
        """Add the gradient of the slab's rows, ``grad``, to the grid rows they came from."""
        _, _, lo, hi, w = bound
        grad_rest[:, :, lo:hi] += grad if w is None else _resize_axis(grad, 0, w.t())


class _SlabStatistics(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, size, statistics, derivatives, targets, valid):
        slabs = _Slabs(logits, size)
        rest = slabs.rest(logits)
        # With the derivatives written out, their weighted sums over each slab go back to the
        # grid's rows now (one accumulator of rest's size per sum that depends on the logits).
        fused = derivatives is not None
        total, grad_rests = None, None
        for bound in slabs.bounds:
            start, stop = bound[:2]
            z, t, v = slabs.slab(rest, bound), _rows(targets, start, stop), _rows(valid, start, stop)
            if fused:
                s, d = derivatives(z, t, v)
                if grad_rests is None:
                    grad_rests = [None if x is None else torch.zeros_like(rest) for x in d]
                for acc, x in zip(grad_rests, d):
                    if x is not None:
                        slabs.add_gradient(acc, bound, x)
            else:
                s = statistics(z, t, v)
            total = list(s) if total is None else [a + b for a, b in zip(total, s)]
        ctx.fused = fused
        if fused:  # the gradient each sum sends to the grid's logits, kept for the backward
            ctx.parts_of = [acc is not None for acc in grad_rests]
            ctx.save_for_backward(*[slabs.rest_transposed(acc) for acc in grad_rests
                                    if acc is not None])
        else:  # the backward pass recomputes each slab
            ctx.save_for_backward(logits, targets, valid)
            ctx.slabs, ctx.statistics = slabs, statistics
        ctx.mark_non_differentiable(*[t for t in total if not t.is_floating_point()])
        return tuple(total)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.fused:
            kept = iter(ctx.saved_tensors)
            parts = [next(kept) if has else None for has in ctx.parts_of]
            return (_weighed_parts(parts, grads),) + (None,) * 5
        logits, targets, valid = ctx.saved_tensors
        slabs = ctx.slabs
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_()
            rest = slabs.rest(leaf)
        grad_rest = torch.zeros_like(rest)
        for bound in slabs.bounds:
            start, stop = bound[:2]
            z = slabs.slab(rest.detach(), bound)
            t, v = _rows(targets, start, stop), _rows(valid, start, stop)
            with torch.enable_grad():
                z.requires_grad_()
                pairs = [(a, g) for a, g in zip(ctx.statistics(z, t, v), grads)
                         if a.requires_grad and g is not None]
                if pairs:
                    torch.autograd.backward([a for a, _ in pairs], [g for _, g in pairs])
            if z.grad is not None:
                slabs.add_gradient(grad_rest, bound, z.grad)
        (grad,) = torch.autograd.grad(rest, leaf, grad_rest)
        return grad, None, None, None, None, None


def _weighed_parts(parts: list[Tensor | None], grads: Sequence[Tensor | None]) -> Tensor | None:
    """Sum over the statistics of their gradients (broadcast over the voxels) times the
    gradient each sends to the grid's logits."""
    grad = None
    for part, g in zip(parts, grads):
        if part is None or g is None:
            continue
        term = part * g.view(*g.shape, *(1,) * (part.dim() - g.dim()))
        grad = term if grad is None else grad.add_(term)
    return grad


def slab_statistics(statistics: SlabStatistics, logits: Tensor, size: Sequence[int],
                    targets: Tensor | None = None, valid: Tensor | None = None,
                    derivatives: SlabDerivatives | None = None) -> tuple[Tensor, ...]:
    """``statistics(resize_linear(logits, size), targets, valid)``, for a ``statistics`` that
    returns sums over voxels (each output the sum of its values over any split of the first
    spatial axis), computed slab by slab of output rows without holding the resized logits;
    differentiable with respect to ``logits``. ``targets`` and ``valid`` are at ``size`` (or
    broadcast along the first axis with size 1 there). Runs in float32 with autocast off.

    ``derivatives``, if given, returns a slab's sums and their per-voxel derivatives (the
    same sums as ``statistics``); the forward pass then also computes each sum's gradient on
    the grid, and the backward pass weighs them (no slab is computed twice). Without it the
    backward pass recomputes each slab and differentiates ``statistics`` with autograd."""
    size = tuple(size)
    with torch.autocast(device_type=logits.device.type, enabled=False):
        logits = logits.float()
        if tuple(logits.shape[2:]) == size:
            return tuple(statistics(logits, targets, valid))
        if not (torch.is_grad_enabled() and logits.requires_grad):
            derivatives = None  # nothing to send back (validation)
        return _SlabStatistics.apply(logits, size, statistics, derivatives, targets, valid)


__all__ = ["SLAB_ELEMENTS", "linear_weights", "resize_linear", "slab_statistics"]
