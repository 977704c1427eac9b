"""Supervised segmentation of EM with a DINOv3-architecture ViT.

    torchrun --nproc_per_node 2 train_segmentation.py \
        --job.config_file train_configs/debug_segmentation_2d.toml
"""

import sys

from torchtitan.tasks import SegmentationTask
from torchtitan.trainer import run

if __name__ == "__main__":
    sys.exit(run(SegmentationTask))
