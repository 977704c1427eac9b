"""Checkpoint features with real torchrun processes: resharding across parallelisms, async
saves, model-only exports, seed checkpoints, partial restores, and a two-node launch."""

from __future__ import annotations

import json
import shutil
import socket

import pytest

from conftest import launch, read_jsonl, train_losses
from torchtitan.checkpoint.reading import checkpoint_keys

pytestmark = pytest.mark.distributed

SEG2D = "train_configs/debug_segmentation_2d.toml"


def _args(data, dump, steps, *extra):
    return ["--job.config_file", SEG2D, "--data.dataset_path", str(data),
            "--job.dump_folder", str(dump), "--training.steps", str(steps),
            "--metrics.log_freq", "1", "--checkpoint.interval", "2", "--no-metrics.progress_bar",
            *extra]


def _ok(r):
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


DDP = ["--training.data_parallel_shard_degree", "1", "--training.data_parallel_replicate_degree", "2"]


def test_fsdp_checkpoint_resumes_under_ddp_and_on_one_process(seg2d_four_steps, demo_data,
                                                              tmp_path):
    """The shared FSDP run's step-2 checkpoint (the run of ``_args(data, dump, 4)``), resumed
    for step 3 under DDP and on one process: step 3's loss is the FSDP run's own (the LR is
    still in warmup, so the shorter resumed runs do not change the schedule)."""
    fsdp = train_losses(seg2d_four_steps)
    for name, nproc, extra in (("ddp", 2, DDP), ("single", 0, [])):
        dump = tmp_path / name
        step2 = seg2d_four_steps / "checkpoint" / "step-2"
        shutil.copytree(step2, dump / "checkpoint" / "step-2")
        r = launch("train_segmentation.py", _args(demo_data, dump, 3, *extra), nproc=nproc)
        _ok(r)
        assert f"resumed from {dump / 'checkpoint' / 'step-2'}" in r.stderr + r.stdout
        assert sorted(train_losses(dump)) == [3], name
        assert train_losses(dump)[3] == pytest.approx(fsdp[3], rel=1e-5), name


def test_async_saves_are_complete_and_atomic(demo_data, tmp_path):
    dump = tmp_path / "async"
    _ok(launch("train_segmentation.py", _args(demo_data, dump, 4, "--checkpoint.async_mode", "async")))
    ckpt = dump / "checkpoint"
    assert (ckpt / "step-2" / ".metadata").is_file() and (ckpt / "step-4" / ".metadata").is_file()
    assert not [p for p in ckpt.iterdir() if p.name.endswith(".tmp")]
    assert any(k.startswith("optimizer.") for k in checkpoint_keys(ckpt / "step-4"))


def test_model_only_final_export_and_resume_from_the_last_full_checkpoint(demo_data, tmp_path):
    dump = tmp_path / "export"
    _ok(launch("train_segmentation.py", _args(demo_data, dump, 3, "--checkpoint.last_save_model_only",
                                              "--checkpoint.export_dtype", "bfloat16")))
    final = dump / "checkpoint" / "step-3"
    keys = checkpoint_keys(final)
    assert keys and all(k.startswith("model.") for k in keys)
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(final)).read_metadata().state_dict_metadata
    assert {str(m.properties.dtype) for m in meta.values()} == {"torch.bfloat16"}
    # More steps: the run resumes from step-2, the newest checkpoint with optimizer state.
    _ok(launch("train_segmentation.py", _args(demo_data, dump, 4)))
    steps = [r["step"] for r in read_jsonl(dump / "logs" / "metrics.jsonl") if "loss" in r]
    # The first launch's step 3 (after the last full checkpoint) is trained again, and logged
    # once: a resume drops the records of steps after the resumed one.
    assert steps == [1, 2, 3, 4]


def test_seed_checkpoint_gives_identical_starts(demo_data, tmp_path):
    seed = tmp_path / "seed"
    r = launch("train_segmentation.py", _args(demo_data, seed, 1, "--checkpoint.create_seed_checkpoint",
                                              "--training.seed", "7"), nproc=0)
    _ok(r)
    step0 = seed / "checkpoint" / "step-0"
    assert (step0 / ".metadata").is_file()
    assert all(k.startswith("model.") for k in checkpoint_keys(step0))
    losses = []
    for name, nproc in (("a", 2), ("b", 0)):
        dump = tmp_path / name
        _ok(launch("train_segmentation.py", _args(demo_data, dump, 1, "--checkpoint.initial_load_path",
                                                  str(step0)), nproc=nproc))
        losses.append(train_losses(dump)[1])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    r = launch("train_segmentation.py", _args(demo_data, tmp_path / "x", 1,
                                              "--checkpoint.create_seed_checkpoint"), nproc=2)
    assert r.returncode != 0 and "one process" in r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_launch_trains_and_checkpoints(demo_data, tmp_path):
    """Two torchrun launches, one per "node", rendezvous (c10d) on 127.0.0.1."""
    import subprocess
    import sys

    from conftest import REPO, _env

    port = _free_port()
    dump = tmp_path / "multinode"
    procs = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
               "1", "--node_rank", str(node_rank), "--rdzv_backend", "c10d", "--rdzv_endpoint",
               f"127.0.0.1:{port}", "--rdzv_id", "test-multinode", str(REPO / "train_segmentation.py"),
               *_args(demo_data, dump, 2)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    assert "FSDP 2" in outs[0][1] + outs[0][0]
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file()
    assert json.loads((dump / "checkpoint" / "best.json").read_text())["step"] == 2
