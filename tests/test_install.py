"""`pip install -r requirements.txt` alone is the whole install: it installs the project
(editable, with its test extra) and its pinned dependencies, after which every helper script
and the documented commands run from any folder.

In CI: a new venv layered over this environment's packages (a .pth file), into which pip
installs requirements.txt with no index at all, so that every pin must resolve against what is
installed and the project itself is installed from requirements.txt's own line. The slow suite
builds a venv from nothing, from the package registry.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HELPERS = sorted((REPO / "helpers").glob("*.py"))


def _run(cmd, cwd, timeout=600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, **kw)


def _venv(path: Path, layered: bool) -> Path:
    """A new venv at ``path``; ``layered``: without a pip of its own, and it also sees this
    environment's installed packages, after its own."""
    r = _run([sys.executable, "-m", "venv", *(["--without-pip"] if layered else []), path],
             cwd=path.parent)
    assert r.returncode == 0, r.stderr
    python = path / "bin" / "python"
    if layered:
        site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=path.parent).stdout.strip()
        Path(site, "zz_outer_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def _pip_install_requirements(python: Path, *options: str) -> subprocess.CompletedProcess:
    """``pip install -r requirements.txt`` into ``python``'s venv, run in the repository as the
    README says (pip from this environment, driving the target interpreter)."""
    return _run([sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
                 *options, "-r", "requirements.txt"], cwd=REPO, timeout=3000)


def _commands_run_from_anywhere(python: Path, where: Path, extra: list[list[str]] = ()) -> None:
    """Every helper's --help and the scoring command's --help (also under its earlier name),
    run by ``python`` from a folder outside the repository (so only the installed project can be
    imported), in parallel."""
    cmds = [[python, h, "--help"] for h in HELPERS]
    cmds += [[python, "-m", "torchtitan.scoring", "--help"],
             [python, "-m", "torchtitan.evaluation", "--help"], *extra]
    procs = [subprocess.Popen([str(c) for c in cmd], cwd=where, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for cmd in cmds]
    for cmd, proc in zip(cmds, procs):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{err[-3000:]}"
        assert "usage" in out.lower(), (cmd, out[:500])


def test_requirements_install_the_project_with_its_pinned_dependencies():
    """requirements.txt is the project itself (editable, test extra); pyproject.toml holds
    the pins: the runtime list, the test extra and the benchmarks' extra, every one exact."""
    lines = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines == ["-e .[test]"]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "dependencies" not in project.get("dynamic", [])
    extras = project["optional-dependencies"]
    pins = project["dependencies"] + extras["test"] + extras["bench"]
    assert all("==" in p for p in pins), pins
    assert "torch==2.13.0" in project["dependencies"]
    names = {p.split("==")[0].split("[")[0] for p in pins}
    assert {"pytest", "moto", "ome-zarr"} <= names - {p.split("==")[0] for p in project["dependencies"]}


def test_requirements_alone_make_every_helper_run(tmp_path):
    python = _venv(tmp_path / "venv", layered=True)
    # Before: the helpers cannot find the project.
    before = _run([python, HELPERS[0], "--help"], cwd=tmp_path)
    assert before.returncode != 0 and "No module named" in before.stderr
    r = _pip_install_requirements(python, "--no-index", "--no-build-isolation")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    found = _run([python, "-c", "import torchtitan; print(torchtitan.__file__)"], cwd=tmp_path)
    assert found.stdout.strip() == str(REPO / "torchtitan" / "__init__.py"), found.stderr
    _commands_run_from_anywhere(python, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the install alone takes 10-15 minutes on 2 busy cores
def test_a_fresh_venv_from_the_registry_runs_the_documented_commands(tmp_path, demo_data):
    """A venv with nothing in it, `pip install -r requirements.txt` from the package registry
    (minutes), then the helpers, the entry scripts and a short training run."""
    python = _venv(tmp_path / "venv", layered=False)
    # The README's line: the venv's own pip, in the repository.
    r = _run([python, "-m", "pip", "install", "--quiet", "-r", "requirements.txt"], cwd=REPO,
             timeout=3000)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    entries = [[python, REPO / s, "--help"] for s in ("train_mae.py", "train_segmentation.py",
                                                      "predict.py", "pth_to_dcp.py")]
    _commands_run_from_anywhere(python, tmp_path, entries + [[python, "-m", "pytest", "--help"]])
    dump = tmp_path / "run"
    run = _run([python, REPO / "train_segmentation.py", "--job.config_file",
                REPO / "train_configs" / "debug_segmentation_2d.toml", "--data.dataset_path",
                demo_data, "--job.dump_folder", dump, "--training.steps", "2",
                "--no-metrics.progress_bar"], cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    assert (dump / "logs" / "metrics.jsonl").is_file()
