"""The floors of the package (who may import whom), kept by import-linter's contracts in
pyproject.toml ([tool.importlinter]): each floor imports only those below it, the core never
imports a product, models and data know nothing of each other, and no package loops."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}  # the package under ``root`` comes first
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_import_contracts():
    r = _lint(REPO)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_a_lazy_upward_import_breaks_the_floors(tmp_path):
    """The contracts see an import inside a function too: a model that reaches up to the
    trainer fails them, naming the chain."""
    shutil.copytree(REPO / "torchtitan", tmp_path / "torchtitan",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with open(tmp_path / "torchtitan" / "models" / "vit.py", "a") as f:
        f.write("\n\ndef _reach_up():\n    from torchtitan import trainer  # noqa: F401\n")
    r = _lint(tmp_path)
    assert r.returncode != 0
    assert "Floors" in r.stdout and "BROKEN" in r.stdout
    assert "torchtitan.models.vit -> torchtitan.trainer" in r.stdout, r.stdout[-3000:]
