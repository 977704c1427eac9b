"""The neuron segmentation metrics (VOI split / merge, adapted Rand error; CREMI's definitions):
equal to scikit-image's on the same arrays, known values by hand, pooling over crops, and
the wiring through validation's and the scoring command's scores for ``cell``.

scikit-image is the cross-check only (``torchtitan`` never imports it): with the truth set to
0 outside the validity mask, ``variation_of_information(truth, pred, ignore_labels=(0,))`` is
(split, merge) and ``adapted_rand_error(truth, pred, ignore_labels=(0,))[0]`` the error.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.ndimage as ndi
from skimage.metrics import adapted_rand_error as sk_arand
from skimage.metrics import variation_of_information as sk_voi

from torchtitan.cellmap.classes import INSTANCE_CLASSES, NEURON_CLASSES
from torchtitan.scoring.metrics import combine_scores, score_crop, validation_scores
from torchtitan.scoring.neuron_metrics import (
    adapted_rand_error,
    contingency_table,
    neuron_scores,
    pool_neuron_scores,
    rand_sums,
    voi_merge,
    voi_split,
)

VOXEL = (8.0, 8.0, 8.0)


def skimage_scores(truth, pred, valid=None) -> tuple[float, float, float]:
    """(split, merge, arand) by scikit-image, invalid voxels mapped to the ignored truth 0."""
    truth = np.asarray(truth) if valid is None else np.where(valid, truth, 0)
    split, merge = sk_voi(truth, np.asarray(pred), ignore_labels=(0,))
    return float(split), float(merge), float(sk_arand(truth, np.asarray(pred), ignore_labels=(0,))[0])


def ours(truth, pred, valid=None) -> tuple[float, float, float]:
    s = neuron_scores(truth, pred, valid)
    return s["voi_split"], s["voi_merge"], s["arand"]


def blocks(shape, size) -> np.ndarray:
    """Ids 1.. of a grid of boxes of ``size`` voxels per axis (touching, as cells do)."""
    index = np.indices(shape) // size
    cells = np.ceil(np.asarray(shape) / size).astype(int)
    return np.ravel_multi_index(tuple(index), tuple(cells)) + 1


# ---------------------------------------------------------------------------------------------
# Equal to scikit-image
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(40, 50), (12, 14, 16)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equal_to_scikit_image_on_random_ids(shape, seed):
    """Random ids, 0 among them in truth and prediction, a random validity mask."""
    rng = np.random.default_rng(seed)
    truth = rng.integers(0, 6, shape)
    pred = rng.integers(0, 9, shape)
    valid = rng.random(shape) > 0.2
    np.testing.assert_allclose(ours(truth, pred, valid), skimage_scores(truth, pred, valid), atol=1e-6)
    np.testing.assert_allclose(ours(truth, pred), skimage_scores(truth, pred), atol=1e-6)


@pytest.mark.parametrize("shape", [(64, 64), (16, 24, 24)])
def test_equal_to_scikit_image_on_structured_ids(shape):
    """Cells as touching boxes; predictions that merge pairs of them, split them, shift them
    and leave parts as background (predicted 0), with a background (truth 0) band and an
    unknown slab."""
    rng = np.random.default_rng(7)
    truth = blocks(shape, 8)
    truth[..., :5] = 0  # extracellular space: not scored
    valid = np.ones(shape, bool)
    valid[:3] = False  # unknown
    merged = (truth + 1) // 2
    split = truth * 2 + (np.indices(shape)[-1] % 8 >= 4)
    shifted = np.roll(truth, 3, axis=-2)
    holes = np.where(rng.random(shape) > 0.3, truth, 0)
    for pred in (truth, merged, split, shifted, holes, np.zeros(shape, int)):
        np.testing.assert_allclose(ours(truth, pred, valid), skimage_scores(truth, pred, valid), atol=1e-6)


def test_ids_are_only_names():
    """Large, negative or unsigned 64-bit ids (ranked, not indexed) and booleans give the
    numbers of the same partition in small ids."""
    rng = np.random.default_rng(3)
    truth = rng.integers(0, 5, (10, 12, 14))
    pred = rng.integers(0, 4, truth.shape)
    expected = ours(truth, pred)
    renamed = np.where(pred == 0, 0, pred.astype(np.uint64) * np.uint64(2**40) + np.uint64(3))
    assert ours(truth, renamed) == pytest.approx(expected, abs=1e-12)
    assert ours(truth, -pred) == pytest.approx(expected, abs=1e-12)
    assert ours(truth.astype(np.uint64) << np.uint64(50), pred) == pytest.approx(expected, abs=1e-12)
    mask = pred > 0
    assert ours(truth, mask) == pytest.approx(ours(truth, mask.astype(np.int32)), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# Known values
# ---------------------------------------------------------------------------------------------


def test_identical_segmentations_score_zero():
    truth = blocks((12, 12, 12), 4)
    truth[0] = 0
    assert ours(truth, truth) == (0.0, 0.0, 0.0)
    # What the prediction does where the truth is 0 or unknown does not count.
    pred = truth.copy()
    pred[0] = 99
    valid = np.ones(truth.shape, bool)
    valid[5] = False
    pred[5] = 7
    assert ours(truth, pred, valid) == (0.0, 0.0, 0.0)


def test_full_merge_and_full_split():
    k, m = 8, 64  # 8 true cells of 64 voxels
    truth = blocks((8, 8, 8), 4)  # ids 1..8, boxes of 4 x 4 x 4
    assert np.bincount(truth.ravel())[1:].tolist() == [m] * k
    n = k * m
    # Everything one predicted segment (predicted 0 is a segment too): merge = log2 k bits.
    for pred in (np.ones_like(truth), np.zeros_like(truth)):
        split, merge, arand = ours(truth, pred)
        assert split == 0.0 and merge == pytest.approx(math.log2(k), abs=1e-12)
        joint, both = k * m * m - n, (k * m * m - n + n * n - n) / 2
        assert arand == pytest.approx(1 - joint / both, abs=1e-12)
    # Every voxel its own segment: split = log2 m bits; no pair of voxels shares a predicted id.
    split, merge, arand = ours(truth, np.arange(truth.size).reshape(truth.shape) + 1)
    assert split == pytest.approx(math.log2(m), abs=1e-12) and merge == 0.0 and arand == 1.0
    # One cell, half of it left as predicted background: one bit of split, nothing merged.
    one = np.ones((4, 4), int)
    half = np.concatenate([np.zeros((2, 4), int), np.ones((2, 4), int)])
    assert ours(one, half)[:2] == pytest.approx((1.0, 0.0), abs=1e-12)


def test_contingency_table_and_sums():
    truth = np.array([[1, 1, 2], [2, 0, 5]])
    pred = np.array([[3, 0, 3], [3, 4, 0]])
    table = contingency_table(truth, pred)
    assert table.truth.tolist() == [1, 1, 2, 5] and table.pred.tolist() == [0, 3, 3, 0]
    assert table.count.tolist() == [1, 1, 2, 1]
    assert rand_sums(table) == {"pair_sq_sum": 7, "truth_sq_sum": 2 * 2 + 2 * 2 + 1,
                                "pred_sq_sum": 2 * 2 + 3 * 3, "neuron_voxels": 5}
    assert voi_split(table) == pytest.approx(2 / 5)  # truth 1 split in two halves: 1 bit, weight 2/5
    assert voi_merge(table) == pytest.approx(skimage_scores(truth, pred)[1], abs=1e-12)
    empty = contingency_table(np.zeros((3, 3), int), np.ones((3, 3), int))
    assert empty.count.size == 0 and voi_split(empty) == voi_merge(empty) == 0.0
    assert adapted_rand_error(rand_sums(empty)) == 0.0


# ---------------------------------------------------------------------------------------------
# Pooling over crops
# ---------------------------------------------------------------------------------------------


def test_pooling_equals_the_crops_side_by_side():
    rng = np.random.default_rng(11)
    crops = []
    for shape in ((10, 12, 12), (10, 12, 7)):
        truth = rng.integers(0, 5, shape)
        pred = rng.integers(0, 6, shape)
        valid = rng.random(shape) > 0.1
        crops.append((truth, pred, valid))
    pooled = pool_neuron_scores([neuron_scores(t, p, v) for t, p, v in crops])
    # Side by side in one array, the second crop's ids (predicted 0 included) apart.
    (t1, p1, v1), (t2, p2, v2) = crops
    offset = 100
    truth = np.concatenate([t1, np.where(t2 > 0, t2 + offset, 0)], axis=-1)
    pred = np.concatenate([p1, p2 + offset], axis=-1)
    valid = np.concatenate([v1, v2], axis=-1)
    whole = neuron_scores(truth, pred, valid)
    for key in ("voi_split", "voi_merge", "arand"):
        assert pooled[key] == pytest.approx(whole[key], abs=1e-9), key
    for key in ("pair_sq_sum", "truth_sq_sum", "pred_sq_sum", "neuron_voxels"):
        assert pooled[key] == whole[key], key
    assert pooled["voi"] == pytest.approx(whole["voi_split"] + whole["voi_merge"], abs=1e-9)
    np.testing.assert_allclose([whole[k] for k in ("voi_split", "voi_merge", "arand")],
                               skimage_scores(truth, pred, valid), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Validation's and the scoring command's scores
# ---------------------------------------------------------------------------------------------


def cell_crop(seed: int):
    """Truth: touching cells (ids) beside background; prediction: a boolean mask, one
    component that merges them all, with a corner missed (predicted background)."""
    rng = np.random.default_rng(seed)
    truth = blocks((12, 16, 16), 6)
    truth[:, :, 12:] = 0
    pred = truth > 0
    pred[:3, :3, :3] = False
    valid = rng.random(truth.shape) > 0.05
    return pred, truth, valid


def test_score_crop_combine_scores_validation_scores_for_cell():
    assert NEURON_CLASSES == ("cell",) and set(NEURON_CLASSES) <= set(INSTANCE_CLASSES)
    crops, expected = [], []
    for seed in (0, 1):
        pred, truth, valid = cell_crop(seed)
        crop = score_crop({"cell": pred, "mito": pred}, {"cell": truth, "mito": truth},
                          {"cell": valid, "mito": valid}, VOXEL)
        cell = crop["classes"]["cell"]
        # The instances the instance metric scores: the mask's components (full connectivity).
        components, _ = ndi.label(pred & valid, structure=np.ones((3, 3, 3)))
        reference = skimage_scores(truth, components, valid)
        assert (cell["voi_split"], cell["voi_merge"], cell["arand"]) == pytest.approx(reference, abs=1e-6)
        assert cell["voi_merge"] > 0 and cell["voi_split"] > 0  # a merge and a missed corner
        assert "voi_split" not in crop["classes"]["mito"]
        # Every other number as without the neuron metrics.
        plain = score_crop({"cell": pred}, {"cell": truth}, {"cell": valid}, VOXEL, neuron_classes=())
        assert {k: v for k, v in cell.items() if k in plain["classes"]["cell"]} == plain["classes"]["cell"]
        crops.append(crop)
        expected.append((truth, components, valid))

    combined = combine_scores(crops)
    pooled = pool_neuron_scores([c["classes"]["cell"] for c in crops])
    cell = combined["classes"]["cell"]
    assert {k: cell[k] for k in pooled} == pooled
    assert "voi" not in combined["classes"]["mito"]
    scores = validation_scores(combined, ["cell", "mito"])
    assert scores["val/voi_split/cell"] == cell["voi_split"]
    assert scores["val/voi_merge/cell"] == cell["voi_merge"]
    assert scores["val/voi/cell"] == pytest.approx(cell["voi_split"] + cell["voi_merge"])
    assert scores["val/arand/cell"] == cell["arand"]
    assert not any(k.endswith("/mito") and k.split("/")[1] in ("voi", "voi_split", "voi_merge", "arand")
                   for k in scores)
    # The pool is the two crops side by side, ids apart.
    (t1, c1, v1), (t2, c2, v2) = expected
    truth = np.concatenate([t1, np.where(t2 > 0, t2 + 1000, 0)], axis=-1)
    comps = np.concatenate([c1, c2 + 1000], axis=-1)
    np.testing.assert_allclose([cell["voi_split"], cell["voi_merge"], cell["arand"]],
                               skimage_scores(truth, comps, np.concatenate([v1, v2], axis=-1)), atol=1e-6)


@pytest.mark.parametrize("version", ["2025", "2024"])
def test_scoring_command_reports_them(version):
    from torchtitan.scoring.stores import combine_challenge_scores, format_table, score_label

    pred, truth, valid = cell_crop(2)
    entry = score_label(pred, truth, valid, VOXEL, "cell", version)
    components, _ = ndi.label(pred & valid, structure=np.ones((3, 3, 3)))
    assert (entry["voi_split"], entry["voi_merge"], entry["arand"]) == pytest.approx(
        skimage_scores(truth, components, valid), abs=1e-6)
    # Left out of the submission: all predicted background, every true cell merged into it.
    missing = score_label(None, truth, valid, VOXEL, "cell", version)
    assert (missing["voi_split"], missing["voi_merge"], missing["arand"]) == pytest.approx(
        skimage_scores(truth, np.zeros_like(truth), valid), abs=1e-6)
    assert "voi_split" not in score_label(pred, truth, valid, VOXEL, "mito", version)

    crops = [{"classes": {"cell": entry}}, {"classes": {"cell": missing}}]
    combined = combine_challenge_scores(crops, version)
    assert combined["classes"]["cell"]["arand"] == pytest.approx(
        pool_neuron_scores([entry, missing])["arand"], abs=1e-12)
    result = {"metric_description": version, "metric": version, "crops": {"crop1": crops[0]},
              **combined}
    table = format_table(result)
    assert "VOIspl" in table and f"{entry['voi_merge']:.3f}" in table
