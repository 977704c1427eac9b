#!/usr/bin/env bash
# Create (once) the project's virtual environment in .venv from requirements.txt.
# Sourced by run_demo.sh and run_tests.sh; re-installs only when requirements.txt changes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
stamp="$VENV/.requirements.sha256"
want="$(sha256sum "$ROOT/requirements.txt" | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setting up $VENV from requirements.txt (once) ..."
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install --quiet -r "$ROOT/requirements.txt"
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
