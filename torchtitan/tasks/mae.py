"""Masked-autoencoder pretraining on unlabeled EM.

The masking noise of each sample is drawn by the data pipeline from the sample's own
generator (keyed by its global index), so which patches are hidden does not depend on how
the batch is split across ranks.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from torchtitan.datasets.cellmap import discover
from torchtitan.datasets.loader import build_mae_samples
from torchtitan.models import MaskedAutoencoder, build_backbone, training_flops_per_sample
from torchtitan.models.mae import mae_loss_terms
from torchtitan.tasks.common import check_backbone

logger = logging.getLogger(__name__)

# Validation draws its samples from a separate stream (seed + offset): a fixed held-out set
# of crops, identical at every evaluation.
VAL_SEED_OFFSET = 1_000_003
VAL_SAMPLES = 32


class MAETask:
    name = "mae"
    best_metric, best_higher = "val/reconstruction_loss", False  # marks the best checkpoint

    def __init__(self, cfg):
        self.cfg = cfg

    def prepare(self) -> None:
        check_backbone(self.cfg)
        self.sources = discover(self.cfg.data.dataset_path)
        logger.info("MAE data: %d EM volumes (%s)", len(self.sources),
                    ", ".join(s.name for s in self.sources))

    def num_patches(self) -> int:
        return math.prod(c // self.cfg.model.patch_size for c in self.cfg.model.crop_size)

    def train_dataset(self, seed_offset: int = 0):
        return build_mae_samples(self.cfg, self.sources, seed_offset, num_patches=self.num_patches())

    def build_model(self) -> MaskedAutoencoder:
        m = self.cfg.model
        encoder = build_backbone(m.backbone, ndim=m.ndim, in_chans=m.in_chans,
                                 patch_size=m.patch_size, attention=m.attention)
        return MaskedAutoencoder(encoder, decoder_dim=m.decoder_dim, decoder_depth=m.decoder_depth,
                                 decoder_num_heads=m.decoder_num_heads, norm_pix_loss=m.norm_pix_loss)

    def flops_per_sample(self, model) -> float:
        return training_flops_per_sample(model, (self.cfg.model.in_chans, *self.cfg.model.crop_size))

    def loss_terms(self, model, batch):
        _, pred, mask = model(batch["image"], self.cfg.model.mask_ratio, batch["noise"],
                              batch["valid"])
        return mae_loss_terms(batch["image"], pred.float(), mask, self.cfg.model.patch_size,
                              batch["valid"], self.cfg.model.norm_pix_loss)

    def validate(self, model, trainer) -> dict[str, float]:
        """Reconstruction loss on a fixed held-out set of crops, split evenly across dp ranks
        (so sharded models run the same number of forwards everywhere)."""
        dp, rank = trainer.dims.dp_degree, trainer.dp_rank
        n = -(-VAL_SAMPLES // dp) * dp
        data = self.train_dataset(VAL_SEED_OFFSET)
        indices = list(range(n))[rank::dp]
        bs = max(1, self.cfg.training.batch_size // dp)
        total = torch.zeros(2, dtype=torch.float64)
        for i in range(0, len(indices), bs):
            items = [data[j] for j in indices[i:i + bs]]
            batch = {k: torch.stack([it[k] for it in items]).to(trainer.device) for k in items[0]}
            s, c = self.loss_terms(model, batch)
            total += torch.stack([s.detach().double().cpu(), c.detach().double().cpu()])
        if trainer.dp_mesh is not None:
            dist.all_reduce(total, group=trainer.dp_mesh.get_group())
        return {"val/reconstruction_loss": float(total[0] / total[1].clamp_min(1))}

    def summary(self, scores: dict[str, float]) -> None:
        cfg = self.cfg
        print(f"\nMAE pretraining finished: {cfg.job.dump_folder}")
        print(f"  checkpoints: {cfg.job.dump_folder}/{cfg.checkpoint.folder}")
        print(f"  logs:        {cfg.job.dump_folder}/{cfg.metrics.save_tb_folder}")
        if "val/reconstruction_loss" in scores:
            print(f"  val reconstruction loss: {scores['val/reconstruction_loss']:.4f}")
