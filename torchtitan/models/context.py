"""A rank's part of a context-parallel group, as the models see it.

Under context parallelism (CP) the ranks of one group hold the same samples, and each rank
works on a contiguous part of every sample's patch-token sequence: the ``rank``-th of ``size``
equal slabs along the first spatial axis of the patch grid (z in 3D), which in the C-ordered
token sequence is a contiguous range of tokens. The prefix tokens (cls, storage) are kept on
every rank. The models need three things from the group, given to them from outside
(``parallelisms/context_parallel.py``) so that they stay single-device code:

* ``slab(t, dim)``: this rank's part of ``t`` along ``dim`` (no communication);
* ``gather(t, dim)``: the parts of all ranks, concatenated along ``dim``, differentiable (its
  backward sums the gradients of all ranks and keeps this rank's part: a reduce-scatter);
* ``n_prefix``: the number of prefix tokens at the front of every sequence.

The split is on exactly while the model it was given to trains: ``active`` follows the
model's mode (:class:`ContextParallelModel`'s ``train``, and :func:`use_context` when the
shard is handed over), never what a forward did. Evaluation and inference run the whole input
on every rank, so validation and prediction work with any window size. Code outside the model
asks for the shard explicitly, :func:`context_shard` (None when nothing is split), and passes
it to :func:`local_part` to take the part of its own per-voxel tensors (targets, masks) that
matches the model's outputs. The rules of CP (which models, losses and sizes it takes) are
in :mod:`torchtitan.config.context_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from torchtitan.config.context_parallel import slab_size


@dataclass(eq=False)
class SequenceShard:
    """This rank's part of a context-parallel group; one object shared by every module of a
    model (:func:`use_context`), so that they all split while the model trains."""

    rank: int
    size: int
    gather: Callable[[Tensor, int], Tensor]
    n_prefix: int
    active: bool = False  # the model's training mode (see the module docstring)

    def slab(self, t: Tensor, dim: int) -> Tensor:
        """This rank's contiguous part of ``t`` along ``dim`` (``t.shape[dim]`` splits evenly)."""
        part = slab_size(t.shape[dim], self.size)
        return t.narrow(dim, self.rank * part, part)

    def gather_kv(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, heads, n_prefix + n_local, hd) of this rank -> those of the
        whole sequence: the prefix once (this rank's copy), then every rank's patch tokens in
        rank order. One collective for both."""
        p = self.n_prefix
        kv = self.gather(torch.stack([k[:, :, p:], v[:, :, p:]]).contiguous(), 3)
        return (torch.cat([k[:, :, :p], kv[0]], dim=2), torch.cat([v[:, :, :p], kv[1]], dim=2))


def in_use(shard: SequenceShard | None) -> SequenceShard | None:
    """``shard`` while its model trains, else None: what a layer given ``shard`` splits by."""
    return shard if shard is not None and shard.active else None


class ContextParallelModel(nn.Module):
    """A model whose token sequences context parallelism may split (the segmentation model,
    the MAE): it holds the group's shard and keeps the shard's ``active`` equal to its own
    training mode, so that its layers split exactly while it trains."""

    context: SequenceShard | None = None  # set by use_context

    def train(self, mode: bool = True):
        super().train(mode)
        if self.context is not None:
            self.context.active = mode
        return self

    def context_shard(self) -> SequenceShard | None:
        """The shard whose part of every sample this model computes now: its group's while it
        trains under context parallelism, else None (the whole sample)."""
        return in_use(self.context)


def context_shard(model: nn.Module) -> SequenceShard | None:
    """:meth:`ContextParallelModel.context_shard` of ``model``, or of the model a wrapper
    holds as ``module`` (DDP); None for a model without context parallelism."""
    if not isinstance(model, ContextParallelModel) and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model.context_shard() if isinstance(model, ContextParallelModel) else None


def local_part(shard: SequenceShard | None, t: Tensor | None, dim: int = 2) -> Tensor | None:
    """The part of a per-voxel tensor (an image, targets, a validity mask; (B, C, *spatial))
    that matches a model's outputs computed under ``shard`` (:func:`context_shard`): this
    rank's slab along ``dim``; ``t`` itself when ``shard`` is None."""
    if t is None or shard is None:
        return t
    return shard.slab(t, dim)


def use_context(model: nn.Module, shard: SequenceShard | None) -> None:
    """Give every module of ``model`` that has a ``context`` attribute (the attention layers,
    the ViTs, the MAE and segmentation models) the same ``shard``, active while ``model`` (a
    :class:`ContextParallelModel`, which keeps it in step with its mode) trains."""
    if shard is not None:
        shard.active = isinstance(model, ContextParallelModel) and model.training
    for module in model.modules():
        if hasattr(module, "context"):
            module.context = shard
