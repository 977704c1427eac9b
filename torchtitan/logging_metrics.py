"""Logging of training metrics: stdout, ``logs/metrics.jsonl`` and TensorBoard (rank 0 only)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Dense peak FLOP/s per GPU (datasheet figures, without sparsity) by the precision the step's
# matmuls run in: bf16, TF32 (float32 with TensorFloat-32 matmuls) and plain float32 (IEEE). MFU
# divides by the peak of the step's own precision. Unknown devices (and CPUs) report no MFU.
PEAK_FLOPS = {
    "H100": {"bfloat16": 989e12, "tf32": 494.5e12, "float32": 66.9e12},
    "H200": {"bfloat16": 989e12, "tf32": 494.5e12, "float32": 66.9e12},
    "GH200": {"bfloat16": 989e12, "tf32": 494.5e12, "float32": 66.9e12},
    "A100": {"bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12},
    "B200": {"bfloat16": 2250e12, "tf32": 1100e12, "float32": 75e12},
}


def tf32_matmuls() -> bool:
    """Whether float32 matmuls on CUDA run as TF32 (torch's new per-backend setting if it was
    made, else the global ``torch.set_float32_matmul_precision``)."""
    setting = torch.backends.cuda.matmul.fp32_precision  # "ieee", "tf32" or "none" (unset)
    if setting != "none":
        return setting == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


def matmul_precision(dtype: torch.dtype) -> str:
    """The ``PEAK_FLOPS`` column of a step whose compute dtype is ``dtype``."""
    if dtype == torch.bfloat16:
        return "bfloat16"
    if dtype == torch.float32:
        return "tf32" if tf32_matmuls() else "float32"
    raise ValueError(f"no peak FLOP/s for compute dtype {dtype}")


def peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a GPU by name (e.g. "NVIDIA H100 80GB HBM3") for ``precision``
    (a ``PEAK_FLOPS`` column); None for an unknown GPU."""
    for key, value in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in device_name:
            return value[precision]
    return None


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak FLOP/s of ``device`` for steps computed in ``dtype``; None off CUDA."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), matmul_precision(dtype))


class MetricLogger:
    """Writes one JSON object per logged step and the same scalars to TensorBoard."""

    def __init__(self, dump_folder: str, tb_folder: str, enable_tensorboard: bool, rank: int,
                 keep_until: int | None = None):
        """``keep_until``: the step the run resumes from; records of later steps (logged before
        a crash, and logged again when those steps are replayed) are dropped first."""
        self.enabled = rank == 0
        self.folder = Path(dump_folder) / tb_folder
        self.writer = None
        self.jsonl = None
        if not self.enabled:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        if keep_until is not None:
            truncate_jsonl(self.folder / "metrics.jsonl", keep_until)
        self.jsonl = open(self.folder / "metrics.jsonl", "a", buffering=1)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.folder))

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in values.items()}, "time": time.time()}
        self.jsonl.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, float(value), step)
            self.writer.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


def truncate_jsonl(path: Path, keep_until: int) -> None:
    """Drop the records of steps after ``keep_until`` from a metrics.jsonl, atomically (a new
    file renamed over the old one), and only when there is something to drop. A torn last
    line (a kill mid-write) is dropped too."""
    if not path.is_file():
        return
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if record.get("step", 0) > keep_until:
            dropped += 1
        else:
            kept.append(line)
    if not dropped:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    logger.info("%s: dropped %d records after step %d (they are logged again)", path, dropped,
                keep_until)


class Throughput:
    """Times steps between logs and turns them into voxels/s, FLOP/s and MFU."""

    def __init__(self, voxels_per_sample: int, flops_per_sample: float, global_batch: int,
                 world_size: int, device: torch.device, compute_dtype: torch.dtype):
        """``compute_dtype``: what the step's matmuls run in (bf16 under mixed precision,
        else float32); MFU is measured against that precision's peak."""
        self.voxels_per_step = voxels_per_sample * global_batch
        self.flops_per_step = flops_per_sample * global_batch
        self.world_size = world_size
        self.peak = device_peak_flops(device, compute_dtype)
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.steps = 0

    def tick(self) -> None:
        self.steps += 1

    def report(self) -> dict[str, float]:
        dt = max(time.perf_counter() - self.t0, 1e-9) / max(self.steps, 1)
        out = {
            "voxels_per_second": self.voxels_per_step / dt,
            "step_time_s": dt,
            "tflops_per_device": self.flops_per_step / dt / self.world_size / 1e12,
        }
        if self.peak:
            out["mfu_percent"] = 100 * self.flops_per_step / dt / self.world_size / self.peak
        if self.device.type == "cuda":
            out["memory_max_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        self.reset()
        return out


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO; other ranks only warnings and errors."""
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


# How long a rank other than 0 waits before reporting a user error of its own.
USER_ERROR_GRACE_S = 10.0


def report_user_error(error: Exception, rank: int, grace_s: float = USER_ERROR_GRACE_S) -> None:
    """Print a configuration or dataset error once for the whole job.

    Such errors are found before any process group exists, and usually by every rank alike
    (same config, same data). Rank 0 prints at once. Another rank first waits ``grace_s``:
    when rank 0 failed too, its message is out by then and the launcher has stopped this
    rank; when rank 0 did not fail, the error is this rank's own and it prints it, naming
    itself. Returning immediately would let torchrun stop rank 0 before it prints.
    """
    if rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return
    time.sleep(grace_s)
    print(f"error (rank {rank}): {error}", file=sys.stderr, flush=True)
