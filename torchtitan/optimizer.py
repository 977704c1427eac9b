"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW/Adam; weight decay only on matrices and kernels, never on norms, biases, LayerScale
    or learned tokens (all 1-D or token-shaped parameters)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_token = name.split(".")[-1] in ("cls_token", "storage_tokens", "mask_token")
        (no_decay if p.ndim <= 1 or is_token else decay).append(p)
    o = cfg.optimizer
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[o.name]
    # foreach=False: identical update order on every parallelism (and works with DTensors).
    return cls(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)


def lr_factor(step: int, warmup: int, total: int, decay_type: str, min_factor: float) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based): linear warmup over
    ``warmup`` steps, then decay to ``min_factor`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if decay_type == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if decay_type == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_factor + (1.0 - min_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg) -> LambdaLR:
    t, s = cfg.training, cfg.lr_scheduler
    return LambdaLR(
        optimizer,
        lambda step: lr_factor(step, t.warmup_steps, t.steps, s.decay_type, s.min_lr_factor),
    )
