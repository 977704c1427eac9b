"""Masked-autoencoder pretraining on unlabeled EM: the EM of the run's volume source
(``data/volume_source.py``: the zarr stores of ``data.dataset_path``, or the EM images of a
slices dataset, 2D only).

Validation tells whether the pretraining learns: the reconstruction loss of a fixed set of
crops of held-out EM (inside the crops ``data.val_crops`` names, which training never sees),
beside the loss of the trivial reconstruction (every hidden voxel the mean of the visible ones),
and pictures of the first few of those crops.

The masking noise of each sample is drawn by the data pipeline from the sample's own
generator (keyed by its global index), so which patches are hidden does not depend on how
the batch is split across ranks.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan.config.context_parallel import mae_problems
from torchtitan.data.sampling.augment import Augmenter
from torchtitan.errors import ConfigError
from torchtitan.data.sampling.batch import Batch, collate
from torchtitan.data.volume_source import VolumeSource, build_source
from torchtitan.models import MaskedAutoencoder, build_backbone, training_flops_per_sample
from torchtitan.models.context import context_shard, local_part
from torchtitan.models.mae import mae_loss_terms, patchify, unpatchify
from torchtitan.tasks.base import ValidationContext
from torchtitan.tasks.common import TaskBase, check_backbone

# Validation draws its samples from a separate stream (seed + offset): a fixed held-out set
# of crops, identical at every evaluation.
VAL_SEED_OFFSET = 1_000_003
VAL_SAMPLES = 32
PICTURES = 4  # held-out crops drawn at each validation (rank 0's first ones)


class MAETask(TaskBase):
    """MAE pretraining; ``visuals`` (:class:`~torchtitan.tasks.base.MAEVisuals`) draws a held-out sample."""

    name = "mae"
    best_metric, best_higher = "val/reconstruction_loss", False  # marks the best checkpoint

    def prepare(self) -> None:
        check_backbone(self.cfg)
        self._check_context_parallel()
        self.source: VolumeSource = build_source(self.cfg, labels=False)  # it logs what it holds
        self.train_dataset()  # held-out crops that leave no room for training fail here

    def _check_context_parallel(self) -> None:
        """Under context parallelism each rank encodes an equal part of the kept patches
        (:func:`torchtitan.config.context_parallel.mae_problems`)."""
        m = self.cfg.model
        problems = mae_problems(self.cfg.training.context_parallel_degree,
                                crop_size=m.crop_size, patch_size=m.patch_size,
                                mask_ratio=m.mask_ratio)
        if problems:
            raise ConfigError("; ".join(problems))

    def num_patches(self) -> int:
        return math.prod(c // self.cfg.model.patch_size for c in self.cfg.model.crop_size)

    def train_dataset(self):
        return self.source.mae_dataset(num_patches=self.num_patches())

    def validation_dataset(self):
        """The fixed held-out stream: its own seed, no augmentation."""
        return self.source.mae_dataset(VAL_SEED_OFFSET, num_patches=self.num_patches(),
                                       augment=False, validation=True)

    def build_model(self) -> MaskedAutoencoder:
        m = self.cfg.model
        encoder = build_backbone(m.backbone, ndim=m.ndim, in_chans=m.in_chans,
                                 patch_size=m.patch_size, attention=m.attention)
        return MaskedAutoencoder(encoder, decoder_dim=m.decoder_dim, decoder_depth=m.decoder_depth,
                                 decoder_num_heads=m.decoder_num_heads, norm_pix_loss=m.norm_pix_loss)

    def flops_per_sample(self, model) -> float:
        m = self.cfg.model
        return training_flops_per_sample(model, (m.in_chans, *m.crop_size), mask_ratio=m.mask_ratio)

    def _forward(self, model, batch):
        """(pred, mask, (sum, count)) of one batch."""
        shard = context_shard(model)  # the part of every sample the model computes (or None)
        pred, mask = model(batch.image, self.cfg.model.mask_ratio, batch.noise)
        # The loss, once, outside the model: on the fp32 image (FSDP casts the model's inputs),
        # under context parallelism on the slab of it whose patches this rank predicted.
        terms = mae_loss_terms(local_part(shard, batch.image), pred, mask,
                               self.cfg.model.patch_size, local_part(shard, batch.valid),
                               self.cfg.model.norm_pix_loss)
        return pred, mask, terms

    def loss_terms(self, model, batch):
        return self._forward(model, batch)[2]

    def _picture(self, ctx: ValidationContext, images, preds, masks) -> None:
        """Masked input / reconstruction / original of the first held-out crops, handed to
        the picture writer (a PNG in ``visuals/`` and a TensorBoard image)."""
        m = self.cfg.model
        image = torch.cat(images)[:PICTURES].float().cpu()
        target = patchify(image, m.patch_size, m.ndim)
        recon = torch.cat(preds)[:PICTURES].float().cpu()
        if m.norm_pix_loss:  # predictions are per-patch normalised: undo with the true stats
            mean = target.mean(-1, keepdim=True)
            std = target.var(-1, keepdim=True, unbiased=True).add(1e-6).sqrt()
            recon = recon * std + mean
        hidden = torch.cat(masks)[:PICTURES].cpu().bool()[..., None]
        grid = [c // m.patch_size for c in m.crop_size]
        masked = unpatchify(target.masked_fill(hidden, float("nan")), m.patch_size, grid, m.in_chans)
        shown = unpatchify(torch.where(hidden, recon, target), m.patch_size, grid, m.in_chans)
        self.visuals(Path(self.cfg.job.dump_folder) / "visuals", ctx.step, image, masked,
                     shown, writer=ctx.writer)

    def _baseline_terms(self, batch: Batch, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum, count) of the loss of the trivial reconstruction: every hidden voxel the mean
        of the sample's visible patches (with ``norm_pix_loss``, each hidden patch its own
        mean: 0 in the normalised values the loss compares)."""
        m = self.cfg.model
        target = patchify(batch.image.float(), m.patch_size, m.ndim)
        if m.norm_pix_loss:
            flat = torch.zeros_like(target)
        else:
            visible = 1 - mask.float()
            mean = (target.mean(-1) * visible).sum(1) / visible.sum(1).clamp_min(1)
            flat = mean[:, None, None].expand_as(target)
        return mae_loss_terms(batch.image, flat, mask, m.patch_size, batch.valid, m.norm_pix_loss)

    def validate(self, model, ctx: ValidationContext) -> dict[str, float]:
        """Reconstruction loss on a fixed held-out set of crops, split evenly across dp ranks
        (so sharded models run the same number of forwards everywhere), and that of the
        trivial reconstruction (``val/baseline_loss``): a model that learns the EM's structure
        ends well below it."""
        dp, rank = ctx.dp_degree, ctx.dp_rank
        n = -(-VAL_SAMPLES // dp) * dp
        data = self.validation_dataset()
        indices = list(range(n))[rank::dp]
        bs = max(1, self.cfg.training.batch_size // dp)
        total = torch.zeros(4, dtype=torch.float64)
        shown: tuple[list, list, list] = ([], [], [])
        for i in range(0, len(indices), bs):
            batch = collate([data[j] for j in indices[i:i + bs]]).to(ctx.device)
            batch = Augmenter.device(batch)  # nothing to do without augmentation
            pred, mask, terms = self._forward(model, batch)
            terms = (*terms, *self._baseline_terms(batch, mask))
            total += torch.stack([t.detach().double().cpu() for t in terms])
            if len(shown[0]) * bs < PICTURES:
                for kept, x in zip(shown, (batch.image, pred, mask)):
                    kept.append(x.detach())
        if rank == 0 and ctx.writes_files and self.visuals is not None:
            self._picture(ctx, *shown)  # from global rank 0
        if ctx.dp_group is not None:
            dist.all_reduce(total, group=ctx.dp_group)
        return {"val/reconstruction_loss": float(total[0] / total[1].clamp_min(1)),
                "val/baseline_loss": float(total[2] / total[3].clamp_min(1))}

    def summary(self, scores: dict[str, float]) -> None:
        cfg = self.cfg
        print(f"\nMAE pretraining finished: {cfg.job.dump_folder}")
        print(f"  checkpoints: {cfg.job.dump_folder}/{cfg.checkpoint.folder}")
        print(f"  logs:        {cfg.job.dump_folder}/{cfg.metrics.save_tb_folder}")
        if "val/reconstruction_loss" in scores:
            print(f"  val reconstruction loss: {scores['val/reconstruction_loss']:.4f} (the "
                  f"mean of the visible patches: {scores['val/baseline_loss']:.4f})")
