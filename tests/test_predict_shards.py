"""predict.py as many jobs: ``--shard I/N`` shards written into one store give the store of
one job (instances numbered the same across the whole region), whether the shards run one
after another, as tasks of the SLURM array script (``predict.sh``) on two ranks, or one of
them is killed and run again; ``--finish`` with
blocks missing names them; one job at a time claims the last step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from conftest import REPO, _env, launch, script_module
from torchtitan.prediction.store import BLOCKS, claim_finishing, release_finishing

CLASSES = ("nuc", "mito", "er", "cell")
# 10 sections of 159 x 159 voxels of jrc_synth-1, each window predicted with flips.
REGION = ["--dataset", "jrc_synth-1", "--roi", "0:80,0:1272,0:1272", "--instances", "--tta"]
SLABS = ["--max_block_mb", "1"]  # the 2D model's blocks: 5 slabs of 2 sections
# Blocks of 1 x 64 x 128 voxels (60 blocks): slow enough for a shard to be killed in the middle.
SMALL_BLOCKS = ["--max_block_mb", "0.3"]


def predict_args(run: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["--checkpoint", str(run / "checkpoint"), "--data", str(data), "--out", str(out),
            "--no-progress", *extra]


def predict(run, data, out, *extra, nproc=0):
    r = launch("predict.py", predict_args(run, data, out, *extra), nproc=nproc, timeout=300)
    return r, r.stdout + r.stderr


def levels(store: Path, region: str = "jrc_synth-1") -> dict[str, np.ndarray]:
    group = zarr.open_group(str(store / region), mode="r")
    return {f"{cls}/{lvl}": group[cls][lvl][:] for cls in CLASSES
            for lvl in sorted(group[cls].array_keys())}


def finished(store: Path, region: str = "jrc_synth-1") -> bool:
    attrs = json.loads((store / region / ".zattrs").read_text())
    return bool(attrs.get("prediction_complete"))


def assert_same_store(a: Path, b: Path) -> None:
    first, second = levels(a), levels(b)
    assert first.keys() == second.keys()
    for key, values in first.items():
        assert values.dtype == second[key].dtype, key
        np.testing.assert_array_equal(values, second[key], err_msg=key)


@pytest.fixture(scope="module")
def one_job(seg2d_four_steps, demo_data, tmp_path_factory):
    """The region predicted by one job in one block (the whole-region result)."""
    out = tmp_path_factory.mktemp("one_job") / "pred.zarr"
    r, log = predict(seg2d_four_steps, demo_data, out, *REGION)
    assert r.returncode == 0, log[-3000:]
    assert "in blocks [10, 159, 159]" in log
    values = levels(out)
    assert values["mito/s0"].dtype == np.uint32 and values["mito/s0"].max() > 1
    return out


def test_shards_one_after_another_give_the_store_of_one_job(seg2d_four_steps, demo_data,
                                                            one_job, tmp_path):
    out = tmp_path / "pred.zarr"
    r, log = predict(seg2d_four_steps, demo_data, out, *REGION, *SLABS, "--shard", "0/3")
    assert r.returncode == 0, log[-3000:]
    assert "in blocks [2, 159, 159]" in log and "shard 0/3: 2 block(s)" in log
    assert "shard 0/3 is done; 3 block(s) of other shards remain" in log
    assert not finished(out) and (out / "jrc_synth-1" / BLOCKS).is_dir()

    # --finish before every shard is done: an error that says what is missing.
    r, log = predict(seg2d_four_steps, demo_data, out, *REGION, *SLABS, "--finish")
    assert r.returncode == 2, log[-3000:]
    assert "blocks are not written yet (jrc_synth-1: 3 block(s))" in log

    # Another shard as a task of the SLURM array script, on two ranks (which share the shard's
    # blocks), then the last one, which finds every block written and runs the last step.
    env = {**_env(), "SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "3",
           "GPUS_PER_NODE": "2", "REPO": str(REPO)}
    r = subprocess.run(["bash", str(REPO / "predict.sh"),
                        *predict_args(seg2d_four_steps, demo_data, out, *REGION, *SLABS)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "shard 2/3 is done; 2 block(s) of other shards remain" in log
    r, log = predict(seg2d_four_steps, demo_data, out, *REGION, *SLABS, "--shard", "1/3")
    assert r.returncode == 0, log[-3000:]
    assert "jrc_synth-1/mito:" in log and "peak memory per rank (MiB)" in log
    assert finished(out) and not (out / "jrc_synth-1" / BLOCKS).exists()
    assert_same_store(out, one_job)


def test_a_killed_shard_run_again_gives_the_store_of_one_job(seg2d_four_steps, demo_data,
                                                              one_job, tmp_path):
    out = tmp_path / "pred.zarr"
    blocks = out / "jrc_synth-1" / BLOCKS
    cmd = [sys.executable, str(REPO / "predict.py"),
           *predict_args(seg2d_four_steps, demo_data, out, *REGION, *SMALL_BLOCKS,
                         "--shard", "0/2")]
    shard = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and shard.poll() is None:
        if blocks.is_dir() and len(os.listdir(blocks)) >= 3:
            shard.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert shard.wait(timeout=60) == -signal.SIGKILL, "the shard ended before it was killed"
    written = len(os.listdir(blocks))
    assert 3 <= written < 30  # 30 blocks are shard 0's

    r, log = predict(seg2d_four_steps, demo_data, out, *REGION, *SMALL_BLOCKS, "--shard", "1/2")
    assert r.returncode == 0, log[-3000:]
    assert "block(s) of other shards remain" in log and not finished(out)
    r, log = predict(seg2d_four_steps, demo_data, out, *REGION, *SMALL_BLOCKS, "--shard", "0/2")
    assert r.returncode == 0, log[-3000:]
    assert f"jrc_synth-1: resuming, {30 + written} of 60 blocks are written" in log
    assert f"shard 0/2: {30 - written} block(s)" in log
    assert "in blocks [1, 64, 128]" in log and finished(out)
    assert_same_store(out, one_job)


def test_one_job_at_a_time_claims_the_last_step(tmp_path):
    assert claim_finishing(str(tmp_path)) is None
    held = claim_finishing(str(tmp_path))  # this process holds it, and runs
    assert held["pid"] == os.getpid()
    assert claim_finishing(str(tmp_path), take_over=True) is None  # --finish takes it over
    release_finishing(str(tmp_path))
    assert not (tmp_path / ".finishing").exists()
    # The claim of a process that has ended, on this host, is taken over.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / ".finishing").write_text(json.dumps(
        {"host": held["host"], "pid": gone.pid, "time": 0.0}))
    assert claim_finishing(str(tmp_path)) is None
    assert json.loads((tmp_path / ".finishing").read_text())["pid"] == os.getpid()
    # A claim of another host is left to that host's job.
    (tmp_path / ".finishing").write_text(json.dumps({"host": "elsewhere", "pid": 1, "time": 0}))
    assert claim_finishing(str(tmp_path))["host"] == "elsewhere"


def test_bad_shard_arguments_are_refused(capsys):
    predict = script_module("predict.py")
    for extra, message in ((["--shard", "3/3"], "needs 0 <= I < N"),
                           (["--shard", "1-3"], "expected I/N"),
                           (["--shard", "0/2", "--finish"], "not allowed with argument"),
                           (["--shard", "0/2", "--overwrite"], "--overwrite cannot be used")):
        with pytest.raises(SystemExit) as exit_:
            predict.parse_args(["--checkpoint", "run/checkpoint", "--out", "pred.zarr", *extra])
        assert exit_.value.code == 2 and message in capsys.readouterr().err, extra
    assert predict.parse_args(["--checkpoint", "c", "--out", "o", "--shard", "2/4"]).shard == (2, 4)
