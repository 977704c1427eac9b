#!/usr/bin/env bash
# GPU smoke test of the cluster configs: every train_configs/demo_*.toml runs for 3 steps on
# every GPU of this node (torchrun, NCCL) as shipped -- bf16, torch.compile, activation
# checkpointing, attention "auto" (FlashAttention-4 when requirements-gpu.txt is installed on a
# Hopper/Blackwell GPU, else SDPA) -- at a reduced size: the demo data, a 32^3 / 64^2 crop, one
# sample per GPU, and the smallest backbone with the config's feed-forward type and 64-wide
# heads. Prints one PASS/FAIL line per config and the total time (about 5 minutes at most).
#
#   bash bench/gpu_smoke.sh                 # on a GPU node (or inside an salloc)
#   bash bench/gpu_smoke.sh --dry-run       # print the torchrun commands only (any machine)
#   bash bench/gpu_smoke.sh --backbone shipped --timeout 300    # the configs' own backbones
#
# It sets up .venv from PyPI (helpers/setup_env.sh). On a node without a package registry use
# `bash bench/device_check.sh OUT --sections configs` (the same runs, the node's own Python).
set -euo pipefail
cd "$(dirname "$0")/.."
source helpers/setup_env.sh
configs=$(cd train_configs && ls demo_*.toml | sed 's/\.toml$//')
exec python bench/shipped_configs.py --only $configs --backbone small --steps 3 --timeout 100 \
  --data "${DATA:-data/demo}" --out "${OUT:-outputs/gpu_smoke}" "$@"
