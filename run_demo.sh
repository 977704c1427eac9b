#!/usr/bin/env bash
# Command 1: set up the environment (once), generate the demo data (once), then run MAE
# pretraining and segmentation training started from the MAE encoder.
#
# Uses every local GPU (NCCL) or, without one, 2 CPU processes (gloo). Override with
#   NPROC=4 ./run_demo.sh
#   MAE_CONFIG=train_configs/... SEG_CONFIG=train_configs/... ./run_demo.sh
# Extra arguments go to both training commands, e.g. ./run_demo.sh --training.seed 1
set -euo pipefail
cd "$(dirname "$0")"
source helpers/setup_env.sh

MAE_CONFIG="${MAE_CONFIG:-train_configs/quickstart_mae_2d.toml}"
SEG_CONFIG="${SEG_CONFIG:-train_configs/quickstart_segmentation_2d.toml}"
DATA="${DATA:-data/demo}"
if [ -z "${NPROC:-}" ]; then
  NPROC=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
fi
launch() { torchrun --standalone --nproc_per_node "$NPROC" "$@"; }

start=$(date +%s)
python helpers/make_demo_data.py --out "$DATA"

echo "== MAE pretraining ($MAE_CONFIG, $NPROC processes)"
MAE_DUMP=$(python -c "import sys; from torchtitan.config.manager import ConfigManager as C; print(C().parse_args(sys.argv[1:]).job.dump_folder)" --job.config_file "$MAE_CONFIG" "$@")
launch train_mae.py --job.config_file "$MAE_CONFIG" --data.dataset_path "$DATA" "$@"

echo "== segmentation from the MAE encoder ($SEG_CONFIG)"
launch train_segmentation.py --job.config_file "$SEG_CONFIG" --data.dataset_path "$DATA" \
  --checkpoint.initial_load_path "$MAE_DUMP/checkpoint" \
  --checkpoint.initial_load_prefix_map "encoder.=backbone." "$@"

echo "== demo finished in $(( $(date +%s) - start )) s"
echo "MAE run:          $MAE_DUMP"
echo "segmentation run: $(python -c "import sys; from torchtitan.config.manager import ConfigManager as C; print(C().parse_args(sys.argv[1:]).job.dump_folder)" --job.config_file "$SEG_CONFIG" "$@")"
