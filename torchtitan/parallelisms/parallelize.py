"""Apply parallelism, activation checkpointing, compilation and mixed precision from outside.

Context parallelism (``context_parallel.py``) comes first: it only tells the model's layers
which group splits the sequence. FSDP then shards over ``dp_shard`` x ``cp``. CP does not
combine with TP (config.checks refuses it).

Models are single-device code that expose their transformer blocks as ``nn.ModuleList``s
named ``blocks`` (``backbone.blocks``, ``encoder.blocks``, ``decoder.blocks``). Everything here
finds them by name, so one function serves every model. The order follows torchtitan:
TP -> activation checkpointing -> compile -> FSDP/HSDP or DDP.

Tensor parallelism shards the blocks only (see ``tensor_parallel.py``). It combines with FSDP
and HSDP (2-D / 3-D meshes: FSDP shards over the dp dims what TP left on each rank) and with
DDP. PyTorch's ``DistributedDataParallel`` does not take DTensor parameters, so DDP + TP uses
FSDP2's replicate-only variant (``replicate``: gradients all-reduced over the dp mesh, one
bucket per block), applied like FSDP on the meta device; DDP without TP keeps the classic
wrapper.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from torchtitan.models.attention import FA4_OP
from torchtitan.parallelisms.context_parallel import apply_cp
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.parallelisms.tensor_parallel import apply_tp, check_divisible, is_strided_tp

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# CPU flags (``/proc/cpuinfo``) of instructions that compute in bf16: x86's AVX512-BF16 and
# AMX, Arm's BF16 extension. Without them oneDNN converts to float32 and back around every
# matmul and convolution.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_has_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU has bf16 instructions, from ``/proc/cpuinfo`` (or the text given);
    None where that cannot be read (not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    if not flags:
        return None
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def warn_if_bf16_is_slow(param_dtype: str, device: torch.device,
                         cpuinfo: str | None = None) -> bool:
    """Warn (and return True) when a CPU run asks for bf16 on a CPU without bf16 instructions,
    where each step is slower than in float32 (docs/benchmarks/quality_3d.md).

    ``cpuinfo`` is the text of ``/proc/cpuinfo`` to judge by; None reads this machine's. A CPU
    whose flags cannot be read (no flags line, not Linux) is not warned about: no guess.
    """
    if device.type != "cpu" or param_dtype != "bfloat16":
        return False
    if cpu_has_bf16(cpuinfo) is not False:
        return False
    logger.warning(
        "training.mixed_precision_param = 'bfloat16' on a CPU without bf16 instructions (none "
        "of %s in /proc/cpuinfo): bf16 is converted around every matmul here, and a step is "
        "slower than in float32 (docs/benchmarks/quality_3d.md); set it to 'float32' on this "
        "machine",
        "/".join(BF16_CPU_FLAGS))
    return True


def block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """Every ``nn.ModuleList`` named ``blocks`` in the model, with its qualified name."""
    return [(name, m) for name, m in model.named_modules()
            if name.split(".")[-1] == "blocks" and isinstance(m, nn.ModuleList)]


# Ops whose outputs selective per-op AC keeps (recomputing them is what costs): matmuls and
# attention. Everything else in a block (norms, activations, adds) is recomputed.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    FA4_OP,  # FlashAttention-4 (torch.ops.torchtitan_em.fa4_attention)
}


def _op_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _op_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_op_policy)


def apply_ac(model: nn.Module, mode: str, option: str) -> None:
    """Activation checkpointing per block: ``full`` = every block; ``selective`` with an
    integer option N = every N-th block, with ``op`` = every block, keeping the outputs of
    matmuls and attention and recomputing the cheap ops in between."""
    if mode == "none":
        return
    every, kwargs = 1, {}
    if mode == "selective" and option == "op":
        kwargs = {"context_fn": _op_context}
    elif mode == "selective":
        if not option.isdigit() or int(option) < 1:
            raise ValueError(
                f"activation_checkpoint.selective_ac_option={option!r}: use 'op' or a positive "
                "integer N to checkpoint every N-th block"
            )
        every = int(option)
    for _, blocks in block_lists(model):
        for i in range(len(blocks)):
            if i % every == 0:
                blocks[i] = checkpoint_wrapper(blocks[i], preserve_rng_state=False, **kwargs)
    logger.info("activation checkpointing: %s (%s)", mode,
                "per op" if kwargs else f"every {every}-th block")


def apply_compile(model: nn.Module) -> None:
    """Compile each block on its own (fast compile, reused across identical blocks)."""
    for _, blocks in block_lists(model):
        for i in range(len(blocks)):
            blocks[i] = torch.compile(blocks[i], fullgraph=True)
    logger.info("compiled every transformer block with torch.compile")


def _fsdp_placement(param: nn.Parameter) -> Shard | None:
    """FSDP shards dim 0 (the default, None) except for the TP-packed qkv weight, whose dim 0
    is already split per q/k/v part: sharding it again there cannot be described as one
    placement per mesh dim, so FSDP takes dim 1 (the input features) instead."""
    return Shard(1) if isinstance(param, DTensor) and is_strided_tp(param) else None


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype) -> None:
    """FSDP2: shard each block, then the root (which picks up the remaining parameters)."""
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "shard_placement_fn": _fsdp_placement,
    }
    for _, blocks in block_lists(model):
        for block in blocks:
            fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def _size_option(list_name: str, cfg) -> str:
    """The config option that sets the size of the blocks in ``list_name``."""
    if list_name.startswith("decoder."):
        return "model.decoder_num_heads / model.decoder_dim"
    return f"model.backbone={cfg.model.backbone!r}"


def check_parallelism(model: nn.Module, dims: ParallelDims, cfg) -> None:
    """Settings that fit the world size but not the model or each other; raises a
    ParallelismError. ``model`` may live on the meta device: call this before any process
    group exists, so that every rank stops with the same message."""
    if not dims.tp_enabled:
        return
    for list_name, blocks in block_lists(model):
        check_divisible(list_name, blocks, dims.tp, _size_option(list_name, cfg))


def parallelize(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None, cfg) -> nn.Module:
    """Apply TP, AC, compile and data parallelism; returns the module to train.

    TP, FSDP and DDP + TP (FSDP2's ``replicate``) are applied here on the meta device. The
    classic DDP wrapper needs materialised weights, so it is applied by :func:`wrap_ddp` after
    initialisation.
    """
    if dims.cp_enabled:
        apply_cp(model, mesh["cp"])
    if dims.tp_enabled:
        check_parallelism(model, dims, cfg)
        apply_tp(block_lists(model), mesh["tp"])
        logger.info("applied tensor parallelism %d to every transformer block", dims.tp)
    ac = cfg.activation_checkpoint
    apply_ac(model, ac.mode, ac.selective_ac_option)
    if ac.mode == "selective" and ac.selective_ac_option == "op" and not cfg.training.compile:
        logger.warning(
            "activation_checkpoint.selective_ac_option = 'op' without training.compile: every "
            "op of every block passes through a Python dispatch mode, which made a 3D ViT-L "
            "step 3.3x slower than no checkpointing on an H200 (docs/benchmarks/gpu.md); "
            "compiled, the same policy is free. Set training.compile = true, or checkpoint "
            "whole blocks (mode = 'full', or selective_ac_option = an integer N)")
    if cfg.training.compile:
        apply_compile(model)
    if dims.fsdp_enabled:
        apply_fsdp(model, dims.fsdp_mesh(mesh), DTYPES[cfg.training.mixed_precision_param],
                   DTYPES[cfg.training.mixed_precision_reduce])
        logger.info("applied %s", dims.describe())
    elif dims.ddp_enabled and dims.tp_enabled:
        apply_replicate(model, mesh["dp_replicate"])
        logger.info("applied %s (DDP by FSDP2's replicate)", dims.describe())
    return model


def apply_replicate(model: nn.Module, mesh: DeviceMesh) -> None:
    """DDP for models with DTensor (tensor-parallel) parameters: FSDP2's replicate-only mode,
    per block and then the root, like :func:`apply_fsdp`. Parameters keep their dtype (bf16
    compute comes from autocast, as with the DDP wrapper)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for _, blocks in block_lists(model):
        for block in blocks:
            replicate(block, mesh=mesh)
    replicate(model, mesh=mesh)


def wrap_ddp(model: nn.Module, dims: ParallelDims, mesh: DeviceMesh | None) -> nn.Module:
    """Classic DDP (data parallel without sharding or TP); a no-op otherwise."""
    if not dims.ddp_enabled or dims.tp_enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = None
    p = next(model.parameters())
    if p.device.type == "cuda":
        device_ids = [p.device.index]
    logger.info("applied %s", dims.describe())
    return DistributedDataParallel(model, process_group=mesh["dp_replicate"].get_group(),
                                   device_ids=device_ids)


def autocast_context(dims: ParallelDims, cfg, device_type: str):
    """bf16 autocast where FSDP's mixed-precision policy does not already cast parameters."""
    dtype = DTYPES[cfg.training.mixed_precision_param]
    if dims.fsdp_enabled or dtype == torch.float32:
        import contextlib

        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def _foreach(tensors: list[torch.Tensor]) -> bool:
    """Whether to take the multi-tensor (foreach) kernels: one launch per group of tensors
    instead of one or two per tensor (hundreds per step on a GPU), wherever torch has them
    for the device, DTensors included. On a CPU the foreach ops run tensor by tensor, with
    the same kernels and therefore the same bits as the plain loop."""
    from torch.utils._foreach_utils import _device_has_foreach_support

    return bool(tensors) and _device_has_foreach_support(tensors[0].device)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip the gradients to a total L2 norm of ``max_norm`` (``inf``: measure only) and return
    the total norm before clipping, a plain scalar tensor, the same on every rank.

    Under FSDP every gradient is a DTensor on the dp mesh; with tensor parallelism the blocks'
    gradients are DTensors on the (dp x) tp mesh while the rest are plain tensors (TP only) or
    DTensors on the dp mesh (FSDP + TP). ``torch.nn.utils.clip_grad_norm_`` cannot mix them,
    so the norm is taken per mesh (each DTensor reduced over its own shards, replicated
    tensors counted once) and the parts are combined.
    """
    params = [p for p in parameters if p.grad is not None]
    by_mesh: dict = {}
    for p in params:
        mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        by_mesh.setdefault(mesh, []).append(p)
    parts = []
    for group in by_mesh.values():
        grads = [p.grad for p in group]
        norm = torch.nn.utils.get_total_norm(grads, foreach=_foreach(grads))
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not parts:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(parts))
    for group in by_mesh.values():  # one mesh at a time: a multi-tensor op takes one mesh
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total,
                                             foreach=_foreach([p.grad for p in group]))
    return total
