"""End-to-end training with real torchrun processes (gloo): FSDP, DDP, checkpoints, resume,
MAE -> segmentation, and bad inputs that must stop every rank with one clear message."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import zarr

from conftest import launch, read_jsonl, train_losses

pytestmark = pytest.mark.distributed

SEG2D = "train_configs/debug_segmentation_2d.toml"
MAE2D = "train_configs/debug_mae_2d.toml"


def _seg_args(data, dump, *extra):
    return ["--job.config_file", SEG2D, "--data.dataset_path", str(data),
            "--job.dump_folder", str(dump), "--training.steps", "4", "--metrics.log_freq", "1",
            "--checkpoint.interval", "2", "--no-metrics.progress_bar", *extra]


def _ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


@pytest.fixture(scope="module")
def fsdp_run(seg2d_four_steps):
    """The shared 2-process FSDP run: _seg_args's 4 steps, checkpoints every 2."""
    return seg2d_four_steps


def test_fsdp_run_leaves_config_checkpoints_and_logs(fsdp_run):
    dump = fsdp_run
    assert (dump / "config.toml").is_file()
    assert (dump / "checkpoint" / "step-4" / ".metadata").is_file()
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file()
    assert not list((dump / "checkpoint").glob(".*tmp*")), "no temporary checkpoint is left"
    records = read_jsonl(dump / "logs" / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        for key in ("loss", "lr", "grad_norm", "voxels_per_second"):
            assert math.isfinite(r[key]), key
    val = [r for r in records if "val/mean_iou" in r]
    assert val and val[-1]["step"] == 4
    assert any(k.startswith("val/iou/") for k in val[-1])
    assert list((dump / "logs").glob("events.out.tfevents.*")), "TensorBoard event file"


def test_tensorboard_events_hold_the_scalars(fsdp_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (event_file,) = (fsdp_run / "logs").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(event_file))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "loss" in tags and "val/mean_iou" in tags
    assert {"val/iou/nuc", "val/iou/mito", "val/instance_score/mito"} <= set(tags)
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]
    assert any(t.startswith("visuals/") for t in acc.Tags()["images"])


def test_validation_writes_a_gif_per_crop(fsdp_run):
    from PIL import Image

    val = [r for r in read_jsonl(fsdp_run / "logs" / "metrics.jsonl") if "val/mean_iou" in r]
    gifs = sorted((fsdp_run / "visuals").glob("*_step4.gif"))
    assert len(gifs) >= 1 and val
    with Image.open(gifs[0]) as gif:
        assert gif.is_animated and gif.n_frames > 1


@pytest.mark.slow  # DDP against one process and FSDP in CI: test_parity, test_resume_workers
def test_ddp_gives_the_same_losses_as_fsdp(fsdp_run, demo_data, tmp_path):
    dump = tmp_path / "ddp"
    _ok(launch("train_segmentation.py", _seg_args(
        demo_data, dump, "--training.data_parallel_shard_degree", "1",
        "--training.data_parallel_replicate_degree", "2")))
    fsdp, ddp = train_losses(fsdp_run), train_losses(dump)
    assert fsdp.keys() == ddp.keys()
    for step in fsdp:
        assert ddp[step] == pytest.approx(fsdp[step], rel=1e-4), step


def test_resume_continues_after_the_last_checkpoint(fsdp_run, demo_data, tmp_path):
    dump = tmp_path / "resume"
    shutil.copytree(fsdp_run, dump)  # a finished 4-step run, as _seg_args makes it
    first = train_losses(dump)
    _ok(launch("train_segmentation.py", _seg_args(demo_data, dump, "--training.steps", "6")))
    records = [r for r in read_jsonl(dump / "logs" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6], "resumed at step 5, not from 1"
    assert (dump / "checkpoint" / "step-6" / ".metadata").is_file()
    # keep_latest_k = 2: only the two newest checkpoints remain (the best one is kept too,
    # and here it is one of them), and best.json names the best validation step.
    folders = sorted(p.name for p in (dump / "checkpoint").iterdir() if p.is_dir())
    assert folders == ["step-4", "step-6"]
    best = json.loads((dump / "checkpoint" / "best.json").read_text())
    assert best["step"] in (4, 6) and "val/mean_iou" in best
    # A run of 6 steps in one go sees the same batches and reaches the same losses.
    straight = tmp_path / "straight"
    _ok(launch("train_segmentation.py", _seg_args(demo_data, straight, "--training.steps", "6")))
    again = train_losses(straight)
    resumed = {r["step"]: r["loss"] for r in records}
    for step in (5, 6):
        assert resumed[step] == pytest.approx(again[step], rel=1e-5), step
    assert first[1] == pytest.approx(again[1], rel=1e-6)


def _model_weights(step_folder, tmp_path):
    """A DCP checkpoint's model weights, by model key."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{step_folder.parent.parent.name}.pt"
    dcp_to_torch_save(step_folder, out)
    return torch.load(out, weights_only=False)["model"]


def test_mae_then_segmentation_from_the_encoder(demo_data, tmp_path):
    """MAE with held-out crops (validation loss and pictures on them), then fine-tuning from
    its encoder with the backbone frozen for the first step."""
    mae = tmp_path / "mae"
    result = launch("train_mae.py", ["--job.config_file", MAE2D, "--data.dataset_path",
                                     str(demo_data), "--job.dump_folder", str(mae),
                                     "--training.steps", "3", "--data.val_crops", "crop2,crop7",
                                     "--no-metrics.progress_bar"])
    _ok(result)
    assert "held out for validation: jrc_synth-1/crop2, jrc_synth-2/crop7" in result.stderr
    records = read_jsonl(mae / "logs" / "metrics.jsonl")
    (val,) = [r for r in records if "val/reconstruction_loss" in r]
    assert 0 < val["val/reconstruction_loss"] and 0 < val["val/baseline_loss"]
    assert (mae / "checkpoint" / "step-3" / ".metadata").is_file()
    from PIL import Image

    with Image.open(mae / "visuals" / "mae_step3.png") as png:  # 4 samples, one row each
        assert png.height > 3 * png.width // 3 and png.width > 3 * 64
    seg = tmp_path / "seg"
    result = launch("train_segmentation.py", _seg_args(
        demo_data, seg, "--training.steps", "1",
        "--checkpoint.initial_load_path", str(mae / "checkpoint"),
        "--checkpoint.initial_load_prefix_map", "encoder.=backbone.",
        "--lr_scheduler.backbone_frozen_steps", "1"))
    _ok(result)
    assert "loaded" in result.stdout + result.stderr and "step-3" in result.stdout + result.stderr
    encoder = _model_weights(mae / "checkpoint" / "step-3", tmp_path)
    tuned = _model_weights(seg / "checkpoint" / "step-1", tmp_path)
    for key in ("blocks.0.attn.qkv.weight", "patch_embed.proj.weight", "norm.weight"):
        assert tuned[f"backbone.{key}"].equal(encoder[f"encoder.{key}"]), key  # frozen


@pytest.mark.slow  # single-process 2D and 3D runs in CI: test_parity's references
@pytest.mark.parametrize("dims", ["2d", "3d"])
def test_single_process_runs_in_2d_and_3d(demo_data, tmp_path, dims):
    cfg = f"train_configs/debug_segmentation_{dims}.toml"
    dump = tmp_path / dims
    _ok(launch("train_segmentation.py", ["--job.config_file", cfg, "--data.dataset_path",
                                         str(demo_data), "--job.dump_folder", str(dump),
                                         "--training.steps", "2", "--no-metrics.progress_bar"],
               nproc=0))
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file()


# ---------------------------------------------------------------------------------------------
# Bad input: one clear message, non-zero exit, no rank left hanging.
# ---------------------------------------------------------------------------------------------


def _fails_with(result, *fragments):
    assert result.returncode != 0, result.stdout + result.stderr
    err = result.stderr
    for frag in fragments:
        assert frag in err, f"{frag!r} not in:\n{err[-4000:]}"
    # The message is printed once (by rank 0), not once per rank.
    assert err.count("error:") == 1, err[-4000:]


_ERROR_SCRIPT = """
import os, sys, time
from torchtitan.logging_metrics import report_user_error

rank = int(os.environ["RANK"])
delay = float(sys.argv[1 + rank])  # seconds before this rank fails; < 0: it never fails
if delay < 0:
    time.sleep(120)
    sys.exit(0)
time.sleep(delay)
report_user_error(ValueError(f"bad value seen by rank {rank}"), rank, grace_s=5.0)
sys.exit(2)
"""


@pytest.mark.parametrize("delays, expected", [
    # Rank 1 fails first: rank 0's message still gets out before torchrun stops the job.
    (("1.0", "0"), "error: bad value seen by rank 0"),
    # Only rank 1 fails: after the grace it reports the error itself.
    (("-1", "0"), "error (rank 1): bad value seen by rank 1"),
])
def test_user_error_is_printed_once_whichever_rank_fails_first(tmp_path, delays, expected):
    script = tmp_path / "fail.py"
    script.write_text(_ERROR_SCRIPT)
    r = launch(str(script), list(delays), timeout=300)
    assert r.returncode != 0
    assert expected in r.stderr, r.stderr[-4000:]
    assert r.stderr.count("bad value seen") == 1, r.stderr[-4000:]


# Under torchrun in CI: data errors (no expected groups, a class no crop annotates) and a
# parallelism error; a missing dataset path in test_bad_inputs (one process), a misspelt key
# in test_config (in process), a config error under torchrun there: these three, slow only.
@pytest.mark.slow
def test_bad_input_missing_dataset_path(tmp_path):
    r = launch("train_segmentation.py", _seg_args(tmp_path / "nowhere", tmp_path / "d"), timeout=300)
    _fails_with(r, "data.dataset_path", "nowhere", "does not exist")


def test_bad_input_dataset_without_expected_groups(tmp_path):
    root = tmp_path / "data"
    zarr.open_group(str(root / "jrc_x" / "jrc_x.zarr" / "recon-1" / "raw"), mode="w", zarr_format=2)
    r = launch("train_segmentation.py", _seg_args(root, tmp_path / "d"), timeout=300)
    _fails_with(r, "jrc_x.zarr", "recon-1/em/fibsem-uint8")


@pytest.mark.slow
def test_bad_input_crop_size_larger_than_any_crop(demo_data, tmp_path):
    r = launch("train_segmentation.py", _seg_args(demo_data, tmp_path / "d", "--model.crop_size",
                                                  "1024,1024"), timeout=300)
    _fails_with(r, "model.crop_size", "[1024, 1024]", "larger than every training label crop")


def test_bad_input_class_no_crop_annotates(demo_data, tmp_path):
    r = launch("train_segmentation.py", _seg_args(demo_data, tmp_path / "d", "--data.classes",
                                                  "mito,perox"), timeout=300)
    _fails_with(r, "data.classes", "'perox'", "mito")


def test_bad_input_batch_not_divisible_by_data_parallel_degree(demo_data, tmp_path):
    r = launch("train_segmentation.py", _seg_args(demo_data, tmp_path / "d",
                                                  "--training.batch_size", "3"), timeout=300)
    _fails_with(r, "training.batch_size=3", "data-parallel degree 2")


@pytest.mark.slow
def test_bad_input_config_key(demo_data, tmp_path):
    r = launch("train_segmentation.py", _seg_args(demo_data, tmp_path / "d", "--training.setps",
                                                  "3"), timeout=300)
    _fails_with(r, "training.setps", "training.steps")
