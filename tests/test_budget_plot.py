"""``bench/budget_plot.py``: finished runs' final scores gathered per model and budget, as a
table and a plot (runs made here as folders of metrics, as the trainer writes them)."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from conftest import script_module


def _run(folder, values: list[float]):
    """A dump folder whose metrics.jsonl logged ``values`` of val/mean_iou, then a loss."""
    (folder / "logs").mkdir(parents=True)
    records = [{"step": 10 * i, "val/mean_iou": v} for i, v in enumerate(values, 1)]
    records.append({"step": 99, "loss": 0.5})
    (folder / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def test_the_table_takes_each_runs_final_score_and_the_plot_is_drawn(tmp_path, capsys):
    script_module("bench/quality.py")  # what the script imports as ``quality``
    plot = script_module("bench/budget_plot.py")
    a8, b8 = _run(tmp_path / "a8", [0.1, 0.60]), _run(tmp_path / "b8", [0.66])
    a24 = _run(tmp_path / "a24", [0.70])
    u8 = _run(tmp_path / "u8", [0.55])
    out = tmp_path / "plot.png"
    assert plot.main(["--series", f"ours=8:{a8},{b8};24:{a24}", "--series", f"unet=8:{u8}",
                      "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| ours | 8 | 0.600 / 0.660 | **0.630** | 0.060 |" in text
    assert "| ours | 24 | 0.700 | **0.700** | 0.000 |" in text
    assert "| unet | 8 | 0.550 | **0.550** | 0.000 |" in text
    assert Image.open(out).size == (720, 440)
    # a score recorded by an earlier run, beside a run's folder
    assert plot.main(["--series", f"unet=8:{u8},=0.45"]) == 0
    assert "| unet | 8 | 0.550 / 0.450 | **0.500** | 0.100 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="=NUMBER"):
        plot.main(["--series", "unet=8:=high"])
    with pytest.raises(SystemExit, match="no logs/metrics.jsonl"):
        plot.main(["--series", f"ours=8:{tmp_path / 'missing'}"])
