"""Attention kernels: PyTorch SDPA everywhere, FlashAttention-4 where it can run.

Models call ``attention(q, k, v, backend)`` with q, k, v of shape (B, heads, N, head_dim),
non-causal, no mask (ViT encoders attend densely). Backends:

* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``; runs on any device and
  picks flash / memory-efficient / math kernels by itself.
* ``"fa4"``: FlashAttention-4 (``flash_attn.cute`` from the optional PyPI package
  ``flash-attn-4``, CuTe-DSL kernels) on NVIDIA Hopper
  (sm90) or Blackwell (sm100/sm110) GPUs. It only takes fp16/bf16 inputs; float32 inputs are
  cast to bf16 for the kernel and the output is cast back. The kernel is called through the
  custom op ``torch.ops.torchtitan_em.fa4_attention`` (forward, FA4's own backward as its
  registered autograd, and a fake implementation for tracing), so ``torch.compile(fullgraph=
  True)`` traces a block that uses it and selective activation checkpointing can keep its
  output (``parallelisms/parallelize.py``) instead of running the kernel again.

``resolve_attention_backend`` turns a configured name ("sdpa", "fa4", "auto") into one of
the two backends for a given device, failing early with an actionable message. The trainer and
the predictor resolve the configured name once per model build, before ``torch.compile``, and
give every attention layer the concrete backend (``vit.use_attention``): a compiled block then
sees a fixed kernel choice, never the resolution itself (which logs and caches, and cannot be
traced with ``fullgraph=True``). Eager code may still pass "auto" to :func:`attention`.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from torchtitan.choices import ATTENTION_BACKENDS

logger = logging.getLogger(__name__)


# Compute capability majors that FlashAttention-4 has kernels for: Hopper 9.x, Blackwell 10.x/11.x.
_FA4_ARCH_MAJORS = (9, 10, 11)


@functools.lru_cache(maxsize=1)
def _fa4_kernels():
    """FA4's forward and backward functions (``flash_attn.cute.interface._flash_attn_fwd`` and
    ``_flash_attn_bwd``, what its own ``flash_attn_func`` autograd calls), imported once; None
    when the package is not installed or lacks them."""
    try:
        from flash_attn.cute import interface  # type: ignore[import-not-found]

        return interface._flash_attn_fwd, interface._flash_attn_bwd
    except Exception:  # ImportError, a broken CUDA/CuTe install that fails at import, or a
        return None    # version whose internals moved


def fa4_unavailable_reason(device: torch.device | str) -> str | None:
    """Why FA4 cannot run on ``device``, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FlashAttention-4 needs a CUDA GPU, but the model runs on '{device.type}'"
    if not torch.cuda.is_available():
        return "FlashAttention-4 needs CUDA, but torch.cuda.is_available() is False"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in _FA4_ARCH_MAJORS:
        return (
            f"FlashAttention-4 supports Hopper (sm90) and Blackwell (sm100) GPUs; "
            f"this GPU is sm{major}{minor}"
        )
    if _fa4_kernels() is None:
        return ("the package `flash_attn.cute` (FlashAttention-4, with its `_flash_attn_fwd` "
                "and `_flash_attn_bwd`) is not installed")
    return None


def resolve_attention_backend(name: str, device: torch.device | str) -> str:
    """Choose the attention backend for ``device``: returns "sdpa" or "fa4".

    "sdpa" is always possible. "fa4" raises a RuntimeError saying why when it cannot run here.
    "auto" takes fa4 when it can run and sdpa otherwise, and logs the choice.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; expected one of {ATTENTION_BACKENDS}")
    if name == "sdpa":
        return "sdpa"
    reason = fa4_unavailable_reason(device)
    if name == "fa4":
        if reason is not None:
            raise RuntimeError(
                f"attention='fa4' was requested but {reason}. Use attention='sdpa' (or 'auto'), "
                "or run on a Hopper/Blackwell GPU with the optional FlashAttention-4 extra "
                "installed (`pip install -r requirements-gpu.txt`)."
            )
        return "fa4"
    chosen = "fa4" if reason is None else "sdpa"
    logger.info(
        "attention='auto' on %s: using %s%s",
        torch.device(device),
        chosen,
        "" if reason is None else f" ({reason})",
    )
    return chosen


@functools.lru_cache(maxsize=None)
def _auto_backend_for(device: torch.device) -> str:
    """Cached "auto" resolution, so that it is decided (and logged) once per device."""
    return resolve_attention_backend("auto", device)


# --------------------------------------------------------------------------- FA4 as an op
# The FA4 kernels are opaque to torch.compile (CuTe DSL JIT, Python-side caches) and FA4's
# own ``flash_attn_func`` is a Python autograd.Function, which dynamo must trace through and
# which selective AC cannot name. As a custom op the kernel is one node in the graph: the fake
# implementation gives its output shapes to the tracer, the registered autograd calls FA4's
# backward kernel on what the forward saved (q, k, v, out, lse), and per-op AC policies can
# save it by its overload, ``torch.ops.torchtitan_em.fa4_attention.default``.
# Only a CUDA implementation is registered: on any other device the op has no kernel.


@torch.library.custom_op("torchtitan_em::fa4_attention", mutates_args=(), device_types="cuda")
def fa4_attention_op(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Non-causal FA4 forward: q, k, v (B, N, heads, head_dim) fp16/bf16 -> (out (B, N,
    heads, head_dim) in their dtype, lse (B, heads, N) float32)."""
    fwd, _ = _fa4_kernels()
    out, lse, *_ = fwd(q, k, v, causal=False, return_lse=True)
    return out, lse


@fa4_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    B, N, H, _ = q.shape
    return q.new_empty(B, N, H, v.shape[-1]), q.new_empty(B, H, N, dtype=torch.float32)


@torch.library.custom_op("torchtitan_em::fa4_attention_backward", mutates_args=(),
                         device_types="cuda")
def fa4_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                              lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """FA4's backward kernel: (dq, dk, dv) of :func:`fa4_attention_op`."""
    _, bwd = _fa4_kernels()
    dq, dk, dv = bwd(q, k, v, out, dout, lse, causal=False)[:3]
    return dq, dk, dv


@fa4_attention_backward_op.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor
      ) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fa4_setup_context(ctx, inputs, output) -> None:
    q, k, v = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)


def _fa4_backward(ctx, dout: Tensor, dlse: Tensor | None):
    # The lse output is for the backward only (nothing downstream differentiates it): its
    # gradient is ignored, as in FA4's own autograd without return_lse.
    q, k, v, out, lse = ctx.saved_tensors
    return torch.ops.torchtitan_em.fa4_attention_backward(dout.contiguous(), q, k, v, out, lse)


fa4_attention_op.register_autograd(_fa4_backward, setup_context=_fa4_setup_context)
# The overload that per-op activation checkpointing policies name.
FA4_OP = torch.ops.torchtitan_em.fa4_attention.default


def _fa4_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """FA4 takes (B, N, heads, head_dim) in fp16/bf16: transpose views in and out, cast."""
    in_dtype = q.dtype
    kernel_dtype = in_dtype if in_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    q, k, v = (t.transpose(1, 2).to(kernel_dtype) for t in (q, k, v))
    out, _ = torch.ops.torchtitan_em.fa4_attention(q, k, v)
    return out.transpose(1, 2).to(in_dtype)


def attention(q: Tensor, k: Tensor, v: Tensor, backend: str = "sdpa") -> Tensor:
    """Dense, non-causal multi-head attention; q, k, v and the result are (B, heads, N, hd)."""
    if backend == "auto":
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "attention='auto' reached a compiled block; resolve it before torch.compile "
                "with resolve_attention_backend() and vit.use_attention()")
        backend = _auto_backend_for(q.device)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v)
    if backend == "fa4":
        return _fa4_attention(q, k, v)
    raise ValueError(f"Unknown attention backend {backend!r}; expected one of {ATTENTION_BACKENDS}")
