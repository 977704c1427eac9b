"""Optimizer, learning-rate schedule and the weights' moving average."""

from __future__ import annotations

import contextlib
import logging
import math
import re

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

logger = logging.getLogger(__name__)


# The parameters lr_scheduler.backbone_frozen_steps holds still: a segmentation model's backbone.
FROZEN_PREFIX = "backbone."
# Transformer blocks of a backbone ("backbone." in segmentation, "encoder." in the MAE).
_BLOCK = re.compile(r"^(?:backbone|encoder)\.blocks\.(\d+)\.")
_BACKBONE = re.compile(r"^(?:backbone|encoder)\.")
_TOKENS = ("cls_token", "storage_tokens", "mask_token")


def layer_depth(name: str, num_blocks: int) -> int:
    """Depth of a parameter for layer-wise LR decay: 0 for the backbone's embeddings and
    tokens, ``i + 1`` for its block ``i``, ``num_blocks + 1`` for everything after the last
    block (its final norm, the head, an MAE decoder)."""
    match = _BLOCK.match(name)
    if match:
        return int(match.group(1)) + 1
    if _BACKBONE.match(name) and not re.match(r"^(?:backbone|encoder)\.(?:norm|local_cls_norm)\.", name):
        return 0
    return num_blocks + 1


def build_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """AdamW/Adam; weight decay only on matrices and kernels, never on norms, biases, LayerScale
    or learned tokens (all 1-D or token-shaped parameters).

    ``optimizer.layer_decay`` < 1 scales the LR of a backbone parameter at depth ``d`` (see
    :func:`layer_depth`) by ``layer_decay ** (num_blocks + 1 - d)``, as in BEiT's and MAE's
    fine-tuning: the head learns at the full LR, early blocks change least. With
    ``lr_scheduler.backbone_frozen_steps`` the backbone's parameters are in groups of their
    own (for :func:`build_lr_scheduler`), after the others.
    """
    o = cfg.optimizer
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    num_blocks = 1 + max((int(m.group(1)) for n, _ in named if (m := _BLOCK.match(n))), default=-1)
    apart = cfg.lr_scheduler.backbone_frozen_steps > 0
    groups: dict[tuple[int, bool, bool], dict] = {}
    for name, p in named:
        is_token = name.split(".")[-1] in _TOKENS
        decays = not (p.ndim <= 1 or is_token)
        depth = layer_depth(name, num_blocks) if o.layer_decay < 1.0 else num_blocks + 1
        key = (depth, decays, apart and name.startswith(FROZEN_PREFIX))
        if key not in groups:
            scale = o.layer_decay ** (num_blocks + 1 - depth)
            groups[key] = {"params": [], "weight_decay": o.weight_decay if decays else 0.0,
                           "lr": o.lr * scale}
        groups[key]["params"].append(p)
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[o.name]
    # Decaying group first (the historical order), then by depth: a fixed, documented order;
    # a backbone kept apart comes last, so that the logged LR (group 0's) is the head's.
    ordered = [groups[k] for k in sorted(groups, key=lambda k: (k[2], not k[1], k[0]))]
    # torch's fused kernel (one multithreaded kernel per parameter, CPU and GPU), where it
    # can take every parameter; else the batched foreach ops; one op at a time only where the
    # parameters are of mixed kinds. All compute the same update to float rounding.
    implementation = "fused"
    if len({_placement_kind(p) for _, p in named}) > 1:
        # Tensor parallelism leaves some parameters plain and others DTensors (or DTensors on
        # different meshes); a fused or foreach kernel takes only one kind per call.
        logger.info("optimizer: parameters are of mixed kinds (tensor parallelism); the "
                    "update runs one parameter at a time")
        implementation = "for-loop"
    elif not _fused_kernels_for(p for _, p in named):
        logger.warning("optimizer: torch has no fused %s kernel for parameters on %s; the "
                       "update runs as batched foreach ops", o.name,
                       sorted({p.device.type for _, p in named}))
        implementation = "foreach"
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True},
            "for-loop": {"foreach": False}}[implementation]
    return cls(ordered, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **impl)


def _fused_kernels_for(params) -> bool:
    """Whether torch's fused Adam kernels take all of ``params`` (it checks only at the
    first step)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch that moved it: let torch decide at the first step
        return True
    devices = set(_get_fused_kernels_supported_devices())
    return all(p.device.type in devices and p.is_floating_point() for p in params)


def _placement_kind(p: torch.Tensor) -> tuple:
    """What a fused or foreach kernel needs to be equal across its tensors: plain, or a
    DTensor on a given mesh."""
    if isinstance(p, DTensor):
        return ("dtensor", p.device_mesh.mesh_dim_names, tuple(p.device_mesh.mesh.shape))
    return ("tensor",)


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


def thaw_factor(step: int, frozen: int, ramp: int) -> float:
    """Multiplier of a frozen-then-thawed group's LR at step ``step``: 0 for the first
    ``frozen`` steps, then a linear ramp to 1 over ``ramp`` steps."""
    if step < frozen:
        return 0.0
    return min(1.0, (step - frozen + 1) / max(1, ramp))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg,
                       model: torch.nn.Module | None = None) -> LambdaLR:
    """The schedule of every group; with ``lr_scheduler.backbone_frozen_steps`` the groups of
    ``model``'s backbone (kept apart by :func:`build_optimizer`) also thaw by
    :func:`thaw_factor`, over ``training.warmup_steps``."""
    t, s = cfg.training, cfg.lr_scheduler

    def schedule(step: int) -> float:
        return lr_factor(step, t.warmup_steps, t.steps, s.decay_type, s.min_lr_factor)

    def thawed(step: int) -> float:
        return thaw_factor(step, s.backbone_frozen_steps, t.warmup_steps) * schedule(step)

    frozen = _backbone_groups(optimizer, model) if s.backbone_frozen_steps else set()
    return LambdaLR(optimizer, [thawed if i in frozen else schedule
                                for i in range(len(optimizer.param_groups))])


def _backbone_groups(optimizer: torch.optim.Optimizer, model) -> set[int]:
    """Indices of the optimizer's groups that hold backbone parameters of ``model``."""
    if model is None:
        raise ValueError("lr_scheduler.backbone_frozen_steps needs the model, to find its "
                         "backbone's parameter groups")
    backbone = {id(p) for n, p in model.named_parameters() if n.startswith(FROZEN_PREFIX)}
    return {i for i, g in enumerate(optimizer.param_groups)
            if any(id(p) in backbone for p in g["params"])}


class WeightAverage:
    """An exponential moving average of a model's weights (``training.ema_decay``), kept as
    shards beside the model's own: each tensor of the model's state dict (DTensor shards under
    FSDP / TP, plain tensors otherwise) has its average, updated after every applied optimizer
    step as ``avg += (1 - d) * (w - avg)`` with ``d = min(decay, (1 + n) / (10 + n))`` after
    ``n`` updates (the warm-up of timm's ``ModelEmaV3``: early averages follow the weights).
    Integer buffers are copied, not averaged.

    ``torch.optim.swa_utils.AveragedModel`` would deep-copy the module, which sharded modules
    do not support, and hold a second model; this holds only the averaged tensors.
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if not 0.0 < decay < 1.0:
            raise ValueError(f"training.ema_decay = {decay}: must lie in (0, 1)")
        self.decay = float(decay)
        self.updates = 0
        # The state dict's tensors share storage with the model's parameters and buffers,
        # which optimizer steps update in place: read once, they follow the model.
        self.live = get_model_state_dict(model)
        self.avg = {k: v.detach().clone() for k, v in self.live.items()}
        self._float = [k for k, v in self.live.items() if v.is_floating_point()]
        self._other = [k for k, v in self.live.items() if not v.is_floating_point()]

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def decay_now(self) -> float:
        """The decay of the next update (warmed up over the first updates)."""
        return min(self.decay, (1.0 + self.updates) / (10.0 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """Average in the weights of an applied optimizer step."""
        weight = 1.0 - self.decay_now()
        torch._foreach_lerp_([self._local(self.avg[k]) for k in self._float],
                             [self._local(self.live[k]) for k in self._float], weight)
        for k in self._other:
            self._local(self.avg[k]).copy_(self._local(self.live[k]))
        self.updates += 1

    @torch.no_grad()
    def reset(self) -> None:
        """Averages equal to the weights now (averaging turned on at a resume)."""
        for k, v in self.live.items():
            self._local(self.avg[k]).copy_(self._local(v))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged weights, keyed as the model's state dict."""
        return self.avg

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            self._local(self.avg[k]).copy_(self._local(v))

    @contextlib.contextmanager
    def swapped_in(self):
        """The averaged weights in the model for the duration (validation), the trained
        ones back after."""
        with torch.no_grad():
            kept = {k: self._local(v).clone() for k, v in self.live.items()}
            for k, v in self.live.items():
                self._local(v).copy_(self._local(self.avg[k]))
        try:
            yield
        finally:
            with torch.no_grad():
                for k, v in self.live.items():
                    self._local(v).copy_(kept[k])
