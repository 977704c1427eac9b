"""The SLURM batch scripts themselves (train_segmentation.sh, train_mae.sh and their shared
body helpers/slurm_launch.sh), run as the batch shell with stand-in ``srun`` and ``scontrol``
on PATH: the signal SLURM sends before the time limit (``#SBATCH --signal=B:USR1@300``) goes
to the batch script's own process; its trap forwards it to the training, which saves, leaves
the REQUEUE marker and exits; the script then requeues the job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, _env, read_jsonl

pytestmark = pytest.mark.distributed

JOB_ID = "4242"


def _stand_ins(bin_dir: Path, srun: str | None = None) -> Path:
    """``scontrol`` records its arguments (and names localhost as the allocation's node),
    ``srun`` drops its own options and runs its command (torchrun) here, or is the given
    script; ``torchrun`` is torch's. Returns the scontrol log."""
    bin_dir.mkdir()
    log = bin_dir.parent / "scontrol.log"
    (bin_dir / "scontrol").write_text(
        f'#!/bin/bash\necho "$@" >> {log}\n'
        'if [ "$1 $2" = "show hostnames" ]; then echo localhost; fi\n')
    (bin_dir / "srun").write_text(
        srun or '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "torchrun").write_text(
        f'#!/bin/bash\nexec {sys.executable} -m torch.distributed.run "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return log


def _batch_env(bin_dir: Path, tmp_path: Path, gpus: int) -> dict:
    """SLURM's variables for job 4242; torchrun gives the workers up to 10 minutes to finish
    their step and save after the signal (a busy shared machine takes a minute a step)."""
    env = _env()
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID=JOB_ID, GPUS_PER_NODE=str(gpus),
               REPO=str(REPO), MAX_RESTARTS="0", SHUTDOWN_TIMEOUT="600",
               RDZV_PORT=str(29500 + os.getpid() % 400),
               TORCHTITAN_REQUEUE_FILE=str(tmp_path / f"requeue-{JOB_ID}"))
    return env


def _wait_for_step(dump: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    path = dump / "logs" / "metrics.jsonl"
    end = time.time() + timeout
    while time.time() < end:
        if path.is_file():
            try:
                if any(r.get("step", 0) >= step and "loss" in r for r in read_jsonl(path)):
                    return
            except json.JSONDecodeError:  # a line being written
                pass
        assert proc.poll() is None, "the run ended before step %d:\n%s" % (
            step, proc.communicate()[1][-4000:])
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


def _signal_the_batch_script(tmp_path: Path, script: str, config: str, data: Path, sig: int,
                             gpus: int, steps: int = 40) -> None:
    bin_dir = tmp_path / "bin"
    log = _stand_ins(bin_dir)
    dump = tmp_path / "run"
    args = ["--data.dataset_path", str(data), "--job.dump_folder", str(dump),
            "--training.steps", str(steps), "--metrics.log_freq", "1",
            "--checkpoint.interval", "1000", "--checkpoint.keep_latest_k", "0",
            "--no-metrics.progress_bar"]
    # Its own session, so that a failing test can stop the whole job (srun, torchrun, workers).
    proc = subprocess.Popen(["bash", str(REPO / script), config, *args], cwd=tmp_path,
                            env=_batch_env(bin_dir, tmp_path, gpus), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_step(dump, 2, proc, timeout=600)
        os.kill(proc.pid, sig)  # the batch shell: SLURM's B: signal target
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    name = signal.Signals(sig).name
    assert proc.returncode == 0, out[-3000:] + err[-4000:]
    assert f"received {name}: forwarding it to the training processes" in out
    # The training saved at a step boundary and left the REQUEUE marker (under SLURM at
    # $TORCHTITAN_REQUEUE_FILE, which the batch script sets) naming that step ...
    marker_file = tmp_path / f"requeue-{JOB_ID}"
    assert marker_file.is_file(), out[-3000:] + err[-4000:]
    marker = json.loads(marker_file.read_text())
    step = marker["step"]
    assert 2 <= step < steps and marker["reason"] == name
    assert (dump / "checkpoint" / f"step-{step}" / ".metadata").is_file()
    assert max(r["step"] for r in read_jsonl(dump / "logs" / "metrics.jsonl") if "loss" in r) == step
    # ... and the batch script requeued the job.
    assert f"requeue {JOB_ID}" in log.read_text().splitlines()
    assert f"scontrol requeue {JOB_ID}" in out


@pytest.mark.timeout(1500)
def test_sigusr1_to_the_segmentation_batch_script_saves_and_requeues(demo_data, tmp_path):
    _signal_the_batch_script(tmp_path, "train_segmentation.sh",
                             "train_configs/debug_segmentation_2d.toml", demo_data,
                             signal.SIGUSR1, gpus=1)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sigterm_to_the_mae_batch_script_saves_and_requeues(demo_data, tmp_path):
    _signal_the_batch_script(tmp_path, "train_mae.sh", "train_configs/debug_mae_2d.toml",
                             demo_data, signal.SIGTERM, gpus=2)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sigusr1_to_the_mae_batch_script_on_two_processes(demo_data, tmp_path):
    _signal_the_batch_script(tmp_path, "train_mae.sh", "train_configs/debug_mae_3d.toml",
                             demo_data, signal.SIGUSR1, gpus=2)


@pytest.mark.parametrize("script,default", [
    ("train_mae.sh", "train_configs/demo_mae.toml"),
    ("train_segmentation.sh", "train_configs/demo_segmentation_3d.toml"),
])
def test_batch_scripts_train_their_default_config(tmp_path, script, default):
    """``sbatch train_mae.sh`` with no argument (or with overrides only) trains the default
    config, as the original scripts did; a config given first is used instead. The stand-in
    srun records the command line it would run on every node."""
    record = tmp_path / "srun.args"
    log = _stand_ins(tmp_path / "bin", srun=f'#!/bin/bash\nprintf "%s\\n" "$@" > {record}\n')
    env = _batch_env(tmp_path / "bin", tmp_path, gpus=1)
    entry = "train_mae.py" if script == "train_mae.sh" else "train_segmentation.py"
    assert (REPO / default).is_file()
    for args, config, rest in (([], default, []),
                               (["--training.steps", "5"], default, ["--training.steps", "5"]),
                               (["my.toml", "--training.steps", "5"], "my.toml",
                                ["--training.steps", "5"])):
        r = subprocess.run(["bash", str(REPO / script), *args], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        argv = record.read_text().splitlines()
        assert argv[argv.index(entry):] == [entry, "--job.config_file", config, *rest]
    assert "requeue" not in log.read_text()  # nothing asked for a requeue
