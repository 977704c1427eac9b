"""Context parallelism (CP): the patch-token sequence of every sample split over a group of ranks.

The ranks of a ``cp`` mesh group hold the same samples (they share the data-parallel rank).
Rank r works on the r-th of ``cp`` equal slabs of each sample along the first spatial axis of
the patch grid (a contiguous range of the C-ordered tokens); the prefix tokens (cls, storage)
are replicated. What the models do with it is in ``models/context.py`` and their ``forward``s:

* patch embedding and RoPE: on the slab, with the slab's global positions;
* attention (non-causal): each rank's queries attend to the keys and values of every rank,
  all-gathered once per block (forward) and reduce-scattered (backward), a functional
  collective, so ``torch.compile`` traces it; activation memory of a block is that of
  ``N / cp`` tokens except for the gathered K and V (and the attention kernel's work space);
* heads: the linear head on the slab (its logits on the patch grid are gathered for the
  upsampling at the slab edges); the convolutional heads (upconv, multiscale) get the
  gathered feature map and run on the whole sample;
* MAE: every rank masks the whole sample the same way (the noise comes with the sample) and
  encodes its ``1 / cp`` of the kept tokens; the decoder gathers them and runs on the slab;
* the loss: each rank's (sum, count) over its slab; the trainer adds them up over the
  data-parallel and CP ranks (``ParallelDims.loss_mesh``).

Gradients. Each rank's loss is that of its slab; the collectives' backwards carry the other
slabs' contributions. The prefix tokens are computed on every rank from the same values, and
each copy serves its own rank's queries, so the parameter gradients of the CP ranks add up to
those of one process. They are reduced by FSDP over the flattened ``dp_shard`` x ``cp`` mesh
(which therefore shards the weights over the CP ranks too, as torchtitan does), with the loss
scaled by the number of ranks it is averaged over.

Evaluation (``model.eval()``) runs the whole input on every rank of the group, so validation
and prediction work with any window size. The loss asks the model which part of every sample
it computed (``models/context.py``: ``context_shard``, ``local_part``). The rules of which
configurations CP takes are :mod:`torchtitan.config.context_parallel`'s.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.models.context import ContextParallelModel, SequenceShard, use_context

logger = logging.getLogger(__name__)


def _prefix_tokens(model: nn.Module) -> int:
    for module in model.modules():
        if hasattr(module, "num_prefix_tokens") and hasattr(module, "patch_embed"):
            return module.num_prefix_tokens
    raise ValueError("context parallelism needs a model with a ViT (cls and storage tokens)")


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh) -> SequenceShard:
    """Make ``model`` split its token sequences over ``cp_mesh`` while it trains. The model
    must be a :class:`ContextParallelModel`: it is what switches the split with its mode and
    tells the task which part of every sample it computes."""
    if not isinstance(model, ContextParallelModel):
        raise ValueError(f"context parallelism splits a ContextParallelModel (the segmentation "
                         f"model, the MAE), not a {type(model).__name__}")
    try:  # torch 2.13's differentiable all-gather; imported here so that the rest runs on older torch
        from torch.distributed._functional_collectives import all_gather_single
    except ImportError as e:
        raise RuntimeError(f"context parallelism needs torch==2.13.0 (pinned in pyproject.toml); "
                           f"torch {torch.__version__} lacks all_gather_single") from e
    group = cp_mesh.get_group()

    def gather(t: Tensor, dim: int) -> Tensor:
        return all_gather_single(t, dim, group)  # differentiable: backward reduce-scatters

    shard = SequenceShard(rank=cp_mesh.get_local_rank(), size=cp_mesh.size(), gather=gather,
                          n_prefix=_prefix_tokens(model))
    use_context(model, shard)
    logger.info("applied context parallelism %d: every sample's tokens split in %d slabs",
                shard.size, shard.size)
    return shard
