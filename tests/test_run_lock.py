"""The dump-folder lock (torchtitan/run/lock.py): real lock files, and real
processes as their holders, alive or gone. The end-to-end cases (a second training into a live run's folder,
restarts after SIGKILL and requeues) are in test_bad_inputs.py and test_reliability_loop.py."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict

import pytest

from torchtitan.errors import ConfigError
from torchtitan.run.lock import (
    LOCK_NAME,
    STALE_AFTER_S,
    DumpFolderBusy,
    DumpFolderLock,
    Holder,
    _process_start,
)


@pytest.fixture
def live_process():
    """A process that runs while the test does."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(autouse=True)
def plain_launch(monkeypatch):
    """This process as a plain (not torchrun) launch, whatever the environment of the tests."""
    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def write_lock(folder, **fields) -> Holder:
    base = dict(host=socket.gethostname(), pid=1, pid_start=None, run_id="", rendezvous="",
                rank0_pid=1, started="2026-01-01T00:00:00+0000", heartbeat=time.time())
    holder = Holder(**{**base, **fields})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps(asdict(holder)))
    return holder


def lock_names_me(folder) -> bool:
    return json.loads((folder / LOCK_NAME).read_text())["rank0_pid"] == os.getpid()


def test_a_live_holder_on_this_host_refuses_naming_it(tmp_path, live_process):
    holder = write_lock(tmp_path, pid=live_process.pid, pid_start=_process_start(live_process.pid))
    before = (tmp_path / LOCK_NAME).read_bytes()
    with pytest.raises(DumpFolderBusy) as err:
        DumpFolderLock(tmp_path, 0, 5).acquire()
    assert (f"job.dump_folder {tmp_path} is in use by another run (host {holder.host}, PID "
            f"{live_process.pid}, started 2026-01-01T00:00:00+0000; lock file "
            f"{tmp_path / LOCK_NAME})") in str(err.value)
    assert (tmp_path / LOCK_NAME).read_bytes() == before


def test_a_gone_holder_is_taken_over_with_a_warning_and_released(tmp_path, dead_pid, caplog):
    write_lock(tmp_path, pid=dead_pid, pid_start="12345", rank0_pid=dead_pid)
    lock = DumpFolderLock(tmp_path, 0, 5)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        lock.acquire()
    assert f"taking over the stale lock of a run that is gone (host {socket.gethostname()}, " \
           f"PID {dead_pid}" in caplog.text
    assert lock_names_me(tmp_path)
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_reused_pid_is_a_gone_holder(tmp_path, live_process, caplog):
    """The PID runs, but another process than the one that took the lock (start time differs)."""
    write_lock(tmp_path, pid=live_process.pid, pid_start="1")
    lock = DumpFolderLock(tmp_path, 0, 5)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        lock.acquire()
    assert "taking over the stale lock" in caplog.text and lock_names_me(tmp_path)
    lock.release()


def test_another_host_counts_by_its_heartbeat(tmp_path, caplog):
    write_lock(tmp_path, host="elsewhere", pid=4242, heartbeat=time.time() - 30)
    with pytest.raises(DumpFolderBusy, match="host elsewhere, PID 4242"):
        DumpFolderLock(tmp_path, 0, 5).acquire()
    write_lock(tmp_path, host="elsewhere", pid=4242, heartbeat=time.time() - STALE_AFTER_S - 1)
    lock = DumpFolderLock(tmp_path, 0, 5)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        lock.acquire()
    assert "taking over the stale lock" in caplog.text and lock_names_me(tmp_path)
    lock.release()


def test_the_same_job_on_another_host_goes_on(tmp_path, monkeypatch, caplog):
    """A SLURM requeue on another node: same rendezvous id (the job id), fresh heartbeat."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4711")
    write_lock(tmp_path, host="elsewhere", pid=4242, run_id="4711")
    lock = DumpFolderLock(tmp_path, 0, 5)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        lock.acquire()
    assert "stale" not in caplog.text and lock_names_me(tmp_path)
    lock.release()
    # torchrun's default rendezvous id of multi-node runs says nothing: not the same job.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    write_lock(tmp_path, host="elsewhere", pid=4242, run_id="none")
    with pytest.raises(DumpFolderBusy):
        DumpFolderLock(tmp_path, 0, 5).acquire()


def test_other_ranks_wait_for_their_runs_lock(tmp_path, live_process):
    """Rank 1 goes on once rank 0 of its run holds the lock, stops on another live run's lock,
    and gives up after wait_s when rank 0 never takes it."""
    with pytest.raises(ConfigError, match=r"rank 1: rank 0 did not take the lock .* within 0 s"):
        DumpFolderLock(tmp_path, 1, 0.3).acquire()
    rank0 = DumpFolderLock(tmp_path, 0, 5)
    rank0.acquire()
    DumpFolderLock(tmp_path, 1, 5).acquire()  # the same launcher: no refusal
    rank0.release()
    write_lock(tmp_path, pid=live_process.pid, pid_start=_process_start(live_process.pid))
    with pytest.raises(DumpFolderBusy):
        DumpFolderLock(tmp_path, 1, 5).acquire()


def test_a_restart_of_the_same_launcher_goes_on(tmp_path, caplog):
    """torchrun --max_restarts: the lock of the previous workers names the same agent."""
    me = Holder.this_launch()
    write_lock(tmp_path, pid=me.pid, pid_start=me.pid_start, rank0_pid=999999)
    lock = DumpFolderLock(tmp_path, 0, 5)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        lock.acquire()
    assert "stale" not in caplog.text and lock_names_me(tmp_path)
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_release_leaves_another_runs_lock(tmp_path, live_process):
    lock = DumpFolderLock(tmp_path, 0, 5)
    lock.acquire()
    write_lock(tmp_path, pid=live_process.pid, pid_start=_process_start(live_process.pid),
               rank0_pid=live_process.pid)
    lock.release()
    assert (tmp_path / LOCK_NAME).exists()


def test_a_file_as_dump_folder_is_refused(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(ConfigError, match="is an existing file, not a folder"):
        DumpFolderLock(tmp_path / "out", 0, 5).acquire()


def test_an_unreadable_lock_is_replaced_with_a_warning(tmp_path, caplog):
    (tmp_path / LOCK_NAME).write_text("")
    lock = DumpFolderLock(tmp_path, 0, 5)
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        lock.acquire()
    assert f"replacing the unreadable lock file {tmp_path / LOCK_NAME}" in caplog.text
    assert lock_names_me(tmp_path)
    lock.release()
