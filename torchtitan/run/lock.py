"""One run per dump folder: the lock file ``<job.dump_folder>/run.lock``.

Two runs writing one dump folder corrupt each other silently (each step twice in
``metrics.jsonl``, checkpoints and ``best.json`` from whichever saved last, a later resume from
a mix). So a run holds the folder while it lives, and a second run into it stops before any
process group with a message naming the holder.

Who holds it. A run, not a process: the lock names the run's *launcher* (the ``torchrun``
agent that started the workers, else the Python process itself) with its host, PID and
process start time, the rendezvous id (``TORCHELASTIC_RUN_ID``; the SLURM scripts set
``$SLURM_JOB_ID``) and the rendezvous address. Rank 0 takes the lock; the other ranks wait
until it names their run (so the ranks of one run never refuse each other), or stop when it
names another live run. Workers that ``torchrun --max_restarts`` restarts have the same agent,
so a restart is the same run and goes on.

Stale locks. A lock whose holder is gone is taken over with a warning, so that a run killed
(SIGKILL, node failure) and started again, or requeued, goes on:

* on the same host: the launcher's PID no longer runs, or runs a different process (its start
  time differs: the PID was reused);
* from another host (a shared file system), where no PID can be checked: rank 0 of a live run
  rewrites the lock's ``heartbeat`` every :data:`HEARTBEAT_S` seconds, and a lock whose
  heartbeat is older than :data:`STALE_AFTER_S` is stale;
* a lock of the same job (same rendezvous id, not torchrun's default ``none``) is this run's,
  on any host: a SLURM requeue on another node keeps its job id.

A run that ends (finished, requeue exit, user error, non-finite stop) removes its lock; only a
killed one leaves it behind. Floor 4, beside :mod:`torchtitan.run.preemption`; standard library
only.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from torchtitan.errors import ConfigError

logger = logging.getLogger("torchtitan")

LOCK_NAME = "run.lock"
HEARTBEAT_S = 60.0  # rank 0 of a live run rewrites the lock's heartbeat this often
STALE_AFTER_S = 600.0  # another host's lock without a heartbeat for this long is stale


class DumpFolderBusy(ConfigError):
    """Another live run holds the dump folder."""


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, from ``/proc``), to tell a
    reused PID from the process that took the lock; None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22 of stat(5), after "pid (comm)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


@dataclass
class Holder:
    """What a lock file says about the run that holds it."""

    host: str
    pid: int  # the launcher: torchrun's agent, or the Python process of a plain run
    pid_start: str | None  # the launcher's start time (tells a reused PID)
    run_id: str  # TORCHELASTIC_RUN_ID ('' for a plain run)
    rendezvous: str  # MASTER_ADDR:MASTER_PORT of the workers ('' for a plain run)
    rank0_pid: int  # the process that wrote the lock (rank 0)
    started: str  # when the lock was taken (local time, ISO 8601)
    heartbeat: float  # time.time() of its last refresh

    @staticmethod
    def this_launch() -> Holder:
        elastic = "TORCHELASTIC_RUN_ID" in os.environ
        pid = os.getppid() if elastic else os.getpid()
        rendezvous = (f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
                      if elastic else "")
        return Holder(host=socket.gethostname(), pid=pid, pid_start=_process_start(pid),
                      run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""), rendezvous=rendezvous,
                      rank0_pid=os.getpid(), started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      heartbeat=time.time())

    def same_run(self, other: Holder) -> bool:
        """Whether ``other`` (this launch) belongs to the run this lock names."""
        if self.host == other.host and self.pid == other.pid and self.pid_start == other.pid_start:
            return True  # the same launcher: a worker of it, or a torchrun restart
        if self.run_id and self.run_id != "none" and self.run_id == other.run_id:
            return True  # the same job (rendezvous id), on any host
        return bool(self.rendezvous) and self.rendezvous == other.rendezvous \
            and self.run_id == other.run_id

    def alive(self) -> bool:
        """Whether the holder still runs (see the module docstring for the rules)."""
        if self.host == socket.gethostname():
            return _pid_alive(self.pid) and (self.pid_start is None
                                             or _process_start(self.pid) == self.pid_start)
        return time.time() - self.heartbeat < STALE_AFTER_S

    def describe(self) -> str:
        return f"host {self.host}, PID {self.pid}, started {self.started}"


class DumpFolderLock:
    """The lock of one run on ``dump_folder`` (see the module docstring).

    :meth:`acquire` on every rank before any process group; :meth:`release` at the end (rank
    0 removes the lock when it still names this process).
    """

    def __init__(self, dump_folder: str | os.PathLike, rank: int, wait_s: float):
        self.folder = Path(dump_folder)
        self.path = self.folder / LOCK_NAME
        self.rank = rank
        self.wait_s = wait_s
        self.me = Holder.this_launch()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- reading and writing the lock file ---------------------------------------------------

    def read(self) -> Holder | None:
        """The holder the lock names; None when there is no lock, or it cannot be parsed (a
        lock being written is complete: it is written whole and renamed into place)."""
        try:
            return Holder(**json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def _write(self, exclusive: bool) -> bool:
        """Write this launch's lock: ``exclusive`` only if none exists (False if one does),
        else replacing any. Written whole to a temporary file first."""
        tmp = self.folder / f".{LOCK_NAME}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(asdict(self.me)) + "\n")
        try:
            if exclusive:
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    return False
            else:
                os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def _check_folder(self) -> None:
        if self.folder.exists() and not self.folder.is_dir():
            raise ConfigError(f"job.dump_folder {self.folder} is an existing file, not a folder; "
                              "give the path of a folder for the run's outputs")

    # -- taking and giving back ---------------------------------------------------------------

    def acquire(self) -> None:
        """Rank 0: take the lock (or take over a stale one, with a warning); other ranks: wait
        until it names this run. :class:`DumpFolderBusy` when another live run holds it."""
        self._check_folder()
        if self.rank == 0:
            self._take()
            self._thread = threading.Thread(target=self._heartbeat, name="run-lock",
                                            daemon=True)
            self._thread.start()
        else:
            self._wait_for_rank0()

    def _busy(self, holder: Holder) -> DumpFolderBusy:
        return DumpFolderBusy(
            f"job.dump_folder {self.folder} is in use by another run ({holder.describe()}; lock "
            f"file {self.path}): two runs in one folder would overwrite each other's checkpoints "
            "and logs. Wait for it to end, stop it, or choose another job.dump_folder")

    def _take(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for attempt in range(20):
                if self._write(exclusive=True):
                    return
                holder = self.read()
                if holder is None and attempt < 10:  # removed meanwhile: look again
                    time.sleep(0.05)
                    continue
                if holder is None:  # still there, and not a lock of ours: nobody holds it
                    logger.warning("job.dump_folder %s: replacing the unreadable lock file %s",
                                   self.folder, self.path)
                    self._write(exclusive=False)
                    return
                if holder.same_run(self.me):
                    self._write(exclusive=False)
                    return
                if holder.alive():
                    raise self._busy(holder)
                logger.warning("job.dump_folder %s: taking over the stale lock of a run that is "
                               "gone (%s)", self.folder, holder.describe())
                self._write(exclusive=False)
                time.sleep(0.2)  # two runs taking over at once: the later write wins
                if (self.read() or holder).rank0_pid == os.getpid():
                    return
            holder = self.read()
            if holder is not None:
                raise self._busy(holder)
            raise ConfigError(f"job.dump_folder {self.folder}: cannot take the lock {self.path}")
        except OSError as e:
            raise ConfigError(f"job.dump_folder {self.folder} cannot be written "
                              f"({e.strerror or e}); choose a folder you can write") from None

    def _wait_for_rank0(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while True:
            holder = self.read()
            if holder is not None and holder.same_run(self.me):
                return
            if holder is not None and holder.alive():
                raise self._busy(holder)
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"rank {self.rank}: rank 0 did not take the lock {self.path} of "
                    f"job.dump_folder within {self.wait_s:.0f} s (comm.init_timeout_seconds)")
            time.sleep(0.1)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            holder = self.read()
            if holder is None or holder.rank0_pid != os.getpid():
                return  # released, or taken over: not ours to refresh
            self.me.heartbeat = time.time()
            try:
                self._write(exclusive=False)
            except OSError:
                pass  # a full or flaky file system: the next beat tries again

    def release(self) -> None:
        """Remove the lock if this process wrote it (rank 0); nothing on other ranks."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.rank != 0:
            return
        holder = self.read()
        if holder is not None and holder.rank0_pid == os.getpid() \
                and holder.host == self.me.host:
            self.path.unlink(missing_ok=True)
