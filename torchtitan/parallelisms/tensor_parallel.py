"""Tensor parallelism (Megatron-style) for the transformer blocks, and the layout helpers that
keep checkpoints in the unsharded (Meta) layout.

Per block, on the ``tp`` mesh:

    attn.qkv             packed colwise: each rank computes q, k and v of its own heads
    attn.proj            rowwise (its output is summed over the tp ranks)
    mlp.fc1 / mlp.fc2    colwise / rowwise                       (GELU MLP)
    mlp.w1, mlp.w2 / w3  colwise / rowwise: w3(silu(w1 x) * w2 x) (SwiGLU)

Everything else (norms, LayerScale, patch embedding, tokens, RoPE, the MAE decoder's embedding
and prediction, segmentation heads) stays a plain tensor, computed redundantly on every tp
rank. The activations between the sharded pairs are plain local tensors, so the block code is
unchanged: attention reshapes with ``-1`` heads and sees only this rank's heads. Each block
costs two all-reduces forward (after ``proj`` and after ``fc2``/``w3``) and two backward.

No sequence parallelism: norms, LayerScale, drop-path and the residual adds run on the whole
sequence on every tp rank. Sequence parallelism would turn each all-reduce into a
reduce-scatter + all-gather of the same volume and divide those activations (about a third
of a block's; the attention and MLP ones are already split) by the tp degree. It is not done:
it needs sequence-sharded norms, LayerScale, drop-path and RoPE (whose prefix tokens make the
shards uneven), and activation checkpointing already removes most of that memory more simply.

No loss parallelism either: the heads are not sharded, so the loss sees the full, replicated
output on every tp rank and is computed the ordinary way.

The packed qkv weight. ``attn.qkv.weight`` is Meta's (3 * dim, dim) matrix, rows [q; k; v].
A plain ``Shard(0)`` would give rank 0 all of q; instead the weight is a DTensor with placement
``_StridedShard(0, split_factor=3)``: rank r holds rows ``[q_r; k_r; v_r]``, the heads
``r * H/tp .. (r+1) * H/tp`` of each part, and ``full_tensor()`` gives back Meta's layout.
The qkv bias (and Meta's ``bias_mask`` buffer) are tiny and stay replicated on the tp mesh
(the matmul slices the bias locally; its gradient is all-gathered, 3 * dim values). Under
FSDP + TP the qkv weight is FSDP-sharded on dim 1 (see ``parallelize._fsdp_placement``).

Distributed checkpoints (DCP) and the state-dict utilities store one contiguous block per
rank, which a strided shard is not. :func:`to_storage_layout` therefore redistributes such
tensors to ordinary ``Shard`` placements before a save (and :func:`from_storage_layout` back
after a load): checkpoints hold the unsharded layout and load under any parallelism. This
costs one all-gather of each qkv weight (and of its two Adam moments) per save and per load.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from torchtitan.parallelisms.parallel_dims import ParallelismError


class PackedColwiseParallel(ColwiseParallel):
    """Colwise sharding of a Linear whose output packs ``parts`` projections (q, k, v).

    The weight is sharded per part (``_StridedShard(0, split_factor=parts)``), so the local
    output is ``[q_r | k_r | v_r]``: the same packed layout, for this rank's heads. Bias and
    buffers (``bias_mask``) are replicated; the module returns a local tensor.
    """

    def __init__(self, parts: int = 3):
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):
        weight = distribute_tensor(module.weight, device_mesh,
                                   [_StridedShard(0, split_factor=self.parts)],
                                   src_data_rank=self.src_data_rank)
        module.register_parameter("weight", nn.Parameter(weight, module.weight.requires_grad))
        if module.bias is not None:
            bias = distribute_tensor(module.bias, device_mesh, [Replicate()],
                                     src_data_rank=self.src_data_rank)
            module.register_parameter("bias", nn.Parameter(bias, module.bias.requires_grad))
        for key, buffer in list(module.named_buffers(recurse=False)):
            module.register_buffer(key, distribute_tensor(buffer, device_mesh, [Replicate()],
                                                          src_data_rank=self.src_data_rank))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError("PackedColwiseParallel shards nn.Linear modules only")
        parts = self.parts

        def input_fn(mod, inputs, mesh):
            # The block's activations are plain tensors, replicated over the tp ranks.
            x = inputs[0]
            if isinstance(x, DTensor):
                return x.redistribute(placements=(Replicate(),))
            return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)

        def output_fn(mod, outputs, mesh):
            # The matmul yields the per-part shards without communication; anything else
            # (never expected) is redistributed, so the local result is always [q_r|k_r|v_r].
            want = (_StridedShard(outputs.ndim - 1, split_factor=parts),)
            if outputs.placements != want:
                outputs = outputs.redistribute(placements=want)
            return outputs.to_local()

        return distribute_module(module, device_mesh, self._partition_linear_fn, input_fn,
                                 output_fn)


def block_plan(block: nn.Module) -> dict[str, Any]:
    """The TP plan of one transformer block (``vit.Block``), by submodule name."""
    plan: dict[str, Any] = {"attn.qkv": PackedColwiseParallel(3), "attn.proj": RowwiseParallel()}
    if hasattr(block.mlp, "fc1"):
        plan.update({"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
    else:  # SwiGLU: w3(silu(w1 x) * w2 x); w3 is the output projection
        plan.update({"mlp.w1": ColwiseParallel(), "mlp.w2": ColwiseParallel(),
                     "mlp.w3": RowwiseParallel()})
    return plan


def check_divisible(list_name: str, blocks: nn.ModuleList, tp: int, option: str) -> None:
    """Raise a ParallelismError when the blocks of ``list_name`` cannot be split over ``tp``
    ranks; ``option`` names the config setting that sizes them, for the message."""
    if not len(blocks):
        return
    block = blocks[0]
    heads = block.attn.num_heads
    if heads % tp:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ParallelismError(
            f"training.tensor_parallel_degree={tp} must divide the number of attention heads, "
            f"but {list_name} has {heads} heads ({option}); use a degree in {divisors} or a "
            "model whose head count the degree divides"
        )
    mlp = block.mlp
    hidden = (mlp.fc1 if hasattr(mlp, "fc1") else mlp.w1).out_features
    if hidden % tp:
        raise ParallelismError(
            f"training.tensor_parallel_degree={tp} must divide the MLP width, but {list_name} "
            f"has {hidden} ({option})"
        )


def apply_tp(block_lists: list[tuple[str, nn.ModuleList]], tp_mesh: DeviceMesh) -> None:
    """Shard every transformer block over ``tp_mesh`` (see the module docstring)."""
    for _, blocks in block_lists:
        for block in blocks:
            parallelize_module(block, tp_mesh, block_plan(block))


# ----------------------------------------------------------------------------- checkpoints
def is_strided_tp(t: DTensor) -> bool:
    """Whether ``t`` is sharded in strided blocks over the tp mesh dim (the packed qkv)."""
    return _storage_placements(t) is not None


def _storage_placements(t: DTensor) -> tuple[Placement, ...] | None:
    """Contiguous placements for a DTensor sharded in strided blocks on the tp mesh dim, or
    None when it is already storable (strided shards FSDP makes on dp dims are contiguous)."""
    names = t.device_mesh.mesh_dim_names or ()
    placements = list(t.placements)
    changed = False
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard) and i < len(names) and names[i] == "tp":
            placements[i] = Shard(p.dim)
            changed = True
    return tuple(placements) if changed else None


def _map_tensors(state: Any, fn) -> Any:
    if isinstance(state, dict):
        return {k: _map_tensors(v, fn) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_map_tensors(v, fn) for v in state)
    if isinstance(state, DTensor):
        return fn(state)
    return state


def to_storage_layout(state: Any) -> Any:
    """A copy of ``state`` (nested dicts/lists of tensors) where every tensor that DCP cannot
    store as one block per rank (the packed qkv weight under TP, and its optimizer states)
    is redistributed to ordinary shards; other entries are returned as they are."""

    def convert(t: DTensor) -> DTensor:
        target = _storage_placements(t)
        return t if target is None else t.redistribute(placements=target)

    return _map_tensors(state, convert)


def from_storage_layout(loaded: Any, like: Any) -> Any:
    """Undo :func:`to_storage_layout`: bring each tensor of ``loaded`` back to the placements
    of the matching entry of ``like`` (the model's or optimizer's own state)."""
    if isinstance(loaded, dict):
        return {k: from_storage_layout(v, like[k]) if k in like else v for k, v in loaded.items()}
    if isinstance(loaded, (list, tuple)):
        return type(loaded)(from_storage_layout(v, w) for v, w in zip(loaded, like))
    if isinstance(loaded, DTensor) and isinstance(like, DTensor) and \
            loaded.placements != like.placements:
        return loaded.redistribute(placements=like.placements)
    return loaded
