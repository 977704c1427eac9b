"""`pip install -r requirements.txt` alone is the whole install: it installs the project
(editable, with its test extra) and the pinned set of its dependencies (the lock), after which every helper script
and the documented commands run from any folder.

In CI: a new venv layered over this environment's packages (a .pth file), into which pip
installs requirements.txt with no index at all, so that every pin must resolve against what is
installed and the project itself is installed from requirements.txt's own line. The slow suite
builds a venv from nothing, from the package registry.
"""

from __future__ import annotations

import importlib.metadata
import re
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
    """Every helper's --help and the scoring command's --help,
    run by ``python`` from a folder outside the repository (so only the installed project can be
    imported), in parallel."""
    cmds = [[python, h, "--help"] for h in HELPERS]
    cmds += [[python, "-m", "torchtitan.scoring", "--help"], *extra]
    procs = [subprocess.Popen([str(c) for c in cmd], cwd=where, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for cmd in cmds]
    for cmd, proc in zip(cmds, procs):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{err[-3000:]}"
        assert "usage" in out.lower(), (cmd, out[:500])


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement line (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0]).lower()


def test_pyproject_declares_ranges_and_extras():
    """The library's metadata declares what the code supports, never an exact pin, so that
    installing it keeps an environment's own torch (2.11 or newer); the slice-dataset stack is
    an extra, and the test extra takes every optional feature but the GPU kernels."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for req in project["dependencies"] + [r for reqs in extras.values() for r in reqs]:
        assert "==" not in req, f"pyproject.toml pins {req!r}: declare a range"
    assert "torch>=2.11" in project["dependencies"]
    runtime = {_name(r) for r in project["dependencies"]}
    assert not runtime & {"datasets", "huggingface-hub", "mwatershed", "waterz", "onnx"}
    assert {"datasets", "huggingface-hub"} <= {_name(r) for r in extras["slices"]}
    assert "torchtitan-em[slices,neurons,export]" in extras["test"]


def test_requirements_pin_exactly_the_environment_the_tests_run_in():
    """requirements.txt is the lock: the project (editable, test extra) and every package of
    this environment at the version installed, nothing more and nothing less."""
    lines = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert "-e .[test]" in lines
    pins = dict(line.split("==") for line in lines if line != "-e .[test]")
    # What pip installed into this environment's site-packages (not the copies another package
    # vendors and makes importable, as setuptools does with its own once imported).
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {_name(d.metadata["Name"]): d.version.split("+")[0]
                 for d in importlib.metadata.distributions(path=site)}
    installed = {n: v for n, v in installed.items()
                 if n not in ("torchtitan-em", "pip", "setuptools", "wheel")}
    locked = {_name(n): v for n, v in pins.items()}
    assert locked == installed, {
        "locked, not installed (or another version)":
            {n: v for n, v in locked.items() if installed.get(n) != v},
        "installed, not locked": {n: v for n, v in installed.items() if n not in locked}}


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


def test_a_missing_optional_package_names_the_extra_that_installs_it(monkeypatch):
    """An optional feature whose package is absent stops with a user error that says which
    extra installs it (here the neuron cut without mwatershed: ``None`` in ``sys.modules``
    makes its import fail as if it were not installed)."""
    import numpy as np

    from torchtitan.errors import MissingExtraError, UserError
    from torchtitan.postprocess.affinities import mutex_objects

    monkeypatch.setitem(sys.modules, "mwatershed", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'torchtitan-em\[neurons\]'") as e:
        mutex_objects(np.zeros((3, 4, 4, 4)), [(1, 0, 0), (0, 1, 0), (0, 0, 1)])
    assert isinstance(e.value, UserError) and "mwatershed" in str(e.value)
