"""Post-processing (torchtitan/postprocess/masks.py): small objects, holes, watershed instances, the
measurement of each step, its config options, validation's val_post scores and predict.py."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage as ndi
import zarr

from conftest import debug_run, launch, read_jsonl, script_module
from torchtitan.cellmap.classes import INSTANCE_CLASSES
from torchtitan.config.manager import ConfigManager
from torchtitan.errors import ConfigError
from torchtitan.scoring.metrics import label_instances
from torchtitan.postprocess.masks import (
    PostProcessing,
    PostProcessingError,
    clean_mask,
    fill_holes,
    min_object_voxels,
    postprocess,
    remove_small_objects,
    separate_instances,
    watershed_instances,
)

V8 = (8.0, 8.0, 8.0)


def ball(shape, centre, radius) -> np.ndarray:
    grid = np.indices(shape)
    return sum((g - c) ** 2 for g, c in zip(grid, centre)) <= radius**2


def two_touching_balls(r1=8, r2=8):
    """Two balls that touch (they share the voxel between them), and their instance ids."""
    shape = (2 * max(r1, r2) + 6, 2 * max(r1, r2) + 6, 2 * (r1 + r2) + 8)
    c = shape[0] // 2
    a = ball(shape, (c, c, 4 + r1), r1)
    b = ball(shape, (c, c, 4 + 2 * r1 + r2), r2) & ~a  # centres r1 + r2 apart
    return a | b, a.astype(np.int32) + 2 * b.astype(np.int32)


# ---------------------------------------------------------------------------------------------
# Instances
# ---------------------------------------------------------------------------------------------


def test_watershed_separates_touching_balls_that_components_merge():
    mask, truth = two_touching_balls()
    ids, n = watershed_instances(mask, V8)
    assert n == 2
    assert label_instances(mask)[1] == 1  # connected components: one object
    for k in (1, 2):  # each instance is one ball, up to the voxels of the contact
        inter = np.bincount(ids[truth == k], minlength=3)[1:]
        assert inter.max() >= 0.97 * np.count_nonzero(truth == k)
    assert separate_instances(mask, V8, PostProcessing(instances="watershed"))[1] == 2
    assert separate_instances(mask, V8, PostProcessing())[1] == 1


def test_watershed_splits_unequal_balls_at_their_neck():
    mask, truth = two_touching_balls(r1=10, r2=5)
    ids, n = watershed_instances(mask, V8)
    assert n == 2
    big = np.bincount(ids[truth == 1]).argmax()
    small = np.bincount(ids[truth == 2]).argmax()
    assert big != small
    # The big ball keeps its cap next to the small one (a split half-way between the
    # centres would give the small one about a fifth of it).
    assert np.count_nonzero(ids[truth == 1] == big) >= 0.97 * np.count_nonzero(truth == 1)
    assert np.count_nonzero(ids[truth == 2] == small) >= 0.9 * np.count_nonzero(truth == 2)
    # A part smaller than min_object_nm3 is never split off: it stays with the big ball.
    small_nm3 = np.count_nonzero(truth == 2) * 8.0**3
    assert watershed_instances(mask, V8, min_object_nm3=small_nm3 * 0.8)[1] == 2
    assert watershed_instances(mask, V8, min_object_nm3=small_nm3 * 2)[1] == 1
    pp = PostProcessing(min_object_nm3=small_nm3 * 2, instances="watershed")
    assert separate_instances(mask, V8, pp)[1] == 1


def test_watershed_keeps_objects_without_a_narrow_neck_whole():
    shape = (24, 24, 60)
    cylinder = ball(shape[:2], (12, 12), 6)[:, :, None] & (np.arange(60) > 5)[None, None, :]
    cylinder &= (np.arange(60) < 54)[None, None, :]
    overlapping = ball(shape, (12, 12, 20), 9) | ball(shape, (12, 12, 28), 9)  # wide waist
    cube = np.zeros(shape, bool)
    cube[4:20, 4:20, 10:40] = True
    for mask in (cylinder, overlapping, cube):
        assert watershed_instances(mask, V8)[1] == 1
    # The neck ratio decides: the waist of the overlapping balls is ~0.8 of their radius.
    assert watershed_instances(overlapping, V8, neck_ratio=1.0)[1] == 2


def test_watershed_is_deterministic_and_refines_components():
    rng = np.random.default_rng(0)
    mask = ndi.gaussian_filter(rng.random((48, 64, 64)), 2.5) > 0.52
    ids, n = watershed_instances(mask, (16.0, 8.0, 8.0))
    again, _ = watershed_instances(mask, (16.0, 8.0, 8.0))
    np.testing.assert_array_equal(ids, again)
    components, n_components = label_instances(mask)
    assert np.array_equal(ids > 0, mask) and n >= n_components
    # Every instance lies inside one connected component.
    pairs = np.unique(np.stack([ids[mask], components[mask]]), axis=1)
    assert len(np.unique(pairs[0])) == pairs.shape[1] == n


# ---------------------------------------------------------------------------------------------
# Small objects and holes
# ---------------------------------------------------------------------------------------------


def test_a_speck_is_removed_at_its_size_and_kept_below():
    mask = np.zeros((20, 20, 20), bool)
    mask[2, 2, 2:5] = True  # a 3-voxel speck: 3 * 512 nm^3
    mask[8:16, 8:16, 8:16] = True  # a big object
    speck = 3 * 8.0**3
    kept = remove_small_objects(mask, V8, speck)  # not smaller than the threshold
    np.testing.assert_array_equal(kept, mask)
    removed = remove_small_objects(mask, V8, speck + 1)
    assert not removed[2, 2].any() and removed[8:16, 8:16, 8:16].all()
    assert np.count_nonzero(removed) == 512
    # Corner-touching voxels are one object (full connectivity, as the metrics count).
    diagonal = np.zeros((5, 5, 5), bool)
    diagonal[1, 1, 1] = diagonal[2, 2, 2] = True
    assert remove_small_objects(diagonal, V8, 2 * 512).sum() == 2


def test_world_units_give_the_same_result_at_two_voxel_sizes():
    fine = np.zeros((32, 32, 32), bool)
    fine[4:8, 4:8, 4:8] = True  # 64 voxels of 4 nm: 4096 nm^3
    fine[16:28, 16:28, 16:28] = True
    coarse = fine[::2, ::2, ::2]  # the same objects at 8 nm: 8 voxels, 4096 nm^3
    anisotropic = fine[::4, ::2, ::2]  # at (16, 8, 8) nm: 4 voxels
    for threshold, objects in ((4000.0, 2), (4096.0, 2), (5000.0, 1)):
        for mask, voxel in ((fine, (4.0,) * 3), (coarse, V8), (anisotropic, (16.0, 8.0, 8.0))):
            out = remove_small_objects(mask, voxel, threshold)
            assert label_instances(out)[1] == objects, (threshold, voxel)
            assert out[mask.shape[0] // 2:].sum() == mask[mask.shape[0] // 2:].sum()  # big one
    assert min_object_voxels(4096.0, V8) == 8 and min_object_voxels(4096.0, (4.0,) * 3) == 64


def test_holes_are_filled_in_3d_and_per_plane():
    shell = ball((21, 21, 21), (10, 10, 10), 8) & ~ball((21, 21, 21), (10, 10, 10), 4)
    np.testing.assert_array_equal(fill_holes(shell, "volume"), ball((21, 21, 21), (10, 10, 10), 8))
    # A tube along z, open at both ends: no 3D cavity, but a hole in every plane, the first
    # and last planes included.
    disc = ball((21, 21), (10, 10), 8)
    ring = disc & ~ball((21, 21), (10, 10), 3)
    tube = np.repeat(ring[None], 6, axis=0)
    np.testing.assert_array_equal(fill_holes(tube, "volume"), tube)
    np.testing.assert_array_equal(fill_holes(tube, "planes"), np.repeat(disc[None], 6, axis=0))
    np.testing.assert_array_equal(fill_holes(tube, "none"), tube)
    # A hole with a channel to the side of the volume is no hole.
    open_ring = tube.copy()
    open_ring[:, 10, :10] = False
    np.testing.assert_array_equal(fill_holes(open_ring, "planes"), open_ring)


def test_clean_mask_applies_the_classes_steps_only():
    mask = np.zeros((4, 21, 21), bool)
    mask[:] = ball((21, 21), (10, 10), 8) & ~ball((21, 21), (10, 10), 3)
    mask[0, 0, 0] = True  # a speck
    pp = PostProcessing(min_object_nm3=10 * 512, fill_holes="planes", fill_holes_classes=("nuc",))
    nuc, er = clean_mask(mask, "nuc", V8, pp), clean_mask(mask, "er", V8, pp)
    assert not nuc[0, 0, 0] and not er[0, 0, 0]
    assert nuc[:, 10, 10].all() and not er[:, 10, 10].any()
    out = postprocess({"nuc": mask, "er": mask}, V8, pp)
    assert out["nuc"].dtype == np.int32 and out["nuc"].max() == 1  # ids: an instance class
    assert out["er"].dtype == bool


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def test_measure_compares_raw_with_each_step():
    """``bench/postprocess.py`` scores each post-processing step against the raw masks."""
    bench = script_module("bench/postprocess.py")
    steps, measure, combine_steps, format_table = (
        bench.steps, bench.measure, bench.combine_steps, bench.format_table)
    mask, truth = two_touching_balls()
    prob = np.where(mask, 0.9, 0.1).astype(np.float32)
    prob[1, 1, 1:3] = 0.8  # a false-positive speck
    pp = PostProcessing(min_object_nm3=10 * 512, instances="watershed")
    assert list(steps(pp)) == ["raw", "min_object", "watershed", "all"]
    scores = measure({"mito": prob}, {"mito": truth}, V8, pp)
    f1 = {step: s["classes"]["mito"]["f1"] for step, s in scores.items()}
    # raw: one merged object and a speck against two balls; watershed splits the balls; the
    # speck goes with min_object.
    assert f1["raw"] == pytest.approx(2 * 1 / (2 * 1 + 1 + 1))  # F1 = 2TP / (2TP + FP + FN)
    assert f1["min_object"] == pytest.approx(2 * 1 / (2 * 1 + 0 + 1))
    assert f1["watershed"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 0))
    assert f1["all"] == 1.0
    iou = {step: s["classes"]["mito"]["iou"] for step, s in scores.items()}
    assert iou["min_object"] > iou["raw"] and iou["watershed"] == iou["raw"]
    combined = combine_steps([scores, scores])
    assert combined["all"]["classes"]["mito"]["f1"] == 1.0
    table = format_table(combined, ["mito"])
    assert "| mito | watershed | 1.000 (+0.000) |" in table and "(+0.300)" in table


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, key", [
    ({"min_object_nm3": -1.0}, "inference.min_object_nm3"),
    ({"fill_holes": "2d"}, "inference.fill_holes"),
    ({"instances": "blobs"}, "inference.instances"),
    ({"watershed_neck_ratio": 0.0}, "inference.watershed_neck_ratio"),
])
def test_bad_settings_name_the_option(kwargs, key):
    with pytest.raises(PostProcessingError, match=key):
        PostProcessing(**kwargs)


@pytest.mark.parametrize("args, message", [
    (["--inference.fill_holes", "2d"], "'inference.fill_holes'.*'none', 'planes', 'volume'"),
    (["--inference.instances", "blobs"], "'inference.instances'.*'components', 'watershed'"),
    (["--inference.min_object_nm3", "-5"], "'inference.min_object_nm3'.*>= 0"),
    (["--inference.watershed_neck_ratio", "1.5"], "'inference.watershed_neck_ratio'.*\\(0, 1\\]"),
    (["--inference.fill_holes", "planes", "--inference.fill_holes_classes", "nuc,nucleus"],
     "fill_holes_classes.*'nucleus'.*data.classes"),
    (["--inference.fill_holes_classes", "nuc"], "fill_holes_classes.*no effect.*fill_holes"),
])
def test_config_rejects_bad_post_processing(args, message):
    with pytest.raises(ConfigError, match=message):
        ConfigManager().parse_args(["--job.config_file", "train_configs/debug_segmentation_2d.toml",
                                    *args])


def test_config_options_reach_the_settings():
    cfg = ConfigManager().parse_args([
        "--job.config_file", "train_configs/debug_segmentation_2d.toml",
        "--inference.min_object_nm3", "2e5", "--inference.fill_holes", "volume",
        "--inference.fill_holes_classes", "nuc,mito", "--inference.instances", "watershed",
        "--inference.watershed_neck_ratio", "0.6"])
    assert PostProcessing.from_config(cfg.inference) == PostProcessing(
        min_object_nm3=2e5, fill_holes="volume", fill_holes_classes=("nuc", "mito"),
        instances="watershed", watershed_neck_ratio=0.6)
    assert not PostProcessing.from_config(ConfigManager().parse_args([]).inference).enabled


# ---------------------------------------------------------------------------------------------
# End to end: validation during training, predict.py
# ---------------------------------------------------------------------------------------------

POST_ARGS = ["--inference.min_object_nm3", "3e5", "--inference.fill_holes", "planes",
             "--inference.instances", "watershed"]


@pytest.fixture(scope="module")
def trained_post(demo_data, tmp_path_factory):
    """A 2-step debug run validated with post-processing on."""
    dump = tmp_path_factory.mktemp("post") / "run"
    debug_run("train_segmentation.py", "train_configs/debug_segmentation_2d.toml", demo_data,
              dump, "--training.steps", "2", "--metrics.eval_freq", "2",
              "--data.val_crops", "crop1", *POST_ARGS)
    return dump


def test_validation_reports_raw_and_post_processed_scores(trained_post):
    (val,) = [r for r in read_jsonl(trained_post / "logs" / "metrics.jsonl") if "val/mean_iou" in r]
    raw = {k.removeprefix("val/") for k in val if k.startswith("val/")} - {"time_s", "skipped_crops"}
    post = {k.removeprefix("val_post/") for k in val if k.startswith("val_post/")}
    # hausdorff_nm/<class> (the mean distance of matched instances) exists only where some
    # instance matched: the noisy raw masks of a 2-step model may have too many objects to
    # be scored at all (the challenge's cut-off), the post-processed ones not.
    distances = {k for k in raw | post if k.startswith("hausdorff_nm/")}
    assert raw - distances == post - distances
    assert {"mean_iou", "iou/mito", "f1/mito"} <= post


def test_predict_writes_post_processed_masks_and_instances(trained_post, demo_data, tmp_path):
    """predict.py with the run's post-processing writes exactly the post-processed raw
    prediction: masks cleaned, instance classes split by the watershed."""
    common = ["--checkpoint", str(trained_post / "checkpoint"), "--data", str(demo_data),
              "--crops", "crop1", "--no-progress"]
    raw = tmp_path / "raw.zarr"
    r = launch("predict.py", [*common, "--probabilities", "--out", str(raw)], nproc=0)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = ConfigManager().parse_args(["--job.config_file", str(trained_post / "config.toml")])
    probs = {c: zarr.open_array(str(raw / "crop1" / c / "s0"), mode="r")[:] for c in cfg.data.classes}
    # A threshold at the median of mito's probabilities gives foreground to post-process.
    threshold = float(np.median(probs["mito"]))
    post = PostProcessing.from_config(cfg.inference)
    assert post.instances == "watershed" and post.min_object_nm3 == 3e5
    out = tmp_path / "post.zarr"
    r = launch("predict.py", [*common, "--threshold", f"{threshold!r}", "--instances",
                              "--out", str(out)], nproc=0)
    assert r.returncode == 0, r.stderr[-3000:]
    changed = 0
    for cls in cfg.data.classes:
        mask = probs[cls] > threshold
        written = zarr.open_array(str(out / "crop1" / cls / "s0"), mode="r")[:]
        cleaned = clean_mask(mask, cls, V8, post)
        changed += int(np.count_nonzero(cleaned != mask))
        if cls in INSTANCE_CLASSES:  # ids
            assert written.dtype == np.uint32
            np.testing.assert_array_equal(written, separate_instances(cleaned, V8, post)[0])
        else:
            assert written.dtype == np.uint8
            np.testing.assert_array_equal(written > 0, cleaned)
    assert changed > 0  # the post-processing had something to do
