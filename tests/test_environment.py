"""The environment setup: helpers/setup_env.sh when sourced, and the Python version checks.

None of these tests installs anything or touches the repository's .venv: the "already set
up" case uses a stand-in venv (a folder whose bin/python is this interpreter, stamped with
the hash of the checkout's path, requirements.txt and pyproject.toml, which is all
setup_env.sh looks at), and the failing cases use fake interpreters and a VENV path in a
temporary folder.
"""

from __future__ import annotations

import ast
import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETUP = REPO / "helpers" / "setup_env.sh"


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VENV", "PYTHON", "PYTHONPATH")}
    env.update(extra)
    return env


def _bash(script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], cwd=REPO, env=_env(**env),
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def ready_venv(tmp_path) -> Path:
    """A venv that setup_env.sh takes as up to date, so sourcing it only exports."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    stamped = (f"{REPO}\n".encode() + (REPO / "requirements.txt").read_bytes()
               + (REPO / "pyproject.toml").read_bytes())
    (venv / ".setup.sha256").write_text(hashlib.sha256(stamped).hexdigest() + "\n")
    return venv


def _fake_python(tmp_path: Path, version: str, venv_fails: bool = True) -> Path:
    """An executable that reports ``version`` when asked and fails at anything else."""
    exe = tmp_path / f"fake-python{version}"
    exe.write_text("#!/bin/sh\n"
                   f'case "$*" in *version_info*) echo {version};; '
                   '*) echo "fake python: cannot $*" >&2; exit 3;; esac\n')
    exe.chmod(0o755)
    return exe


def test_sourcing_leaves_the_shell_usable(ready_venv):
    """The README's `source helpers/setup_env.sh` leaves no `set -e` behind."""
    r = _bash("source helpers/setup_env.sh; false; echo still here", VENV=str(ready_venv))
    assert r.returncode == 0, r.stderr
    assert "still here" in r.stdout


@pytest.mark.parametrize("options", ["", "set -euo pipefail", "set -u", "set -o pipefail"])
def test_sourcing_keeps_options_and_exports(ready_venv, options):
    script = (f"{options}\n"
              "before=$(set +o); source helpers/setup_env.sh; rc=$?; after=$(set +o)\n"
              '[ "$before" = "$after" ] && echo "options unchanged"\n'
              'echo "rc=$rc"; echo "PATH=$PATH"; echo "PYTHONPATH=$PYTHONPATH"\n'
              'echo "python=$(command -v python)"\n'
              'declare -p | grep -c "^declare[^=]*_em_setup" || true\n')
    r = _bash(script, VENV=str(ready_venv), PYTHONPATH="/some/where")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "options unchanged" in out
    assert "rc=0" in out
    assert f"PATH={ready_venv}/bin:" in out
    assert "PYTHONPATH=/some/where\n" in out  # the package is installed: no PYTHONPATH needed
    assert f"python={ready_venv}/bin/python" in out
    assert out.rstrip().endswith("0"), "setup_env.sh left its helper variables behind"
    assert "setting up" not in out  # up to date: nothing installed


def test_old_python_is_refused_before_creating_the_venv(tmp_path):
    fake = _fake_python(tmp_path, "3.10")
    venv = tmp_path / "new-venv"
    r = _bash('source helpers/setup_env.sh; echo "rc=$?"; false; echo still here; echo "PATH=$PATH"',
              VENV=str(venv), PYTHON=str(fake))
    assert "rc=1" in r.stdout and "still here" in r.stdout, r.stdout + r.stderr
    assert "Python >= 3.11" in r.stderr
    assert "Python 3.10" in r.stderr and str(fake) in r.stderr  # names the interpreter found
    assert "PYTHON=" in r.stderr  # and how to choose another
    assert not venv.exists()
    assert f"{venv}/bin" not in r.stdout  # nothing exported


def test_strict_callers_stop_when_setup_fails(tmp_path):
    """run_tests.sh and run_demo.sh (set -e) stop with the error instead of running on."""
    fake = _fake_python(tmp_path, "3.9")
    r = _bash("set -euo pipefail; source helpers/setup_env.sh; echo unreachable",
              VENV=str(tmp_path / "venv"), PYTHON=str(fake))
    assert r.returncode != 0
    assert "unreachable" not in r.stdout
    assert "Python >= 3.11" in r.stderr


def test_failed_install_returns_nonzero(tmp_path):
    fake = _fake_python(tmp_path, "3.12")  # new enough, but `-m venv` fails
    venv = tmp_path / "venv"
    r = _bash('source helpers/setup_env.sh; echo "rc=$?"', VENV=str(venv), PYTHON=str(fake))
    assert "rc=1" in r.stdout, r.stdout + r.stderr
    assert "-m venv" in r.stderr and "failed" in r.stderr
    assert not (venv / ".setup.sha256").exists()


def test_a_venv_whose_pip_does_not_run_is_made_again(tmp_path):
    """An interrupted set-up can leave a half-upgraded pip behind: the next set-up creates
    the venv again (``venv --clear``) instead of failing on every later run."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    broken = venv / "bin" / "python"
    broken.write_text("#!/bin/sh\necho 'ImportError: cannot import name from pip' >&2; exit 1\n")
    broken.chmod(0o755)
    log = tmp_path / "venv-args"
    fake = tmp_path / "fake-python"  # records how `-m venv` is called, then fails
    fake.write_text("#!/bin/sh\n"
                    'case "$*" in *version_info*) echo 3.12;; '
                    f'*) echo "$*" >> {log}; exit 3;; esac\n')
    fake.chmod(0o755)
    r = _bash('source helpers/setup_env.sh; echo "rc=$?"', VENV=str(venv), PYTHON=str(fake))
    assert "pip does not run" in r.stdout, r.stdout + r.stderr
    assert log.read_text().split() == ["-m", "venv", "--clear", str(venv)]


def test_missing_interpreter_is_named(tmp_path):
    r = _bash('source helpers/setup_env.sh; echo "rc=$?"',
              VENV=str(tmp_path / "venv"), PYTHON="no-such-python-3.11")
    assert "rc=1" in r.stdout
    assert "no-such-python-3.11" in r.stderr and "PYTHON" in r.stderr


def test_run_as_a_script_exits_with_the_status(tmp_path):
    fake = _fake_python(tmp_path, "3.10")
    r = subprocess.run(["bash", str(SETUP)], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env=_env(VENV=str(tmp_path / "venv"), PYTHON=str(fake)))
    assert r.returncode == 1
    assert "Python >= 3.11" in r.stderr


# ---------------------------------------------------------------------------------------
# The package's own check
# ---------------------------------------------------------------------------------------


def test_package_refuses_old_python():
    """Importing torchtitan under Python < 3.11 exits with one clear line, no traceback."""
    code = "import sys; sys.version_info = (3, 10, 14, 'final', 0); import torchtitan"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=60, env=_env())
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "needs Python >= 3.11" in r.stderr and "Python 3.10" in r.stderr


# ---------------------------------------------------------------------------------------
# The installed package (pyproject.toml; setup_env.sh runs `pip install -e .`)
# ---------------------------------------------------------------------------------------


def test_package_is_importable_from_anywhere(tmp_path):
    """The editable install, not the working directory or PYTHONPATH, finds torchtitan, and the
    installed distribution holds that one top-level package: the script folders helpers/ and
    bench/ are not installed (they run as ``python helpers/x.py``; modules named ``helpers``
    or ``bench`` would collide with other projects')."""
    code = ("import importlib.metadata, importlib.util, torchtitan; print(torchtitan.__file__); "
            "print(*(importlib.util.find_spec(n) is not None for n in ('helpers', 'bench'))); "
            "print(*importlib.metadata.distribution('torchtitan-em').read_text('top_level.txt')"
            ".split())")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env=_env())
    assert r.returncode == 0, ("the project is not installed in this interpreter's environment; "
                               "run `pip install -e .` (or ./run_tests.sh, which does)\n" + r.stderr)
    found, scripts_importable, top_level = r.stdout.splitlines()
    assert Path(found) == REPO / "torchtitan" / "__init__.py"
    stale = "installed from an older pyproject.toml? run `pip install -e .` again"
    assert scripts_importable == "False False", f"helpers or bench is importable: {stale}"
    assert top_level == "torchtitan", f"the installed torchtitan-em holds {top_level}: {stale}"


def _dotted_folders(root: Path) -> set[str]:
    """``root`` and its folders that hold Python files, dotted as setuptools names packages."""
    return {".".join(f.parent.relative_to(REPO).parts) for f in root.rglob("*.py")}


def test_pyproject_packages_torchtitan_alone():
    """pyproject.toml packages torchtitan with every subpackage, and nothing else: not the
    script folders (helpers/, bench/) nor tests/."""
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    library = _dotted_folders(REPO / "torchtitan")
    folders = library | {d.name for d in REPO.iterdir() if d.is_dir() and any(d.glob("*.py"))}
    assert {"helpers", "bench", "tests", "torchtitan.inference", "torchtitan.cellmap"} <= folders
    packaged = {d for d in folders if any(fnmatch.fnmatchcase(d, pat) for pat in find["include"])}
    assert packaged == library, sorted(packaged ^ library)


def test_nothing_edits_the_import_path():
    """Scripts and tests import the installed packages; none of them edits the import path."""
    needle = "sys." + "path"  # spelled apart so that this file does not match itself
    sources = [*REPO.glob("*.py"), *(f for d in ("torchtitan", "helpers", "bench", "tests")
                                      for f in (REPO / d).rglob("*.py"))]
    assert len(sources) > 20
    offenders = [f"{f.relative_to(REPO)}:{n}" for f in sources
                 for n, line in enumerate(f.read_text().splitlines(), 1) if needle in line]
    assert not offenders, offenders


def test_package_init_parses_on_old_pythons():
    """The check must be reachable: torchtitan/__init__.py uses no newer syntax."""
    source = (REPO / "torchtitan" / "__init__.py").read_text()
    ast.parse(source, feature_version=(3, 6))


def _older_python() -> str | None:
    for name in ("python3.10", "python3.9", "python3.8"):
        exe = shutil.which(name)
        if exe is None:
            continue
        try:
            r = subprocess.run([exe, "-c", "import sys; print(sys.version_info < (3, 11))"],
                               capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0 and r.stdout.strip() == "True":
            return exe
    return None


def test_entry_script_on_a_real_old_python():
    exe = _older_python()
    if exe is None:
        pytest.skip("no Python older than 3.11 on this machine")
    r = subprocess.run([exe, "train_mae.py", "--job.config_file", "train_configs/debug_mae_2d.toml"],
                       cwd=REPO, capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "needs Python >= 3.11" in r.stderr


# ---------------------------------------------------------------------------------------
# Requirement files
# ---------------------------------------------------------------------------------------


def test_requirements_state_the_python_version():
    head = (REPO / "requirements.txt").read_text().splitlines()[:5]
    assert any("Python >= 3.11" in line and line.startswith("#") for line in head)


def test_gpu_requirements_are_pinned():
    lines = [line.split("#")[0].strip()
             for line in (REPO / "requirements-gpu.txt").read_text().splitlines()]
    reqs = [line for line in lines if line and not line.startswith("-r")]
    assert any(re.fullmatch(r"flash-attn-4\[cu13\]==[\w.]+", r) for r in reqs), reqs
    for req in reqs:
        assert re.fullmatch(r"[\w.-]+(\[[\w,-]+\])?==[\w.]+", req), f"not pinned: {req}"
    assert "-r requirements.txt" in lines
