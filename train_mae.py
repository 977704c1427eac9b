"""MAE pretraining on unlabeled EM.

    torchrun --nproc_per_node 2 train_mae.py --job.config_file train_configs/debug_mae_2d.toml
"""

import sys

from torchtitan.tasks import MAETask
from torchtitan.trainer import run

if __name__ == "__main__":
    sys.exit(run(MAETask))
