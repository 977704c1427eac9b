"""Loss parity across parallelisms: the same global batch and seed give the same losses on one
process, under DDP, FSDP, HSDP and with activation checkpointing (float32, gloo)."""

from __future__ import annotations

import pytest

from conftest import launch, train_losses

pytestmark = pytest.mark.distributed

STEPS = 5


def _run(cfg, data, dump, nproc, *extra):
    r = launch("train_segmentation.py" if "segmentation" in cfg else "train_mae.py", [
        "--job.config_file", cfg, "--data.dataset_path", str(data), "--job.dump_folder", str(dump),
        "--training.steps", str(STEPS), "--metrics.log_freq", "1", "--no-metrics.progress_bar",
        "--no-checkpoint.enable_checkpoint", "--training.deterministic", *extra], nproc=nproc)
    assert r.returncode == 0, r.stderr[-4000:]
    return train_losses(dump)


def _same(reference, other, name):
    assert reference.keys() == other.keys(), name
    for step, loss in reference.items():
        assert other[step] == pytest.approx(loss, rel=1e-4), f"{name}, step {step}"


SEG = "train_configs/debug_segmentation_2d.toml"
SHARD1 = ["--training.data_parallel_shard_degree", "1"]

CASES = {
    "ddp2": (2, [*SHARD1, "--training.data_parallel_replicate_degree", "2"]),
    "fsdp2": (2, []),
    "fsdp2_ac_full": (2, ["--activation_checkpoint.mode", "full"]),
    "ddp2_ac_every2": (2, [*SHARD1, "--training.data_parallel_replicate_degree", "2",
                           "--activation_checkpoint.mode", "selective",
                           "--activation_checkpoint.selective_ac_option", "2"]),
    "fsdp2_ac_per_op": (2, ["--activation_checkpoint.mode", "selective",
                            "--activation_checkpoint.selective_ac_option", "op"]),
    "hsdp2x2": (4, ["--training.data_parallel_replicate_degree", "2",
                    "--training.data_parallel_shard_degree", "2"]),
}


@pytest.fixture(scope="module")
def single(demo_data, tmp_path_factory):
    return _run(SEG, demo_data, tmp_path_factory.mktemp("parity") / "single", 0)


@pytest.mark.parametrize("name", list(CASES))
def test_segmentation_losses_match_single_process(single, demo_data, tmp_path, name):
    nproc, extra = CASES[name]
    _same(single, _run(SEG, demo_data, tmp_path / name, nproc, *extra), name)


def test_mae_losses_match_single_process_under_fsdp_with_ac(demo_data, tmp_path):
    """MAE masks are drawn per sample from the data generator: the split does not matter."""
    cfg = "train_configs/debug_mae_3d.toml"
    reference = _run(cfg, demo_data, tmp_path / "single", 0)
    _same(reference, _run(cfg, demo_data, tmp_path / "fsdp", 2, "--activation_checkpoint.mode",
                          "full"), "mae fsdp2 + ac")
