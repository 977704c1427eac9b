#!/bin/bash
# Shared body of train_mae.sh and train_segmentation.sh: start one torchrun per node with srun,
# rendezvous (c10d) on the first node of the allocation.
#   helpers/slurm_launch.sh ENTRY_SCRIPT CONFIG_TOML [--section.key value ...]
set -euo pipefail
ENTRY=$1
CONFIG=${2:?usage: sbatch train_*.sh CONFIG_TOML [--section.key value ...]}
shift 2
# Under sbatch, $0 is a copy in SLURM's spool folder: use the submission folder instead.
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}}
cd "$REPO"
if [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi

GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}}
GPUS_PER_NODE=${GPUS_PER_NODE:-1}
NNODES=${SLURM_NNODES:-1}
HEAD_NODE=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}" | head -n 1)
RDZV_PORT=${RDZV_PORT:-29500}

# NCCL: fail fast on hangs, report errors; set NCCL_SOCKET_IFNAME / NCCL_IB_HCA for your fabric.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export PYTHONUNBUFFERED=1

echo "job ${SLURM_JOB_ID:-local}: $NNODES nodes x $GPUS_PER_NODE GPUs, rendezvous $HEAD_NODE:$RDZV_PORT"
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  torchrun \
    --nnodes "$NNODES" \
    --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_backend c10d \
    --rdzv_endpoint "$HEAD_NODE:$RDZV_PORT" \
    --rdzv_id "${SLURM_JOB_ID:-local}" \
    --max_restarts "${MAX_RESTARTS:-3}" \
    "$ENTRY" --job.config_file "$CONFIG" "$@"
