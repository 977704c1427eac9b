#!/bin/bash
# SLURM array: predict.py as many jobs (shards) into one store; each job predicts its share of
# the blocks (--shard TASK/COUNT), and the one that finds every block written runs the last
# step (post-processing and instances across the blocks, pyramids, completion, --submission).
#
#   sbatch --array=0-15 predict.sh --checkpoint outputs/run/checkpoint --dataset jrc_hela-2 \
#       --out hela2.zarr --instances
#   python predict.py ... --finish      # the same arguments: the last step, if it was cut short
#
# A job that is stopped (preempted, a node lost: --requeue) resumes at the blocks it had not
# written. Arrays must count from 0 (--array=0-N). Edit the #SBATCH lines for your cluster.
#SBATCH --job-name=em-predict
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --time=4:00:00
#SBATCH --output=slurm-%x-%A_%a.out
#SBATCH --requeue

# Under sbatch the script runs from a spool copy: find the repository from the submit folder.
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(dirname "$(readlink -f "$0")")}}
TASK=${SLURM_ARRAY_TASK_ID:?"submit predict.sh as an array: sbatch --array=0-N predict.sh ..."}
COUNT=${SLURM_ARRAY_TASK_COUNT:?"submit predict.sh as an array: sbatch --array=0-N predict.sh ..."}
# One process per GPU of the node (the blocks of the shard are dealt out to them).
NPROC=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
exec torchrun --standalone --nproc_per_node "$NPROC" "$REPO/predict.py" "$@" \
    --shard "$TASK/$COUNT"
