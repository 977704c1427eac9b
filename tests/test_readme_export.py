"""The commands of docs/export.md's "Export the demo model" run as written, on the demo model.

The test puts a trained demo run where the page expects the quickstart's
(``outputs/quickstart_segmentation_2d``: a copy of the ``seg2d_four_steps`` run, whose config
names the session's demo data), then runs every command of the section's shell block in that
folder, one after the other, exactly as written except that our scripts are found in the
repository and ``python`` / ``bioimageio`` are the test environment's. Then it checks what
the page promises: the package and hub folder, bioimage.io's test passing, and predictions
from the export equal to the checkpoint's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import _env, script_module
from test_readme_own_em import runnable, section_commands

pytest.importorskip("bioimageio.core")
pytest.importorskip("onnxruntime")

PAGE = "docs/export.md"
SECTION = "## Export the demo model"


def test_section_has_the_commands_it_promises():
    argvs = [argv for _, argv in section_commands(SECTION, page=PAGE)]
    assert any("helpers/export_model.py" in a and "--checkpoint" in a for a in argvs)
    assert any(a[:2] == ["bioimageio", "test"] for a in argvs)
    assert any("predict.py" in a and "--model" in a and "--weights" in a for a in argvs)
    assert any("predict.py" in a and any(x.endswith("/hub") for x in a) for a in argvs)


def masks(store: Path) -> dict[str, np.ndarray]:
    import zarr

    group = zarr.open_group(str(store), mode="r")["crop1"]
    return {cls: group[f"{cls}/s0"][:] for cls in group.group_keys()}


@pytest.mark.distributed
def test_sharing_a_model_commands_run_as_written(seg2d_four_steps, tmp_path):
    run = tmp_path / "outputs" / "quickstart_segmentation_2d"
    shutil.copytree(seg2d_four_steps, run)
    log = []
    for written, argv in section_commands(SECTION, page=PAGE):
        argv = runnable(argv)
        if argv[0] == "bioimageio":  # the command line tool of the test's environment
            argv[0] = str(Path(sys.executable).parent / "bioimageio")
        r = subprocess.run(argv, cwd=tmp_path, env=_env(), capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, f"{written}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        log.append(r.stdout + r.stderr)
    export = tmp_path / "exported" / "quickstart"
    for name in ("rdf.yaml", "weights.pt", "weights_torchscript.pt", "weights.onnx",
                 "test_input.npy", "test_output.npy", "README.md", "config.toml"):
        assert (export / "bioimageio" / name).is_file(), name
    assert (export / "bioimageio.zip").is_file()
    for name in ("README.md", "model.safetensors", "config.toml"):
        assert (export / "hub" / name).is_file(), name
    assert "Your Name" in (export / "hub" / "README.md").read_text()
    assert "passed" in log[1] and "Reproduce test outputs from test inputs (onnx)" in log[1]

    predict = script_module("predict.py")
    assert predict.main(["--checkpoint", str(run / "checkpoint"), "--crops", "crop1",
                         "--out", str(tmp_path / "pred_checkpoint.zarr"), "--no-progress"]) == 0
    reference = masks(tmp_path / "pred_checkpoint.zarr")
    hub, onnx = masks(tmp_path / "pred_hub.zarr"), masks(tmp_path / "pred_onnx.zarr")
    for cls, mask in reference.items():
        assert np.array_equal(hub[cls], mask), cls
        # ONNX probabilities are within 1e-4: a voxel that close to the threshold may flip.
        assert np.mean(onnx[cls] != mask) < 1e-3, cls
