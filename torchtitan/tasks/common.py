"""Pieces both tasks share."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtitan.errors import ConfigError
from torchtitan.models import list_backbones


def check_backbone(cfg) -> None:
    if cfg.model.backbone not in list_backbones():
        raise ConfigError(
            f"model.backbone={cfg.model.backbone!r} is not a known backbone; choose one of: "
            f"{', '.join(list_backbones())}"
        )


def most_forwards(count: int, ctx) -> int:
    """The largest ``count`` over data-parallel ranks when the model is sharded, else ``count``
    (``ctx``: the :class:`~torchtitan.tasks.base.ValidationContext`).

    Sharded (FSDP) forwards all-gather parameters, so every rank must run the same number of
    them: a rank with less work pads with idle forwards up to this number. Call it before any
    forward, so that the all-reduce here is matched on every rank.
    """
    if not ctx.sharded or ctx.dp_group is None:
        return count
    most = torch.tensor(count, dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=ctx.dp_group)
    return int(most)


class TaskBase:
    """What every task holds: the run's config and the picture writer it was built with
    (handed in by the entry script, a tool the core does not import; None: no pictures)."""

    def __init__(self, cfg, visuals=None):
        self.cfg = cfg
        self.visuals = visuals
