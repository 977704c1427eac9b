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

# Preemption and time limits (docs/scaling.md, docs/reliability.md):
# `#SBATCH --signal=B:USR1@300` sends SIGUSR1 to this batch shell 300 s before the end; the trap below forwards it to srun, which
# passes it to every torchrun; torchrun (with SIGUSR1 in --signals_to_handle) passes it to its
# workers and gives them --shutdown_timeout seconds before SIGKILL. The workers finish the
# step, save a checkpoint, write $TORCHTITAN_REQUEUE_FILE and exit with code 3; torchrun then
# exits 1 whatever the workers' codes, so this script looks for the file and requeues the job
# (scontrol requeue), which resumes from that checkpoint. training.time_limit does the same
# from inside, counted from TORCHTITAN_LAUNCH_TIME.
export TORCHTITAN_LAUNCH_TIME=${TORCHTITAN_LAUNCH_TIME:-$(date +%s)}
export TORCHTITAN_REQUEUE_FILE=${TORCHTITAN_REQUEUE_FILE:-$REPO/outputs/.requeue-${SLURM_JOB_ID:-local}}
mkdir -p "$(dirname "$TORCHTITAN_REQUEUE_FILE")"
rm -f "$TORCHTITAN_REQUEUE_FILE"

echo "job ${SLURM_JOB_ID:-local}: $NNODES nodes x $GPUS_PER_NODE GPUs, rendezvous $HEAD_NODE:$RDZV_PORT"
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  torchrun \
    --nnodes "$NNODES" \
    --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_backend c10d \
    --rdzv_endpoint "$HEAD_NODE:$RDZV_PORT" \
    --rdzv_id "${SLURM_JOB_ID:-local}" \
    --max_restarts "${MAX_RESTARTS:-3}" \
    --signals_to_handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" \
    --shutdown_timeout "${SHUTDOWN_TIMEOUT:-240}" \
    "$ENTRY" --job.config_file "$CONFIG" "$@" &
SRUN_PID=$!
forward() { echo "received SIG$1: forwarding it to the training processes"; kill -"$1" "$SRUN_PID" 2>/dev/null || true; }
trap 'forward USR1' USR1
trap 'forward TERM' TERM
status=0
# `wait` returns early (>128) when a trapped signal arrives: wait again until srun has ended.
while true; do
  wait "$SRUN_PID" && status=0 || status=$?
  kill -0 "$SRUN_PID" 2>/dev/null || break
done
if [ -f "$TORCHTITAN_REQUEUE_FILE" ]; then
  echo "training saved a checkpoint for a requeue ($(cat "$TORCHTITAN_REQUEUE_FILE")): scontrol requeue ${SLURM_JOB_ID:-}"
  if [ -n "${SLURM_JOB_ID:-}" ]; then scontrol requeue "$SLURM_JOB_ID"; fi
  exit 0
fi
exit "$status"
