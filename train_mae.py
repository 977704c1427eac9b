"""MAE pretraining on unlabeled EM.

    torchrun --nproc_per_node 2 train_mae.py --job.config_file train_configs/debug_mae_2d.toml
"""

import sys
from functools import partial

from torchtitan.tasks import MAETask
from torchtitan.pictures.visualization import write_mae_visuals
from torchtitan.trainer import run

if __name__ == "__main__":
    # The picture writer is a product, handed to the task here: the core never imports products.
    sys.exit(run(partial(MAETask, visuals=write_mae_visuals)))
