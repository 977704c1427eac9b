"""Pieces both tasks share."""

from __future__ import annotations

from torchtitan.errors import ConfigError
from torchtitan.models import list_backbones


def check_backbone(cfg) -> None:
    if cfg.model.backbone not in list_backbones():
        raise ConfigError(
            f"model.backbone={cfg.model.backbone!r} is not a known backbone; choose one of: "
            f"{', '.join(list_backbones())}"
        )


class TaskBase:
    """What every task holds: the run's config and the picture writer it was built with
    (handed in by the entry script, a product the core does not import; None: no pictures)."""

    def __init__(self, cfg, visuals=None):
        self.cfg = cfg
        self.visuals = visuals
