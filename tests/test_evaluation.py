"""Semantic and instance metrics (CellMap definitions) and the scoring command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.ndimage as ndi
import zarr
from scipy.optimize import linear_sum_assignment
from scipy.spatial.distance import directed_hausdorff

from torchtitan.scoring.metrics import (
    combine_scores,
    instance_scores,
    label_instances,
    score_crop,
    semantic_crop_scores,
)
from torchtitan.scoring.hausdorff import hausdorff_distance, normalize_distance

REPO = Path(__file__).resolve().parents[1]
VOXEL = (40.0, 4.0, 4.0)  # strongly anisotropic (z coarser), nm


def box(shape, *slices) -> np.ndarray:
    """A boolean volume with the box ``slices`` set."""
    out = np.zeros(shape, bool)
    out[tuple(slices)] = True
    return out


def cap_score(voxel_size, shape) -> float:
    """Normalised Hausdorff distance of an unmatched instance."""
    cap = min(np.asarray(voxel_size) * np.asarray(shape)) / 2
    return float(normalize_distance(cap, voxel_size))


# ---------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------


def test_perfect_prediction():
    truth = box((10, 20, 20), slice(2, 5), slice(2, 8), slice(2, 8)) | box((10, 20, 20), slice(6, 9), 12, slice(3, 15))
    sem = semantic_crop_scores(truth, truth, None)
    assert sem["iou"] == 1 and sem["dice"] == 1 and sem["fp"] == sem["fn"] == 0
    inst = instance_scores(truth, truth, VOXEL)
    assert (inst["n_true"], inst["tp"], inst["fp"], inst["fn"]) == (2, 2, 0, 0)
    assert inst["f1"] == 1 and inst["hausdorff_nm"] == [0.0, 0.0]
    assert inst["normalized_hausdorff"] == 1 and inst["score"] == 1


def test_empty_prediction_of_a_nonempty_class():
    truth = box((8, 16, 16), slice(1, 4), slice(2, 6), slice(2, 6)) | box((8, 16, 16), 6, 10, slice(0, 16))
    empty = np.zeros_like(truth)
    sem = semantic_crop_scores(empty, truth, None)
    assert sem["iou"] == 0 and sem["dice"] == 0 and sem["fn"] == truth.sum()
    inst = instance_scores(empty, truth, VOXEL)
    assert (inst["tp"], inst["fp"], inst["fn"]) == (0, 0, 2)
    assert inst["f1"] == 0 and inst["score"] == 0 and inst["mean_hausdorff_nm"] is None
    assert inst["normalized_hausdorff"] == pytest.approx(cap_score(VOXEL, truth.shape))


def test_empty_class_predicted_empty_is_perfect():
    empty = np.zeros((4, 8, 8), bool)
    sem = semantic_crop_scores(empty, empty, np.ones_like(empty))
    assert sem["iou"] == 1 and sem["dice"] == 1
    inst = instance_scores(empty, empty, VOXEL)
    assert inst["f1"] == 1 and inst["normalized_hausdorff"] == 1 and inst["score"] == 1


def test_shifted_object_hausdorff_with_anisotropic_voxels():
    shape = (12, 24, 24)
    truth = box(shape, slice(2, 6), slice(4, 10), slice(4, 10))
    pred = box(shape, slice(3, 7), slice(4, 10), slice(6, 12))  # +1 voxel in z, +2 in x
    hd = math.hypot(1 * 40.0, 2 * 4.0)  # the far corners: 40 nm in z and 8 nm in x
    inst = instance_scores(pred, truth, VOXEL)
    assert inst["tp"] == 1 and inst["f1"] == 1
    assert inst["hausdorff_nm"][0] == pytest.approx(hd)
    expected = 1.01 ** (-hd / np.linalg.norm(VOXEL))
    assert inst["normalized_hausdorff"] == pytest.approx(expected)
    assert inst["score"] == pytest.approx(math.sqrt(expected))
    # Semantic IoU of the overlap: 3 of 4 z slices x 4 of 6 x columns.
    overlap, size = 3 * 6 * 4, 4 * 6 * 6
    assert semantic_crop_scores(pred, truth)["iou"] == pytest.approx(overlap / (2 * size - overlap))


def test_split_instance():
    shape = (4, 40, 40)  # cap: min(160, 160, 160) nm / 2 = 80 nm
    truth = box(shape, slice(1, 3), slice(4, 8), slice(2, 30))  # one bar
    pred = truth.copy()
    pred[:, :, 12:14] = False  # cut in two: the larger part (x 14..30) matches
    inst = instance_scores(pred, truth, VOXEL)
    assert (inst["n_true"], inst["n_pred"], inst["tp"], inst["fp"], inst["fn"]) == (1, 2, 1, 1, 0)
    assert inst["f1"] == pytest.approx(2 / 3)
    # The challenge's quirk: the unmatched part (x 2..12, the first component in raster order)
    # keeps its number 1, the bar's id, so it counts with the match: the bar is 1 voxel
    # (x 12 or 13, 4 nm) from that union. The matched part alone would be 12 voxels (48 nm) off.
    assert inst["hausdorff_nm"] == [pytest.approx(4.0)]
    nhd = (float(normalize_distance(4.0, VOXEL)) + cap_score(VOXEL, shape)) / 2
    assert inst["normalized_hausdorff"] == pytest.approx(nhd)
    assert inst["score"] == pytest.approx(math.sqrt(2 / 3 * nhd))


def test_merged_instances():
    shape = (4, 40, 40)  # cap: min(160, 160, 160) nm / 2 = 80 nm
    truth = np.zeros(shape, np.uint16)  # two touching objects given as instance ids
    truth[1:3, 4:8, 2:14] = 7
    truth[1:3, 4:8, 14:30] = 9
    pred = truth > 0  # one connected blob
    inst = instance_scores(pred, truth, VOXEL)
    assert (inst["n_true"], inst["n_pred"], inst["tp"], inst["fp"], inst["fn"]) == (2, 1, 1, 0, 1)
    assert inst["f1"] == pytest.approx(2 / 3)
    # The larger true object (id 9, x 14..30) is matched; the blob reaches 12 voxels beyond it.
    # One distance per true instance, in id order: id 7 is missed (the cap, 80 nm).
    assert inst["hausdorff_nm"] == [80.0, pytest.approx(48.0)]
    # Instance ids are used as they are: the prediction given as ids of the two objects is perfect.
    assert instance_scores(truth.astype(np.int32) * 3, truth, VOXEL)["score"] == 1


def test_instance_ids_are_renumbered_consecutively():
    ids = np.zeros((2, 4, 4), np.uint64)
    ids[0, 0, 0], ids[0, 3, 3], ids[1, 1, 1:3] = 2**40, 7, 2**63  # huge, sparse ids
    labels, n = label_instances(ids)
    assert n == 3 and labels.dtype == np.int32
    assert sorted(np.unique(labels)) == [0, 1, 2, 3] and labels[1, 1, 1] == labels[1, 1, 2]
    small = np.array([[[0, 5, 5, 9]]], np.int16)
    assert label_instances(small)[0].tolist() == [[[0, 1, 1, 2]]]
    assert label_instances(-small)[1] == 0  # negative values are background


def test_full_connectivity_joins_corner_neighbours():
    x = np.zeros((3, 3, 3), bool)
    x[0, 0, 0] = x[1, 1, 1] = x[2, 2, 2] = True
    assert label_instances(x)[1] == 1  # 26-connected: one object
    assert label_instances(x[0:2, 0:2, 0:2].any(0))[1] == 1  # 8-connected in 2D


def test_unannotated_class_is_not_scored():
    truth = box((4, 8, 8), slice(1, 3), slice(1, 3), slice(1, 3))
    crop = score_crop(
        {"mito": truth, "er": truth, "ecs": np.ones_like(truth)},
        {"mito": truth, "er": truth},  # ecs not annotated in this crop
        {"er": np.zeros_like(truth)},  # er: every voxel unknown
        VOXEL,
    )
    assert set(crop["classes"]) == {"mito"}
    assert crop["classes"]["mito"]["type"] == "instance" and crop["classes"]["mito"]["score"] == 1


def test_unknown_voxels_are_ignored():
    shape = (6, 16, 16)
    truth = box(shape, slice(1, 4), slice(2, 6), slice(2, 6))
    valid = np.ones(shape, bool)
    valid[:, :, 10:] = False  # unknown slab
    pred = truth | box(shape, slice(0, 6), slice(8, 12), slice(11, 15))  # extra object, all unknown
    pred[1:4, 2:6, 11] = True  # and a stray plane there
    sem = semantic_crop_scores(pred, truth, valid)
    assert sem["iou"] == 1 and sem["valid_voxels"] == valid.sum()
    inst = instance_scores(pred, truth, VOXEL, valid)
    assert (inst["tp"], inst["fp"], inst["fn"]) == (1, 0, 0) and inst["score"] == 1
    # Without the mask the extra object and the stray plane are false positives.
    assert instance_scores(pred, truth, VOXEL)["fp"] == 2


def test_missing_prediction_counts_as_empty():
    truth = box((4, 8, 8), slice(1, 3), slice(1, 3), slice(1, 3))
    crop = score_crop({}, {"er": truth, "ld": truth}, {}, VOXEL)
    assert crop["classes"]["er"]["iou"] == 0
    assert crop["classes"]["ld"]["score"] == 0 and crop["classes"]["ld"]["instance_fn"] == 1


def test_combine_pools_semantic_counts_and_instance_counts_and_distances():
    t = np.zeros((1, 1, 4), bool)
    t[..., :2] = True
    p1 = np.array([[[1, 0, 0, 0]]], bool)  # er: tp 1, fn 1; mito: the object found exactly
    p2 = np.zeros_like(t)  # er: fn 2; mito: missed
    crops = [score_crop({"er": p1, "mito": t}, {"er": t, "mito": t}, {}, (8, 8, 8)),
             score_crop({"er": p2, "mito": p2}, {"er": t, "mito": t}, {}, (8, 8, 8))]
    out = combine_scores(crops)
    assert out["classes"]["er"]["iou"] == pytest.approx(1 / 4)  # pooled: tp 1 / (1 + 3)
    assert out["classes"]["er"]["crops"] == 2
    # mito pooled over both crops: TP 1, FN 1 (F1 2/3); distances 0 and the cap of the second
    # crop, half its shortest side: 8 nm / 2 = 4 nm, normalised by the voxel diagonal 8 sqrt 3.
    mean = (1 + 1.01 ** (-4 / (8 * math.sqrt(3)))) / 2
    mito = math.sqrt(2 / 3 * mean)
    assert out["classes"]["mito"]["score"] == pytest.approx(mito, abs=1e-12)
    assert out["classes"]["mito"]["f1"] == pytest.approx(2 / 3)
    assert out["overall"]["mean_semantic_iou"] == pytest.approx(1 / 4)
    assert out["overall"]["mean_instance_score"] == pytest.approx(mito, abs=1e-12)
    assert out["overall"]["score"] == pytest.approx(math.sqrt(1 / 4 * mito), abs=1e-12)


# ---------------------------------------------------------------------------------------------
# Cross-checks against direct formulations on random data
# ---------------------------------------------------------------------------------------------


def test_iou_and_dice_match_numpy_and_pooled_counts():
    rng = np.random.default_rng(0)
    pred, truth, valid = (rng.random((3, 9, 11, 13)) < q for q in (0.4, 0.3, 0.8))
    for k in range(3):
        s = semantic_crop_scores(pred[k], truth[k], valid[k])
        p, t = pred[k][valid[k]], truth[k][valid[k]]
        assert s["iou"] == pytest.approx((p & t).sum() / (p | t).sum())
        assert s["dice"] == pytest.approx(2 * (p & t).sum() / (p.sum() + t.sum()))
    # Pooled over the three volumes as crops of one class: IoU and Dice of the summed counts.
    pooled = combine_scores([score_crop({"x": pred[k]}, {"x": truth[k]}, {"x": valid[k]}, VOXEL)
                             for k in range(3)])["classes"]["x"]
    p, t = pred[valid], truth[valid]
    assert pooled["iou"] == pytest.approx((p & t).sum() / (p | t).sum())
    assert pooled["dice"] == pytest.approx(2 * (p & t).sum() / (p.sum() + t.sum()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hausdorff_matches_scipy_directed_hausdorff(seed):
    rng = np.random.default_rng(seed)
    voxel = (rng.uniform(1, 30), rng.uniform(1, 10), rng.uniform(1, 10))
    a, b = rng.random((2, 7, 9, 8)) < [[[[0.05]]], [[[0.1]]]]
    pa, pb = np.argwhere(a) * voxel, np.argwhere(b) * voxel
    expected = max(directed_hausdorff(pa, pb)[0], directed_hausdorff(pb, pa)[0])
    assert hausdorff_distance(a, b, voxel) == pytest.approx(expected)


def test_instance_matching_maximises_total_iou():
    """Against a dense IoU matrix built instance by instance and one global assignment."""
    rng = np.random.default_rng(3)
    shape = (16, 32, 32)
    truth = np.zeros(shape, np.int32)
    pred = np.zeros(shape, np.int32)
    for ids, n in ((truth, 25), (pred, 30)):
        for i in range(1, n + 1):  # overlapping random boxes, later ones paint over earlier
            lo = rng.integers(0, np.array(shape) - 3)
            hi = lo + rng.integers(2, 7, size=3)
            ids[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] = i
    inst = instance_scores(pred, truth, (8, 8, 8))

    t_ids, p_ids = np.unique(truth[truth > 0]), np.unique(pred[pred > 0])
    iou = np.array([[np.sum((truth == i) & (pred == j)) / np.sum((truth == i) | (pred == j)) for j in p_ids]
                    for i in t_ids])
    r, c = linear_sum_assignment(iou, maximize=True)
    tp = int(np.sum(iou[r, c] > 0))
    assert (inst["n_true"], inst["n_pred"]) == (len(t_ids), len(p_ids))
    assert inst["tp"] == tp and 0 < tp < len(t_ids)
    assert inst["f1"] == pytest.approx(2 * tp / (len(t_ids) + len(p_ids)))


# ---------------------------------------------------------------------------------------------
# The scoring command, end to end
# ---------------------------------------------------------------------------------------------


def _run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchtitan.scoring", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def _truth_crops(root: Path):
    """(crop name, class name, s0 array, voxel size, voxel-0 centre) of every demo label."""
    for store in sorted(root.glob("*/*.zarr")):
        gt = zarr.open_group(str(store / "recon-1/labels/groundtruth"), mode="r")
        for crop_name, crop in gt.groups():
            for cls, group in crop.groups():
                transforms = group.attrs["multiscales"][0]["datasets"][0]["coordinateTransformations"]
                by_type = {t["type"]: t for t in transforms}
                yield (crop_name, cls, np.asarray(group["s0"][...]), by_type["scale"]["scale"],
                       by_type["translation"]["translation"])


@pytest.fixture(scope="module")
def gt_root(tmp_path_factory) -> Path:
    from torchtitan.demo.data import generate_demo_data

    root = tmp_path_factory.mktemp("eval") / "data"
    generate_demo_data(root, scale=0.25)
    return root


def test_cli_scores_the_ground_truth_itself_near_one(gt_root, tmp_path):
    """Predictions = ground truth written at half the voxel size (the submission layout):
    semantic classes as float probabilities, instance classes as uint16 ids; one class as an
    OME-NGFF group; pm and ecs instead at the crop's voxel size on a grid that starts three
    voxels earlier (a half-voxel slip in the translation convention would break these).
    Resampled back to each crop's grid they must agree with the truth."""
    from torchtitan.cellmap.ome_ngff import multiscales_attrs

    from torchtitan.scoring.metrics import INSTANCE_CLASSES

    pred_path = tmp_path / "pred.zarr"
    store = zarr.open_group(str(pred_path), mode="w", zarr_format=2)
    for crop_name, cls, labels, scale, translation in _truth_crops(gt_root):
        fine = [s / 2 for s in scale]
        fine_translation = [t - s / 4 for t, s in zip(translation, scale)]  # centre of the first half voxel
        present = labels == 1
        if cls in INSTANCE_CLASSES:
            data = ndi.label(present, structure=np.ones((3, 3, 3)))[0].astype(np.uint16)
        else:
            data = present.astype(np.float32)
        if cls in ("pm", "ecs"):
            data = np.pad(data, [(3, 0)] * 3)
            fine, fine_translation = scale, [t - 3 * s for t, s in zip(translation, scale)]
        else:
            for ax in range(3):
                data = np.repeat(data, 2, axis=ax)
        group = store.require_group(crop_name)
        if (crop_name, cls) == ("crop1", "er"):
            g = group.create_group(cls, attributes={"multiscales": multiscales_attrs(cls, fine, fine_translation, 1)})
            g.create_array("s0", data=data)
        else:
            arr = group.create_array(cls, data=data)
            arr.attrs.update(voxel_size=fine, translation=fine_translation)
    out = tmp_path / "scores.json"
    proc = _run_cli("--predictions", pred_path, "--groundtruth", gt_root, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert "overall score" in proc.stdout
    scores = json.loads(out.read_text())
    assert len(scores["crops"]) == 8
    assert scores["crops"]["crop3"]["classes"].keys() == {"nuc", "cell"}  # only what crop3 annotates
    for crop in scores["crops"].values():
        for cls, s in crop["classes"].items():
            assert s["predicted"] and s["iou"] > 0.999, (cls, s)
            if s["type"] == "instance":
                assert s["score"] > 0.999 and s["instance_fp"] == s["instance_fn"] == 0, (cls, s)
    assert scores["overall"]["score"] > 0.999


def test_cli_zero_predictions_and_selection(gt_root, tmp_path):
    pred_path = tmp_path / "zeros.zarr"
    store = zarr.open_group(str(pred_path), mode="w", zarr_format=2)
    truth = {}
    for crop_name, cls, labels, scale, translation in _truth_crops(gt_root):
        truth[crop_name, cls] = labels
        if cls != "nuc":  # nuc left out: counts as an empty prediction
            arr = store.require_group(crop_name).create_array(cls, data=np.zeros(labels.shape, np.uint8))
            arr.attrs.update(voxel_size=scale, translation=translation)
    out = tmp_path / "zeros.json"
    proc = _run_cli("--predictions", pred_path, "--groundtruth", gt_root, "--crops", "1,5",
                    "--classes", "mito,nuc,ecs", "--out", out)
    assert proc.returncode == 0, proc.stderr
    scores = json.loads(out.read_text())
    assert list(scores["crops"]) == ["crop1", "crop5"]
    for crop_name, crop in scores["crops"].items():
        assert set(crop["classes"]) == {"mito", "nuc", "ecs"}
        for cls, s in crop["classes"].items():
            assert s["predicted"] == (cls != "nuc")
            nonempty = np.any(truth[crop_name, cls] == 1)
            assert s["iou"] == (0.0 if nonempty else 1.0), (crop_name, cls)
    assert scores["classes"]["mito"]["crops"] == 2


def test_cli_reports_a_missing_or_invalid_store(gt_root, tmp_path, capsys):
    """Clear errors naming the path (in process: the subprocess runs above cover the entry)."""
    from torchtitan.scoring.stores import main

    missing = tmp_path / "nowhere.zarr"
    assert main(["--predictions", str(missing), "--groundtruth", str(gt_root)]) != 0
    assert str(missing) in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    assert main(["--predictions", str(tmp_path / "plain"), "--groundtruth", str(gt_root)]) != 0
    assert "not a zarr group" in capsys.readouterr().err
    bad = tmp_path / "bad.zarr"
    zarr.open_group(str(bad), mode="w", zarr_format=2).require_group("crop1").create_array(
        "mito", data=np.zeros((2, 2, 2), np.uint8))  # no voxel_size / translation
    assert main(["--predictions", str(bad), "--groundtruth", str(gt_root)]) != 0
    err = capsys.readouterr().err
    assert "voxel_size" in err and str(bad / "crop1" / "mito") in err
    assert main(["--predictions", str(bad), "--groundtruth", str(gt_root), "--crops", "99"]) != 0
    assert "crop99" in capsys.readouterr().err
