"""Attention kernels: PyTorch SDPA everywhere, FlashAttention-4 where it can run.

Models call ``attention(q, k, v, backend)`` with q, k, v of shape (B, heads, N, head_dim),
non-causal, no mask (ViT encoders attend densely). Backends:

* ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention``; runs on any device and
  picks flash / memory-efficient / math kernels by itself.
* ``"fa4"``: FlashAttention-4 (``flash_attn.cute`` from the optional PyPI package
  ``flash-attn-4``, CuTe-DSL kernels) on NVIDIA Hopper
  (sm90) or Blackwell (sm100/sm110) GPUs. It only takes fp16/bf16 inputs; float32 inputs are
  cast to bf16 for the kernel and the output is cast back.

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
def _fa4_function():
    """Import FA4's ``flash_attn_func`` once; None when the package is not installed."""
    try:
        from flash_attn.cute import flash_attn_func  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a broken CUDA/CuTe install that fails at import
        return None
    return flash_attn_func


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
    if _fa4_function() is None:
        return "the package `flash_attn.cute` (FlashAttention-4) is not installed"
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


def _fa4_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """FA4 takes (B, N, heads, head_dim) in fp16/bf16 and may also return the log-sum-exp."""
    flash_attn_func = _fa4_function()
    in_dtype = q.dtype
    kernel_dtype = in_dtype if in_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    q, k, v = (t.transpose(1, 2).to(kernel_dtype) for t in (q, k, v))
    out = flash_attn_func(q, k, v, causal=False)
    if isinstance(out, tuple):  # (out, lse) in some versions
        out = out[0]
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
