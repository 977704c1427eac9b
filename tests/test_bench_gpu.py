"""bench/gpu.py --dry-run (every section on the CPU at toy sizes) and bench/model_step.py
--tiny at a toy size run to the end and print a row for everything they measure."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*argv: str, timeout: int = 240) -> str:
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _table(out: str, section: str) -> list[list[str]]:
    """Rows (cells) of the markdown table under ``## section``."""
    body = out.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[1:]]  # minus the header


def test_gpu_bench_dry_run_fills_every_section():
    out = _run("bench/gpu.py", "--dry-run", "--infer-repeats", "1")
    train = _table(out, "train")
    status = {row[0]: row[1] for row in train}
    # Every model and mask ratio ran eagerly, with and without selective AC, and gave a rate.
    for name in ("seg 32^3 x2, sdpa, eager", "seg 32^3 x2, sdpa, eager, selective AC",
                 "MAE 0.75 32^3 x2, sdpa, eager", "MAE 0.9 32^3 x2, sdpa, eager, selective AC"):
        assert status[name] == "ok", (name, status)
    for row in train:
        if row[1] == "ok":
            assert float(row[3]) > 0, row  # Mvoxel/s
    # FA4 cannot run on a CPU: its rows say why instead of failing.
    fa4 = [row[1] for row in train if ", fa4," in row[0]]
    assert fa4 and all(s.startswith(("not installed", "FlashAttention-4 needs")) for s in fa4), fa4
    assert not [row for row in train if row[1].startswith("failed")], train

    loader = _table(out, "loader")
    assert loader and loader[0][1] == "ok" and float(loader[0][2]) > 0, loader
    assert loader[0][4].endswith("x"), loader  # headroom against the seg row

    # Context parallelism: CP 1 against CP 2 (2 CPU processes), memory per rank divided.
    cp = _table(out, "cp")
    assert [row[1] for row in cp] == ["ok"] * 3, cp  # two lengths and the longest sequence
    for row in cp[:2]:
        assert 0 < float(row[3]) < 1, row  # CP 2's activation memory per rank / CP 1's
    assert cp[2][3].endswith("x") and float(cp[2][3][:-1]) > 1, cp

    inference = _table(out, "inference")
    assert inference, out
    if importlib.util.find_spec("monai") and importlib.util.find_spec("einops"):
        ours, monai = inference
        assert ours[1] == monai[1] == "ok", inference
        assert float(ours[5]) <= 1e-2, inference  # the same output (bf16)
        assert re.fullmatch(r"\d+\.\d\dx", ours[4]), inference
    else:
        assert any("pip install" in row[1] for row in inference), inference


def test_gpu_bench_runs_only_the_chosen_rows_and_profiles_them():
    row = "seg 32^3 x2, sdpa, eager"
    out = _run("bench/gpu.py", "--dry-run", "--sections", "train", "--train-only", row,
               "--profile", row)
    status = {r[0]: r[1] for r in _table(out, "train")}
    assert status.pop(row) == "ok", status
    assert set(status.values()) <= {"skipped: not in --train-only",
                                    "not installed (pip install -r requirements-gpu.txt)"}, status
    profile = out.split(f"### profile of {row}: 3 steps", 1)[1]
    assert "aten::linear" in profile.split("\n## train", 1)[0], out


@pytest.mark.skipif(not (importlib.util.find_spec("monai") and importlib.util.find_spec("einops")
                         and importlib.util.find_spec("timm")),
                    reason="bench/model_step.py compares with MONAI and timm (benchmark-only "
                           "peers, not project dependencies)")
def test_model_step_tiny_compares_every_model():
    out = _run("bench/model_step.py", "--tiny", "--repeats", "4")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
             if line.startswith("| ") and "---" not in line]
    models = [c for c in cells if len(c) == 8 and c[0] != "model"]
    ratios = [c for c in cells if len(c) == 7 and c[0] != "ratio"]
    assert [c[0] for c in models] == ["ours", "ours+linear", "ours+linear, bce", "MONAI ViT",
                                      "ours", "timm DINOv3 ViT"], out
    for c in models:
        assert float(c[3]) > 0 and float(c[4]) > 0, c  # samples/s, GFLOP/sample
    # Each goal's ratio, taken within the rounds, with its spread.
    assert [c[0].split(" (")[0] for c in ratios] == [
        "ours vs MONAI ViT", "ours+linear / the backbone", "ours+linear, bce / the backbone",
        "ours vs timm DINOv3 ViT"], out
    for c in ratios:  # the median, its 95 % interval around it, its IQR
        med = float(c[1].strip("*x"))
        lo, hi = (float(v) for v in c[2].split("-"))
        assert med > 0 and lo <= med <= hi and c[3].endswith("%"), c
    assert out.count("parameters: ours / ") == 2, out
    # Ours and timm's DINOv3 compute the same tokens from the same weights.
    parity = re.search(r"relative ([0-9.e+-]+);", out)
    assert parity and float(parity.group(1)) < 1e-4, out
