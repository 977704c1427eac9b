"""predict.py output lifecycle, with real runs: a completion marker per finished region, a clear
error instead of overwriting a finished output (unless --overwrite), and an interrupted output
resumed (finished regions kept, an unfinished one predicted again from its start)."""

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

    # A finished output is not overwritten: one clear message, exit 2, nothing touched.
    r = predict(seed_run, demo_data, out)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "already holds the finished prediction of crop1, crop2; pass --overwrite" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("error:") == 1

    # Interrupted in crop2: its marker is missing and its blocks are partly garbage.
    attrs = json.loads((out / "crop2" / ".zattrs").read_text())
    del attrs["prediction_complete"]
    (out / "crop2" / ".zattrs").write_text(json.dumps(attrs))
    zarr.open_array(str(out / "crop2" / "mito" / "s0"), mode="r+")[:] = 7
    crop1_before = (out / "crop1" / "mito" / "s0").stat().st_mtime_ns
    r = predict(seed_run, demo_data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    log = r.stdout + r.stderr
    assert "keeping the finished region(s) crop1; predicting crop2" in log
    assert "crop2 is unfinished (no completion marker): predicting it again from its start" in log
    assert marker(out, "crop2")
    root = zarr.open_group(str(out), mode="r")
    for cls in CLASSES:
        np.testing.assert_array_equal(root[f"crop2/{cls}/s0"][:], reference[cls])
    assert (out / "crop1" / "mito" / "s0").stat().st_mtime_ns == crop1_before  # not redone

    # --overwrite predicts a finished output again.
    r = predict(seed_run, demo_data, out, "--overwrite")
    assert r.returncode == 0, r.stderr[-3000:]
    assert marker(out, "crop1") and marker(out, "crop2")
