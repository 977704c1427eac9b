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

import gc
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchtitan.checkpoint import CheckpointError, CheckpointManager, load_full_state_dict
from torchtitan.config_manager import ConfigError, ConfigManager, JobConfig, save_config
from torchtitan.datasets.cellmap import DatasetError
from torchtitan.datasets.loader import batch_to_device, build_loader
from torchtitan.metrics import MetricLogger, Throughput, report_user_error, setup_logging
from torchtitan.models import resolve_attention_backend, use_attention
from torchtitan.optimizer import build_lr_scheduler, build_optimizer
from torchtitan.parallelisms.parallel_dims import ParallelDims, ParallelismError
from torchtitan.parallelisms.parallelize import (
    autocast_context,
    check_parallelism,
    parallelize,
    wrap_ddp,
)
from torchtitan.parallelisms.utils import clip_grad_norm_

logger = logging.getLogger("torchtitan")

# Errors that mean "the user must change something": shown as one message, no traceback.
USER_ERRORS = (ConfigError, DatasetError, ParallelismError, CheckpointError)


class TrainState:
    """Step counter and data position, checkpointed with the model."""

    def __init__(self, global_batch: int, dp_degree: int):
        self.step = 0
        self.global_batch = global_batch
        self.dp_degree = dp_degree

    def state_dict(self) -> dict:
        return {
            "step": torch.tensor(self.step),
            "global_batch": torch.tensor(self.global_batch),
            "dp_degree": torch.tensor(self.dp_degree),
            "rng_cpu": torch.get_rng_state(),
        }

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        if int(sd["global_batch"]) != self.global_batch:
            raise CheckpointError(
                f"the checkpoint was trained with training.batch_size={int(sd['global_batch'])} "
                f"but this run asks for {self.global_batch}; samples are keyed by global batch "
                "position, so resume with the same global batch size (or start a new dump_folder)"
            )
        if int(sd["dp_degree"]) != self.dp_degree:
            # Samples are keyed by global index, so every step still sees the same global
            # batch, only split differently; losses match up to reduction order.
            logger.warning("resuming with data-parallel degree %d (checkpoint: %d); the global "
                           "batches are unchanged", self.dp_degree, int(sd["dp_degree"]))
        torch.set_rng_state(sd["rng_cpu"])


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
    def __init__(self, cfg: JobConfig, task):
        self.cfg = cfg
        self.task = task
        self.best_score: float | None = None
        self.rank = _env_int("RANK", 0)
        self.world_size = _env_int("WORLD_SIZE", 1)
        self.dims = ParallelDims(cfg.training.data_parallel_replicate_degree,
                                 cfg.training.data_parallel_shard_degree,
                                 cfg.training.tensor_parallel_degree, self.world_size)
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
        if self.dims.tp_enabled:  # does the model split over the tp ranks?
            with torch.device("meta"):
                check_parallelism(task.build_model(), self.dims, cfg)

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
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, timeout=timedelta(seconds=self.cfg.comm.init_timeout_seconds),
                device_id=self.device if self.device.type == "cuda" else None)
        self.mesh = self.dims.build_mesh(self.device.type)
        self.dp_mesh = self.dims.dp_mesh(self.mesh)
        self.dp_rank = self.dims.dp_rank(self.mesh)
        # Ranks of one tensor-parallel group hold the same batch: only tp rank 0 writes files.
        self.tp_rank = self.mesh["tp"].get_local_rank() if self.dims.tp_enabled else 0
        if self.cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    def _init_model(self) -> None:
        """Build on the meta device, parallelise, materialise, then load one reference
        initialisation (made on the CPU from the seed) so every parallelism starts from the
        same weights."""
        with torch.device("meta"):
            model = self.task.build_model()
        self.flops_per_sample = self.task.flops_per_sample(model)
        self.num_params = sum(p.numel() for p in model.parameters())
        use_attention(model, self.attention)  # before compile: blocks see "sdpa" or "fa4"
        model = parallelize(model, self.dims, self.mesh, self.cfg)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights()  # also computes buffers that are not in the state dict
        reference = None
        if self.rank == 0:
            torch.manual_seed(self.cfg.training.seed)
            reference = self.task.build_model()
            reference.init_weights()  # attention is not part of the weights: left as built
            reference = reference.state_dict()
        load_full_state_dict(model, reference)  # broadcast from rank 0, keep own shards
        self.model = wrap_ddp(model, self.dims, self.mesh)
        self.autocast = autocast_context(self.dims, self.cfg, self.device.type)

    def setup(self) -> None:
        self._init_distributed()
        cfg = self.cfg
        if self.rank == 0:
            Path(cfg.job.dump_folder).mkdir(parents=True, exist_ok=True)
            save_config(cfg, Path(cfg.job.dump_folder) / "config.toml")
        torch.manual_seed(cfg.training.seed)
        self._init_model()
        self.optimizer = build_optimizer(self.model, cfg)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)
        self.state = TrainState(cfg.training.batch_size, self.dims.dp_degree)
        self.checkpoint = CheckpointManager(cfg, self.model, self.optimizer, self.lr_scheduler,
                                            self.state)
        if cfg.checkpoint.create_seed_checkpoint:
            return  # the caller saves the freshly initialised model and exits
        self.state.step = self.checkpoint.resume()
        self.metrics = MetricLogger(cfg.job.dump_folder, cfg.metrics.save_tb_folder,
                                    cfg.metrics.enable_tensorboard, self.rank)
        self.loader = build_loader(
            self.task.train_dataset(), cfg.training.batch_size, self.dp_rank, self.dims.dp_degree,
            start_step=self.state.step, num_workers=cfg.data.num_workers,
            pin_memory=self.device.type == "cuda")
        logger.info(
            "%s: %s, %.2fM parameters, %s, global batch %d (%d per data-parallel rank), "
            "device %s, attention %s", self.task.name, cfg.model.backbone, self.num_params / 1e6,
            self.dims.describe(), cfg.training.batch_size,
            cfg.training.batch_size // self.dims.dp_degree, self.device, self.attention)

    # -- loop -----------------------------------------------------------------------------------

    def _to_device(self, batch: dict) -> dict:
        return batch_to_device(batch, self.device)

    def train_step(self, batch: dict) -> tuple[float, float]:
        """One optimizer step; returns (global mean loss, gradient norm)."""
        with self.autocast:
            loss_sum, count = self.task.loss_terms(self.model, batch)
        # Normalise by the GLOBAL count so that gradient averaging over data-parallel ranks
        # yields the gradient of the global-batch mean, however the batch is split.
        global_count = _all_reduce(count.detach().double().clone(), self.dp_mesh).clamp_min(1)
        loss = loss_sum * (self.dims.dp_degree / global_count.to(loss_sum.dtype))
        loss.backward()
        max_norm = self.cfg.training.max_norm
        grad_norm = clip_grad_norm_(self.model.parameters(),
                                    max_norm if max_norm > 0 else float("inf"))
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        global_sum = _all_reduce(loss_sum.detach().double().clone(), self.dp_mesh)
        return float(global_sum / global_count), float(grad_norm)

    def validate(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.model.eval()
        module = self.model.module if isinstance(self.model, DistributedDataParallel) \
            else self.model
        with torch.no_grad(), self.autocast:
            scores = self.task.validate(module, self)
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
                           self.world_size, self.device)
        data_iter = iter(self.loader)
        bar = None
        if self.rank == 0 and cfg.metrics.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=total, initial=start, desc=self.task.name, dynamic_ncols=True)
        self.model.train()
        scores: dict[str, float] = {}
        resampled_local = 0
        for step in range(start + 1, total + 1):
            batch = next(data_iter)
            resampled = batch.pop("resampled", None)
            if resampled is not None:
                resampled_local += int(resampled.sum())
            batch = self._to_device(batch)
            loss, grad_norm = self.train_step(batch)
            meter.tick()
            self.state.step = step
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            if step % cfg.metrics.log_freq == 0 or step == total or step == start + 1:
                values = {"loss": loss, "lr": self.lr_scheduler.get_last_lr()[0],
                          "grad_norm": grad_norm, **meter.report()}
                # Samples replaced after a read error (corrupt chunk), all ranks, this launch.
                values["data/resampled"] = float(_all_reduce(
                    torch.tensor(float(resampled_local), dtype=torch.float64, device=self.device),
                    self.dp_mesh))
                self.metrics.log(step, values)
                if bar is None:
                    logger.info("step %d loss %.4f lr %.2e grad_norm %.3f %.0f voxels/s", step,
                                loss, values["lr"], grad_norm, values["voxels_per_second"])
            last = step == total
            improved = False
            if last or (cfg.metrics.eval_freq > 0 and step % cfg.metrics.eval_freq == 0):
                scores = self.validate(step)
                improved = self._is_best(scores)
            if self.checkpoint.should_save(step, last) or (improved and self.checkpoint.enabled):
                model_only = last and cfg.checkpoint.last_save_model_only
                self.checkpoint.save(step, model_only=model_only)
                if improved:
                    metric = self.task.best_metric
                    self.checkpoint.mark_best(step, scores[metric], metric)
        if bar is not None:
            bar.close()
        if start >= total and not scores:
            scores = self.validate(start)
        return scores

    def _is_best(self, scores: dict[str, float]) -> bool:
        """Whether this validation beats every earlier one on the task's best metric."""
        metric = getattr(self.task, "best_metric", None)
        if metric is None or metric not in scores:
            return False
        value = scores[metric] if self.task.best_higher else -scores[metric]
        if self.best_score is None or value > self.best_score:
            self.best_score = value
            return True
        return False

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
        if hasattr(self, "checkpoint"):
            self.checkpoint.wait()
        if hasattr(self, "metrics"):
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


def run(task_cls, argv: list[str] | None = None) -> int:
    """Entry point shared by ``train_mae.py`` and ``train_segmentation.py``."""
    rank = _env_int("RANK", 0)
    setup_logging(rank)
    try:
        cfg = ConfigManager().parse_args(argv)
        if cfg.job.print_config and rank == 0:
            from torchtitan.config_manager import config_to_toml

            print(config_to_toml(cfg))
        task = task_cls(cfg)
        task.prepare()  # reads and checks the data; no process group yet
        trainer = Trainer(cfg, task)
    except USER_ERRORS as e:
        report_user_error(e, rank)
        return 2
    try:
        trainer.setup()
        if cfg.checkpoint.create_seed_checkpoint:
            trainer.save_seed_checkpoint()
        else:
            scores = trainer.train()
            if rank == 0:
                task.summary(scores)
        trainer.close()
    except USER_ERRORS as e:
        print(f"error (rank {rank}): {e}", file=sys.stderr)
        return 2
    return 0
