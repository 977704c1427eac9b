"""Checkpoints and configs lose nothing: failed saves, killed jobs, corrupt metadata, warm
starts, and config history across launches. Every case runs real torchrun jobs (gloo, two CPU
processes) that write and read real DCP checkpoints.

The one simulated fault is a full disk: ``CheckpointManager._storage_writer`` (the seam where
DCP gets its storage writer) is replaced, inside the worker processes, by a small entry script
written by the test. Its writer is a real ``FileSystemWriter`` writing real files into the real
``.step-N.tmp`` folder, except that on one chosen rank and step each file gets a few bytes and
then ``OSError(ENOSPC)``, as ``write()`` on a full disk would. Everything above the storage
layer (DCP's collectives, the cleanup, the error, the exit of every rank) is the production code.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, _env, launch, read_jsonl, train_losses

pytestmark = pytest.mark.distributed

SEG2D = "train_configs/debug_segmentation_2d.toml"
EXCLUDE_ALL = "optimizer,lr_scheduler,train_state"


def _args(data, dump, steps, *extra):
    return ["--job.config_file", SEG2D, "--data.dataset_path", str(data),
            "--job.dump_folder", str(dump), "--training.steps", str(steps),
            "--metrics.log_freq", "1", "--checkpoint.interval", "2", "--no-metrics.progress_bar",
            "--training.compile", "false", *extra]


def _ok(r):
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def _out(r) -> str:
    return r.stdout + r.stderr


def _logged_steps(dump: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(dump / "logs" / "metrics.jsonl") if "loss" in r]


def _tmp_entries(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".tmp"))


@pytest.fixture(scope="module")
def four_steps(seg2d_four_steps):
    """A finished 4-step run with checkpoints step-2 and step-4 (copy it before changing it):
    the shared run, made with the flags of ``_args(data, dump, 4)`` (compile is off by
    default)."""
    dump = seg2d_four_steps
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file()
    assert (dump / "checkpoint" / "step-4" / ".metadata").is_file()
    return dump


# -- 1. a failed save -----------------------------------------------------------------------------

DISK_FULL_ENTRY = '''
"""train_segmentation.py, with a disk that fills up while one rank saves one step."""
import errno
import os
import sys
from contextlib import contextmanager

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.tasks import SegmentationTask
from torchtitan.trainer import run

FAIL_STEP, FAIL_RANK = int(sys.argv.pop(1)), int(sys.argv.pop(1))


class FullDisk(FileSystem):
    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            stream.write(b"\\0" * 4096)  # the first bytes land, then the disk is full
            stream.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            yield stream


class FullDiskWriter(dcp.FileSystemWriter):
    def __init__(self, path):
        super().__init__(path)
        self.fs = FullDisk()


real_writer = CheckpointManager._storage_writer


def storage_writer(self, path):
    if path.name == f".step-{FAIL_STEP}.tmp" and int(os.environ["RANK"]) == FAIL_RANK:
        return FullDiskWriter(str(path))
    return real_writer(self, path)


CheckpointManager._storage_writer = storage_writer
sys.exit(run(SegmentationTask))
'''


def _run_with_full_disk(tmp_path, args, step, rank) -> subprocess.CompletedProcess:
    entry = tmp_path / "train_disk_full.py"
    entry.write_text(textwrap.dedent(DISK_FULL_ENTRY))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           str(entry), str(step), str(rank), *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)


def _check_disk_full(demo_data, tmp_path, rank, extra=()):
    dump = tmp_path / "full"
    args = _args(demo_data, dump, 6, *extra)
    r = _run_with_full_disk(tmp_path, args, step=4, rank=rank)
    out = _out(r)
    assert r.returncode != 0, out[-3000:]
    ckpt = dump / "checkpoint"
    # Both ranks stopped with the message (none hung: subprocess.run has a timeout).
    for k in (0, 1):
        assert f"error (rank {k}): saving the checkpoint of step 4" in out, out[-3000:]
    assert "the disk is full" in out and str(ckpt / ".step-4.tmp") in out
    assert "Free space" in out and "job.dump_folder" in out
    assert f"previous checkpoint {ckpt / 'step-2'} is intact" in out
    assert _tmp_entries(ckpt) == []
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == ["step-2"]
    if "async" in extra:
        # A background save is finished (and its failure found) at the next save or at the
        # end of the run, so the steps after it have trained; the resume drops their records.
        assert _logged_steps(dump)[:4] == [1, 2, 3, 4]
    else:
        assert _logged_steps(dump) == [1, 2, 3, 4]
    # The previous checkpoint loads: the same command resumes from it and finishes.
    r = launch("train_segmentation.py", args)
    _ok(r)
    assert f"resumed from {ckpt / 'step-2'}" in _out(r)
    assert _logged_steps(dump)[-4:] == [3, 4, 5, 6]


def test_disk_full_on_rank1_keeps_the_previous_checkpoint(demo_data, tmp_path):
    _check_disk_full(demo_data, tmp_path, rank=1)


@pytest.mark.slow
@pytest.mark.parametrize("rank,extra", [(0, ()), (1, ("--checkpoint.async_mode", "async")),
                                        (0, ("--checkpoint.async_mode", "async"))])
def test_disk_full_matrix(demo_data, tmp_path, rank, extra):
    _check_disk_full(demo_data, tmp_path, rank=rank, extra=extra)


# -- 2. a job killed mid-save ---------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def _kill_job(torchrun: subprocess.Popen, workers: list[int]) -> None:
    """SIGKILL a whole torchrun job at once. torchrun starts each worker in a session of its
    own (so that it can signal the worker's group), so killing torchrun's process group alone
    would leave the workers running: kill each worker's group first, then torchrun's."""
    for pid in workers:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(torchrun.pid, signal.SIGKILL)
    torchrun.wait()


def _kill_while_saving(cmd: list[str], ckpt: Path, timeout: float = 300) -> int | None:
    """Start the job in its own session; as soon as a ``.step-N.tmp`` appears for a step after
    a complete one, SIGKILL torchrun and every worker. Returns N, or None when the job ended
    before that happened."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout
    workers: list[int] = []
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if len(workers) < 2:
                workers = _children(proc.pid)
            elif ckpt.is_dir():
                for name in os.listdir(ckpt):
                    if name.startswith(".step-") and name.endswith(".tmp"):
                        step = int(name[len(".step-"):-len(".tmp")])
                        if (ckpt / f"step-{step - 2}" / ".metadata").is_file():
                            _kill_job(proc, workers)
                            return step
            time.sleep(0.001)
        return None
    finally:
        if proc.poll() is None:
            _kill_job(proc, workers)


@pytest.mark.slow  # its 21.6M-parameter saves are long; CI kills and resumes: test_reliability_loop
def test_sigkill_mid_save_leaves_a_tmp_folder_that_the_next_start_removes(demo_data, tmp_path):
    # A 21.6M-parameter backbone makes each save (weights + AdamW states) take long enough on
    # CPU for the kill to land inside it; the debug vit_tiny saves in a few milliseconds.
    big = ["--model.backbone", "dinov3_vits16", "--checkpoint.keep_latest_k", "0"]
    for attempt in range(3):
        dump = tmp_path / f"killed-{attempt}"
        ckpt = dump / "checkpoint"
        args = _args(demo_data, dump, 8, *big)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--standalone", str(REPO / "train_segmentation.py"), *args]
        step = _kill_while_saving(cmd, ckpt)
        assert step is not None, "the job finished without a save to interrupt"
        time.sleep(1)  # were the workers really stopped? nothing may change any more
        if (ckpt / f".step-{step}.tmp").is_dir() and not (ckpt / f"step-{step}").exists():
            break  # killed mid-save
    else:
        pytest.fail("the kill never landed inside a save in 3 attempts")
    # A job killed while writing best.json leaves this one behind.
    (ckpt / ".best.json.tmp").write_text('{"step": ')
    r = launch("train_segmentation.py", args)
    _ok(r)
    out = _out(r)
    assert f"removing {ckpt / f'.step-{step}.tmp'}" in out
    assert f"resumed from {ckpt / f'step-{step - 2}'}" in out
    assert _tmp_entries(ckpt) == []
    assert (ckpt / "step-8" / ".metadata").is_file()
    assert _logged_steps(dump)[-(8 - step + 2):] == list(range(step - 1, 9))


# -- 3. corrupt metadata --------------------------------------------------------------------------

@pytest.mark.parametrize("corruption", [
    "truncated",
    pytest.param("garbage", marks=pytest.mark.slow),
])
def test_corrupt_metadata_is_skipped_for_the_previous_checkpoint(four_steps, demo_data, tmp_path,
                                                                 corruption):
    dump = tmp_path / "corrupt"
    shutil.copytree(four_steps, dump)
    meta = dump / "checkpoint" / "step-4" / ".metadata"
    data = meta.read_bytes()
    meta.write_bytes(data[: len(data) // 2] if corruption == "truncated" else os.urandom(len(data)))
    r = launch("train_segmentation.py", _args(demo_data, dump, 6))
    _ok(r)
    out = _out(r)
    assert f"skipping checkpoint {dump / 'checkpoint' / 'step-4'}" in out
    assert f"resumed from {dump / 'checkpoint' / 'step-2'}" in out
    assert _logged_steps(dump)[-4:] == [3, 4, 5, 6]
    assert train_losses(dump)[3] == pytest.approx(train_losses(four_steps)[3], rel=1e-5)


# -- 4. exclude_from_loading ----------------------------------------------------------------------

def test_exclude_from_loading_applies_to_the_warm_start_only(four_steps, demo_data, tmp_path):
    # Resuming the run's own checkpoint restores everything, exclusions or not.
    own = tmp_path / "own"
    shutil.copytree(four_steps, own)
    r = launch("train_segmentation.py", _args(demo_data, own, 6, "--checkpoint.exclude_from_loading",
                                              EXCLUDE_ALL))
    _ok(r)
    assert "not restored" not in _out(r)
    assert f"resumed from {own / 'checkpoint' / 'step-4'}" in _out(r)
    assert _logged_steps(own)[-2:] == [5, 6]
    # A warm start from another run's checkpoint honours them: step and schedule restart.
    warm = tmp_path / "warm"
    r = launch("train_segmentation.py", _args(
        demo_data, warm, 2, "--checkpoint.initial_load_path", str(four_steps / "checkpoint"),
        "--no-checkpoint.initial_load_model_only", "--checkpoint.exclude_from_loading", EXCLUDE_ALL))
    _ok(r)
    assert "not restored" in _out(r)
    assert _logged_steps(warm) == [1, 2]
    # ...and its own restart (step-2 of the warm run) again resumes whole.
    r = launch("train_segmentation.py", _args(
        demo_data, warm, 3, "--checkpoint.initial_load_path", str(four_steps / "checkpoint"),
        "--no-checkpoint.initial_load_model_only", "--checkpoint.exclude_from_loading", EXCLUDE_ALL))
    _ok(r)
    assert f"resumed from {warm / 'checkpoint' / 'step-2'}" in _out(r)
    assert _logged_steps(warm) == [1, 2, 3]


# -- 5. warm start with checkpointing off ---------------------------------------------------------

def test_initial_load_path_with_checkpointing_off(four_steps, demo_data, tmp_path):
    source = four_steps / "checkpoint" / "step-2"
    off = ["--checkpoint.enable_checkpoint", "false"]
    # Full load: step, optimizer, schedule and RNG come back, so steps 3 and 4 repeat the
    # source run's losses exactly.
    full = tmp_path / "full"
    _ok(launch("train_segmentation.py", _args(demo_data, full, 4, *off,
                                              "--checkpoint.initial_load_path", str(source),
                                              "--no-checkpoint.initial_load_model_only")))
    assert _logged_steps(full) == [3, 4]
    for step in (3, 4):
        assert train_losses(full)[step] == pytest.approx(train_losses(four_steps)[step], rel=1e-5)
    assert not (full / "checkpoint").exists()
    # Model only: step 1 sees the source's step-2 weights on the first batch. The same load
    # with checkpointing on gives the same loss; a fresh model (the source's step 1) does not.
    losses = {}
    for name, extra in (("off", off), ("on", [])):
        dump = tmp_path / f"weights-{name}"
        _ok(launch("train_segmentation.py", _args(demo_data, dump, 1, *extra,
                                                  "--checkpoint.initial_load_path", str(source))))
        losses[name] = train_losses(dump)[1]
    assert losses["off"] == pytest.approx(losses["on"], rel=1e-6)
    assert losses["off"] != pytest.approx(train_losses(four_steps)[1], rel=1e-3)


# -- 6. config history and model changes ----------------------------------------------------------

def test_model_changes_stop_the_resume_and_other_changes_are_kept(four_steps, demo_data, tmp_path):
    dump = tmp_path / "history"
    shutil.copytree(four_steps, dump)
    first = (dump / "config.toml").read_bytes()
    before = sorted(p.name for p in (dump / "checkpoint").iterdir())
    # A changed class order under torchrun: each worker exits with 2 before the process group.
    r = launch("train_segmentation.py", _args(demo_data, dump, 6, "--data.classes",
                                              "mito,nuc,er,cell"))
    out = _out(r)
    assert r.returncode != 0 and "exitcode  : 2" in out, out[-3000:]
    assert ('data.classes: ["nuc", "mito", "er", "cell"] -> ["mito", "nuc", "er", "cell"]'
            in out), out[-3000:]
    assert "model.backbone" not in out.split("cannot resume")[1].split("\n")[0]
    assert "start a new job.dump_folder" in out
    # A changed backbone, and both at once (plain python: its exit status is the run's).
    r = launch("train_segmentation.py", _args(demo_data, dump, 6, "--model.backbone",
                                              "vit_debug"), nproc=0)
    assert r.returncode == 2, _out(r)[-3000:]
    assert 'model.backbone: "vit_tiny" -> "vit_debug"' in r.stderr
    assert "data.classes" not in r.stderr
    r = launch("train_segmentation.py", _args(demo_data, dump, 6, "--model.backbone", "vit_debug",
                                              "--data.classes", "mito,nuc,er,cell"), nproc=0)
    assert r.returncode == 2, _out(r)[-3000:]
    message = [line for line in r.stderr.splitlines() if "cannot resume" in line]
    assert len(message) == 1 and "model.backbone" in message[0] and "data.classes" in message[0]
    assert "Traceback" not in r.stderr
    # Nothing of the refused launches was kept.
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == before
    assert not list(dump.glob("config.launch-*.toml"))
    # Changed lr and steps: resumes, and the launch's config is kept beside the first one.
    r = launch("train_segmentation.py", _args(demo_data, dump, 6, "--optimizer.lr", "5e-4"))
    _ok(r)
    assert f"resumed from {dump / 'checkpoint' / 'step-4'}" in _out(r)
    assert (dump / "config.toml").read_bytes() == first
    second = (dump / "config.launch-2.toml").read_text()
    assert "lr = 0.0005" in second and "steps = 6" in second
