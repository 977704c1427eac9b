"""Distributed checkpoints (torch.distributed.checkpoint): save, resume, seed loading.

Layout: ``<dump_folder>/<checkpoint.folder>/step-N/`` holds one DCP checkpoint with

    model.*          model weights (unwrapped names: no DDP/FSDP/compile/AC prefixes)
    optimizer.*      optimizer state
    lr_scheduler.*   schedule state
    train_state.*    step, data-sampler position, RNG states

A checkpoint is written to ``.step-N.tmp`` and renamed to ``step-N`` only once every rank
has finished and DCP has written ``.metadata``, so a crash mid-save never leaves a folder
that loading would take. A save that fails (a full disk on any rank) removes its ``.tmp``
folder and stops every rank with a :class:`CheckpointError`; the previous ``step-N`` stays.
Temporary folders left by a killed job are removed at the next start, and a ``step-N`` whose
``.metadata`` cannot be read is skipped (with a warning) in favour of the one before. Because DCP reshards on load, a checkpoint written under FSDP on two
ranks loads under DDP or on one process.

Tensors are always stored in their unsharded layout (Meta's, for the ViT). The one tensor that
tensor parallelism shards in strided blocks (the packed qkv weight, and its optimizer states)
is redistributed to ordinary shards around each save and load (``to_storage_layout``), so a
TP checkpoint loads under any parallelism and vice versa.

Reading checkpoints (the step folders, their keys, model weights through prefix maps) is
:mod:`torchtitan.checkpoint.reading`.

What a start loads is decided first (:func:`plan_resume`), before the model is initialised:
the trainer initialises only what the plan does not restore (nothing, on a resume of the
run's own checkpoint), then :meth:`CheckpointManager.resume` loads it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from torchtitan.checkpoint.reading import (
    check_seed_shapes,
    check_stored_shapes,
    checkpoint_keys,
    complete_steps,
    load_model_weights,
    model_part,
    PARTIAL_STEP_RE,
    parse_prefix_map,
    partial_step_folder,
    readable_steps,
    resolve_step_folder,
    shared_parts_map,
    step_folder,
    unused_seed_keys,
)
from torchtitan.errors import CheckpointError
from torchtitan.parallelisms.tensor_parallel import from_storage_layout, to_storage_layout

logger = logging.getLogger(__name__)

BEST_RECORD = "best.json"  # names the best checkpoint: {"step": N, <metric>: score}
# Left behind by a job killed mid-save (checkpoint) or mid-write (best.json); never loadable.
SEED_STEP = 0  # a model-only checkpoint at this step is a seed (pth_to_dcp.py, create_seed_checkpoint)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def read_best(folder: str | os.PathLike) -> dict | None:
    """The record of the best checkpoint in ``folder`` (``{"step": N, <metric>: score}``, see
    :meth:`CheckpointManager.mark_best`), or None when no validation has marked one."""
    path = Path(folder) / BEST_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


class CheckpointManager:
    """Saves and restores the full training state; see the module docstring.

    The best checkpoint is the train state's ``best_step`` (its one owner): ``keep_latest_k``
    purging spares it, and :meth:`mark_best` writes it to ``best.json`` for people and tools.
    """

    def __init__(self, cfg, model: torch.nn.Module, optimizer, lr_scheduler, train_state,
                 ema=None):
        self.cfg = cfg.checkpoint
        self.enabled = self.cfg.enable_checkpoint
        self.folder = Path(cfg.job.dump_folder) / self.cfg.folder
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        # Has state_dict() / load_state_dict() and best_step (None before the first best).
        self.train_state = train_state
        # The weights' moving average (training.ema_decay), or None: see _state.
        self.ema = ema
        self.pending = None  # (future, step) of an asynchronous save not yet finalised
        # Background saves coordinate through their own (gloo) process group, so that their
        # collectives never interleave with the training step's on the default group.
        self.async_group = None
        if self.enabled and self.cfg.async_mode == "async" and dist.is_initialized():
            self.async_group = dist.new_group(backend="gloo")

    # -- saving ---------------------------------------------------------------------------------

    def _state(self) -> dict:
        """What a step holds. With a moving average of the weights, ``model`` holds the
        averaged weights (what prediction, export, seeds and fine-tuning read) and
        ``train_model`` the trained ones, which only a resume reads."""
        state = {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "train_state": self.train_state.state_dict(),
        }
        if self.ema is not None:
            state["train_model"], state["model"] = state["model"], self.ema.state_dict()
        return state

    def should_save(self, step: int, last_step: bool) -> bool:
        return self.enabled and (last_step or step % self.cfg.interval == 0)

    def save(self, step: int, model_only: bool = False) -> Path:
        """Write ``step-N`` atomically: into ``.step-N.tmp``, renamed once every rank is done.

        With ``async_mode = "async"`` the write runs in the background (after a copy of the
        state to host memory) and is finalised before the next save or at :meth:`close`.
        """
        self.wait()
        final = step_folder(self.folder, step)
        tmp = partial_step_folder(self.folder, step)
        if _is_rank0():
            self.folder.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        _barrier()
        if model_only:
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.cfg.export_dtype]
            weights = to_storage_layout(get_model_state_dict(self.model) if self.ema is None
                                        else self.ema.state_dict())
            state = {"model": {k: v.to(dtype) for k, v in weights.items()}}
        else:
            state = to_storage_layout(self._state())
        if self.cfg.async_mode == "async" and not model_only:
            try:
                future = dcp.async_save(state, storage_writer=self._storage_writer(tmp),
                                        process_group=self.async_group)
            except (Exception, CheckpointException) as e:
                self._save_failed(step, e)
            self.pending = (future, step)
            return final
        try:
            dcp.save(state, storage_writer=self._storage_writer(tmp))
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            self._save_failed(step, e)
        self._finalize(step)
        return final

    def _storage_writer(self, path: Path) -> dcp.FileSystemWriter:
        """Where DCP writes a checkpoint. The one seam through which tests substitute a storage
        layer that fails (a full disk), to check what a failed save leaves behind."""
        return dcp.FileSystemWriter(str(path))

    def _save_failed(self, step: int, error: BaseException) -> None:
        """Clean up after a failed save and raise a :class:`CheckpointError` saying what to do.

        DCP gathers every rank's write result before it writes ``.metadata`` and raises the
        same ``CheckpointException`` on all ranks when any of them failed, so every rank gets
        here together: rank 0 removes the partial ``.tmp`` folder and no rank waits for
        another. The previous ``step-N`` folders are never touched by a save.
        """
        tmp = partial_step_folder(self.folder, step)
        if _is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        causes = _failure_causes(error)
        if not any(isinstance(c, OSError) for _, c in causes):
            raise error  # not a storage problem: a bug, shown with its traceback
        previous = [s for s in complete_steps(self.folder) if s < step]
        kept = (f"the previous checkpoint {step_folder(self.folder, previous[-1])} is intact and "
                "a relaunch of the same command resumes from it" if previous else
                "there is no earlier checkpoint, so a relaunch starts from step 0")
        no_space = any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT)
                       for _, c in causes)
        what = "the disk is full" if no_space else "a storage error"
        detail = "; ".join(f"rank {r}: {c}" for r, c in causes if isinstance(c, OSError))
        raise CheckpointError(
            f"saving the checkpoint of step {step} to {tmp} failed: {what} ({detail}). The "
            f"partial folder was removed and {kept}. Free space on the disk holding "
            f"{self.folder}, or set job.dump_folder to a disk with room (copy the checkpoint "
            "folder along to resume there)"
        ) from None

    def wait(self) -> None:
        """Finish a pending asynchronous save (no-op when there is none)."""
        if self.pending is not None:
            future, step = self.pending
            self.pending = None
            try:
                future.result()
            except (Exception, CheckpointException) as e:
                self._save_failed(step, e)
            self._finalize(step)

    def _finalize(self, step: int) -> None:
        _barrier()  # every rank's files and DCP's .metadata are written
        final = step_folder(self.folder, step)
        if _is_rank0():
            if final.exists():
                shutil.rmtree(final)
            os.replace(partial_step_folder(self.folder, step), final)
            self._purge()
        _barrier()
        logger.info("saved checkpoint %s", final)

    def mark_best(self, score: float, metric: str) -> None:
        """Write ``best.json`` naming the train state's ``best_step`` with its ``score`` on
        ``metric``, and purge the earlier best it replaces."""
        if _is_rank0():
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / f".{BEST_RECORD}.tmp"
            tmp.write_text(json.dumps({"step": self.train_state.best_step, metric: score}) + "\n")
            os.replace(tmp, self.folder / BEST_RECORD)
            self._purge()  # an earlier best may now go

    def _purge(self) -> None:
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        best = self.train_state.best_step
        for step in complete_steps(self.folder)[:-k]:
            if step != best:
                shutil.rmtree(step_folder(self.folder, step), ignore_errors=True)

    # -- loading --------------------------------------------------------------------------------

    def resume(self, plan: ResumePlan | None = None) -> int:
        """Restore what ``plan`` (by default :func:`plan_resume`'s) names; returns the
        restored step (0 for a fresh start, a seed or a warm start of the weights)."""
        if plan is None:
            plan = plan_resume(self.cfg, self.folder, self.model)
        if plan.kind == "weights":
            load_model_weights(self.model, plan.path, list(plan.prefix_map))
            return 0
        if plan.kind == "seed":
            return self.load_seed(plan.path, list(plan.prefix_map))
        if plan.kind == "full":
            return self.load_full(plan.path, list(plan.exclude))
        return 0

    def remove_stale_tmp(self) -> None:
        """See :func:`remove_stale_tmp`."""
        remove_stale_tmp(self.folder)

    def load_seed(self, path: Path, prefix_map: list[str] | None = None) -> int:
        """Start training from the model-only seed ``path`` in the run's own folder: its model
        weights, step 0, a fresh optimizer and schedule.

        ``prefix_map`` (by default ``initial_load_prefix_map``, or else every top-level part
        that seed and model share: ``backbone.``, ``encoder.``, or every part of a
        ``create_seed_checkpoint``) says what is loaded, strictly; model parts the seed does
        not hold (a new segmentation head) keep their initialisation.
        """
        model_keys = list(get_model_state_dict(self.model))
        seed_keys = [k[len("model."):] for k in checkpoint_keys(path) if k.startswith("model.")]
        if prefix_map is None:
            prefix_map = list(self.cfg.initial_load_prefix_map) or shared_parts_map(
                path, seed_keys, model_keys)
        pairs = parse_prefix_map(prefix_map)
        check_seed_shapes(self.model, path, pairs)
        load_model_weights(self.model, path, prefix_map)
        unused = unused_seed_keys(seed_keys, model_keys, pairs)
        if unused:  # e.g. the training-only local_cls_norm of the SAT-493M ViT-L
            logger.info("seed checkpoint %s: %d weights not used by this model, e.g. %s",
                        path, len(unused), unused[:5])
        loaded = {dst for _, dst in pairs}
        kept = sorted({model_part(k) for k in model_keys} - loaded)
        logger.info(
            "starting from the seed checkpoint %s at step 0: model weights of %s loaded%s; "
            "fresh optimizer and LR schedule", path, ", ".join(sorted(loaded)),
            f", {', '.join(kept)} left as initialised (not in the seed)" if kept else "",
        )
        return 0

    def load_full(self, path: Path, exclude: list[str] = ()) -> int:
        """Restore model, optimizer, schedule and train state (minus ``exclude``) from
        ``path``; returns the restored step (0 when the train state is excluded)."""
        stored = {k.split(".")[0] for k in checkpoint_keys(path)}
        if "optimizer" not in stored:
            raise CheckpointError(
                f"{path} holds only model weights (a seed or model-only export); load it with "
                "checkpoint.initial_load_path instead of resuming from it"
            )
        if "optimizer" not in exclude:
            _init_optimizer_state(self.optimizer)
        exclude = list(exclude) + (["train_model"] if "model" in exclude else [])
        own = {k: v for k, v in self._state().items() if k not in exclude}
        if "model" in own:
            check_stored_shapes(path, {f"model.{k}": v for k, v in own["model"].items()},
                                "the checkpoint")
        # A checkpoint with a moving average holds the trained weights as train_model.
        averaged = "train_model" in stored
        if "model" in own and self.ema is None and averaged:
            own["train_model"] = own.pop("model")  # averaging off now: its averages are dropped
        elif "model" in own and self.ema is not None and not averaged:
            own["model"] = own.pop("train_model")  # averaging on now: it starts from the weights
        stored_layout = to_storage_layout(own)
        dcp.load(stored_layout, checkpoint_id=str(path))
        state = from_storage_layout(stored_layout, own)
        if "train_model" in state:
            set_model_state_dict(self.model, state["train_model"])
            if self.ema is not None:
                self.ema.load_state_dict(state["model"])
        elif "model" in state:
            set_model_state_dict(self.model, state["model"])
            if self.ema is not None:
                self.ema.reset()
        if "optimizer" in state:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        if "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        step = 0
        if "train_state" in state:
            self.train_state.load_state_dict(state["train_state"])
            step = self.train_state.step
        logger.info("resumed from %s%s", path, f" (not restored: {exclude})" if exclude else "")
        return step


class ResumePlan:
    """What a start loads, decided before the model is initialised, so that nothing the
    checkpoint restores is initialised first (:meth:`restored_model_keys`).

    ``kind``: ``"none"`` (a fresh start), ``"full"`` (model, optimizer, schedule and train
    state of ``path``, less ``exclude``), ``"weights"`` (model weights of ``path`` through
    ``prefix_map``: ``initial_load_model_only``) or ``"seed"`` (a model-only ``step-0`` in
    the run's own folder, through ``prefix_map``).
    """

    def __init__(self, kind: str, path: Path | None = None, exclude: list[str] = (),
                 prefix_map: list[str] = ()):
        self.kind = kind
        self.path = path
        self.exclude = tuple(exclude)
        self.prefix_map = tuple(prefix_map)

    def restored_model_keys(self, model_keys) -> set[str]:
        """The model state-dict keys among ``model_keys`` that this plan loads."""
        if self.kind == "none" or (self.kind == "full" and "model" in self.exclude):
            return set()
        pairs = parse_prefix_map(list(self.prefix_map))
        if self.kind == "full" or not pairs:
            return set(model_keys)
        return {k for k in model_keys if any(k.startswith(dst) for _, dst in pairs)}

    def describe(self) -> str:
        return "a fresh start" if self.kind == "none" else f"{self.path} ({self.kind})"


def plan_resume(cfg, folder: Path, model: torch.nn.Module) -> ResumePlan:
    """What :meth:`CheckpointManager.resume` loads: the latest (or ``load_step``) checkpoint
    of this run; else, with ``initial_load_path``, a warm start from it; else nothing.

    ``cfg`` is the ``[checkpoint]`` section, ``folder`` the run's checkpoint folder. A run
    whose own folder holds only a model-only ``step-0`` (a seed written there by
    ``pth_to_dcp.py`` or ``checkpoint.create_seed_checkpoint``) starts from its weights at
    step 0 with a fresh optimizer, as torchtitan does; once the run has saved a full
    checkpoint, that one is resumed instead. Removes the temporary folders of interrupted
    saves first (rank 0) and raises :class:`CheckpointError` for a checkpoint that cannot be
    used as asked.
    """
    remove_stale_tmp(folder)
    if not cfg.enable_checkpoint:
        steps = complete_steps(folder)
        if steps:
            logger.warning("checkpoint.enable_checkpoint is off: the checkpoints in %s "
                           "(steps %s) are not loaded", folder, steps)
        return _plan_initial(cfg)  # a warm start needs no checkpointing of this run
    steps = readable_steps(folder)
    if cfg.load_step >= 0:
        if cfg.load_step not in steps:
            raise CheckpointError(
                f"checkpoint.load_step={cfg.load_step}: no complete checkpoint "
                f"{step_folder(folder, cfg.load_step)}; available steps: {steps or 'none'}"
            )
        step = cfg.load_step
        if step == SEED_STEP and not _has_optimizer_state(step_folder(folder, step)):
            return _plan_seed(cfg, step_folder(folder, step), model)
    elif steps:
        # The newest checkpoint that can resume training (a model-only final export cannot).
        full = [s for s in steps if _has_optimizer_state(step_folder(folder, s))]
        if not full and steps[-1] == SEED_STEP:
            return _plan_seed(cfg, step_folder(folder, SEED_STEP), model)
        if not full:
            raise CheckpointError(
                f"{folder} holds only model-only checkpoints {steps}; start a new "
                "dump_folder and seed it with checkpoint.initial_load_path (a model-only "
                "step-0 alone would be taken as the run's seed, a later one is a final export)"
            )
        step = full[-1]
    else:
        return _plan_initial(cfg)
    # This run's own checkpoint: everything is restored (exclude_from_loading is for warm
    # starts only, else every restart would reset the step and the optimizer).
    return ResumePlan("full", step_folder(folder, step))


def _plan_initial(cfg) -> ResumePlan:
    """Warm start from ``initial_load_path`` (another run's checkpoint or a seed): model
    weights only, or everything but ``exclude_from_loading``."""
    if not cfg.initial_load_path:
        return ResumePlan("none")
    if cfg.initial_load_model_only:
        return ResumePlan("weights", Path(cfg.initial_load_path),
                          prefix_map=cfg.initial_load_prefix_map)
    return ResumePlan("full", resolve_step_folder(cfg.initial_load_path),
                      exclude=cfg.exclude_from_loading)


def _plan_seed(cfg, path: Path, model: torch.nn.Module) -> ResumePlan:
    if cfg.initial_load_path and resolve_step_folder(cfg.initial_load_path).resolve() != path.resolve():
        logger.warning("checkpoint.initial_load_path %s is ignored: the run's own folder "
                       "holds the seed %s", cfg.initial_load_path, path)
    prefix_map = list(cfg.initial_load_prefix_map)
    if not prefix_map:
        model_keys = list(get_model_state_dict(model))
        seed_keys = [k[len("model."):] for k in checkpoint_keys(path) if k.startswith("model.")]
        prefix_map = shared_parts_map(path, seed_keys, model_keys)
    return ResumePlan("seed", path, prefix_map=prefix_map)


def remove_stale_tmp(folder: Path) -> None:
    """Remove the ``.step-N.tmp`` / ``.best.json.tmp`` left by a job killed mid-write
    (rank 0, before anything else reads or writes the folder)."""
    if _is_rank0() and folder.is_dir():
        for p in folder.iterdir():
            if PARTIAL_STEP_RE.match(p.name) or p.name == f".{BEST_RECORD}.tmp":
                logger.warning("removing %s, left by an interrupted save", p)
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
    _barrier()


@torch.no_grad()
def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a fresh optimizer's state (zeros), for DCP to load into, one parameter at a time.

    ``get_optimizer_state_dict`` would create it with one step on zero gradients of every
    parameter at once, which holds a full set of gradients (as much memory as the weights) on
    top of weights and state. Here each parameter gets a zero gradient, a step at learning
    rate 0 (which changes no weight) and loses the gradient again, before the next one. The
    zero gradients are views of one scratch buffer of the largest (local) parameter, so that
    nothing but the state itself is allocated: a fresh tensor per gradient would leave the
    heap full of freed holes between the state tensors (about 0.4 GiB per rank for ViT-H+).
    """
    if optimizer.state:
        return
    groups = optimizer.param_groups
    saved = [(g["params"], g["lr"]) for g in groups]
    largest: dict[tuple, int] = {}  # (dtype, device) -> the most elements of a local parameter
    for params, _ in saved:
        for p in params:
            local = p.to_local() if isinstance(p, DTensor) else p
            key = (local.dtype, local.device)
            largest[key] = max(largest.get(key, 0), local.numel())
    scratch = {key: torch.zeros(n, dtype=key[0], device=key[1]) for key, n in largest.items()}
    try:
        for g in groups:
            g["params"] = []
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        for g, (params, _) in zip(groups, saved):
            for p in params:
                if not p.requires_grad:
                    continue
                g["params"] = [p]
                p.grad = _zero_grad_view(p, scratch)
                optimizer.step()
                p.grad = None
            g["params"] = []
    finally:
        for g, (params, lr) in zip(groups, saved):
            g["params"], g["lr"] = params, lr


def _zero_grad_view(p: torch.Tensor, scratch: dict[tuple, torch.Tensor]) -> torch.Tensor:
    """A zero gradient for ``p`` (a DTensor for a DTensor) on the shared scratch buffer."""
    local = p.to_local() if isinstance(p, DTensor) else p
    grad = scratch[local.dtype, local.device][:local.numel()].view(local.shape)
    if isinstance(p, DTensor):
        return DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return grad


def _failure_causes(error: BaseException) -> list[tuple[int | None, BaseException]]:
    """(rank, exception) of each failure inside a DCP ``CheckpointException`` (which carries
    every failed rank's exception), or of a plain exception (rank unknown)."""
    if isinstance(error, CheckpointException):
        return [(rank, pair[0] if isinstance(pair, tuple) else pair)
                for rank, pair in error.failures.items()]
    return [(None, error)]


def _has_optimizer_state(path: Path) -> bool:
    return any(k.startswith("optimizer.") for k in checkpoint_keys(path))
















