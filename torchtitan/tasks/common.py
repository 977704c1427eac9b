"""Pieces both tasks share."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from torchtitan.config_manager import ConfigError
from torchtitan.models import list_backbones


def check_backbone(cfg) -> None:
    if cfg.model.backbone not in list_backbones():
        raise ConfigError(
            f"model.backbone={cfg.model.backbone!r} is not a known backbone; choose one of: "
            f"{', '.join(list_backbones())}"
        )


def idle_forwards(forward_once: Callable[[], object], done: int, trainer) -> None:
    """Call ``forward_once`` until this rank has run as many forwards as the busiest rank.

    Sharded (FSDP) forwards all-gather parameters, so every rank must run the same number.
    """
    if not trainer.dims.fsdp_enabled:
        return
    most = torch.tensor(done, dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=trainer.dp_mesh.get_group())
    for _ in range(int(most) - done):
        forward_once()
