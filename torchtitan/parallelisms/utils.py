"""Gradient-norm clipping over parameters that live on different device meshes."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


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
    grads = [p.grad for p in params]
    by_mesh: dict = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    parts = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, foreach=False)
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not parts:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(parts))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
    return total
