"""predict.py output lifecycle, with real runs: a completion marker per finished region;
finished regions kept when asked for again (an error when asked for with other settings, unless
--overwrite); an interrupted output resumed (finished regions kept, an unfinished one from the
blocks it had not written, or from its start when it has no record of them)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr

from conftest import debug_run, launch

CLASSES = ("nuc", "mito", "er", "cell")


@pytest.fixture(scope="module")
def seed_run(demo_data, tmp_path_factory):
    """A run folder with a model-only step-0 checkpoint and its config.toml (no training)."""
    dump = tmp_path_factory.mktemp("predout") / "run"
    debug_run("train_segmentation.py", "train_configs/debug_segmentation_2d.toml", demo_data,
              dump, "--checkpoint.create_seed_checkpoint", timeout=300)
    return dump


def predict(run, demo_data, out, *extra):
    return launch("predict.py", ["--checkpoint", str(run / "checkpoint"), "--data",
                                 str(demo_data), "--crops", "crop1,crop2", "--out", str(out),
                                 "--no-progress", *extra], nproc=0, timeout=300)


def marker(out, region) -> bool:
    return json.loads((out / region / ".zattrs").read_text()).get("prediction_complete", False)


def test_marker_refusal_resume_and_overwrite(seed_run, demo_data, tmp_path):
    out = tmp_path / "pred.zarr"
    r = predict(seed_run, demo_data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert marker(out, "crop1") and marker(out, "crop2")
    root = zarr.open_group(str(out), mode="r")
    reference = {cls: root[f"crop2/{cls}/s0"][:] for cls in CLASSES}

    # A finished output asked for again is kept: nothing is touched.
    crop1_before = (out / "crop1" / "mito" / "s0").stat().st_mtime_ns
    r = predict(seed_run, demo_data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "crop1 is finished: kept" in r.stderr and "crop2 is finished: kept" in r.stderr
    assert (out / "crop1" / "mito" / "s0").stat().st_mtime_ns == crop1_before
    # ... but not with other settings: one clear message, exit 2.
    r = predict(seed_run, demo_data, out, "--threshold", "0.3")
    assert r.returncode == 2, r.stderr[-3000:]
    assert ("holds crop1 finished, predicted with other settings (inference.threshold: 0.5 -> "
            "0.3); pass --overwrite") in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("error:") == 1

    # Interrupted in crop2: its marker is missing, its blocks are partly garbage and there is no
    # record of which were written (they are removed with the working folders when a region
    # is finished).
    attrs = json.loads((out / "crop2" / ".zattrs").read_text())
    del attrs["prediction_complete"]
    (out / "crop2" / ".zattrs").write_text(json.dumps(attrs))
    zarr.open_array(str(out / "crop2" / "mito" / "s0"), mode="r+")[:] = 7
    r = predict(seed_run, demo_data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "crop1 is finished: kept" in log and "1 block(s) of 1 region(s) to predict" in log
    assert marker(out, "crop2")
    root = zarr.open_group(str(out), mode="r")
    for cls in CLASSES:
        np.testing.assert_array_equal(root[f"crop2/{cls}/s0"][:], reference[cls])
    assert (out / "crop1" / "mito" / "s0").stat().st_mtime_ns == crop1_before  # not redone

    # Cut short before its plan was stored: predicted again from its start.
    attrs = json.loads((out / "crop2" / ".zattrs").read_text())
    del attrs["prediction_complete"], attrs["prediction_plan"]
    (out / "crop2" / ".zattrs").write_text(json.dumps(attrs))
    r = predict(seed_run, demo_data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "crop2 is without a plan (cut short): predicting it again from its start" in r.stderr

    # --overwrite predicts a finished output again.
    r = predict(seed_run, demo_data, out, "--overwrite")
    assert r.returncode == 0, r.stderr[-3000:]
    assert marker(out, "crop1") and marker(out, "crop2")
