"""The one training loop both tasks share.

The trainer owns the process group and device mesh, parallelisation, initialisation, the
optimizer and schedule, checkpoints, the loop, logging and the evaluation cadence. A task
(:mod:`torchtitan.tasks`) supplies only what differs: its model, its data, its loss and its
validation.

Everything that can be wrong with a config or a dataset is checked before the process group
starts, identically on every rank, so a bad input makes every rank exit with the same message
(printed once, by rank 0) instead of leaving some ranks waiting in a collective.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import resource
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torchtitan.run.launch_history import check_resume_compatible, save_launch_config
from torchtitan.checkpoint.manager import CheckpointManager, ResumePlan, plan_resume, read_best
from torchtitan.checkpoint.reading import complete_steps, step_folder
from torchtitan.checkpoint.train_state import TrainState
from torchtitan.config.manager import ConfigManager
from torchtitan.config.job_config import JobConfig
from torchtitan.data.sampling.augment import Augmenter
from torchtitan.data.sampling.batch import Batch
from torchtitan.data.sampling.loader import build_loader
from torchtitan.errors import USER_ERROR_EXIT, ConfigError, UserError
from torchtitan.logging_metrics import MetricLogger, Throughput, report_user_error, setup_logging
from torchtitan.models import resolve_attention_backend, use_attention
from torchtitan.optimizer import WeightAverage, build_lr_scheduler, build_optimizer
from torchtitan.parallelisms.parallel_dims import ParallelDims, ParallelismError
from torchtitan.parallelisms.parallelize import (
    DTYPES,
    autocast_context,
    check_parallelism,
    clip_grad_norm_,
    parallelize,
    warn_if_bf16_is_slow,
    wrap_ddp,
)
from torchtitan.parallelisms.process_group import init_process_group
from torchtitan.parallelisms.seeded_init import init_model
from torchtitan.run.preemption import (
    NONFINITE_EXIT_CODE,
    REQUEUE_EXIT_CODE,
    NonFiniteError,
    StopRequest,
    fault_steps,
    requeue_marker,
    restarted_after_requeue,
)
from torchtitan.run.lock import DumpFolderLock
from torchtitan.tasks.base import Task, ValidationContext

logger = logging.getLogger("torchtitan")

# Errors that mean "the user must change something": shown as one message, no traceback.
USER_ERRORS = (UserError,)


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", _env_int("LOCAL_RANK", 0))
    return torch.device("cpu")


def _all_reduce(t: torch.Tensor, mesh) -> torch.Tensor:
    if mesh is not None:
        dist.all_reduce(t, group=mesh.get_group())
    return t


class Trainer:
    def __init__(self, cfg: JobConfig, task: Task):
        self.cfg = cfg
        self.task = task
        self.requeue_reason: str | None = None  # set when a stop request ends the run
        self.rank = _env_int("RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        self.dims = ParallelDims(cfg.training.data_parallel_replicate_degree,
                                 cfg.training.data_parallel_shard_degree,
                                 cfg.training.tensor_parallel_degree, self.world_size,
                                 cfg.training.context_parallel_degree)
        if cfg.training.batch_size % self.dims.dp_degree != 0:
            raise ParallelismError(
                f"training.batch_size={cfg.training.batch_size} (the global batch) is not "
                f"divisible by the data-parallel degree {self.dims.dp_degree} "
                f"({self.dims.describe()}); use a multiple of {self.dims.dp_degree}"
            )
        try:  # decided once per run, before any model is built or compiled
            self.attention = resolve_attention_backend(cfg.model.attention, _device())
        except RuntimeError as e:
            raise ConfigError(f"model.attention = {cfg.model.attention!r}: {e}") from None
        # The one build of the model per start: on the meta device (no memory, no values);
        # parallelised, materialised shard by shard and initialised or loaded in setup().
        with torch.device("meta"):
            self.meta_model = task.build_model()
        if self.dims.tp_enabled:  # does the model split over the tp ranks?
            check_parallelism(self.meta_model, self.dims, cfg)
        # All else the run holds, built by setup() in this order; None until then, so that
        # close() knows what to release wherever setup stopped. The device and mesh:
        self.device: torch.device | None = None
        self.mesh = self.dp_mesh = self.loss_mesh = None
        self.dp_rank = self.tp_rank = self.cp_rank = 0
        # the parallelised model (_init_model, _init_weights); optimisation, the train state,
        # its checkpoints, logs, stop requests and data (setup).
        self.model: torch.nn.Module | None = None
        self.flops_per_sample = self.num_params = 0
        self.autocast = self.optimizer = self.lr_scheduler = self.loader = None
        self.ema: WeightAverage | None = None  # training.ema_decay
        self.setup_started, self.nan_grad_steps = 0.0, set()
        self.state: TrainState | None = None
        self.checkpoint: CheckpointManager | None = None
        self.metrics: MetricLogger | None = None
        self.stop: StopRequest | None = None
        # training.time_budget_s counts from the start of this launch's first step (its batch
        # included).
        self.train_started: float | None = None
        self.first_step = 1

    # -- setup ----------------------------------------------------------------------------------

    def _init_distributed(self) -> None:
        self.device = _device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            # Share the cores between the local processes instead of oversubscribing them.
            local_world = _env_int("LOCAL_WORLD_SIZE", 1)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        if self.world_size > 1:
            init_process_group(self.device, self.cfg.comm.init_timeout_seconds)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dp_mesh = self.dims.dp_mesh(self.mesh)
        self.dp_rank = self.dims.dp_rank(self.mesh)
        self.loss_mesh = self.dims.loss_mesh(self.mesh)  # dp x cp: where loss terms add up
        # Ranks of one tensor-parallel group hold the same batch: only tp rank 0 writes files.
        self.tp_rank = self.mesh["tp"].get_local_rank() if self.dims.tp_enabled else 0
        self.cp_rank = self.dims.cp_rank(self.mesh)  # so do those of a context-parallel group
        if self.cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    def _init_model(self) -> None:
        """Parallelise the meta model and materialise this rank's shards (``to_empty``: no
        values yet); :meth:`_init_weights` fills them."""
        model, self.meta_model = self.meta_model, None
        self.flops_per_sample = self.task.flops_per_sample(model)
        self.num_params = sum(p.numel() for p in model.parameters())
        use_attention(model, self.attention)  # before compile: blocks see "sdpa" or "fa4"
        model = parallelize(model, self.dims, self.mesh, self.cfg)
        model.to_empty(device=self.device)
        self.model = model

    def _init_weights(self, plan: ResumePlan) -> None:
        """Initialise, on each rank's own shards and from ``training.seed``, every tensor that
        ``plan`` does not restore (``parallelisms/seeded_init.py``: each tensor drawn from a
        generator seeded by the seed and its name, so every parallelism starts from the same
        weights and no rank holds more than one full tensor); then wrap DDP."""
        t0 = time.perf_counter()
        restored = plan.restored_model_keys(get_model_state_dict(self.model).keys())
        done = init_model(self.model, self.cfg.training.seed, skip=restored)
        logger.info("initialised %d model tensors from training.seed %d in %.1f s%s", len(done),
                    self.cfg.training.seed, time.perf_counter() - t0,
                    f"; {len(restored)} are loaded from {plan.describe()} instead"
                    if restored else "")
        self.model = wrap_ddp(self.model, self.dims, self.mesh)
        self.autocast = autocast_context(self.dims, self.cfg, self.device.type)

    def setup(self) -> None:
        self.setup_started = time.perf_counter()
        cfg = self.cfg
        dump = Path(cfg.job.dump_folder)
        # Resuming checkpoints of another model fails inside DCP with a raw traceback: compare
        # the model-shaping keys with the previous launch first, on every rank alike, before
        # any process group exists (so every rank stops with the same message).
        if cfg.checkpoint.enable_checkpoint and complete_steps(dump / cfg.checkpoint.folder):
            check_resume_compatible(cfg, dump, self.task.name)
        self._init_distributed()
        if self.rank == 0:
            dump.mkdir(parents=True, exist_ok=True)
            # config.toml (first launch) is kept; later launches add config.launch-N.toml.
            logger.info("resolved config saved to %s", save_launch_config(cfg, dump))
        torch.manual_seed(cfg.training.seed)
        self._init_model()
        # What this start loads is decided before initialising, which then skips it: a resume
        # initialises nothing, a seed checkpoint only the parts it lacks.
        plan = (ResumePlan("none") if cfg.checkpoint.create_seed_checkpoint else
                plan_resume(cfg.checkpoint, dump / cfg.checkpoint.folder, self.model))
        self._init_weights(plan)
        self.optimizer = build_optimizer(self.model, cfg)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg, self.model)
        self.state = TrainState(cfg.training.batch_size, self.dims.dp_degree)
        self.ema = (WeightAverage(self.model, cfg.training.ema_decay)
                    if cfg.training.ema_decay > 0 and not cfg.checkpoint.create_seed_checkpoint
                    else None)
        self.checkpoint = CheckpointManager(cfg, self.model, self.optimizer, self.lr_scheduler,
                                            self.state, self.ema)
        if cfg.checkpoint.create_seed_checkpoint:
            return  # the caller saves the freshly initialised model and exits
        self.state.step = self.checkpoint.resume(plan)
        if self.ema is not None:  # the updates so far: the applied optimizer steps
            self.ema.updates = self.state.step - self.state.skipped_steps
        self._restore_best()
        if self.rank == 0 and _env_int("TORCHELASTIC_RESTART_COUNT", 0) == 0:
            requeue_marker(cfg.job.dump_folder).unlink(missing_ok=True)  # a fresh launch
        # Records of steps after the checkpoint (a crash or kill between checkpoints) are
        # logged again when those steps are replayed: drop them so every step appears once.
        self.metrics = MetricLogger(cfg.job.dump_folder, cfg.metrics.save_tb_folder,
                                    cfg.metrics.enable_tensorboard, self.rank,
                                    keep_until=self.state.step)
        self.stop = StopRequest(cfg.training.preemption_signals, cfg.training.time_limit)
        self.nan_grad_steps = fault_steps("nan_grad")
        # Python's cyclic GC runs at our cadence (gc.collect(1) every gc_freq steps, as
        # torchtitan does) instead of pausing ranks at different moments.
        gc.disable()
        self.loader = build_loader(
            self.task.train_dataset(), cfg.training.batch_size, self.dp_rank, self.dims.dp_degree,
            start_step=self.state.step, num_workers=cfg.data.num_workers,
            pin_memory=self.device.type == "cuda")
        logger.info(
            "%s: %s, %.2fM parameters, %s, global batch %d (%d per data-parallel rank), "
            "device %s, attention %s", self.task.name, cfg.model.backbone, self.num_params / 1e6,
            self.dims.describe(), cfg.training.batch_size,
            cfg.training.batch_size // self.dims.dp_degree, self.device, self.attention)
        if self.rank == 0:
            warn_if_bf16_is_slow(cfg.training.mixed_precision_param, self.device)

    # -- loop -----------------------------------------------------------------------------------

    def train_step(self, batch: Batch, step: int
                   ) -> tuple[torch.Tensor, torch.Tensor, bool, bool, bool]:
        """One optimizer step on this rank's ``batch`` (from the loader, on the host); returns
        (global mean loss, gradient norm) as device tensors
        (read only at log steps), whether the update was skipped as non-finite, whether
        the run must stop after this step (and be requeued), and whether
        ``training.time_budget_s`` is spent (the run ends after this step, finished).

        One host sync per step: the decision "skip / stop / end", taken from one all-reduce
        (MAX, over all ranks) of [non-finite local loss or global norm, stop requested here,
        budget spent by this rank's clock]. The loss and norm are read on the host only at
        log steps.
        A non-finite step changes nothing: no optimizer step, no LR-schedule step (as
        Megatron does for skipped iterations: the schedule counts applied updates), the
        gradients are dropped; the data position advances, so the bad batch is not retried.
        """
        # Two steps: model inputs on the device, then the augmentation drawn for the device.
        batch = Augmenter.device(batch.to(self.device))
        with self.autocast:
            loss_sum, count = self.task.loss_terms(self.model, batch)
        # Normalise by the GLOBAL count so that gradient averaging over data-parallel ranks
        # yields the gradient of the global-batch mean, however the batch is split.
        # (Under context parallelism each rank's terms are those of its part of the samples.)
        global_count = _all_reduce(count.detach().double().clone(), self.loss_mesh).clamp_min(1)
        loss = loss_sum * (self.dims.loss_degree / global_count.to(loss_sum.dtype))
        loss.backward()
        if step in self.nan_grad_steps:
            self._inject_nan_grad()
        max_norm = self.cfg.training.max_norm
        # Clipping by a NaN norm makes every gradient NaN; harmless, as such a step is skipped.
        grad_norm = clip_grad_norm_(self.model.parameters(),
                                    max_norm if max_norm > 0 else float("inf")).to(self.device)
        flags = torch.stack([
            (~torch.isfinite(loss_sum.detach().float())) | (~torch.isfinite(grad_norm.float())),
            torch.tensor(self.stop.reason() is not None, device=self.device),
            torch.tensor(self._budget_spent(step), device=self.device),
        ]).float()
        if self.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        nonfinite, stop, spent = (bool(v) for v in flags.tolist())
        if not nonfinite:
            self.optimizer.step()
            self.lr_scheduler.step()
            if self.ema is not None:
                self.ema.update()
        self.optimizer.zero_grad(set_to_none=True)
        global_sum = _all_reduce(loss_sum.detach().double().clone(), self.loss_mesh)
        return global_sum / global_count, grad_norm, nonfinite, stop, spent

    def _budget_spent(self, step: int) -> bool:
        """Whether, by this rank's clock, one more step after ``step`` would end past
        ``training.time_budget_s`` (counted from this launch's first step; mean step so far)."""
        budget = self.cfg.training.time_budget_s
        if budget <= 0 or self.train_started is None:
            return False
        elapsed = time.perf_counter() - self.train_started
        done = step - self.first_step + 1
        return elapsed + elapsed / done > budget

    def _inject_nan_grad(self) -> None:
        """Test-only (TORCHTITAN_FAULT_INJECT=nan_grad@K): a NaN in one local gradient of the
        last rank, so that the other ranks learn of it only through the all-reduce."""
        if self.rank != self.world_size - 1:
            return
        for p in self.model.parameters():
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if g is not None and g.numel() > 0:
                g.view(-1)[0] = float("nan")
                return

    def _weights_finite(self) -> bool:
        bad = torch.zeros((), device=self.device)
        for p in self.model.parameters():
            local = p.detach().to_local() if isinstance(p, DTensor) else p.detach()
            bad += (~torch.isfinite(local)).sum()
        if self.world_size > 1:
            dist.all_reduce(bad)
        return int(bad) == 0

    def _save(self, step: int, model_only: bool = False) -> None:
        """Save step ``step``; a model with non-finite weights is never written."""
        if not self._weights_finite():
            raise NonFiniteError(
                f"step {step}: the model weights are not finite; not saving them (the last "
                f"checkpoint in {self.checkpoint.folder} is the last finite one)")
        self.checkpoint.save(step, model_only=model_only)

    def _set_train_timeout(self) -> None:
        """After the first step (compiles, first all-gathers: comm.init_timeout_seconds), use
        comm.train_timeout_seconds for every collective, as torchtitan does."""
        if self.world_size == 1:
            return
        timeout = timedelta(seconds=self.cfg.comm.train_timeout_seconds)
        dist.barrier()
        groups = [None]
        if self.mesh is not None:
            groups += [self.mesh.get_group(i) for i in range(self.mesh.ndim)]
        for group in groups:
            dist.distributed_c10d._set_pg_timeout(timeout, group)
        logger.info("collective timeout set to %d s (comm.train_timeout_seconds)",
                    self.cfg.comm.train_timeout_seconds)

    def validate(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.model.eval()
        module = self.model.module if isinstance(self.model, DistributedDataParallel) \
            else self.model
        ctx = ValidationContext(
            device=self.device, step=step, dp_rank=self.dp_rank, dp_degree=self.dims.dp_degree,
            dp_group=self.dp_mesh.get_group() if self.dp_mesh is not None else None,
            sharded=self.dims.fsdp_enabled,
            writer=self.metrics.writer if self.rank == 0 else None,
            # Ranks of one tensor-parallel group hold the same data: one of them writes.
            writes_files=self.tp_rank == 0 and self.cp_rank == 0)
        averaged = self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()
        with torch.no_grad(), self.autocast, averaged:  # the averaged weights, if any
            scores = self.task.validate(module, ctx)
        self.model.train()
        scores["val/time_s"] = time.perf_counter() - t0
        self.metrics.log(step, scores)
        logger.info("step %d validation: %s", step,
                    ", ".join(f"{k}={v:.4f}" for k, v in scores.items()))
        return scores

    def train(self) -> dict[str, float]:
        cfg = self.cfg
        start, total = self.state.step, cfg.training.steps
        if start >= total:
            logger.info("checkpoint step %d >= training.steps %d: nothing to train", start, total)
        voxels = int(torch.tensor(cfg.model.crop_size).prod())
        meter = Throughput(voxels, self.flops_per_sample, cfg.training.batch_size,
                           self.world_size, self.device, DTYPES[cfg.training.mixed_precision_param])
        data_iter = iter(self.loader)
        bar = None
        if self.rank == 0 and cfg.metrics.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=total, initial=start, desc=self.task.name, dynamic_ncols=True)
        self.model.train()
        # ru_maxrss (KiB on Linux) so far: the start-up's peak, before the first step's
        # activations, gradients and (on a fresh start) optimizer state.
        logger.info("start-up: %.1f s from setup to the first step; peak host memory %.0f MiB",
                    time.perf_counter() - self.setup_started,
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        scores: dict[str, float] = {}
        resampled_local = 0
        skipped_in_a_row = 0
        self.first_step = start + 1
        for step in range(start + 1, total + 1):
            if step == start + 1:  # the first batch's wait counts: the loader starts here
                self.train_started = time.perf_counter()
            batch = next(data_iter)
            resampled_local += int(batch.resampled.sum())
            loss_t, norm_t, nonfinite, stop, spent = self.train_step(batch, step)
            trained_s = time.perf_counter() - self.train_started
            meter.tick()
            self.state.step = step
            if step == start + 1:
                self._set_train_timeout()
            if step % cfg.training.gc_freq == 0:
                gc.collect(1)
            if nonfinite:
                skipped_in_a_row = self._skip(step, skipped_in_a_row + 1)
            else:
                skipped_in_a_row = 0
            if bar is not None:
                bar.update(1)
            last = step == total or spent
            if step % cfg.metrics.log_freq == 0 or last or step == start + 1:
                self._log_step(step, loss_t, norm_t, meter, resampled_local, bar)
            # Save before validating: a validation that fails must not cost the checkpoint.
            saved = False
            if self.checkpoint.should_save(step, last) or (stop and self.checkpoint.enabled):
                model_only = last and cfg.checkpoint.last_save_model_only and not stop
                self._save(step, model_only=model_only)
                saved = True
            if stop:  # preemption signal or time limit: saved; the next launch goes on
                self._request_requeue(step, saved)
                break
            if last or (cfg.metrics.eval_freq > 0 and step % cfg.metrics.eval_freq == 0):
                scores = self.validate(step)
                if self._is_best(scores, step) and self.checkpoint.enabled:
                    if not saved:
                        self._save(step)
                    metric = self.task.best_metric
                    self.checkpoint.mark_best(scores[metric], metric)
            if spent:
                logger.info("training.time_budget_s (%g s) spent: finished after step %d of %d "
                            "(%.1f s of training)", cfg.training.time_budget_s, step, total,
                            trained_s)
                break
        if bar is not None:
            bar.close()
        if start >= total and not scores:
            scores = self.validate(start)
        return scores

    def _log_step(self, step: int, loss_t, norm_t, meter: Throughput, resampled_local: int,
                  bar) -> None:
        """The metrics of ``step`` (loss and gradient norm read on the host here), to the
        logs and the progress bar."""
        loss, grad_norm = float(loss_t), float(norm_t)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        values = {"loss": loss, "lr": self.lr_scheduler.get_last_lr()[0],
                  "grad_norm": grad_norm, **meter.report(),
                  "train/skipped_steps": float(self.state.skipped_steps)}
        # Samples replaced after a read error (corrupt chunk), all ranks, this launch.
        values["data/resampled"] = float(_all_reduce(
            torch.tensor(float(resampled_local), dtype=torch.float64, device=self.device),
            self.dp_mesh))
        self.metrics.log(step, values)
        if bar is None:
            logger.info("step %d loss %.4f lr %.2e grad_norm %.3f %.0f voxels/s", step,
                        loss, values["lr"], grad_norm, values["voxels_per_second"])

    def _is_best(self, scores: dict[str, float], step: int) -> bool:
        """Whether this validation beats every earlier one (of this run, resumes included) on
        the task's best metric; if so it becomes the best, in the train state."""
        metric = self.task.best_metric
        if metric is None or metric not in scores or not math.isfinite(scores[metric]):
            return False
        value = scores[metric] if self.task.best_higher else -scores[metric]
        if self.state.best_score is None or value > self.state.best_score:
            self.state.best_score, self.state.best_step = value, step
            return True
        return False

    def _restore_best(self) -> None:
        """After resume: the best validation so far, in the train state (whose ``best_step``
        ``keep_latest_k`` purging spares).

        A step is saved before it is validated, so the checkpoint of a step that then became
        the best does not know it; ``best.json`` (written right after that validation) does,
        and is taken when it names a step up to the resumed one with a better score.
        """
        metric = self.task.best_metric
        record = read_best(self.checkpoint.folder)
        if metric is not None and record is not None:
            score, step = record.get(metric), int(record.get("step", -1))
            if score is not None and 0 < step <= self.state.step:
                value = score if self.task.best_higher else -score
                if self.state.best_score is None or value > self.state.best_score:
                    self.state.best_score, self.state.best_step = value, step

    def _skip(self, step: int, in_a_row: int) -> int:
        """Count a skipped non-finite step; stop after training.max_skipped_steps in a row."""
        self.state.skipped_steps += 1
        limit = self.cfg.training.max_skipped_steps
        logger.warning("step %d: non-finite loss or gradient norm; update skipped (%d in a row, "
                       "%d in all)", step, in_a_row, self.state.skipped_steps)
        if in_a_row >= limit:
            latest = complete_steps(self.checkpoint.folder)
            raise NonFiniteError(
                f"step {step}: {in_a_row} non-finite steps in a row (training.max_skipped_steps="
                f"{limit}); stopped without saving. The last checkpoint "
                f"({step_folder(self.checkpoint.folder, latest[-1])}) is finite; lower optimizer.lr, "
                "check the data, or raise training.max_skipped_steps" if latest else
                f"step {step}: {in_a_row} non-finite steps in a row (training.max_skipped_steps="
                f"{limit}); stopped without saving (no checkpoint yet); lower optimizer.lr or "
                "check the data")
        return in_a_row

    def _request_requeue(self, step: int, saved: bool) -> None:
        """Every rank agreed to stop after ``step`` (saved): mark the run for a requeue."""
        reason = self.stop.reason() or "a preemption signal on another rank"
        self.requeue_reason = reason
        if self.rank == 0:
            marker = requeue_marker(self.cfg.job.dump_folder)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"step": step, "reason": reason}) + "\n")
        logger.warning("stopping after step %d (%s); %s; exit code %d asks for a requeue",
                       step, reason, "checkpoint saved" if saved else
                       "checkpoint.enable_checkpoint is off, nothing saved", REQUEUE_EXIT_CODE)

    def save_seed_checkpoint(self) -> None:
        """``checkpoint.create_seed_checkpoint``: the initialised model as ``step-0``."""
        if self.world_size != 1:
            raise ParallelismError(
                "checkpoint.create_seed_checkpoint runs on one process; launch it with "
                "python (or torchrun --nproc_per_node 1)"
            )
        path = self.checkpoint.save(0, model_only=True)
        print(f"seed checkpoint written to {path}; load it with "
              f"--checkpoint.initial_load_path {path}")

    def close(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.wait()
        if self.metrics is not None:
            self.metrics.close()
        if dist.is_initialized():
            dist.barrier()
            # Free everything that holds on to the process group (DDP's reducer, FSDP state,
            # loader workers) while the group still exists: destroying those after it can
            # hang or abort a rank at exit.
            self.model = self.optimizer = self.lr_scheduler = self.checkpoint = None
            self.loader = None
            gc.collect()
            dist.destroy_process_group()


def run(make_task, argv: list[str] | None = None) -> int:
    """Entry point shared by ``train_mae.py`` and ``train_segmentation.py``.

    ``make_task(cfg)`` builds the task: a task class, or a factory such as
    ``functools.partial(SegmentationTask, visuals=write_validation_visuals)`` through which an
    entry script hands the task what the core may not import (the picture writers are products, floor 6).
    """
    rank = _env_int("RANK", 0)
    setup_logging(rank)
    try:
        cfg = ConfigManager().parse_args(argv)
        if restarted_after_requeue(cfg.job.dump_folder):
            return REQUEUE_EXIT_CODE
        if cfg.job.print_config and rank == 0:
            from torchtitan.config.manager import config_to_toml

            print(config_to_toml(cfg))
        task = make_task(cfg)
        task.prepare()  # reads and checks the data; no process group yet
        trainer = Trainer(cfg, task)
        # One run per dump folder: held from before anything is written there (every check
        # above only reads) until the run ends.
        lock = DumpFolderLock(cfg.job.dump_folder, rank, cfg.comm.init_timeout_seconds)
        lock.acquire()
    except USER_ERRORS as e:
        report_user_error(e, rank)
        return USER_ERROR_EXIT
    try:
        return _train(cfg, task, trainer, rank)
    finally:
        lock.release()


def _train(cfg: JobConfig, task: Task, trainer: Trainer, rank: int) -> int:
    """:func:`run` once the checks have passed and the run holds its dump folder."""
    try:
        trainer.setup()
        if cfg.checkpoint.create_seed_checkpoint:
            trainer.save_seed_checkpoint()
        else:
            scores = trainer.train()
            if rank == 0 and trainer.requeue_reason is None:
                task.summary(scores)
        trainer.close()
    except USER_ERRORS as e:
        print(f"error (rank {rank}): {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    except NonFiniteError as e:
        # Every rank raises it at the same step (the decision is all-reduced): one message.
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        trainer.close()
        return NONFINITE_EXIT_CODE
    if trainer.requeue_reason is not None:
        return REQUEUE_EXIT_CODE
    return 0
