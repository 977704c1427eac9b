#!/bin/bash
# SLURM batch script: MAE pretraining on several nodes with torchrun (one task per node).
#
#   sbatch --nodes 8 train_mae.sh train_configs/demo_mae.toml [--section.key value ...]
#   sbatch train_mae.sh [--section.key value ...]   # its default config, train_configs/demo_mae.toml
#
# Edit the #SBATCH lines (partition, account, GPUs per node, time) for your cluster.
#SBATCH --job-name=em-mae
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=72
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --requeue
# SIGUSR1 to the batch shell 5 minutes before the time limit: save, then requeue
# (helpers/slurm_launch.sh). Keep it above the time one step and one checkpoint save take.
#SBATCH --signal=B:USR1@300

# No config (nothing, or only overrides): the default one, the cluster-scale demo.
case "${1:-}" in ""|--*) set -- train_configs/demo_mae.toml "$@" ;; esac
SCRIPT=${SCRIPT:-train_mae.py}
# Under sbatch the script runs from a spool copy: find the repository from the submit folder.
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(dirname "$(readlink -f "$0")")}}
export REPO
exec bash "$REPO/helpers/slurm_launch.sh" "$SCRIPT" "$@"
