"""Stopping a run on purpose: preemption signals, the wall-clock limit, the exit codes that
tell a launcher what happened, and the test-only fault injection.

Exit codes of the entry scripts (and of every worker; torchrun itself exits 1 whenever a
worker exits non-zero, so launch scripts learn about a requeue from the marker file):

    0  finished
    2  a user error (``torchtitan.errors.USER_ERROR_EXIT``): change the config or data first
    3  ``REQUEUE_EXIT_CODE``: stopped by a signal or ``training.time_limit`` after saving a
       checkpoint at the step boundary; start it again with the same command
    4  ``NONFINITE_EXIT_CODE``: ``training.max_skipped_steps`` non-finite steps in a row
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

# The run was asked to stop (a training.preemption_signals signal, training.time_limit), saved
# a checkpoint at the step boundary and wants to be started again with the same command.
REQUEUE_EXIT_CODE = 3
# training.max_skipped_steps non-finite steps in a row: stopped without saving.
NONFINITE_EXIT_CODE = 4

# Written by rank 0 next to the checkpoints when the run exits with REQUEUE_EXIT_CODE (path
# overridable with this environment variable): helpers/slurm_launch.sh requeues the job when it
# finds it, and workers that torchrun restarts after such an exit stop at once instead of
# training on.
REQUEUE_MARKER = "REQUEUE"
REQUEUE_FILE_ENV = "TORCHTITAN_REQUEUE_FILE"
# Seconds since the epoch at which the job was launched (set by helpers/slurm_launch.sh);
# training.time_limit counts from it, or from this process's start when it is unset.
LAUNCH_TIME_ENV = "TORCHTITAN_LAUNCH_TIME"
# Test-only fault injection, read in one place (fault_steps): "nan_grad@K[,K2,...]" puts a
# NaN into one gradient of the last rank after the backward of each listed step.
FAULT_INJECT_ENV = "TORCHTITAN_FAULT_INJECT"

_PROCESS_START = time.time()


class NonFiniteError(RuntimeError):
    """Too many non-finite steps in a row, or non-finite weights; the message names the step."""


def requeue_marker(dump_folder: str) -> Path:
    return Path(os.environ.get(REQUEUE_FILE_ENV) or Path(dump_folder) / REQUEUE_MARKER)


def parse_time_limit(value: str) -> float | None:
    """'HH:MM:SS' -> seconds ('' -> None)."""
    if not value:
        return None
    h, m, sec = (int(x) for x in value.split(":"))
    return float(h * 3600 + m * 60 + sec)


def fault_steps(kind: str) -> set[int]:
    name, _, steps = os.environ.get(FAULT_INJECT_ENV, "").partition("@")
    if name != kind or not steps:
        return set()
    return {int(k) for k in steps.split(",")}


class StopRequest:
    """Preemption signals and the time limit, as a local flag that the loop all-reduces at each
    step boundary (a signal may reach one rank only; every rank must stop at the same step)."""

    def __init__(self, signals: list[str], time_limit: str):
        self.received: str | None = None
        for name in signals:
            signal.signal(getattr(signal, name), self._handler)
        limit = parse_time_limit(time_limit)
        launched = float(os.environ.get(LAUNCH_TIME_ENV) or _PROCESS_START)
        self.deadline = None if limit is None else launched + limit

    def _handler(self, signum, frame) -> None:
        # Only set a flag: the step in flight finishes, then every rank saves together.
        self.received = signal.Signals(signum).name

    def reason(self) -> str | None:
        if self.received:
            return self.received
        if self.deadline is not None and time.time() >= self.deadline:
            return "training.time_limit"
        return None


def restarted_after_requeue(dump_folder: str) -> bool:
    """torchrun (--max_restarts > 0) restarts all workers whenever one exits non-zero, also
    after they saved and exited with REQUEUE_EXIT_CODE: such restarts exit again at once, so
    the job ends and the launch script requeues it instead of training into the preemption."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
        return False
    marker = requeue_marker(dump_folder)
    if not marker.is_file():
        return False
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{marker} exists: this run stopped for a requeue; not restarting it here",
              file=sys.stderr, flush=True)
    return True
