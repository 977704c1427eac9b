#!/usr/bin/env bash
# Fill .wheels/ (git-ignored, in the repository root) with the wheels that
# bench/device_check.sh installs on a GPU node without a package registry: the run-time
# dependencies of this project that such a node's Python (torch, numpy, scipy, h5py,
# scikit-image, tensorstore, timm) may lack, at the versions pyproject.toml pins (their own
# dependencies at the versions requirements.txt resolves to). The list is
# bench/device_check.py's WHEELS (`python bench/device_check.py --list-wheels`).
#
#   bash bench/build_wheels.sh                     # on a machine with PyPI: CPython 3.12, x86_64
#   PY_VERSION=3.11 bash bench/build_wheels.sh     # for a node with another Python
#
# Then copy the checkout with .wheels/ to the node and run `bash bench/device_check.sh OUT`.
# The folder must stay under 64 MiB (what a device run may carry). FlashAttention-4 is not in
# it: its CuTe DSL libraries alone are two wheels of about 88 MiB each (CUDA 12 and CUDA 13
# builds, nvidia-cutlass-dsl-libs-cu12/-cu13 4.8.1; flash-attn-4 4.0.0b36 needs the first and
# its cu13 extra the second). A node without FA4 gets SDPA and the check says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
PY_VERSION="${PY_VERSION:-3.12}"
LIMIT_MIB=64
dest=.wheels

pins=$("$PYTHON" bench/device_check.py --list-wheels)
mkdir -p "$dest"
rm -f "$dest"/*.whl  # a rebuild holds exactly the pinned set, no older versions beside it
# shellcheck disable=SC2086  # one argument per pin
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
  --python-version "$PY_VERSION" --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" $pins

ls -1 "$dest"
kib=$(du -sk "$dest" | cut -f1)
echo "$dest: $(ls "$dest"/*.whl | wc -l) wheels, $((kib / 1024)) MiB (limit $LIMIT_MIB MiB)" \
     "for CPython $PY_VERSION x86_64 Linux"
if [ "$kib" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "error: $dest is over $LIMIT_MIB MiB" >&2
  exit 1
fi
