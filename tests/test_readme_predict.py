"""The commands of docs/prediction.md's "Predict, score and view" run in order, as written.

A trained demo run stands where the page expects the quickstart's
(``outputs/quickstart_segmentation_2d``: a copy of the ``seg2d_four_steps`` run, whose config
names the session's demo data, copied to ``data/demo``). Every command of the section's
shell blocks runs in that folder, one after the other, exactly as written except that our
scripts are found in the repository and ``python`` is the test environment's. The section
predicts every crop into ``pred.zarr`` and later crop1 into the same store again (kept, not an
error), predicts a dataset as two shards, scores, links, post-processes and draws.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest
import zarr

from conftest import _env
from test_readme_own_em import runnable, section_commands

PAGE = "docs/prediction.md"
SECTION = "## Predict, score and view"


def test_section_has_the_commands_it_promises():
    argvs = [argv for _, argv in section_commands(SECTION, every_block=True, page=PAGE)]
    predicts = [a for a in argvs if "predict.py" in a]
    assert any("--shard" in a for a in predicts)
    # The store of the first command is written into again by a later one.
    outs = [a[a.index("--out") + 1] for a in predicts]
    assert outs.count("pred.zarr") >= 2


@pytest.mark.distributed
def test_prediction_commands_run_in_order_as_written(seg2d_four_steps, demo_data, tmp_path):
    shutil.copytree(seg2d_four_steps, tmp_path / "outputs" / "quickstart_segmentation_2d")
    shutil.copytree(demo_data, tmp_path / "data" / "demo")  # inside the folder view_crop serves
    (tmp_path / "docs").mkdir()
    logs = []
    for written, argv in section_commands(SECTION, every_block=True, page=PAGE):
        t0 = time.perf_counter()
        r = subprocess.run(runnable(argv), cwd=tmp_path, env=_env(), capture_output=True,
                           text=True, timeout=600)
        print(f"{time.perf_counter() - t0:6.1f} s  {written}")
        assert r.returncode == 0, f"{written}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        logs.append((written, r.stdout + r.stderr))

    pred = zarr.open_group(str(tmp_path / "pred.zarr"), mode="r")
    crops = sorted(k for k in pred.group_keys())
    assert crops == [f"crop{n}" for n in range(1, 9)]
    assert all(pred[c].attrs["prediction_complete"] for c in crops)
    assert pred["crop1/mito/s0"].dtype == "uint32"  # instances, kept by the later command
    again = [log for written, log in logs if "--crops crop1 " in written + " "]
    assert again and "pred.zarr/crop1 is finished: kept" in again[0]
    shards = [log for written, log in logs if "--shard" in written]
    assert "shard 0/2 is done" in shards[0] and "synth2.zarr/jrc_synth-2" in shards[1]
    synth2 = zarr.open_group(str(tmp_path / "synth2.zarr" / "jrc_synth-2"), mode="r")
    assert synth2.attrs["prediction_complete"] and synth2["nuc/s0"].dtype == "uint32"
    assert sorted(p.name for p in (tmp_path / "synth2.zarr" / "jrc_synth-2").iterdir()
                  if not p.name.startswith(".")) == ["cell", "er", "mito", "nuc"]
    roi = zarr.open_array(str(tmp_path / "roi.zarr" / "jrc_synth-1" / "mito" / "s0"), mode="r")
    assert roi.dtype == "float32"
    assert "overall" in json.loads((tmp_path / "scores.json").read_text())
    assert (tmp_path / "crop1.gif").is_file() and (tmp_path / "docs" / "demo_prediction.png").is_file()
