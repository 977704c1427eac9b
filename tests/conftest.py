"""Shared fixtures: a small demo dataset made once per test session, and a torchrun helper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """A small demo set (same layout and objects as the default one, smaller volumes)."""
    from torchtitan.datasets.demo_data import generate_demo_data

    root = tmp_path_factory.mktemp("demo") / "data"
    generate_demo_data(root, seed=0, scale=0.5)
    return root


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch(script: str, args: list[str], nproc: int = 2, timeout: int = 600,
           extra_torchrun: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run an entry script under torchrun (or plain python for nproc=0) and capture output."""
    if nproc == 0:
        cmd = [sys.executable, str(REPO / script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               *(extra_torchrun or ["--standalone"]), str(REPO / script), *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def train_losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(dump / "logs" / "metrics.jsonl") if "loss" in r}
