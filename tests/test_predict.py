"""predict.py on the demo data: OME-NGFF output with the crop's geometry, all ranks."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from conftest import launch
from torchtitan.data.crops.layout import discover
from torchtitan.data.crops.reader import crop_grid
from torchtitan.data.io.stores import StoreContext


@pytest.fixture(scope="module")
def trained(seg2d_four_steps):
    """A trained 2D debug run (the shared 4-step one; predict.py reads its step-4)."""
    return seg2d_four_steps


@pytest.mark.parametrize("nproc", [0, 2])
def test_predict_crops_writes_ome_ngff_with_crop_geometry(trained, demo_data, tmp_path, nproc):
    out = tmp_path / "pred.zarr"
    r = launch("predict.py", ["--checkpoint", str(trained / "checkpoint"), "--data",
                              str(demo_data), "--crops", "crop1", "--out", str(out),
                              "--max_block_mb", "0.5", "--no-progress"], nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    (crop,) = [c for s in discover(StoreContext(), demo_data) for c in s.crops if c.name == "crop1"]
    origin, shape = crop_grid(crop, (8.0, 8.0, 8.0))
    root = zarr.open_group(str(out), mode="r")
    for cls in ("nuc", "mito", "er", "cell"):
        group = root[f"crop1/{cls}"]
        ms = group.attrs["multiscales"][0]
        assert [a["name"] for a in ms["axes"]] == ["z", "y", "x"]
        scale, translation = (t for t in ms["datasets"][0]["coordinateTransformations"])
        assert scale["scale"] == [8.0, 8.0, 8.0]
        np.testing.assert_allclose(translation["translation"], origin + 4.0)
        assert group.attrs["voxel_size"] == [8.0, 8.0, 8.0]
        values = group["s0"][:]
        assert values.shape == shape and values.dtype == np.uint8
        assert set(np.unique(values)) <= {0, 1}


def test_predict_roi_probabilities_and_bad_roi(trained, demo_data, tmp_path):
    out = tmp_path / "roi.zarr"
    r = launch("predict.py", ["--checkpoint", str(trained / "checkpoint"), "--data",
                              str(demo_data), "--dataset", "jrc_synth-1", "--roi",
                              "0:32,0:640,0:640", "--probabilities", "--out", str(out),
                              "--no-progress"], nproc=0)
    assert r.returncode == 0, r.stderr[-3000:]
    probs = zarr.open_array(str(out / "jrc_synth-1" / "mito" / "s0"), mode="r")[:]
    assert probs.shape == (4, 80, 80) and probs.dtype == np.float32
    assert 0 <= probs.min() and probs.max() <= 1
    r = launch("predict.py", ["--checkpoint", str(trained / "checkpoint"), "--data",
                              str(demo_data), "--dataset", "jrc_synth-1", "--roi",
                              "0:32,0:640", "--out", str(out), "--no-progress"], nproc=0)
    assert r.returncode != 0 and "--roi" in r.stderr
