"""The CellMap challenge's layouts in and out, with real stores and real runs.

* A folder shaped as ``csc fetch-data`` writes it trains as it is; ``predict.py
  --submission`` on it writes the challenge's submission layout, which the linter passes and
  ``python -m torchtitan.scoring`` scores (named metric version, the previous one by flag).
* Predictions are OME-NGFF pyramids (>= 3 levels) that ``ome-zarr`` and ``ome-zarr-models``
  read back with their metadata.
* The linter's rejections, one by one.
* The challenge's metric versions on hand-made crops whose scores are worked out by hand.
* ``helpers/view_crop.py``: the neuroglancer state in its link, the napari command.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest
import zarr

from conftest import REPO, debug_run, launch
from torchtitan.cellmap.classes import CLASS_IDS, INSTANCE_CLASSES
from torchtitan.cellmap.ome_ngff import multiscales_attrs, read_attrs, read_multiscales
from torchtitan.data.io.stores import StoreContext

GT = "recon-1/labels/groundtruth"
EM = "recon-1/em/fibsem-uint8"


# ---------------------------------------------------------------------------------------------
# A csc fetch-data shaped folder
# ---------------------------------------------------------------------------------------------


def make_fetched_layout(demo: Path, out: Path) -> Path:
    """The demo data reshaped as ``csc fetch-data`` leaves the public data on disk:

    * the ``cellmap`` annotation attributes on every level *array* of a class group (the
      class group itself carries only ``multiscales``), as in the published crops;
    * an ``all`` group per crop (multiscale, the crop's label ids), which is not a class;
    * the EM holding only the chunks that overlap a label crop (fetch-data copies those and
      the arrays' metadata), so the rest of the volume reads as the fill value.
    """
    shutil.copytree(demo, out)
    for store in sorted(out.glob("*/*.zarr")):
        crop_boxes = []
        for crop in sorted(p for p in (store / GT).iterdir() if p.is_dir()):
            ids = None
            for cls_dir in sorted(p for p in crop.iterdir() if p.is_dir()):
                attrs = json.loads((cls_dir / ".zattrs").read_text())
                annotation = attrs.pop("cellmap")
                (cls_dir / ".zattrs").write_text(json.dumps(attrs))
                for level in sorted(p for p in cls_dir.iterdir() if p.is_dir()):
                    (level / ".zattrs").write_text(json.dumps({"cellmap": annotation}))
                s0 = zarr.open_array(str(cls_dir / "s0"), mode="r")[:]
                ids = np.zeros(s0.shape, np.uint8) if ids is None else ids
                ids[(s0 == 1) & (ids == 0)] = CLASS_IDS[cls_dir.name]
                levels = read_multiscales(cls_dir)
                crop_boxes.append((levels[0].box_min, levels[0].box_max))
            ms = json.loads((crop / next(p.name for p in crop.iterdir() if p.is_dir()) / ".zattrs").read_text())
            group = zarr.open_group(str(crop), mode="r+", zarr_format=2).require_group("all")
            group.attrs.update(ms)
            group.attrs["multiscales"] = [dict(ms["multiscales"][0], name="all", datasets=ms["multiscales"][0]["datasets"][:1])]
            group.create_array("s0", data=ids, chunks=(64, 64, 64))
        em_levels = read_multiscales(store / EM)
        for level in em_levels:  # keep only the chunks that overlap a crop
            meta = json.loads((Path(level.path) / ".zarray").read_text())
            chunk_nm = np.asarray(meta["chunks"]) * np.asarray(level.scale)
            for chunk in Path(level.path).iterdir():
                if chunk.name.startswith("."):
                    continue
                index = np.array([int(i) for i in chunk.name.split(".")])
                lo = level.box_min + index * chunk_nm
                hi = lo + chunk_nm
                if not any(np.all(lo < b_hi) and np.all(hi > b_lo) for b_lo, b_hi in crop_boxes):
                    chunk.unlink()
    return out


@pytest.fixture(scope="module")
def fetched(demo_data, tmp_path_factory) -> Path:
    return make_fetched_layout(demo_data, tmp_path_factory.mktemp("fetched") / "data")


def test_fetched_layout_fixture_has_the_public_shape(fetched):
    store = next(fetched.glob("*/*.zarr"))
    crop = store / GT / "crop1"
    assert (crop / "all" / "s0" / ".zarray").is_file()
    mito = crop / "mito"
    assert "cellmap" not in read_attrs(mito) and "multiscales" in read_attrs(mito)
    assert read_attrs(mito / "s0")["cellmap"]["annotation"]["annotation_type"]["encoding"] == \
        {"absent": 0, "present": 1, "unknown": 255}
    s0 = store / EM / "s0"
    kept = [p for p in s0.iterdir() if not p.name.startswith(".")]
    total = math.prod(-(-s // c) for s, c in zip(json.loads((s0 / ".zarray").read_text())["shape"],
                                                 json.loads((s0 / ".zarray").read_text())["chunks"]))
    assert 0 < len(kept) < total  # sparse, as fetched


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_fetched_layout_trains_predicts_a_submission_that_passes_and_is_scored(fetched, tmp_path):
    """The one end-to-end run of the challenge path: train on the fetched folder as it is,
    predict two crops with --submission, check and score the submission."""
    dump = tmp_path / "run"
    debug_run("train_segmentation.py", "train_configs/debug_segmentation_2d.toml", fetched, dump,
              "--training.steps", "2", "--metrics.eval_freq", "2")
    pred, sub = tmp_path / "pred.zarr", tmp_path / "submission.zarr"
    r = launch("predict.py", ["--checkpoint", str(dump / "checkpoint"), "--crops", "crop1,crop2",
                              "--out", str(pred), "--instances", "--submission", str(sub),
                              "--no-progress"], nproc=0, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "OK: 2 crop(s)" in r.stdout + r.stderr
    assert sub.with_suffix(".zip").is_file()

    # Predictions: OME-NGFF pyramids, read back by ome-zarr and ome-zarr-models.
    from ome_zarr.io import parse_url
    from ome_zarr.reader import Reader
    from ome_zarr_models.v04.image import Image

    for cls in ("mito", "er", "nuc"):
        node = next(iter(Reader(parse_url(str(pred / "crop1" / cls)))()))
        shapes = [tuple(d.shape) for d in node.data]
        assert len(shapes) >= 3
        assert all(tuple(-(-a // 2) for a in big) == small for big, small in zip(shapes, shapes[1:]))
        assert [a["name"] for a in node.metadata["axes"]] == ["z", "y", "x"]
        assert {a["unit"] for a in node.metadata["axes"]} == {"nanometer"}
        transforms = node.metadata["coordinateTransformations"]
        scales = [t[0]["scale"] for t in transforms]
        assert scales[0] == [8.0, 8.0, 8.0] and scales[1] == [16.0, 16.0, 16.0]
        t0, t1 = transforms[0][1]["translation"], transforms[1][1]["translation"]
        np.testing.assert_allclose(np.subtract(t1, t0), 4.0)  # voxel centres shift by half a voxel
        image = Image.from_zarr(zarr.open_group(str(pred / "crop1" / cls), mode="r"))
        assert len(image.attributes.multiscales[0].datasets) == len(shapes)
        s0 = zarr.open_array(str(pred / "crop1" / cls / "s0"), mode="r")
        assert s0.chunks == tuple(min(64, s) for s in s0.shape)
        expected = np.uint32 if cls in INSTANCE_CLASSES else np.uint8
        assert s0.dtype == expected

    # The submission: the crops' own grids, the challenge's dtypes and attributes.
    (crop1,) = [c for s in __import__("torchtitan.data.crops.layout", fromlist=["discover"]).discover(StoreContext(), fetched)
                for c in s.crops if c.name == "crop1"]
    for cls in ("mito", "er"):
        arr = zarr.open_array(str(sub / "crop1" / cls), mode="r")
        level = crop1.classes[cls][0]
        assert arr.shape == level.shape and arr.attrs["voxel_size"] == list(level.scale)
        assert arr.attrs["translation"] == list(level.translation)
        assert arr.dtype == (np.uint32 if cls in INSTANCE_CLASSES else np.uint8)
    assert not (sub / "crop1" / "all").exists()

    r = _run("-m", "torchtitan.prediction.submission", "--check", sub, "--groundtruth", fetched, "--crops", "1,2")
    assert r.returncode == 0, r.stdout + r.stderr
    for version, name in (("2025", "cellmap-2025 (revised"), ("2024", "cellmap-2024 (original")):
        out = tmp_path / f"scores_{version}.json"
        r = _run("-m", "torchtitan.scoring", "--predictions", sub, "--groundtruth", fetched,
                 "--metric-version", version, "--out", out)
        assert r.returncode == 0, r.stderr
        assert f"metric: {name}" in r.stdout
        scores = json.loads(out.read_text())
        assert scores["metric"] == f"cellmap-{version}"
        assert set(scores["crops"]) == {"crop1", "crop2"}
        assert "all" not in scores["classes"]
        assert 0.0 <= scores["overall"]["score"] <= 1.0


# ---------------------------------------------------------------------------------------------
# The linter, one rejection at a time
# ---------------------------------------------------------------------------------------------


def _valid_submission(crops, path: Path) -> None:
    root = zarr.open_group(str(path), mode="w", zarr_format=2)
    for name, crop in crops.items():
        for cls, grid in crop.classes.items():
            dtype = np.uint32 if cls in INSTANCE_CLASSES else np.uint8
            arr = root.require_group(name).create_array(cls, shape=grid.shape, dtype=dtype, fill_value=0)
            arr.attrs.update(voxel_size=list(grid.scale), translation=list(grid.translation),
                             shape=list(grid.shape))


def _set_attr(node: Path, key, value):
    attrs = json.loads((node / ".zattrs").read_text())
    if value is None:
        attrs.pop(key)
    else:
        attrs[key] = value
    (node / ".zattrs").write_text(json.dumps(attrs))


def _rewrite(node: Path, dtype=None, shape=None):
    arr = zarr.open_array(str(node), mode="r")
    attrs = dict(arr.attrs)
    shutil.rmtree(node)
    new = zarr.open_group(str(node.parent), mode="r+", zarr_format=2).create_array(
        node.name, shape=shape or arr.shape, dtype=dtype or arr.dtype, fill_value=0)
    new.attrs.update(attrs)


MUTATIONS = {
    "missing crop": (lambda s: shutil.rmtree(s / "crop2"), "crop2", "missing crop"),
    "wrong scale": (lambda s: _set_attr(s / "crop1" / "mito", "voxel_size", [4.0, 4.0, 4.0]),
                    "crop1/mito", "wrong scale"),
    "wrong roi": (lambda s: _set_attr(s / "crop1" / "er", "translation", [0.0, 0.0, 0.0]),
                  "crop1/er", "wrong ROI"),
    "wrong shape": (lambda s: _rewrite(s / "crop1" / "er", shape=(3, 3, 3)), "crop1/er", "wrong shape"),
    "float semantic": (lambda s: _rewrite(s / "crop1" / "er", dtype=np.float32), "crop1/er",
                       "wrong dtype: dtype float32 for the semantic class 'er'"),
    "float instance": (lambda s: _rewrite(s / "crop1" / "mito", dtype=np.float32), "crop1/mito",
                       "wrong dtype: dtype float32 for the instance class 'mito'"),
    "no attributes": (lambda s: _set_attr(s / "crop1" / "er", "voxel_size", None), "crop1/er",
                      "without the attribute(s) ['voxel_size']"),
}


@pytest.fixture(scope="module")
def targets(demo_data):
    from torchtitan.prediction.submission import crops_from_groundtruth

    return crops_from_groundtruth(demo_data, ["crop1", "crop2"])


def test_a_valid_submission_passes_and_a_left_out_class_only_warns(targets, tmp_path, capsys):
    from torchtitan.prediction.submission import check_submission, main

    sub = tmp_path / "sub.zarr"
    _valid_submission(targets, sub)
    assert check_submission(sub, targets) == []
    shutil.rmtree(sub / "crop1" / "nuc")
    (problem,) = check_submission(sub, targets)
    assert (problem.severity, problem.where) == ("warning", "crop1/nuc") and "scored as zero" in problem.message
    manifest = tmp_path / "test_crop_manifest.csv"
    rows = ["crop_name,dataset,class_label,voxel_size,translation,shape"]
    for crop in targets.values():
        for cls, g in crop.classes.items():
            vec = lambda v: "[" + ";".join(str(x) for x in v) + "]"  # noqa: E731
            rows.append(f"{crop.name.removeprefix('crop')},{crop.dataset},{cls},{vec(g.scale)},"
                        f"{vec(g.translation)},{vec(g.shape)}")
    manifest.write_text("\n".join(rows) + "\n")
    assert main(["--check", str(sub), "--manifest", str(manifest)]) == 0  # the challenge's manifest
    assert "OK: 2 crop(s)" in capsys.readouterr().out


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_rejection_is_named(targets, demo_data, tmp_path, mutation, capsys):
    from torchtitan.prediction.submission import check_submission, main

    sub = tmp_path / "sub.zarr"
    _valid_submission(targets, sub)
    change, where, message = MUTATIONS[mutation]
    change(sub)
    errors = [p for p in check_submission(sub, targets) if p.severity == "error"]
    assert len(errors) == 1, errors
    assert errors[0].where == where and message in errors[0].message, errors[0]
    assert main(["--check", str(sub), "--groundtruth", str(demo_data), "--crops", "1,2"]) == 1
    assert "would be REJECTED: 1 error(s)" in capsys.readouterr().out


def test_a_zarr_v3_store_is_rejected(targets, tmp_path):
    from torchtitan.prediction.submission import check_submission

    sub = tmp_path / "v3.zarr"
    zarr.open_group(str(sub), mode="w", zarr_format=3)
    (problem,) = check_submission(sub, targets)
    assert problem.severity == "error" and "zarr format 3" in problem.message


# ---------------------------------------------------------------------------------------------
# The metric versions, by hand
# ---------------------------------------------------------------------------------------------


def test_semantic_2025_pools_counts_2024_weights_crop_scores():
    from torchtitan.scoring.stores import combine_challenge_scores, score_label

    v = (8.0, 8.0, 8.0)
    truth_a = np.zeros((2, 2, 2), bool)
    truth_a[0, 0, 0] = True
    truth_b = np.zeros((2, 2, 2), bool)
    truth_b[0, 0, :] = True
    truth_b[0, 1, 0] = True  # 3 voxels
    pred_a, pred_b = truth_a.copy(), np.zeros((2, 2, 2), bool)
    valid = np.ones((2, 2, 2), bool)
    crops = {version: [{"classes": {"er": score_label(p, t, valid, v, "er", version)}}
                       for p, t in ((pred_a, truth_a), (pred_b, truth_b))] for version in ("2025", "2024")}
    new = combine_challenge_scores(crops["2025"], "2025")
    assert new["classes"]["er"]["iou"] == pytest.approx(1 / 4)  # TP 1 / (1 + 0 + 3)
    old = combine_challenge_scores(crops["2024"], "2024")
    assert old["classes"]["er"]["iou"] == pytest.approx((1.0 * 8 + 0.0 * 8) / 16)
    # A left-out semantic class: every voxel a false negative (2025), zero (2024).
    empty = np.zeros((2, 2, 2), bool)
    missing = score_label(None, empty, valid, v, "er", "2025")
    assert (missing["fn"], missing["iou"]) == (8, 0.0)
    assert score_label(empty, empty, valid, v, "er", "2025")["iou"] == 1.0  # predicted empty: perfect
    assert score_label(None, empty, valid, v, "er", "2024")["iou"] == 0.0


def test_instance_2025_split_object_and_overall():
    """One true cube; the prediction is the cube cut in two: 1 TP, 1 FP. The matched half
    is at Hausdorff distance 2 voxels (16 nm) from the cube, the extra half gets the cap."""
    from torchtitan.scoring.stores import combine_challenge_scores, score_label

    v = (8.0, 8.0, 8.0)
    truth = np.zeros((8, 8, 8), np.uint8)
    truth[2:6, 2:6, 2:6] = 1
    pred = np.zeros((8, 8, 8), np.uint16)
    pred[2:6, 2:6, 2:4] = 1
    pred[2:6, 2:6, 4:6] = 2  # touching: the challenge keeps submitted ids apart
    valid = np.ones(truth.shape, bool)
    s = score_label(pred, truth, valid, v, "mito", "2025")
    assert (s["instance_tp"], s["instance_fp"], s["instance_fn"]) == (1, 1, 0)
    cap = 8 * 8.0 / 2  # half the shortest side, nm
    diag = math.sqrt(3) * 8.0
    norm = [1.01 ** (-16.0 / diag), 1.01 ** (-cap / diag)]
    assert s["hausdorff_norm_sum"] == pytest.approx(sum(norm))
    assert s["n_hausdorff"] == 2
    combined = combine_challenge_scores([{"classes": {"mito": s}}], "2025")
    f1 = 2 / 3
    assert combined["classes"]["mito"]["score"] == pytest.approx(math.sqrt(f1 * np.mean(norm)))
    # No semantic class scored: that half is "not scored" and the overall score is the
    # instance half (not its geometric mean with 0).
    assert combined["overall"]["mean_semantic_iou"] is None
    assert combined["overall"]["score"] == combined["classes"]["mito"]["score"]
    # 2024: accuracy over voxels (the unmatched half is wrong), mean distance over true instances.
    old = score_label(pred, truth, valid, v, "mito", "2024")
    assert old["accuracy"] == pytest.approx(1 - 32 / 512)
    assert old["hausdorff_nm"] == pytest.approx(16.0)
    assert old["score"] == pytest.approx(math.sqrt((1 - 32 / 512) * 1.01 ** (-16.0 / diag)))


def test_instance_2025_nothing_anywhere_is_perfect_and_too_many_instances_is_skipped(caplog):
    from torchtitan.scoring.metrics import ratio_cutoff as ratio_cutoff_2025
    from torchtitan.scoring.stores import combine_challenge_scores, score_label

    v = (4.0, 4.0, 4.0)
    empty = np.zeros((6, 6, 6), np.uint8)
    valid = np.ones(empty.shape, bool)
    s = score_label(empty, empty, valid, v, "ves", "2025")
    assert combine_challenge_scores([{"classes": {"ves": s}}], "2025")["classes"]["ves"]["score"] == 1.0
    truth = np.zeros((20, 20, 20), np.uint8)
    truth[0, 0, 0] = 1
    pred = np.zeros_like(truth)
    pred[::2, ::2, ::2] = 1  # 1000 separate voxels against one true object
    assert 1000 > ratio_cutoff_2025(1)
    s = score_label(pred, truth, np.ones(truth.shape, bool), v, "ves", "2025")
    assert s["status"] == "skipped_too_many_instances" and s["n_hausdorff"] == 0
    assert (s["instance_tp"], s["instance_fp"], s["instance_fn"]) == (0, 0, 0)
    # As on the leaderboard the skipped crop adds nothing to its class, and the log says so.
    with caplog.at_level("WARNING", logger="torchtitan"):
        combine_challenge_scores([{"classes": {"ves": s}}], "2025")
    assert "1 crop(s) not scored as instances: more predicted objects than" in caplog.text


# ---------------------------------------------------------------------------------------------
# The viewer command
# ---------------------------------------------------------------------------------------------


def test_view_crop_prints_a_neuroglancer_state_and_a_napari_command(demo_data, tmp_path, monkeypatch):
    from torchtitan.data.crops.layout import discover

    (crop,) = [c for s in discover(StoreContext(), demo_data) for c in s.crops if c.name == "crop1"]
    level = crop.classes["mito"][0]
    pred = tmp_path / "pred.zarr"
    root = zarr.open_group(str(pred), mode="w", zarr_format=2)
    g = root.require_group("crop1").require_group("mito")
    g.attrs["multiscales"] = multiscales_attrs("mito", level.scale, level.translation, 1)
    g.create_array("s0", data=np.zeros(level.shape, np.uint8))
    serve = Path(str(demo_data)).parents[2]
    assert pred.resolve().is_relative_to(serve.resolve())
    r = _run("helpers/view_crop.py", "--data", demo_data, "--crop", "crop1", "--classes", "mito,er",
             "--predictions", pred, "--serve_root", serve, "--url_base", "http://127.0.0.1:9000")
    assert r.returncode == 0, r.stderr
    url = next(line for line in r.stdout.splitlines() if line.startswith("https://"))
    state = json.loads(unquote(url.split("#!", 1)[1]))
    assert state["dimensions"] == {a: [s * 1e-9, "m"] for a, s in zip("zyx", level.scale)}
    centre = (crop.box_min + crop.box_max) / 2 / np.asarray(level.scale)
    np.testing.assert_allclose(state["position"], centre)
    layers = {layer["name"]: layer for layer in state["layers"]}
    assert list(layers) == ["EM", "gt mito", "gt er", "prediction mito"]
    assert layers["EM"]["type"] == "image" and layers["gt er"]["type"] == "segmentation"
    rel = lambda p: Path(p).resolve().relative_to(serve.resolve()).as_posix()  # noqa: E731
    assert layers["prediction mito"]["source"] == f"zarr://http://127.0.0.1:9000/{rel(pred / 'crop1' / 'mito')}"
    assert layers["gt mito"]["source"].endswith(f"{GT}/crop1/mito")
    assert layers["EM"]["source"].endswith(EM)
    napari = next(line for line in r.stdout.splitlines() if line.startswith("napari "))
    assert str(pred / "crop1" / "mito") in napari and EM in napari
    r = _run("helpers/view_crop.py", "--data", demo_data, "--crop", "crop1", "--classes", "golgi")
    assert r.returncode == 2 and "does not annotate ['golgi']" in r.stderr
