"""The 3D commands of docs/own_em.md run as written, on a small HDF5 volume.

The test writes an HDF5 file where the page expects it (``my_volume.h5``, laid out like the
CREMI files: ``volumes/raw`` and ``volumes/labels/neuron_ids`` with a ``resolution``
attribute) holding a 250-section volume of touching cells (a Voronoi tessellation: every
voxel belongs to a cell, as in dense neuropil, with dark membranes where the ids change),
then runs every command of the section's shell block in that folder, one after the other,
exactly as written except that our scripts and configs are found in the repository and
``--training.steps`` is made tiny. Then it checks what the page promises: the imported
classes, a trained 3D model, a prediction of the held-out crop with neuron ids, its neuron
scores and a viewer link.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest

from conftest import _env, script_module
from test_readme_own_em import runnable, section_commands

SECTION = "## 3D: neurons from an HDF5 volume"  # in docs/own_em.md
shipped = script_module("bench/shipped_configs.py")


def write_volume(path: Path, shape=(250, 64, 64), cells: int = 60) -> None:
    """EM and neuron ids of touching cells, 10 nm voxels (``bench/shipped_configs.py``)."""
    shipped.write_neuron_h5(path, shape, cells)


def test_section_has_the_commands_it_promises():
    argvs = [argv for _, argv in section_commands(SECTION)]
    assert any("--ids" in a and "--boundary" in a for a in argvs)
    assert any("train_configs/own_em_segmentation_3d.toml" in a for a in argvs)
    assert any("predict.py" in a and "--instances" in a for a in argvs)
    assert any("torchtitan.scoring" in a for a in argvs)
    assert any("--training.steps" in a for a in argvs)


@pytest.mark.distributed
def test_isotropic_em_commands_run_as_written(tmp_path):
    write_volume(tmp_path / "my_volume.h5")
    outputs = []
    for written, argv in section_commands(SECTION):
        r = subprocess.run(runnable(argv), cwd=tmp_path, env=_env(), capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"{written}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        outputs.append(r.stdout + r.stderr)
    log = "\n".join(outputs)
    store = tmp_path / "data/mine/medulla/medulla.zarr"
    for cls in ("cell", "pm"):
        assert (store / "recon-1/labels/groundtruth/crop2" / cls / "s0").is_dir()
    assert "1 validation crops (medulla/crop2)" in log and "val/voi_split/cell" in log
    assert any((tmp_path / "outputs/mine3d/checkpoint").glob("step-*"))
    import zarr

    pred = zarr.open_group(str(tmp_path / "outputs/mine3d/pred.zarr"), mode="r")
    ids = pred["crop2/cell/s0"][:]
    assert ids.dtype == np.uint32 and ids.shape == (60, 64, 64)
    assert "instances (cut from its affinities, mutex)" in log
    assert pred["crop2/cell_aff_0_0_1/s0"].dtype == np.uint16  # the affinities, kept
    assert "VOIspl" in log and "ARAND" in log
    links = [unquote(line) for line in log.splitlines() if line.startswith("https://")]
    assert links and "http://localhost:8000/outputs/mine3d/pred.zarr/crop2/cell" in links[0]
