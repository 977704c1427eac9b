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

The group is used only while its model trains (``active``, set by the model's ``forward``):
evaluation and inference run the whole input on every rank, so validation and prediction work
with any window size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from torchtitan.config_context_parallel import slab_size


@dataclass(eq=False)
class SequenceShard:
    rank: int
    size: int
    gather: Callable[[Tensor, int], Tensor]
    n_prefix: int
    active: bool = False

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


def active_shard(module: nn.Module) -> SequenceShard | None:
    """The sequence shard ``module`` is working under now, or None (no CP, or not training).
    ``module`` may be the model or a wrapper whose ``module`` attribute is the model."""
    shard = getattr(module, "context", None)
    if shard is None and isinstance(getattr(module, "module", None), nn.Module):
        shard = getattr(module.module, "context", None)
    return shard if shard is not None and shard.active else None


def local_part(module: nn.Module, t: Tensor | None, dim: int = 2) -> Tensor | None:
    """The part of a per-voxel tensor (an image, targets, a validity mask; (B, C, *spatial))
    that matches this rank's outputs of ``module`` under context parallelism; ``t`` itself
    otherwise."""
    shard = active_shard(module)
    if t is None or shard is None:
        return t
    return shard.slab(t, dim)


def use_context(model: nn.Module, shard: SequenceShard | None) -> None:
    """Give every module of ``model`` that has a ``context`` attribute (the attention layers,
    the ViTs, the MAE and segmentation models) the same ``shard``."""
    for module in model.modules():
        if hasattr(module, "context"):
            module.context = shard
