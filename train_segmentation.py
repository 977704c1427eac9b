"""Supervised segmentation of EM with a DINOv3-architecture ViT.

    torchrun --nproc_per_node 2 train_segmentation.py \
        --job.config_file train_configs/debug_segmentation_2d.toml
"""

import sys
from functools import partial

from torchtitan.tasks import SegmentationTask
from torchtitan.pictures.visualization import write_validation_visuals
from torchtitan.trainer import run

if __name__ == "__main__":
    # The picture writer is a product, handed to the task here: the core never imports products.
    sys.exit(run(partial(SegmentationTask, visuals=write_validation_visuals)))
