"""Exact resume with and without data loader workers, for FSDP and DDP.

Samples are keyed by their global index, and the loader is rebuilt at the checkpointed step,
so a run resumed from step N/2 must reproduce the losses of a straight run exactly, whatever
the parallelism and the number of loader workers. The global batch a step sees does not
depend on the data-parallel degree or the workers either (checked directly, no torchrun).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import launch, read_jsonl
from torchtitan.config.manager import ConfigManager
from torchtitan.data.sampling.loader import build_loader
from torchtitan.checkpoint.convert import read_model_weights
from torchtitan.data.crops.selection import DataSettings, load_segmentation_data
from torchtitan.data.sampling.samples import build_segmentation_samples

SEG2D = "train_configs/debug_segmentation_2d.toml"
PARALLELISM = {
    "fsdp": [],
    "ddp": ["--training.data_parallel_shard_degree", "1",
            "--training.data_parallel_replicate_degree", "2"],
}


def _tensors(batch) -> dict[str, torch.Tensor]:
    """A batch's tensors by field name (fields it does not carry left out)."""
    return {k: v for k, v in vars(batch).items() if v is not None}


def _args(data, dump, parallelism: str, workers: int, *extra: str) -> list[str]:
    return [*extra, "--job.config_file", SEG2D, "--data.dataset_path", str(data),
            "--job.dump_folder", str(dump), "--training.steps", "4", "--metrics.log_freq", "1",
            "--checkpoint.interval", "2", "--data.num_workers", str(workers),
            "--data.val_fraction", "0",  # no validation crops: nothing to evaluate, faster
            "--no-metrics.progress_bar", *PARALLELISM[parallelism]]


def _ok(result):
    assert result.returncode == 0, \
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def _records(dump) -> dict[int, dict]:
    return {r["step"]: r for r in read_jsonl(dump / "logs" / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def straight(demo_data, tmp_path_factory):
    """4-step runs (checkpoints at steps 2 and 4), one per (parallelism, workers), made once."""
    runs = {}

    def get(parallelism: str, workers: int):
        if (parallelism, workers) not in runs:
            dump = tmp_path_factory.mktemp(f"{parallelism}{workers}") / "run"
            _ok(launch("train_segmentation.py", _args(demo_data, dump, parallelism, workers)))
            runs[parallelism, workers] = dump
        return runs[parallelism, workers]

    return get


def _resume_from_step_2(straight_dump, resumed_dump):
    """A fresh dump folder holding only the straight run's step-2 checkpoint: what a job
    stopped after step 2 leaves behind."""
    shutil.copytree(straight_dump / "checkpoint" / "step-2", resumed_dump / "checkpoint" / "step-2")


@pytest.mark.distributed
@pytest.mark.parametrize("parallelism, workers", [
    ("fsdp", 0),
    ("ddp", 2),
    pytest.param("fsdp", 2, marks=pytest.mark.slow),
    pytest.param("ddp", 0, marks=pytest.mark.slow),
])
def test_resume_reproduces_the_straight_run(demo_data, tmp_path, straight, parallelism, workers):
    full = straight(parallelism, workers)
    resumed = tmp_path / "resumed"
    _resume_from_step_2(full, resumed)
    _ok(launch("train_segmentation.py", _args(demo_data, resumed, parallelism, workers)))
    a, b = _records(full), _records(resumed)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [3, 4], "resumed after step 2"
    for step in (3, 4):
        assert b[step]["loss"] == a[step]["loss"], step  # bit for bit
        assert b[step]["grad_norm"] == a[step]["grad_norm"], step


@pytest.mark.distributed
def test_the_weights_average_resumes_exactly(demo_data, tmp_path):
    """``training.ema_decay``: the step-4 checkpoint of a run resumed after step 2 holds the
    straight run's averaged weights (``model``) and trained weights (``train_model``), bit for
    bit; the two differ (the average lags the weights)."""
    ema = ("--training.ema_decay", "0.9")
    full, resumed = tmp_path / "straight", tmp_path / "resumed"
    _ok(launch("train_segmentation.py", _args(demo_data, full, "fsdp", 0, *ema)))
    _resume_from_step_2(full, resumed)
    _ok(launch("train_segmentation.py", _args(demo_data, resumed, "fsdp", 0, *ema)))
    a, b = _records(full), _records(resumed)
    assert b[4]["loss"] == a[4]["loss"]
    for part in ("model", "train_model"):
        want = read_model_weights(full / "checkpoint" / "step-4", part)
        got = read_model_weights(resumed / "checkpoint" / "step-4", part)
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), (part, k)
    averaged = read_model_weights(full / "checkpoint" / "step-4")
    trained = read_model_weights(full / "checkpoint" / "step-4", "train_model")
    assert any(not torch.equal(averaged[k], trained[k]) for k in averaged)


@pytest.mark.distributed
def test_ddp_with_workers_matches_fsdp_without(straight):
    """The two default runs above, against each other: DDP with 2 loader workers per rank
    reaches FSDP's losses without workers (equal up to reduction order)."""
    fsdp0, ddp2 = _records(straight("fsdp", 0)), _records(straight("ddp", 2))
    for step in (1, 2, 3, 4):
        assert ddp2[step]["loss"] == pytest.approx(fsdp0[step]["loss"], rel=1e-4), step


@pytest.mark.distributed
def test_resume_with_another_dp_degree_warns_and_continues(demo_data, tmp_path, straight):
    """An FSDP-2 checkpoint resumed on one process (with 2 workers): DCP reshards, the same
    global batches follow, and the log says so."""
    full = straight("fsdp", 0)
    resumed = tmp_path / "one_rank"
    _resume_from_step_2(full, resumed)
    args = _args(demo_data, resumed, "fsdp", 2)
    r = launch("train_segmentation.py", args, nproc=0)
    _ok(r)
    assert "resuming with data-parallel degree 1 (checkpoint: 2); the global batches are " \
           "unchanged" in r.stderr
    a, b = _records(full), _records(resumed)
    assert sorted(b) == [3, 4]
    for step in (3, 4):  # one rank sums the batch in another order than two
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-4), step


def test_global_batches_do_not_depend_on_dp_degree_or_workers(demo_data):
    cfg = ConfigManager().parse_args(["--job.config_file", SEG2D,
                                      "--data.dataset_path", str(demo_data)])
    sources, train, _ = load_segmentation_data(DataSettings.from_config(cfg))
    dataset = build_segmentation_samples(DataSettings.from_config(cfg), sources, train)

    def batches(dp_rank, dp_degree, workers, start_step=0, steps=3):
        loader = build_loader(dataset, 8, dp_rank, dp_degree, start_step=start_step,
                              num_workers=workers)
        it = iter(loader)
        out = [next(it) for _ in range(steps)]
        del it, loader  # stop the workers
        return out

    reference = batches(0, 1, 0)
    assert [b.index.tolist() for b in reference] == [list(range(s * 8, s * 8 + 8))
                                                         for s in range(3)]
    for workers in (0, 2):
        whole = batches(0, 1, workers)
        halves = [batches(r, 2, workers) for r in range(2)]
        for step in range(3):
            assert halves[0][step].index.tolist() == list(range(step * 8, step * 8 + 4))
            for key, expected in _tensors(reference[step]).items():
                assert torch.equal(getattr(whole[step], key), expected), (workers, step, key)
                merged = torch.cat([getattr(halves[0][step], key), getattr(halves[1][step], key)])
                assert torch.equal(merged, expected), (workers, step, key)
    # Rebuilt at step 2 (a resume) on rank 1 of 2 with 2 workers: the second half of step 2.
    (resumed,) = batches(1, 2, 2, start_step=2, steps=1)
    for key, expected in _tensors(reference[2]).items():
        assert torch.equal(getattr(resumed, key), expected[4:]), key
