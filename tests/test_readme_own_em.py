"""The 2D commands of docs/own_em.md run as written, on a small stack of TIFF and PNG files.

The test writes a tiny serial-section stack where the page expects it (``my_stack/raw``:
20 sections of 8-bit TIFF; ``my_stack/labels``: one PNG per section with the label values the
page names; ``my_stack/more``: unlabelled sections), then runs every command of the
section's shell block in that folder, one after the other, exactly as written except that
our scripts and configs are found in the repository and ``--training.steps`` is made tiny
(the only size the page's commands set). Then it checks what the page promises: a
trained model, a prediction store of the held-out crop, its scores and a viewer link.

``section_commands`` finds the commands of a page of the docs by its section heading; the
other tests that run documented commands (3D own EM, prediction, export) use it too.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pytest
from PIL import Image

from conftest import REPO, _env
from test_readme import fenced_blocks

PAGE = "docs/own_em.md"
SECTION = "## 2D: a stack of TIFF or PNG sections"
# Sizes the page's commands set, and what the test runs instead.
REDUCED = {"--training.steps": "2"}


def section_commands(section: str = SECTION, every_block: bool = False, page: str = PAGE
                     ) -> list[tuple[str, list[str]]]:
    """(as written, argv) of each command of the first shell block after the heading
    ``section`` of ``page`` (of every one with ``every_block``, in order), up to the next
    ``## `` section."""
    text = (REPO / page).read_text()
    assert re.search(rf"^{re.escape(section)}$", text, re.M), f"{page} has no heading {section!r}"
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    blocks = [b[2] for b in fenced_blocks(text[start:end]) if b[0] == "bash"]
    lines = [line for body in (blocks if every_block else blocks[:1]) for line in body]
    commands, parts = [], []
    for line in lines:
        if line.strip().startswith("#") and not parts:
            continue
        if line.rstrip().endswith("\\"):
            parts.append(line.rstrip()[:-1])
            continue
        written = " ".join(p.strip() for p in [*parts, line]).strip()
        parts = []
        if written:
            commands.append((written, shlex.split(written, comments=True)))
    return commands


def runnable(argv: list[str]) -> list[str]:
    """The command with our scripts and configs found in the repository, python the test's
    interpreter, and the sizes of ``REDUCED``."""
    if argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    elif argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    out = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] in REDUCED:
            arg = REDUCED[argv[i - 1]]
        elif (arg.endswith(".py") or arg.startswith("train_configs/")) and (REPO / arg).is_file():
            arg = str(REPO / arg)
        out.append(arg)
    return out


def write_stack(root: Path, n: int = 20, side: int = 64) -> None:
    """Sections of cells (membranes 0/64/128 on a 16-pixel grid, 255 inside) with
    extracellular space (159), synapses (223) and mitochondria (191) that run through several
    sections; EM dark on membranes, darker on mitochondria, bright in the extracellular space."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:side, :side]
    for folder in ("raw", "labels", "more"):
        (root / folder).mkdir(parents=True)
    for z in range(n + 3):
        lab = np.full((side, side), 255, np.uint8)
        lab[yy % 16 == 0] = 0
        lab[xx % 16 == 0] = 64
        lab[(yy % 16 == 0) & (xx % 16 == 0)] = 128
        lab[40:47, 40:47] = 159
        lab[5, 5 + z % 8] = 223
        for cy, cx in ((8, 8), (24, 40), (56, 24)):
            if (z + cy) % 9 < 6:
                lab[(yy - cy) ** 2 + (xx - cx) ** 2 <= 9] = 191
        grey = {0: 40, 64: 40, 128: 30, 159: 210, 191: 80, 223: 60, 255: 150}
        em = np.vectorize(grey.get)(lab) + rng.normal(0, 12, lab.shape)
        em = np.clip(em, 0, 255).astype(np.uint8)
        if z < n:
            Image.fromarray(em).save(root / "raw" / f"{z:02d}.tif")
            Image.fromarray(lab).save(root / "labels" / f"labels{z:08d}.png")
        else:
            Image.fromarray(em).save(root / "more" / f"{z - n:02d}.tif")


def test_section_has_the_commands_it_promises():
    scripts = [" ".join(argv[:2]) for _, argv in section_commands()]
    assert any("helpers/import_stack.py" in s for s in scripts)
    assert any("train_segmentation.py" in " ".join(argv) for _, argv in section_commands())
    assert any(s.startswith("python predict.py") for s in scripts)
    assert any("-m torchtitan.scoring" in " ".join(argv) for _, argv in section_commands())
    assert any("helpers/view_crop.py" in s for s in scripts)
    for flag in REDUCED:
        assert any(flag in argv for _, argv in section_commands()), flag


@pytest.mark.distributed
def test_your_own_em_commands_run_as_written(tmp_path):
    # Sections as large as the shipped config's crop (256 x 256), which needs whole samples.
    write_stack(tmp_path / "my_stack", side=256)
    outputs = []
    for written, argv in section_commands():
        r = subprocess.run(runnable(argv), cwd=tmp_path, env=_env(), capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"{written}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
        outputs.append(r.stdout + r.stderr)
    log = "\n".join(outputs)
    assert (tmp_path / "data/mine/vnc/vnc.zarr/recon-1/labels/groundtruth/crop2/mito").is_dir()
    assert (tmp_path / "data/mine/vnc_more/vnc_more.zarr/recon-1/em/fibsem-uint8/s0").is_dir()
    assert "val IoU" in log and "1 validation crops (vnc/crop2)" in log
    assert any((tmp_path / "outputs/mine/checkpoint").glob("step-*"))
    for cls in ("pm", "mito", "ecs"):
        assert (tmp_path / "outputs/mine/pred.zarr/crop2" / cls / "s0").is_dir()
    # The viewer pyramid of thin sections halves y and x only (50 x 4.6 x 4.6 nm voxels).
    ms = json.loads((tmp_path / "outputs/mine/pred.zarr/crop2/mito/.zattrs").read_text())
    scales = [next(t["scale"] for t in d["coordinateTransformations"] if t["type"] == "scale")
              for d in ms["multiscales"][0]["datasets"]]
    assert scales[:3] == [[50.0, 4.6, 4.6], [50.0, 9.2, 9.2], [50.0, 18.4, 18.4]]
    assert "overall score" in log
    links = [unquote(line) for line in log.splitlines() if line.startswith("https://")]
    assert links and "http://localhost:8000/outputs/mine/pred.zarr/crop2/mito" in links[0]
