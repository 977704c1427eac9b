"""``bash bench/device_check.sh OUT --dry-run``: every section of the offline device check runs
on the CPU as a real process and writes its JSON and table, each row with a status; and the
wheel list that bench/build_wheels.sh downloads is pinned by requirements.txt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ["env", "configs", "micro", "vit", "mae"]


@pytest.mark.distributed  # its configs section starts torchrun (2 gloo processes)
def test_device_check_dry_run_writes_every_row(tmp_path):
    out = tmp_path / "check"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "bench/device_check.sh", str(out), "--dry-run"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads((out / "device_check.json").read_text())
    assert report["dry_run"] is True
    assert report["torch"] and report["python"] and report["gpu"] == "cpu"
    assert report["gemm_bf16_tflops"] is not None and report["copy_gb_s"] > 0
    assert report["wheels"]["no_wheel"] == []  # this venv has every run-time package
    rows = report["rows"]
    assert [s for s in SECTIONS if any(r["section"] == s for r in rows)] == SECTIONS
    status = {r["row"]: r["status"] for r in rows}
    assert all(s for s in status.values())
    assert not [r for r in rows if r["status"].startswith(("failed", "not run"))], rows
    # What must run on a CPU ran; what cannot says why.
    assert status["demo_segmentation_3d.toml"] == "ok"
    assert status["patch embed Conv3d"] == status["patch embed GEMM"] == "ok"
    assert status["SDPA math"] == "ok"
    assert status["SDPA flash"].startswith("unavailable: needs a CUDA GPU")
    assert status["FA4"].startswith("unavailable")
    vit = [r for r in rows if r["section"] == "vit"]
    assert vit[0]["status"] == "ok" and "GPU busy" not in vit[0]  # summary under _profile
    assert vit[0]["_profile"]["kernels_per_step"] == 0  # no GPU
    mae = [r for r in rows if r["section"] == "mae"]
    assert mae[0]["row"].startswith("vit_2b_generic MAE") and "as shipped: full AC" in mae[0]["row"]
    assert all(r["status"] == "ok" for r in mae), mae
    grid = [r for r in rows if "patch embed GEMM" == r["row"]][0]
    assert float(grid["max abs diff vs fp32 conv"]) < 1e-4

    text = (out / "device_check.txt").read_text()
    assert proc.stdout.rstrip().endswith(text.rstrip())  # the table is printed last
    for r in rows:
        assert f"| {r['row']}" in text and r["status"] in text


def test_budget_skips_rows_that_would_start_late(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, "bench/device_check.py", "--out", str(out),
                           "--dry-run", "--sections", "micro", "--budget", "micro=0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "device_check.json").read_text())["rows"]
    assert rows and all(r["status"] == "skipped (budget)" for r in rows), rows


def test_wheel_list_is_pinned():
    proc = subprocess.run([sys.executable, "bench/device_check.py", "--list-wheels"], cwd=REPO,
                          capture_output=True, text=True, check=True)
    pins = proc.stdout.split()
    assert {p.split("==")[0] for p in pins} >= {"zarr", "numcodecs", "tomli-w",
                                                "connected-components-3d", "mwatershed",
                                                "waterz"}
    assert all("==" in p for p in pins)
