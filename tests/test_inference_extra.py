"""Test-time flips, the "zyx" planes of 2D models, crop manifests, and parity between the
validation scores logged in training and predict.py + the scoring command."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, _env, launch, read_jsonl
from torchtitan.config.manager import ConfigManager
from torchtitan.errors import ConfigError
from torchtitan.inference.sliding_window import (
    blending_norm,
    blending_profile,
    blending_weights,
    flip_combinations,
    grid_starts,
    predict_blockwise,
    predict_volume,
    sliding_window,
    WindowPlan,
    with_flips,
)

CLASSES = ["nuc", "mito", "er", "cell"]


# ---------------------------------------------------------------------------------------------
# Blending: the separable normalisation equals summing every window's weights
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blend", ["gaussian", "constant"])
def test_separable_norm_equals_summed_window_weights(blend):
    shape, window, overlap = (11, 40, 29), (4, 16, 12), 0.3
    starts = [grid_starts(s, w, overlap) for s, w in zip(shape, window)]
    brute = torch.zeros(shape)
    weight = blending_weights(window, blend)
    for z in starts[0]:
        for y in starts[1]:
            for x in starts[2]:
                brute[z:z + window[0], y:y + window[1], x:x + window[2]] += weight
    n = [blending_norm(s, w, st, blending_profile(w, blend))
         for s, w, st in zip(shape, window, starts)]
    torch.testing.assert_close(n[0][:, None, None] * n[1][None, :, None] * n[2][None, None, :],
                               brute, rtol=1e-5, atol=0)


def test_gaussian_weights_have_sigma_an_eighth_of_the_window():
    w = blending_profile(64, "gaussian")
    x = torch.arange(64) - 31.5
    torch.testing.assert_close(w, torch.exp(-0.5 * (x / 8) ** 2) / torch.exp(-0.5 * (x / 8) ** 2).max())
    assert w.min() > 1e-4  # no floor needed: edge weights stay far above underflow


# ---------------------------------------------------------------------------------------------
# Test-time flips
# ---------------------------------------------------------------------------------------------


def test_flip_combinations_are_the_whole_group():
    assert flip_combinations(2) == [(), (2,), (3,), (2, 3)]
    three = flip_combinations(3)
    assert len(three) == 8 and len(set(three)) == 8 and three[0] == ()


class _Recorder:
    """A predict callable that records batch sizes."""

    def __init__(self, fn):
        self.fn, self.batches = fn, []

    def __call__(self, x):
        self.batches.append(x.shape[0])
        return self.fn(x)


@pytest.mark.parametrize("ndim", [2, 3])
def test_flip_equivariant_model_is_unchanged_by_tta(ndim):
    """A per-voxel model commutes with flips: TTA must give the same probabilities, with the
    same number of forwards (the flips share each forward)."""
    torch.manual_seed(0)
    conv = (torch.nn.Conv2d if ndim == 2 else torch.nn.Conv3d)(1, 3, kernel_size=1)
    volume = torch.randn(1, 6, 40, 33)
    window = (16, 16) if ndim == 2 else (4, 16, 16)
    plain, tta = _Recorder(lambda x: torch.sigmoid(conv(x))), _Recorder(lambda x: torch.sigmoid(conv(x)))
    with torch.no_grad():
        a = predict_volume(plain, volume, window, 3, batch_size=4)
        b = predict_volume(tta, volume, window, 3, batch_size=4, tta_flips=True)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert len(tta.batches) == len(plain.batches)
    assert [t // p for t, p in zip(tta.batches, plain.batches)] == [2**ndim] * len(plain.batches)


def _manual_flip_average(predict, ndim):
    """The flip average written out directly: flip, predict, flip back, mean."""
    def averaged(x):
        dims_list = [[2 + a for a in range(ndim) if (m >> a) & 1] for m in range(2**ndim)]
        outs = [predict(x.flip(d)).flip(d) if d else predict(x) for d in dims_list]
        return torch.stack(outs).mean(0)
    return averaged


@pytest.mark.parametrize("ndim", [2, 3])
def test_tta_of_a_non_equivariant_model_is_the_flip_average(ndim):
    torch.manual_seed(0)
    conv = (torch.nn.Conv2d if ndim == 2 else torch.nn.Conv3d)(1, 2, kernel_size=3, padding=1)
    ramp = torch.linspace(-1, 1, 16)  # position-dependent: not flip-equivariant

    def model(x):
        return torch.sigmoid(conv(x) + ramp)

    window = (16, 16) if ndim == 2 else (8, 16, 16)
    x = torch.randn(3, 1, *window)
    with torch.no_grad():
        torch.testing.assert_close(with_flips(model, ndim)(x), _manual_flip_average(model, ndim)(x),
                                   atol=1e-6, rtol=1e-6)
        volume = torch.randn(1, 10, 37, 29)
        plain = predict_volume(model, volume, window, 2, overlap=0.25)
        tta = predict_volume(model, volume, window, 2, overlap=0.25, tta_flips=True)
        manual = predict_volume(_manual_flip_average(model, ndim), volume, window, 2, overlap=0.25)
    assert (plain - tta).abs().max() > 1e-3
    torch.testing.assert_close(tta, manual, atol=1e-6, rtol=1e-6)
    # sliding_window takes the option too (here on a 2D image)
    if ndim == 2:
        with torch.no_grad():
            image = volume[:, 0]
            torch.testing.assert_close(
                sliding_window(model, image, window, 2, tta_flips=True),
                sliding_window(_manual_flip_average(model, 2), image, window, 2), atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Planes "zyx"
# ---------------------------------------------------------------------------------------------


def test_zyx_planes_of_a_per_voxel_model_equal_the_single_plane_result():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(1, 3, kernel_size=1)
    volume = torch.randn(1, 20, 37, 29)
    with torch.no_grad():
        z = predict_volume(lambda x: torch.sigmoid(conv(x)), volume, (16, 16), 3, planes="z")
        zyx = predict_volume(lambda x: torch.sigmoid(conv(x)), volume, (16, 16), 3, planes="zyx",
                             voxel_size=(8.0, 8.0, 8.0))
    torch.testing.assert_close(zyx, z, atol=1e-6, rtol=1e-6)


def test_zyx_planes_average_the_three_orientations():
    """zx planes = the volume transposed to (y, z, x) predicted along its first axis, zy
    planes = (x, z, y); the result is the mean of those and the yx-plane prediction."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(1, 2, kernel_size=3, padding=1)

    def model(x):  # context-dependent, so every orientation gives something else
        return torch.sigmoid(conv(x) + x.mean(dim=(2, 3), keepdim=True))

    volume = torch.randn(1, 21, 30, 26)
    calls = []

    def counted(x):
        calls.append(1)
        return model(x)

    with torch.no_grad():
        zyx = predict_volume(counted, volume, (16, 16), 2, batch_size=8, planes="zyx")
        yx = predict_volume(model, volume, (16, 16), 2, batch_size=8)
        zx = predict_volume(model, volume.permute(0, 2, 1, 3), (16, 16), 2, batch_size=8)
        zy = predict_volume(model, volume.permute(0, 3, 1, 2), (16, 16), 2, batch_size=8)
    manual = (yx + zx.permute(0, 2, 1, 3) + zy.permute(0, 2, 3, 1)) / 3
    torch.testing.assert_close(zyx, manual, atol=1e-6, rtol=1e-6)
    assert (zyx - yx).abs().max() > 1e-3
    assert len(calls) == WindowPlan.build((21, 30, 26), (16, 16), 0.25, 8, planes="zyx").num_calls
    assert len(calls) > WindowPlan.build((21, 30, 26), (16, 16), 0.25, 8).num_calls


def test_the_plan_counts_the_forwards_of_every_block():
    """Blockwise prediction runs, block by block, as many forwards as the plan counts for
    those blocks; with test-time flips too (they share each forward)."""
    shape, window = (12, 40, 35), (16, 16)
    plan = WindowPlan.build(shape, window, 0.25, 8, planes="zyx")
    calls = []

    def model(x):
        calls.append(x.shape[0])
        return torch.sigmoid(x.select(1, 0).unsqueeze(1))

    expected = []

    def write(lo, hi, values):
        expected.append(plan.block_calls(lo, hi))

    with torch.no_grad():
        predict_blockwise(model, lambda lo, hi: torch.zeros(1, *[h - l for l, h in zip(lo, hi)]),
                          write, shape, window, 1, batch_size=8, block_shape=(5, 16, 16),
                          tta_flips=True, planes="zyx")
    assert len(calls) == sum(expected) > plan.num_calls  # windows straddling blocks run twice
    calls.clear()
    with torch.no_grad():
        predict_volume(model, torch.zeros(1, *shape), window, 1, batch_size=8, tta_flips=True,
                       planes="zyx")
    assert len(calls) == plan.num_calls


def test_zyx_needs_an_isotropic_grid_and_is_ignored_by_3d_models(caplog):
    conv = torch.nn.Conv3d(1, 1, 1)
    volume = torch.randn(1, 8, 16, 16)
    with pytest.raises(ValueError, match="isotropic"):
        predict_volume(lambda x: x, volume, (16, 16), 1, planes="zyx", voxel_size=(16, 8, 8))
    with pytest.raises(ValueError, match="planes"):
        predict_volume(lambda x: x, volume, (16, 16), 1, planes="xy")
    from torchtitan.inference import sliding_window as inference

    inference._warned.discard("3d")
    with caplog.at_level(logging.WARNING, logger="torchtitan.inference.sliding_window"), torch.no_grad():
        a = predict_volume(conv, volume, (8, 8, 8), 1, planes="zyx")
    assert "ignored" in caplog.text
    with torch.no_grad():
        torch.testing.assert_close(a, predict_volume(conv, volume, (8, 8, 8), 1))


def test_blockwise_equals_whole_volume_with_tta_and_zyx():
    """Small blocks, three tilings, flips, an axis shorter than the window (centred windows,
    zero context outside): still the whole-volume result."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(1, 2, kernel_size=3, padding=1)

    def model(x):
        return torch.sigmoid(conv(x) + x.mean(dim=(2, 3), keepdim=True))

    volume = torch.randn(1, 12, 40, 35)
    shape = tuple(volume.shape[1:])
    with torch.no_grad():  # depth 12 < 16: the zx and zy windows are centred along z
        whole = predict_volume(model, volume, (16, 16), 2, tta_flips=True, planes="zyx")

    def read(lo, hi):  # zeros outside the volume, like sliding_window's padding
        out = torch.zeros(1, *[h - l for l, h in zip(lo, hi)])
        src = tuple(slice(max(l, 0), min(h, s)) for l, h, s in zip(lo, hi, shape))
        dst = tuple(slice(a.start - l, a.stop - l) for a, l in zip(src, lo))
        out[(slice(None), *dst)] = volume[(slice(None), *src)]
        return out

    result = torch.full((2, *shape), float("nan"))

    def write(lo, hi, values):
        result[:, lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] = values

    blocks = predict_blockwise(model, read, write, shape, (16, 16), 2, block_shape=(5, 16, 16),
                               tta_flips=True, planes="zyx", voxel_size=(8, 8, 8))
    assert blocks == 3 * 3 * 3
    torch.testing.assert_close(result, whole, atol=1e-6, rtol=1e-6)


def test_predictor_options_follow_the_config_unless_overridden(demo_data):
    from torchtitan.prediction.predictor import inference_options

    def cfg(*extra):
        return ConfigManager().parse_args([
            "--job.config_file", "train_configs/debug_segmentation_2d.toml",
            "--data.dataset_path", str(demo_data), *extra])

    none = argparse.Namespace(tta=None, planes=None, threshold=None)
    assert inference_options(cfg(), none) == (False, "z", 0.5)
    assert inference_options(cfg("--inference.tta_flips", "--inference.planes", "zyx",
                                 "--inference.threshold", "0.3"), none) == (True, "zyx", 0.3)
    over = argparse.Namespace(tta=True, planes="zyx", threshold=0.7)
    assert inference_options(cfg(), over) == (True, "zyx", 0.7)
    off = argparse.Namespace(tta=False, planes="z", threshold=None)
    assert inference_options(cfg("--inference.tta_flips", "--inference.planes", "zyx"), off)[:2] == (False, "z")
    with pytest.raises(ConfigError, match="isotropic"):
        inference_options(cfg("--data.voxel_size", "16,8,8"), over)


# ---------------------------------------------------------------------------------------------
# Crop manifests
# ---------------------------------------------------------------------------------------------

HEADER = ("crop_name,dataset,origin_z,origin_y,origin_x,shape_z,shape_y,shape_x,"
          "voxel_size_z,voxel_size_y,voxel_size_x")


def test_read_manifest(tmp_path):
    from torchtitan.prediction.regions import covering_grid, read_manifest

    path = tmp_path / "m.csv"
    path.write_text(HEADER + ",class_label\n"
                    "crop7,ds,0,100,200,10,20,30,4,4,4,mito\n"
                    "7,ds,0,100,200,10,20,30,4,4,4,er\n"  # same crop, another class: merged
                    "crop12,ds2,8,8,8,3,3,3,8,8,8,nuc\n")
    crops = read_manifest(str(path))
    assert [c.name for c in crops] == ["crop7", "crop12"]
    np.testing.assert_allclose(crops[0].box_min, [0, 100, 200])
    np.testing.assert_allclose(crops[0].box_max, [40, 180, 320])
    # An extent that is a whole number of voxels: that grid; otherwise covered and centred.
    origin, shape = covering_grid(crops[0].box_min, crops[0].box_max, (8, 8, 8))
    assert shape == (5, 10, 15) and np.allclose(origin, [0, 100, 200])
    origin, shape = covering_grid([0, 0, 0], [44, 8, 8], (8, 8, 8))
    assert shape == (6, 1, 1) and np.allclose(origin, [-2, 0, 0])
    path.write_text(HEADER + "\ncrop7,ds,0,0,0,1,1,1,4,4,4\ncrop7,ds,4,0,0,1,1,1,4,4,4\n")
    with pytest.raises(ConfigError, match="line 3.*crop7"):
        read_manifest(str(path))
    path.write_text(HEADER + "\ncrop7,ds,0,0,zero,1,1,1,4,4,4\n")
    with pytest.raises(ConfigError, match="line 2"):
        read_manifest(str(path))
    path.write_text("crop_name,dataset\ncrop7,ds\n")
    with pytest.raises(ConfigError, match="missing columns"):
        read_manifest(str(path))


# ---------------------------------------------------------------------------------------------
# End to end: validation scores == predict.py + scoring command
# ---------------------------------------------------------------------------------------------

VAL_CROPS = "crop1,jrc_synth-2/crop5"  # the 8 nm crops: label grid = training grid


def _train(dump, demo_data, val_crops, *extra):
    r = launch("train_segmentation.py", [
        "--job.config_file", "train_configs/debug_segmentation_2d.toml",
        "--data.dataset_path", str(demo_data), "--job.dump_folder", str(dump),
        "--training.steps", "2", "--no-metrics.progress_bar", "--data.val_crops", val_crops,
        *extra], nproc=0)
    assert r.returncode == 0, r.stderr[-3000:]
    (val,) = [rec for rec in read_jsonl(dump / "logs" / "metrics.jsonl") if "val/mean_iou" in rec]
    return val


def _predict_and_score(dump, demo_data, out, crops, *extra):
    r = launch("predict.py", ["--checkpoint", str(dump / "checkpoint"), "--data", str(demo_data),
                              "--crops", crops, "--out", str(out), "--no-progress", *extra], nproc=0)
    assert r.returncode == 0, r.stderr[-3000:]
    options = r.stderr
    scores = out.parent / (out.stem + "_scores.json")
    r = subprocess.run([sys.executable, "-m", "torchtitan.scoring", "--predictions", str(out),
                        "--groundtruth", str(demo_data), "--classes", ",".join(CLASSES),
                        "--out", str(scores)], cwd=REPO, env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(scores.read_text()), options


def _assert_same_scores(val, scored):
    """Per-class IoU and Dice logged by validation == the scoring command's, to 1e-6 (they
    come out bit-identical: same windows, batches, blending and threshold; both pool the voxel
    counts over crops, as the challenge's 2025 metric does). The overall score is not compared:
    validation's instance score is still the per-crop one, the scoring command's the 2025 one."""
    assert set(scored["classes"]) == set(CLASSES)
    assert scored["metric"].startswith("cellmap-2025")
    for cls in CLASSES:
        assert scored["classes"][cls]["iou"] == pytest.approx(val[f"val/iou/{cls}"], abs=1e-6), cls
        assert scored["classes"][cls]["dice"] == pytest.approx(val[f"val/dice/{cls}"], abs=1e-6), cls


@pytest.fixture(scope="module")
def default_run(demo_data, tmp_path_factory):
    dump = tmp_path_factory.mktemp("parity") / "run"
    val = _train(dump, demo_data, VAL_CROPS)
    pred = dump.parent / "pred.zarr"
    # One block per crop, as validation predicts it: the same batches and operations, so the
    # probabilities are bit-identical (blocks change them by ~1 ulp at most, which a voxel
    # right at the threshold could feel; test_loader_eval_inference covers blocks).
    scored, options = _predict_and_score(dump, demo_data, pred, VAL_CROPS)
    assert "tta_flips=False, planes=z," in options
    return dump, val, pred, scored


def test_validation_scores_equal_predict_and_score(default_run):
    _, val, _, scored = default_run
    _assert_same_scores(val, scored)
    assert any(val[f"val/iou/{c}"] > 0 for c in CLASSES)  # not a trivially empty comparison


def test_parity_with_tta_and_zyx_planes(demo_data, tmp_path):
    """Both options from the run's config, in validation and in predict.py. The window
    (32x32) fits inside the crop along every axis, so no window reaches past the crop: there
    validation pads with zeros, while predict.py reads the EM around the crop."""
    dump = tmp_path / "run"
    val = _train(dump, demo_data, "crop1", "--inference.tta_flips", "--inference.planes", "zyx",
                 "--model.crop_size", "32,32")
    scored, options = _predict_and_score(dump, demo_data, tmp_path / "pred.zarr", "crop1")
    assert "tta_flips=True, planes=zyx," in options
    _assert_same_scores(val, scored)


def test_manifest_predicts_boxes_without_labels(default_run, demo_data, tmp_path):
    import zarr

    dump, _, pred, _ = default_run
    manifest = tmp_path / "test_crops.csv"
    manifest.write_text(
        HEADER + "\n"
        # crop1's box again, under another number: must equal --crops crop1
        "crop901,jrc_synth-1,156,156,188,40,80,80,8,8,8\n"
        # a box at 4 nm, not a whole number of 8 nm voxels, in the other dataset
        "902,jrc_synth-2,1100,800,1900,11,31,31,4,4,4\n")
    out = tmp_path / "submission.zarr"
    r = launch("predict.py", ["--checkpoint", str(dump / "checkpoint"), "--data", str(demo_data),
                              "--manifest", str(manifest), "--out", str(out), "--no-progress"],
               nproc=0)
    assert r.returncode == 0, r.stderr[-3000:]
    root, ref = zarr.open_group(str(out), mode="r"), zarr.open_group(str(pred), mode="r")
    for cls in CLASSES:
        np.testing.assert_array_equal(root[f"crop901/{cls}/s0"][:], ref[f"crop1/{cls}/s0"][:])
        group = root[f"crop902/{cls}"]
        assert group["s0"].shape == (6, 16, 16)  # ceil(44/8), ceil(124/8)
        np.testing.assert_allclose(group.attrs["translation"], [1100 - 2 + 4, 800 - 2 + 4, 1900 - 2 + 4])
        assert group.attrs["voxel_size"] == [8.0, 8.0, 8.0]
    bad = tmp_path / "bad.csv"
    bad.write_text(HEADER + "\ncrop3,jrc_nowhere,0,0,0,1,1,1,8,8,8\n")
    r = launch("predict.py", ["--checkpoint", str(dump / "checkpoint"), "--data", str(demo_data),
                              "--manifest", str(bad), "--out", str(tmp_path / "x.zarr"),
                              "--no-progress"], nproc=0)
    assert r.returncode == 2 and "jrc_nowhere" in r.stderr
    r = launch("predict.py", ["--checkpoint", str(dump / "checkpoint"), "--data", str(demo_data),
                              "--manifest", str(manifest), "--crops", "crop1", "--out",
                              str(tmp_path / "y.zarr"), "--no-progress"], nproc=0)
    assert r.returncode == 2 and "--manifest" in r.stderr


class _SameObject:
    """A flip-equivariant "model" of affinities: its input is an id volume, and each output
    channel says whether a voxel and its partner at that channel's offset hold the same id
    (0 where the partner leaves the window), beside one class channel (id > 2)."""

    def __init__(self, offsets):
        self.offsets = offsets
        self.channel_offsets = (None, *offsets)

    def __call__(self, x):
        ids = x[:, 0]
        out = [(ids > 2).float()]
        for o in self.offsets:
            same = torch.zeros_like(ids)
            src = tuple(slice(0, n - v) for n, v in zip(ids.shape[1:], o))
            dst = tuple(slice(v, n) for n, v in zip(ids.shape[1:], o))
            same[(slice(None), *src)] = (ids[(slice(None), *src)]
                                         == ids[(slice(None), *dst)]).float()
            out.append(same)
        return torch.stack(out, 1)


@pytest.mark.parametrize("ndim", [2, 3])
def test_tta_realigns_affinity_channels(ndim):
    """Averaging the flips of an exact affinity model gives its own affinities back: each
    flipped-back affinity channel is shifted by its offset before the mean. Without the
    realignment (no ``channel_offsets``) the long-range channels smear across boundaries."""
    offsets = ([(1, 0), (0, 1), (0, 3), (3, 0)] if ndim == 2
               else [(1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 0, 3), (3, 0, 0)])
    gen = torch.Generator().manual_seed(0)
    shape = (24, 28) if ndim == 2 else (12, 20, 18)
    ids = torch.randint(1, 5, tuple(max(1, s // 4) for s in shape), generator=gen).float()
    for a in range(ndim):  # blocks of 4 voxels: objects with boundaries inside windows
        ids = ids.repeat_interleave(4, dim=a)
    model = _SameObject(offsets)
    window = (16, 16) if ndim == 2 else (8, 12, 12)
    volume = ids[None] if ndim == 3 else ids[None, None]
    with torch.no_grad():
        plain = predict_volume(model, volume, window, len(offsets) + 1, overlap=0.25)
        tta = predict_volume(model, volume, window, len(offsets) + 1, overlap=0.25,
                             tta_flips=True)
        del model.channel_offsets
        naive = predict_volume(model, volume, window, len(offsets) + 1, overlap=0.25,
                               tta_flips=True)
    torch.testing.assert_close(tta, plain, atol=1e-5, rtol=1e-5)
    assert (naive - plain).abs().max() > 0.2
