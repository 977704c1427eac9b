"""``bench/quality.py``'s plain-loop U-Net row (``bench/unet_standalone.py``), on tiny data.

The script trains MONAI's BasicUNet outside our trainer; what must hold is that it writes a
record that ``quality.py`` reads like a trainer run's (steps, ``val/...`` scores) and that the
row reaches the table, in 2D and 3D. The sampler is checked on its own: a crop smaller than the
window is padded with unannotated voxels, and image and labels are flipped together.
"""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest
import torch
from conftest import script_module

from torchtitan.data.volume_source import CropVolume

needs_monai = pytest.mark.skipif(not importlib.util.find_spec("monai"),
                                 reason="MONAI is a benchmark dependency: pip install monai")


@needs_monai
def test_plain_unet_rows_train_for_their_budget_and_reach_the_table(demo_data, tmp_path, capsys):
    quality = script_module("bench/quality.py")
    # One small validation crop, few large windows: the scoring is what is tested, not speed.
    config = ("train_configs/debug_segmentation_2d.toml --training.batch_size 2 "
              "--data.val_crops jrc_synth-2/crop7 --inference.batch_size 32")
    out = tmp_path / "quality"
    vit = f"{config} --model.crop_size 64,64 --lr_scheduler.decay_type constant"
    quality.main(["--data", str(demo_data), "--out", str(out), "--budget", "3", "--nproc", "1",
                  "--calibrate", "4", "--model", f"vit={vit}",
                  "--model", f"unet2d_plain={config} --model.crop_size 64,64",
                  "--model", f"unet3d_plain={config} --model.crop_size 16,32,32"])
    printed = capsys.readouterr().out
    # Our trainer's row: a constant schedule gets twice its calibrated steps and the clock
    # (training.time_budget_s) ends it, finished and validated, at the step it reached.
    import tomllib

    assert quality.constant_schedule(vit, demo_data)
    assert not quality.constant_schedule(config, demo_data)
    saved = tomllib.loads((out / "vit" / "config.toml").read_text())["training"]
    assert saved["time_budget_s"] == 3.0
    vit_record = quality.records(out / "vit")[-1]
    assert 1 <= vit_record["step"] < saved["steps"] and "val/mean_iou" in vit_record
    for name in ("unet2d_plain", "unet3d_plain"):
        (record,) = quality.records(out / name)
        assert record["step"] >= 1 and 0 <= record["val/mean_iou"] <= 1, record
        assert record["train_time_s"] <= record["wall_time_s"]
        assert any(k.startswith("val/iou/") for k in record)
        assert f"{name} " in printed.split("| steps")[0], printed  # a column of the table
    results = json.loads((out / "results.json").read_text())["runs"]
    assert results["unet2d_plain"][0] == quality.records(out / "unet2d_plain")[0]["step"]


@pytest.mark.distributed
def test_label_fractions_pretraining_and_equal_time(demo_data, tmp_path, capsys):
    """Every model at every label fraction, MAE-initialised beside scratch, the equal-time
    row at the smallest fraction, the summary table and the plot."""
    import tomllib

    from PIL import Image

    quality = script_module("bench/quality.py")
    seg = ("train_configs/debug_segmentation_2d.toml --training.batch_size 2 "
           "--data.val_crops jrc_synth-2/crop7 --model.crop_size 32,32 --data.classes mito")
    out = tmp_path / "quality"
    quality.main(["--data", str(demo_data), "--out", str(out), "--steps", "2", "--nproc", "1",
                  "--label-fractions", "1/4,1", "--equal-time",
                  "--pretrain", "mae=train_configs/debug_mae_2d.toml --training.steps 2 "
                                "--training.batch_size 2 --model.crop_size 32,32 "
                                "--data.val_crops jrc_synth-2/crop7",
                  "--model", f"vit={seg}", "--model", f"vit@mae={seg}"])
    printed = capsys.readouterr().out
    saved = json.loads((out / "results.json").read_text())
    runs = saved["runs"]
    assert set(runs) == {"vit_f1-4", "vit@mae_f1-4", "vit_f1-1", "vit@mae_f1-1",
                         "vit+maetime_f1-4"}
    # The fraction reaches the run's config; the pretrained runs load the MAE's encoder.
    config = tomllib.loads((out / "vit@mae_f1-4" / "config.toml").read_text())
    assert config["data"]["train_label_fraction"] == 0.25
    assert config["checkpoint"]["initial_load_path"].endswith("pretrain_mae/checkpoint")
    # Equal time: the scratch model trains on for the pretraining's wall time.
    assert runs["vit+maetime_f1-4"][0] > runs["vit_f1-4"][0] == 2
    assert 0 < saved["pretraining"]["mae"]["val/reconstruction_loss"]
    summary = saved["label_efficiency"]
    assert set(summary) == {"vit", "vit@mae", "vit+maetime"}
    assert set(summary["vit"]) == {"1/4", "1"} and set(summary["vit+maetime"]) == {"1/4"}
    assert "| labels | vit | vit@mae | vit+maetime | vit@mae - vit |" in printed
    with Image.open(out / "label_efficiency.png") as png:
        assert png.size == (720, 440)

    # Run again with --reuse: every run is kept, none is trained again; another config is not.
    stamps = {r: (out / r / "logs" / "metrics.jsonl").stat().st_mtime for r in runs}
    quality.main(["--data", str(demo_data), "--out", str(out), "--steps", "2", "--nproc", "1",
                  "--label-fractions", "1/4,1", "--equal-time", "--reuse",
                  "--pretrain", "mae=train_configs/debug_mae_2d.toml --training.steps 2 "
                                "--training.batch_size 2 --model.crop_size 32,32 "
                                "--data.val_crops jrc_synth-2/crop7",
                  "--model", f"vit={seg}", "--model", f"vit@mae={seg}"])
    printed = capsys.readouterr().out
    assert printed.count(": reused (a finished run") == len(runs) + 1, printed  # + the MAE
    assert json.loads((out / "results.json").read_text())["runs"] == runs
    assert stamps == {r: (out / r / "logs" / "metrics.jsonl").stat().st_mtime for r in runs}
    flags = ["--job.config_file", *seg.split(), "--data.dataset_path", str(demo_data),
             "--data.train_label_fraction", "0.25", "--job.dump_folder", str(out / "vit_f1-4"),
             "--training.steps", "2", "--metrics.eval_freq", "0",
             "--no-checkpoint.enable_checkpoint", "--no-metrics.progress_bar"]
    assert quality.finished_run(out / "vit_f1-4", flags)
    assert not quality.finished_run(out / "vit_f1-4", [*flags, "--training.seed", "3"])


def test_calibrate_only_times_each_model_and_trains_nothing(demo_data, tmp_path, capsys):
    quality = script_module("bench/quality.py")
    config = "train_configs/debug_segmentation_2d.toml --training.batch_size 2"
    out = tmp_path / "quality"
    quality.main(["--data", str(demo_data), "--out", str(out), "--budget", "60", "--nproc", "1",
                  "--calibrate", "3", "--calibrate-only", "--model", f"vit={config}"])
    step_s = quality.step_time(out / "vit_calibrate")
    assert f"vit: {step_s:.3f} s/step -> {int(60 / step_s)} steps in 60 s" in capsys.readouterr().out
    assert not (out / "vit").exists() and not (out / "results.json").exists()
    with pytest.raises(SystemExit, match="plain U-Net"):
        quality.main(["--data", str(demo_data), "--out", str(out), "--calibrate-only",
                      "--model", f"unet2d_plain_s0={config}"])


def test_label_fraction_values_are_checked():
    quality = script_module("bench/quality.py")
    assert quality.parse_fractions("1, 1/16,0.25") == [quality.Fraction(1, 16),
                                                       quality.Fraction(1, 4), 1]
    assert quality.parse_fractions("") == [None]
    with pytest.raises(SystemExit, match="in \\(0, 1\\]"):
        quality.parse_fractions("0,1/2")


@needs_monai
@pytest.mark.distributed
def test_in_trainer_unet_row_trains_with_the_trainers_loss(demo_data, tmp_path):
    """The in-trainer U-Net takes the trainer's calls (the loss asks for unresized logits)."""
    quality = script_module("bench/quality.py")
    config = ("train_configs/debug_segmentation_2d.toml --training.batch_size 2 "
              "--data.val_crops jrc_synth-2/crop7 --model.crop_size 64,64")
    out = tmp_path / "quality"
    quality.main(["--data", str(demo_data), "--out", str(out), "--steps", "2", "--seeds", "0",
                  "--model", f"unet2d={config}"])
    records = quality.records(out / "unet2d_s0")
    assert records[-1]["step"] == 2 and 0 <= records[-1]["val/mean_iou"] <= 1
    # A run named with its seed is still the U-Net, not the config's ViT.
    assert "MONAI BasicUNet" in (out / "unet2d_s0.log").read_text()
    assert quality.model_kind("unet3d@mae_f1-16_s1") == "unet3d"


def _volume(shape, classes=("a", "b")) -> CropVolume:
    n = int(np.prod(shape))
    image = torch.arange(n, dtype=torch.float32).reshape(1, *shape)
    target = (image.expand(len(classes), *shape) % 3 == 0)
    return CropVolume(image, target.clone(), torch.ones_like(target), np.zeros(3),
                      voxel_size=(8.0, 8.0, 8.0), classes=list(classes),
                      annotated=list(classes), name="ds/crop1")


def test_windows_pad_small_crops_unannotated_and_flip_labels_with_the_image():
    standalone = script_module("bench/unet_standalone.py")
    vol = _volume((3, 5, 20))
    windows = standalone.UniformWindows([vol], (8, 8), np.random.default_rng(0))
    for _ in range(20):
        image, target, valid = windows.sample()
        assert image.shape == (1, 8, 8) and target.shape == valid.shape == (2, 8, 8)
        # y (5 voxels) is centred in the 8 of the window (rows 1..5, or 2..6 once flipped);
        # the other rows are padding, which the loss skips.
        rows = valid[0].any(dim=1).nonzero().flatten().tolist()
        assert rows in ([1, 2, 3, 4, 5], [2, 3, 4, 5, 6]) and int(valid.sum()) == 2 * 5 * 8
        # The labels are a function of the EM value: any flip moved both alike.
        inside = valid[0]
        assert torch.equal(target[0][inside], image[0][inside] % 3 == 0)
    image, target, valid = windows.batch(4)
    assert image.shape == (4, 1, 8, 8) and target.dtype == valid.dtype == torch.float32


@pytest.mark.distributed
def test_protocol_scores_one_resumed_run_at_each_budget_and_keeps_its_ledger(
        demo_data, tmp_path, capsys):
    """``--budgets``: a constant-schedule model trains one run per seed, scored at the end of
    its first budget and resumed for the rest of the next; a decaying schedule trains a run per
    budget, trained again at its own rate where the clock cut its schedule short; the ledger
    keeps them, so a second invocation trains nothing."""
    import tomllib

    quality = script_module("bench/quality.py")
    seg = ("train_configs/debug_segmentation_2d.toml --training.batch_size 2 "
           "--data.val_crops jrc_synth-2/crop7 --model.crop_size 32,32 --data.classes mito")
    flat, decayed = f"{seg} --lr_scheduler.decay_type constant", f"{seg} --training.warmup_steps 1"
    out = tmp_path / "protocol"
    argv = ["--out", str(out), "--budgets", "4,8", "--nproc", "1", "--calibrate", "3",
            "--stack", f"demo={demo_data} --data.voxel_size 8,8,8", "--reference", "flat",
            "--model", f"flat={flat}", "--model", f"decayed={decayed}"]
    # A step time far faster than the machine: the first decaying run is cut by its clock.
    (out / "demo").mkdir(parents=True)
    (out / "demo" / "decayed_step_s").write_text("0.0001\n")
    quality.main(argv)
    printed = capsys.readouterr().out
    ledger = json.loads((out / "protocol.json").read_text())["demo"]
    flat_runs = ledger["flat"]
    assert set(flat_runs) == {"4.0", "8.0"} and set(ledger["decayed"]) == {"4.0", "8.0"}
    # One run, two launches: the second resumed the first's checkpoint and trained on.
    run = out / "demo" / "flat"
    launches = [tomllib.loads(p.read_text())["training"]
                for p in (run / "config.toml", run / "config.launch-2.toml")]
    assert [t["time_budget_s"] for t in launches] == [4.0, 4.0]
    assert launches[0]["steps"] == launches[1]["steps"]
    assert 1 <= flat_runs["4.0"]["steps"] < flat_runs["8.0"]["steps"] <= launches[0]["steps"]
    assert launches[0]["seed"] == 0 and tomllib.loads((run / "config.toml").read_text())[
        "data"]["voxel_size"] == [8.0, 8.0, 8.0]  # the stack's flags reach the run
    # A decaying schedule: a run of its own per budget, each sized by its budget and, once
    # its clock cut it short, by the rate it ran at (which replaced the planted one).
    assert "before its schedule ended; again at its own rate" in printed
    assert not (out / "demo" / "decayed_calibrate").exists()
    rate = float((out / "demo" / "decayed_step_s").read_text())
    assert rate > 0.001
    for budget in (4, 8):
        config = tomllib.loads((out / "demo" / f"decayed_b{budget}" / "config.toml").read_text())
        assert config["training"]["time_budget_s"] == budget
    assert config["training"]["steps"] == max(1, int(8 / rate))
    assert ledger["decayed"]["8.0"]["steps"] <= config["training"]["steps"]
    assert "decayed - flat (" in printed
    assert re.search(r"\| model +\| demo 4 s +\| demo 8 s +\|", (out / "protocol.md").read_text())
    # Again: everything is in the ledger, nothing trains (not even a calibration).
    stamp = (run / "logs" / "metrics.jsonl").stat().st_mtime
    (out / "demo" / "flat_calibrate").rename(out / "demo" / "old_calibrate")
    quality.main(argv)
    assert (run / "logs" / "metrics.jsonl").stat().st_mtime == stamp
    assert not (out / "demo" / "flat_calibrate").exists()


def test_protocol_summary_keeps_a_lever_only_where_it_helps_on_every_stack():
    quality = script_module("bench/quality.py")

    def cell(iou, voi, steps=10):
        return {"steps": steps, "wall_s": 1.0, "step_s": 0.1,
                "scores": {"val/mean_iou": iou, "val/voi/cell": voi}}

    ledger = {"a": {"base": {"60.0": cell(0.50, 2.0)}, "lever": {"60.0": cell(0.60, 1.5)},
                    "unet2d_plain": {"60.0": cell(0.55, 1.8)}},
              "b": {"base": {"60.0": cell(0.50, 2.0)}, "lever": {"60.0": cell(0.45, 1.9)},
                    "unet2d_plain": {"60.0": cell(0.40, 2.2)}}}
    text = quality.protocol_summary(ledger, ["a", "b"], ["base", "lever", "unet2d_plain"], [],
                                    [60.0], ["val/mean_iou", "val/voi/cell"], "base")
    iou, voi = text.split("val/voi/cell")
    # Better on stack a, worse on b: not kept, though its mean over the stacks is higher.
    assert "lever - base (not better everywhere)" in iou and "+0.100" in iou and "-0.050" in iou
    assert "| lever - best plain U-Net" in iou and "+0.050" in iou
    # VOI: lower is better, so the lever's lower VOI on both stacks keeps it.
    assert "lever - base (better at every stack and budget)" in voi
    assert "0.500 (0.500-0.500; 10 steps; n=1)" in iou


@needs_monai
def test_plain_unet_is_scored_at_each_budget_of_one_run(demo_data, tmp_path):
    """``unet_standalone.py --budgets``: one run, a record per budget, the clock stopped while
    it validates (its training seconds stay under each budget)."""
    unet = script_module("bench/unet_standalone.py")
    out = tmp_path / "plain"
    unet.main(["--config", "train_configs/debug_segmentation_2d.toml",
               "--data.dataset_path", str(demo_data), "--data.val_crops", "jrc_synth-2/crop7",
               "--training.batch_size", "2", "--model.crop_size", "32,32", "--budgets", "2,5",
               "--out", str(out)])
    first, second = (json.loads(line) for line in
                     (out / "logs" / "metrics.jsonl").read_text().splitlines())
    assert (first["budget_s"], second["budget_s"]) == (2.0, 5.0)
    assert 1 <= first["step"] < second["step"]
    # Each stops at the step past which another would end beyond its budget (a step is far
    # shorter than the gap between the two).
    assert first["train_time_s"] < 2.0 + first["train_time_s"] / first["step"]
    assert 2.0 < second["train_time_s"] < 5.0 + second["train_time_s"] / second["step"]
    assert 0 <= first["val/mean_iou"] <= 1 and "val/mean_iou" in second
    with pytest.raises(SystemExit):
        unet.main(["--config", "train_configs/debug_segmentation_2d.toml", "--budgets", "5,2",
                   "--out", str(out)])


@pytest.mark.distributed
def test_each_trainer_model_gets_its_own_calibration_and_clock(demo_data, tmp_path):
    """With a budget, every trainer model is timed and stopped by its own clock, not the
    first model's step count."""
    import tomllib

    quality = script_module("bench/quality.py")
    seg = ("train_configs/debug_segmentation_2d.toml --training.batch_size 2 "
           "--data.val_crops jrc_synth-2/crop7 --model.crop_size 32,32 --data.classes mito")
    out = tmp_path / "quality"
    quality.main(["--data", str(demo_data), "--out", str(out), "--budget", "3", "--nproc", "1",
                  "--calibrate", "3", "--model", f"a={seg}",
                  "--model", f"b={seg} --model.head_channels 8"])
    for name in ("a", "b"):
        assert (out / f"{name}_calibrate" / "logs" / "metrics.jsonl").is_file()
        training = tomllib.loads((out / name / "config.toml").read_text())["training"]
        assert training["time_budget_s"] == 3.0
        assert training["steps"] == max(1, int(3 / quality.step_time(out / f"{name}_calibrate")))
