#!/usr/bin/env bash
# Device check of a GPU node without a package registry (bench/device_check.py): the
# node's own python3 and torch, what they lack installed from .wheels/ (made by
# bench/build_wheels.sh) into OUT/site, the repository on PYTHONPATH (nothing is installed,
# no venv is made). Writes OUT/device_check.json and OUT/device_check.txt.
#
#   bash bench/device_check.sh OUT                 # on the GPU node (about 9 minutes)
#   bash bench/device_check.sh OUT --dry-run       # every section on the CPU, toy sizes
#   PYTHON=/opt/py312/bin/python3 bash bench/device_check.sh OUT --sections env,vit
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:?usage: bash bench/device_check.sh OUT [--dry-run] [--sections ...] [--budget ...]}"
shift
mkdir -p "$out"
out="$(cd "$out" && pwd)"
PYTHON="${PYTHON:-python3}"
site="$("$PYTHON" "$root/bench/device_check.py" --install "$out" | tail -n 1)"
# For this script and the torchrun processes it starts: the wheels' folder, then the repository
# (the project is imported from the checkout, not installed).
export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
exec "$PYTHON" bench/device_check.py --out "$out" "$@"
