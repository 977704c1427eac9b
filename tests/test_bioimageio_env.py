"""An exported bioimage.io package passes bioimage.io's own test in an environment of the
docs/export.md's pinned line alone: no torch, no torchtitan.

docs/export.md gives the ``pip install`` line of bioimage.io's tools
for those who test packages outside this project. Unpinned, that line took pydantic 2.14,
under which bioimageio.spec 0.5.12 cannot validate any package this project exports
(``package_file_descr_serializer: TypeError: 'index_key' is expected to be an integer or a
string``); the project's own environment escaped it only because ome-zarr-models caps pydantic
below 2.13. Here:

* the line is read from docs/export.md: every requirement pinned exactly, and as in the lock
  requirements.txt (what the project's own environment installs), pydantic included;
* (slow) a venv made from nothing with exactly that line, in which neither torch nor
  torchtitan can be imported, runs ``bioimageio test --weight-format onnx`` on the package
  that ``helpers/export_model.py`` writes from a two-step run, and every check passes. The
  venv is built once per line and interpreter, under the system's temporary folder (outside
  the repository: the tests that read every ``*.py`` of the checkout must not see it), at
  the same time as the run trains; with the package registry unreachable the test is skipped.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from conftest import REPO, debug_run

# docs/export.md's install line for bioimage.io's tools, in an inline code span.
EXPORT_PAGE = "docs/export.md"
README_LINE = re.compile(r"`(pip install [^`]*bioimageio\.core[^`]*)`")
# What the line must install (distribution names, normalised).
NEEDED = {"bioimageio-core", "bioimageio-spec", "pydantic", "onnx", "onnxruntime"}
# In pip's output when it could not reach the package registry: its retries' warnings, or, with
# retries off, no version at all of a distribution (a wrong pin lists the versions there are;
# a wrong name fails test_readme_line_pins_what_the_test_extra_pins).
NETWORK_ERRORS = ("NewConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                  "Max retries exceeded", "Temporary failure in name resolution",
                  "Name or service not known", "Network is unreachable", "Connection refused",
                  "ProxyError", "SSLError", "No route to host", "(from versions: none)")
CACHE = Path(tempfile.gettempdir()) / "torchtitan-em-tests" / "bioimageio-env"


def _name(requirement: str) -> str:
    """The distribution name of ``requirement``, normalised (PEP 503): ``bioimageio-core``."""
    name = re.split(r"[\[=<>!~; ]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def readme_requirements() -> list[str]:
    """The requirements of docs/export.md's ``pip install bioimageio.core ...`` line, as written."""
    lines = set(README_LINE.findall((REPO / EXPORT_PAGE).read_text()))
    assert len(lines) == 1, f"expected one `pip install bioimageio.core ...` line: {lines}"
    argv = shlex.split(lines.pop())
    assert argv[:2] == ["pip", "install"] and all(not a.startswith("-") for a in argv[2:]), argv
    return argv[2:]


def _clean_env() -> dict:
    """The environment of a user's shell with nothing of this project's: no PYTHONPATH, no
    active venv, no user site-packages."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env["PYTHONNOUSERSITE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(cmd, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=_clean_env(), capture_output=True,
                          text=True, timeout=timeout)


class RegistryUnreachable(Exception):
    """pip could not reach the package registry."""


def build_pinned_env(requirements: list[str]) -> Path:
    """A venv with exactly ``pip install REQUIREMENTS`` (its own pip, as a user would), made once
    per line and interpreter and kept under ``CACHE``; returns its folder. A folder without the
    ``complete`` marker (an install that stopped) is made again; two sessions take turns."""
    key = hashlib.sha256(" ".join([*requirements, sys.version, platform.machine(),
                                   sys.base_prefix]).encode()).hexdigest()[:16]
    CACHE.mkdir(parents=True, exist_ok=True)
    venv = CACHE / key
    with open(CACHE / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = venv / "complete"
        if marker.is_file() and _run([venv / "bin" / "python", "-c", "import bioimageio.core"],
                                     cwd=CACHE, timeout=300).returncode == 0:
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        r = _run([sys.executable, "-m", "venv", venv], cwd=CACHE, timeout=300)
        assert r.returncode == 0, r.stderr
        r = _run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", *requirements],
                 cwd=CACHE, timeout=1800)
        if r.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            out = r.stdout + r.stderr
            if any(e in out for e in NETWORK_ERRORS):
                raise RegistryUnreachable(out.strip().splitlines()[-1])
            raise AssertionError(f"pip install {' '.join(requirements)} failed:\n{out[-4000:]}")
        marker.write_text(" ".join(requirements) + "\n")
        return venv


@pytest.fixture(scope="module")
def pinned_env():
    """A future of the export page line's venv (``build_pinned_env``), started at once in a thread
    so that pip installs while the run trains; teardown waits for it."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        yield pool.submit(build_pinned_env, readme_requirements())


@pytest.fixture(scope="module")
def exported_package(demo_data, tmp_path_factory) -> Path:
    """The bioimage.io package (``.zip``) of a two-step run of the 2D debug config, written by
    ``helpers/export_model.py`` as docs/export.md runs it, with this project's interpreter."""
    root = tmp_path_factory.mktemp("bioimageio_env")
    dump = root / "run"
    debug_run("train_segmentation.py", "train_configs/debug_segmentation_2d.toml", demo_data,
              dump, "--training.steps", "2", "--checkpoint.interval", "2",
              "--metrics.eval_freq", "0")
    r = subprocess.run([sys.executable, str(REPO / "helpers" / "export_model.py"),
                        "--checkpoint", str(dump / "checkpoint"), "--out", str(root / "exported"),
                        "--format", "bioimageio", "--authors", "Test Author"],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return root / "exported" / "bioimageio.zip"


def test_readme_line_pins_what_the_lock_pins():
    """The export page's line names bioimage.io's tools, pydantic, onnx and onnxruntime, each
    pinned exactly and to the version of the lock, requirements.txt (the project's own
    environment)."""
    requirements = readme_requirements()
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.]+", r) for r in requirements), \
        requirements
    assert NEEDED <= {_name(r) for r in requirements}, requirements
    lock = {_name(line): line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()
            if re.match(r"[A-Za-z0-9]", line)}
    for r in requirements:
        assert lock.get(_name(r)) == r, f"{EXPORT_PAGE} pins {r}, the lock {lock.get(_name(r))}"


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the venv: one to several minutes of pip on 2 cores
def test_exported_package_passes_bioimageio_test_without_torch_or_the_project(
        pinned_env, exported_package, tmp_path):
    """In the venv of the export page's line alone (no torch, no torchtitan), ``bioimageio test
    --weight-format onnx`` on the exported package passes: the format validation and the ONNX
    weights reproducing the package's test output, at batch sizes 1 and 2."""
    try:
        venv = pinned_env.result()
    except RegistryUnreachable as e:
        pytest.skip(f"the package registry is unreachable ({e})")
    code = ("import importlib.util as u; print(*(u.find_spec(n) is not None for n in "
            "('torch', 'torchtitan', 'bioimageio.core', 'onnxruntime')))")
    r = _run([venv / "bin" / "python", "-c", code], cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False", "True", "True"], \
        f"importable (torch, torchtitan, bioimageio.core, onnxruntime): {r.stdout}"

    summary = tmp_path / "summary.json"
    r = _run([venv / "bin" / "bioimageio", "test", "--weight-format", "onnx", "--summary",
              summary, exported_package], cwd=tmp_path, timeout=900)
    report = json.loads(summary.read_text()) if summary.is_file() else {}
    failed = [(d["name"], d.get("errors")) for d in report.get("details", [])
              if d["status"] != "passed"]
    assert r.returncode == 0 and report.get("status") == "passed", \
        f"{failed}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    checks = {d["name"] for d in report["details"]}
    assert "Reproduce test outputs from test inputs (onnx)" in checks, checks
    assert any(c.startswith("bioimageio.spec format validation") for c in checks), checks
    pins = dict(req.split("==") for req in readme_requirements())
    assert {row[0]: row[1] for row in report["env"]}["bioimageio.spec"] == pins["bioimageio.spec"]
