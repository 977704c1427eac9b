"""The README's table of what one reads to follow a training step, a validation pass and a
training sample (``helpers/files_followed.py``: files with 5 or more lines run, their folders,
the re-entries) is the measure of today's code."""

from __future__ import annotations

import re

from conftest import REPO, script_module


def test_readme_table_is_the_code_s(demo_data):
    followed = script_module("helpers/files_followed.py")
    measures = followed.follow(demo_data, "train_configs/debug_segmentation_2d.toml")
    # Each phase ran the code it names; the model and the ground floor are left out.
    assert "torchtitan/trainer.py" in measures["step"]["files"]
    assert not any(f.startswith("torchtitan/models/") for m in measures.values()
                   for f in m["files"])
    assert "torchtitan/inference/sliding_window.py" in measures["validation"]["files"]
    assert "torchtitan/scoring/metrics.py" in measures["validation"]["files"]
    assert "torchtitan/data/sampling/samples.py" in measures["sample"]["files"]
    assert "torchtitan/trainer.py" not in measures["sample"]["files"]
    assert all(n >= followed.MIN_LINES for m in measures.values() for n in m["lines"].values())
    text = (REPO / "README.md").read_text()
    said = re.search(r"<!-- files_followed -->\n(.*?)\n\n", text, re.S)
    assert said, "README.md, Architecture: the files_followed table is missing"
    assert said.group(1) == followed.markdown(measures), (
        f"README.md says\n{said.group(1)}\nhelpers/files_followed.py measures\n"
        f"{followed.markdown(measures)}\n{measures}")


def test_a_call_back_to_an_earlier_file_is_a_re_entry():
    """The walk a -> b -> a counts one re-entry (b back into a); a -> b -> c none; files with
    fewer lines than the floor do not count."""
    followed = script_module("helpers/files_followed.py")
    rec = followed.LineRecorder()
    five = set(range(5))
    rec.lines["p"] = {"torchtitan/a.py": five, "torchtitan/b.py": five, "torchtitan/c.py": five,
                      "torchtitan/tiny.py": {1}, "torchtitan/models/vit.py": five}
    rec.calls["p"] = [("torchtitan/a.py", "torchtitan/b.py"), ("torchtitan/b.py", "torchtitan/c.py"),
                      ("torchtitan/c.py", "torchtitan/tiny.py"),
                      ("torchtitan/b.py", "torchtitan/models/vit.py"),
                      ("torchtitan/b.py", "torchtitan/a.py"), ("torchtitan/b.py", "torchtitan/a.py")]
    m = rec.measure("p")
    assert m["files"] == ["torchtitan/a.py", "torchtitan/b.py", "torchtitan/c.py"]
    assert m["folders"] == ["torchtitan"]
    assert m["re_entries"] == ["torchtitan/b.py -> torchtitan/a.py"]
