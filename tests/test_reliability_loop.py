"""The training loop on long, preemptible runs, with real torchrun processes (gloo, 2 CPU
ranks), real signals and real DCP checkpoints: the best checkpoint survives resumes, a
preemption signal or time limit saves and asks for a requeue, non-finite steps are skipped,
validation read errors are skipped, elastic restarts and whole-job kills resume cleanly, and
the training collective timeout applies."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, _env, launch, read_jsonl, train_losses

pytestmark = pytest.mark.distributed

SEG2D = "train_configs/debug_segmentation_2d.toml"
MAE2D = "train_configs/debug_mae_2d.toml"
STEPS = 8
REQUEUE_EXIT_CODE = 3  # torchtitan.run.preemption.REQUEUE_EXIT_CODE


def _seg_args(data, dump, *extra):
    return ["--job.config_file", SEG2D, "--data.dataset_path", str(data),
            "--job.dump_folder", str(dump), "--training.steps", str(STEPS),
            "--metrics.log_freq", "1", "--checkpoint.interval", "100",
            "--checkpoint.keep_latest_k", "0", "--no-metrics.progress_bar", *extra]


def _ok(result):
    assert result.returncode == 0, \
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def _torchrun_cmd(script, args, extra_torchrun=()):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--standalone", *extra_torchrun, str(REPO / script), *args]


def _start(script, args, extra_torchrun=(), env=None):
    return subprocess.Popen(_torchrun_cmd(script, args, extra_torchrun), cwd=REPO,
                            env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _wait_for_step(dump: Path, step: int, proc, timeout: float = 300) -> None:
    """Block until metrics.jsonl holds the loss record of ``step``."""
    path = dump / "logs" / "metrics.jsonl"
    end = time.time() + timeout
    while time.time() < end:
        if path.is_file() and any(r.get("step", 0) >= step and "loss" in r
                                  for r in _records(path)):
            return
        assert proc.poll() is None, "the run ended before step %d:\n%s" % (
            step, proc.communicate()[1][-4000:])
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def _workers(torchrun_pid: int) -> dict[int, int]:
    """{rank: pid} of the worker processes torchrun started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != torchrun_pid:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry.name)
    return found


def _finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _loss_steps(dump: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(dump / "logs" / "metrics.jsonl") if "loss" in r]


def _same_losses(dump: Path, straight: Path) -> None:
    assert _loss_steps(dump) == list(range(1, STEPS + 1)), "each step logged exactly once"
    got, want = train_losses(dump), train_losses(straight)
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


@pytest.fixture(scope="module")
def straight(demo_data, tmp_path_factory):
    """An uninterrupted run: the per-step losses every interrupted run must reproduce."""
    dump = tmp_path_factory.mktemp("straight") / "run"
    _ok(launch("train_segmentation.py", _seg_args(demo_data, dump)))
    return dump


# ---------------------------------------------------------------------------------------------
# 1. The best checkpoint survives resumes and keep_latest_k purging
# ---------------------------------------------------------------------------------------------


def test_best_checkpoint_survives_restart_and_purges(demo_data, tmp_path):
    """MAE (best = lowest val/reconstruction_loss). Launch 1 trains 2 steps and validates:
    step 2 is the best. Launch 2 resumes it with model.norm_pix_loss on (not a model-shaping
    option): every patch's target is then normalised to unit variance, so the reconstruction
    loss of the same barely trained model is of order 1 instead of about 0.07, and the
    validations at steps 4 and 6 are deterministically worse (the test checks that
    precondition). With keep_latest_k = 1, the saves at steps 4 and 6 would purge step-2 were
    its best status lost in the restart (the old behaviour: the first validation after a
    restart counted as the best, best.json then named it)."""
    dump = tmp_path / "mae"
    common = ["--job.config_file", MAE2D, "--data.dataset_path", str(demo_data),
              "--job.dump_folder", str(dump), "--metrics.log_freq", "1",
              "--metrics.eval_freq", "2", "--checkpoint.interval", "2",
              "--checkpoint.keep_latest_k", "1", "--no-metrics.progress_bar"]
    _ok(launch("train_mae.py", [*common, "--training.steps", "2"]))
    _ok(launch("train_mae.py", [*common, "--training.steps", "6", "--model.norm_pix_loss"]))
    val = {r["step"]: r["val/reconstruction_loss"]
           for r in read_jsonl(dump / "logs" / "metrics.jsonl") if "val/reconstruction_loss" in r}
    assert sorted(val) == [2, 4, 6]
    assert val[4] > val[2] and val[6] > val[2], f"precondition: later validations worse {val}"
    folders = sorted(p.name for p in (dump / "checkpoint").iterdir() if p.is_dir())
    assert folders == ["step-2", "step-6"], "the best (step 2) is kept, latest k=1 besides"
    best = json.loads((dump / "checkpoint" / "best.json").read_text())
    assert best["step"] == 2 and best["val/reconstruction_loss"] == pytest.approx(val[2])


# ---------------------------------------------------------------------------------------------
# 2. Preemption: signal -> save at the step boundary -> requeue exit -> the next launch goes on
# ---------------------------------------------------------------------------------------------


def _preempt(demo_data, tmp_path, straight, target, sig, extra_torchrun=()):
    dump = tmp_path / "run"
    proc = _start("train_segmentation.py", _seg_args(demo_data, dump), extra_torchrun)
    _wait_for_step(dump, 3, proc)
    if target == "worker":  # one rank only: the all-reduced flag stops both
        os.kill(_workers(proc.pid)[1], sig)
    else:
        os.kill(proc.pid, sig)
    code, out, err = _finish(proc)
    marker = json.loads((dump / "REQUEUE").read_text())
    stopped = marker["step"]
    assert 3 <= stopped < STEPS and marker["reason"] in ("SIGUSR1", "SIGTERM",
                                                         "a preemption signal on another rank")
    # torchrun exits 1 whatever the workers' codes; their code is in its failure report
    # (a worker exit) or lost (torchrun's own signal), hence the REQUEUE marker.
    assert code != 0
    if target == "worker":
        assert f"exitcode  : {REQUEUE_EXIT_CODE}" in err, err[-4000:]
    assert (dump / "checkpoint" / f"step-{stopped}" / ".metadata").is_file()
    assert max(_loss_steps(dump)) == stopped
    _ok(launch("train_segmentation.py", _seg_args(demo_data, dump)))
    assert not (dump / "REQUEUE").exists(), "a fresh launch clears the marker"
    _same_losses(dump, straight)


def test_sigusr1_to_one_worker_saves_and_requeues(demo_data, tmp_path, straight):
    _preempt(demo_data, tmp_path, straight, "worker", signal.SIGUSR1)


@pytest.mark.slow  # CI: SIGUSR1 to a worker above, SIGUSR1 to the batch script (test_slurm_scripts)
def test_sigterm_to_torchrun_saves_and_requeues(demo_data, tmp_path, straight):
    """torchrun forwards SIGTERM to its workers and waits --shutdown_timeout (30 s) for them
    before SIGKILL: enough for the step in flight and the save."""
    _preempt(demo_data, tmp_path, straight, "torchrun", signal.SIGTERM)


@pytest.mark.slow
def test_sigterm_to_one_worker_saves_and_requeues(demo_data, tmp_path, straight):
    _preempt(demo_data, tmp_path, straight, "worker", signal.SIGTERM)


@pytest.mark.slow
def test_sigusr1_to_torchrun_with_signals_to_handle(demo_data, tmp_path, straight):
    """What helpers/slurm_launch.sh does: SIGUSR1 in --signals_to_handle (by default torchrun
    does not handle SIGUSR1, and the signal's default action kills torchrun)."""
    _preempt(demo_data, tmp_path, straight, "torchrun", signal.SIGUSR1,
             ["--signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"])


def test_slurm_script_requeues_on_time_limit(demo_data, tmp_path):
    """helpers/slurm_launch.sh with a fake srun (runs its command) and a fake scontrol (records
    its arguments): training.time_limit = 1 s from launch stops the run after its first step
    with a checkpoint, and the script calls `scontrol requeue <job id>`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\necho "$@" >> {log}\n'
        'if [ "$1 $2" = "show hostnames" ]; then echo localhost; fi\n')
    # srun: drop its own options, run the command (torchrun) on this machine.
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "torchrun").write_text(
        f'#!/bin/bash\nexec {sys.executable} -m torch.distributed.run "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    dump = tmp_path / "run"
    env = _env()
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="4242", GPUS_PER_NODE="2",
               REPO=str(REPO), MAX_RESTARTS="1", RDZV_PORT=str(29700 + os.getpid() % 200),
               TORCHTITAN_REQUEUE_FILE=str(tmp_path / "requeue-4242"))
    r = subprocess.run(["bash", str(REPO / "helpers" / "slurm_launch.sh"), "train_segmentation.py",
                        SEG2D, *_seg_args(demo_data, dump)[2:], "--training.time_limit",
                        "00:00:01"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    assert "requeue 4242" in log.read_text().splitlines()
    step = json.loads((tmp_path / "requeue-4242").read_text())["step"]
    assert (dump / "checkpoint" / f"step-{step}" / ".metadata").is_file()
    # torchrun restarted the workers once (MAX_RESTARTS=1) after the requeue exit: they
    # stopped at once instead of training on.
    assert "this run stopped for a requeue" in r.stderr
    assert _loss_steps(dump) == list(range(1, step + 1))


def test_time_budget_ends_the_run_finished(demo_data, tmp_path):
    """training.time_budget_s: both ranks stop at the same step well before training.steps,
    save and validate it as the last step, and exit 0 (no requeue)."""
    dump = tmp_path / "run"
    args = _seg_args(demo_data, dump, "--training.time_budget_s", "4")
    args[args.index("--training.steps") + 1] = "100000"
    r = launch("train_segmentation.py", args)
    _ok(r)
    steps = _loss_steps(dump)
    last = steps[-1]
    assert steps == list(range(1, last + 1)) and 1 <= last < 100000
    assert any(k.startswith("val/") for k in read_jsonl(dump / "logs" / "metrics.jsonl")[-1])
    assert (dump / "checkpoint" / f"step-{last}" / ".metadata").is_file()
    assert not (dump / "REQUEUE").exists()
    assert "training.time_budget_s (4 s) spent: finished after step" in r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# 3. Non-finite steps
# ---------------------------------------------------------------------------------------------


def _checkpoint(path: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def _flat(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_nan_gradient_step_is_skipped_and_counted(demo_data, tmp_path):
    """TORCHTITAN_FAULT_INJECT=nan_grad@3 puts a NaN into one gradient of rank 1 at step 3.
    The right reference for the skipped step is the state before it: the checkpoints of steps
    2 and 3 hold the same model, optimizer and schedule (only the step counter and the skip
    count move), and every weight is finite."""
    dump = tmp_path / "run"
    env = _env()
    env["TORCHTITAN_FAULT_INJECT"] = "nan_grad@3"
    proc = _start("train_segmentation.py", _seg_args(
        demo_data, dump, "--training.steps", "4", "--checkpoint.interval", "1"), env=env)
    code, out, err = _finish(proc)
    assert code == 0, err[-4000:]
    assert "step 3: non-finite loss or gradient norm; update skipped" in err
    records = {r["step"]: r for r in read_jsonl(dump / "logs" / "metrics.jsonl") if "loss" in r}
    assert [records[s]["train/skipped_steps"] for s in (1, 2, 3, 4)] == [0, 0, 1, 1]
    before = dict(_flat(_checkpoint(dump / "checkpoint" / "step-2", tmp_path)))
    after = dict(_flat(_checkpoint(dump / "checkpoint" / "step-3", tmp_path)))
    assert before.keys() == after.keys()
    for key, value in before.items():
        if key.startswith(("model.", "optimizer.", "lr_scheduler.")):
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, after[key]), key
                if value.is_floating_point():
                    assert torch.isfinite(value).all(), key
            else:
                assert value == after[key], key
    assert int(after["train_state.step"]) == 3 and int(after["train_state.skipped_steps"]) == 1
    # The step after the skip updates again: the schedule moves on from where it stood.
    step4 = dict(_flat(_checkpoint(dump / "checkpoint" / "step-4", tmp_path)))
    assert int(step4["lr_scheduler.last_epoch"]) == int(after["lr_scheduler.last_epoch"]) + 1


def test_non_finite_steps_in_a_row_stop_the_run(demo_data, tmp_path):
    dump = tmp_path / "run"
    env = _env()
    env["TORCHTITAN_FAULT_INJECT"] = "nan_grad@3,4"
    proc = _start("train_segmentation.py", _seg_args(
        demo_data, dump, "--training.steps", "6", "--checkpoint.interval", "2",
        "--training.max_skipped_steps", "2"), env=env)
    code, out, err = _finish(proc)
    assert code != 0
    assert "error: step 4: 2 non-finite steps in a row (training.max_skipped_steps=2)" in err, \
        err[-4000:]
    assert "exitcode  : 4" in err  # NONFINITE_EXIT_CODE, from torchrun's failure report
    steps = sorted(p.name for p in (dump / "checkpoint").iterdir() if p.is_dir())
    assert steps == ["step-2"], "no save after the non-finite steps"
    for key, value in _flat(_checkpoint(dump / "checkpoint" / "step-2", tmp_path)):
        if key.startswith(("model.", "optimizer.")) and isinstance(value, torch.Tensor) \
                and value.is_floating_point():
            assert torch.isfinite(value).all(), key


# ---------------------------------------------------------------------------------------------
# 4. Validation read errors; save before validate
# ---------------------------------------------------------------------------------------------


def test_corrupt_validation_crop_is_skipped_and_counted(demo_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    crop3 = data / "jrc_synth-1" / "jrc_synth-1.zarr" / "recon-1" / "labels" / "groundtruth" / "crop3"
    chunks = [p for p in crop3.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert chunks
    for chunk in chunks:  # every label chunk of this validation crop
        chunk.write_bytes(b"\x00 not a compressed chunk \x00" * 4)
    dump = tmp_path / "run"
    r = launch("train_segmentation.py", _seg_args(
        data, dump, "--training.steps", "2", "--checkpoint.interval", "2",
        "--data.val_crops", "crop3,crop7", "--metrics.eval_freq", "2"))
    _ok(r)
    assert "crop3 skipped" in r.stderr, r.stderr[-4000:]
    val = [rec for rec in read_jsonl(dump / "logs" / "metrics.jsonl") if "val/skipped_crops" in rec]
    assert val and val[-1]["val/skipped_crops"] == 1
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file()


# ---------------------------------------------------------------------------------------------
# 5. Elastic restarts and whole-job kills
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # CI: the whole job killed and started again; torchrun's restarts: the SLURM test
def test_sigkill_of_one_worker_restarts_from_the_last_checkpoint(demo_data, tmp_path, straight):
    """--max_restarts 1: torchrun restarts both workers, which resume from step-3; the records
    of steps 4.. logged before the kill are dropped and logged again once."""
    dump = tmp_path / "run"
    args = _seg_args(demo_data, dump, "--checkpoint.interval", "3")
    proc = _start("train_segmentation.py", args, ["--max_restarts", "1"])
    _wait_for_step(dump, 4, proc)
    os.kill(_workers(proc.pid)[1], signal.SIGKILL)
    code, out, err = _finish(proc)
    assert code == 0, err[-4000:]
    _same_losses(dump, straight)


def _step_between_checkpoints(interval: int) -> int:
    """A random step (seeded by the test run's clock, printed) that is not a checkpoint step,
    after the first checkpoint and before the last step."""
    step = random.Random(time.time_ns()).choice(
        [s for s in range(interval + 1, STEPS) if s % interval])
    print(f"killing at step {step}")
    return step


@pytest.mark.slow  # CI: the whole job killed and started again
def test_one_rank_killed_and_started_again(demo_data, tmp_path, straight):
    """SIGKILL of one worker: torchrun (no restarts) stops the other and fails; the same
    command started again resumes from the last checkpoint, each step logged once."""
    dump = tmp_path / "run"
    args = _seg_args(demo_data, dump, "--checkpoint.interval", "3")
    proc = _start("train_segmentation.py", args)
    _wait_for_step(dump, _step_between_checkpoints(3), proc)
    os.kill(_workers(proc.pid)[1], signal.SIGKILL)
    code, _, _ = _finish(proc)
    assert code != 0
    _ok(launch("train_segmentation.py", args))
    _same_losses(dump, straight)


def test_whole_job_killed_and_started_again(demo_data, tmp_path, straight):
    dump = tmp_path / "run"
    args = _seg_args(demo_data, dump, "--checkpoint.interval", "3")
    proc = _start("train_segmentation.py", args)
    _wait_for_step(dump, _step_between_checkpoints(3), proc)
    workers = _workers(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    for pid in workers.values():
        os.kill(pid, signal.SIGKILL)
    proc.communicate()
    time.sleep(1)
    _ok(launch("train_segmentation.py", args))
    _same_losses(dump, straight)


# ---------------------------------------------------------------------------------------------
# 6. comm.train_timeout_seconds
# ---------------------------------------------------------------------------------------------


def test_train_timeout_applies_after_the_first_step(demo_data, tmp_path):
    """A rank that stops responding (SIGSTOP) after the first steps: the other one fails in
    its collective after comm.train_timeout_seconds (4 s), not init_timeout_seconds (300 s)."""
    dump = tmp_path / "run"
    env = _env()
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "3"
    proc = _start("train_segmentation.py", _seg_args(
        demo_data, dump, "--training.steps", "1000", "--comm.train_timeout_seconds", "4"),
        env=env)
    _wait_for_step(dump, 2, proc)
    os.kill(_workers(proc.pid)[1], signal.SIGSTOP)
    t0 = time.time()
    code, out, err = _finish(proc, timeout=120)
    assert code != 0
    assert time.time() - t0 < 60, "failed by the training timeout, not the 300 s init one"
    assert "collective timeout set to 4 s" in err
