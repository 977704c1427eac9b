"""The README's count of the files one reads to follow a training step, a validation pass and
a training sample (``helpers/files_followed.py``) is the count of today's code."""

from __future__ import annotations

import re

from conftest import REPO, script_module


def test_readme_counts_are_the_code_s(demo_data):
    files = script_module("helpers/files_followed.py").follow(
        demo_data, "train_configs/debug_segmentation_2d.toml")
    # Each phase ran the code it names.
    assert "torchtitan/trainer.py" in files["step"]
    assert "torchtitan/models/vit.py" in files["step"]
    assert "torchtitan/inference/sliding_window.py" in files["validation"]
    assert "torchtitan/scoring/metrics.py" in files["validation"]
    assert "torchtitan/data/sampling/samples.py" in files["sample"]
    assert "torchtitan/trainer.py" not in files["sample"]
    text = (REPO / "README.md").read_text()
    said = re.search(r"Today: (\d+) files for a step .*?, (\d+) for a\s+validation pass and "
                     r"(\d+) for a sample", text, re.S)
    assert said, "README.md, Architecture: the sentence with the counts is missing"
    counts = [len(files[k]) for k in ("step", "validation", "sample")]
    assert [int(n) for n in said.groups()] == counts, (
        f"README.md says {said.groups()}; helpers/files_followed.py counts {counts}: {files}")
