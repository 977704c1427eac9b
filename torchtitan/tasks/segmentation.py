"""Supervised segmentation: backbone + head, masked losses, validation on whole held-out crops."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from torchtitan.cellmap.affinities import (AffinitySpec, channel_offsets, face_channels,
                                           output_channels, split_outputs)
from torchtitan.data.sampling.batch import Batch
from torchtitan.data.volume_source import READ_ERRORS, CropVolume, VolumeSource, build_source
from torchtitan.scoring.metrics import combine_scores, score_crop, validation_scores
from torchtitan.inference.sliding_window import VolumePredictor
from torchtitan.models import (
    SegmentationModel,
    build_backbone,
    build_loss,
    training_flops_per_sample,
)
from torchtitan.models.context import context_shard, local_part
from torchtitan.models.losses import Loss
from torchtitan.postprocess.masks import PostProcessing, postprocess
from torchtitan.tasks.base import SegmentationVisuals, ValidationContext
from torchtitan.tasks.common import TaskBase, check_backbone

logger = logging.getLogger(__name__)


def most_forwards(count: int, ctx) -> int:
    """The largest ``count`` over data-parallel ranks when the model is sharded, else ``count``
    (``ctx``: the :class:`ValidationContext`).

    Sharded (FSDP) forwards all-gather parameters, so every rank must run the same number of
    them: a rank with less work pads with idle forwards up to this number. Call it before any
    forward, so that the all-reduce here is matched on every rank.
    """
    if not ctx.sharded or ctx.dp_group is None:
        return count
    most = torch.tensor(count, dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=ctx.dp_group)
    return int(most)


def score_prediction(pred: np.ndarray, vol: CropVolume, post: PostProcessing,
                     affinities: dict | None = None,
                     timing: dict | None = None) -> tuple[dict, dict | None]:
    """One validation crop's scores (:func:`evaluation.score_crop`) of predicted masks ``pred``
    (C, *spatial; boolean, one channel per ``vol.classes``), raw and after ``post`` (None when
    post-processing is off), which cuts the classes of ``affinities`` (``{class:
    (probabilities, offsets)}``) from them; ``timing["post_s"]`` adds the seconds the
    post-processing took. What validation and ``bench/`` peers score a crop with."""
    target, valid = vol.target.numpy(), vol.valid.numpy()
    channel = {name: k for k, name in enumerate(vol.classes) if name in vol.annotated}
    truth = {n: vol.instance_ids.get(n, target[k]) for n, k in channel.items()}
    valid_by_class = {n: valid[k] for n, k in channel.items()}
    masks = {n: pred[k] for n, k in channel.items()}
    raw = score_crop(masks, truth, valid_by_class, vol.voxel_size)
    if not (post.enabled or post.cuts_affinities(affinities)):
        return raw, None
    start = time.perf_counter()
    processed = postprocess(masks, vol.voxel_size, post, affinities=affinities)
    if timing is not None:
        timing["post_s"] = timing.get("post_s", 0.0) + time.perf_counter() - start
    return raw, score_crop(processed, truth, valid_by_class, vol.voxel_size)


class SegmentationTask(TaskBase):
    """Supervised segmentation; ``visuals`` (:class:`SegmentationVisuals`) writes each
    validation crop's GIF and TensorBoard image."""

    name = "segmentation"
    # Marks the best checkpoint: the raw prediction's score, whatever the post-processing.
    best_metric, best_higher = "val/mean_iou", True

    def __init__(self, cfg, visuals: SegmentationVisuals | None = None):
        super().__init__(cfg, visuals)
        self._val_cache: dict[int, CropVolume] = {}  # by position in source.val_crops
        # The model's outputs: the classes, then the affinities of [affinities] (if any).
        self.affinities = AffinitySpec.from_config(cfg)
        self.channels = output_channels(cfg.data.classes, self.affinities)
        # Per output channel, its affinity offset (None for a class): how test-time flips
        # realign it; None without affinities.
        self.channel_offsets = (channel_offsets(cfg.data.classes, self.affinities)
                                if len(self.affinities) else None)
        self._loss: Loss | None = None  # model.loss with its class weights (loss_terms)

    # -- data -----------------------------------------------------------------------------------

    def prepare(self) -> None:
        check_backbone(self.cfg)
        self.source: VolumeSource = build_source(self.cfg)  # it logs what it holds

    def train_dataset(self):
        return self.source.segmentation_dataset()

    # -- model ----------------------------------------------------------------------------------

    def build_model(self) -> SegmentationModel:
        m = self.cfg.model
        backbone = build_backbone(m.backbone, ndim=m.ndim, in_chans=m.in_chans,
                                  patch_size=m.patch_size, attention=m.attention)
        boundary = self.cfg.affinities.boundary
        boundary_from = None
        if boundary:  # the class from the face affinities of the one affinity class
            boundary_from = (self.channels.index(boundary),
                             face_channels(self.cfg.data.classes, self.affinities,
                                           self.affinities.classes[0]))
        return SegmentationModel(backbone, len(self.channels), head=m.head,
                                 out_layers=m.backbone_out_layers, head_channels=m.head_channels,
                                 head_min_channels=m.head_min_channels,
                                 head_image_levels=m.head_image_levels,
                                 freeze_backbone=m.freeze_backbone, boundary_from=boundary_from)

    def flops_per_sample(self, model) -> float:
        return training_flops_per_sample(model, (self.cfg.model.in_chans, *self.cfg.model.crop_size))

    def loss_terms(self, model, batch: Batch):
        """(sum, count) of the configured loss (``model.loss``, see ``models/losses.py``).

        The model gives its logits before their linear resize to the targets' size (the linear
        head's are on the patch grid) and the loss resizes them slab by slab, never holding
        the full-resolution logits (``Loss.resized``): the same loss, at a fraction of the
        memory and time. Under context parallelism the logits are this rank's slab at full
        resolution: so are the targets."""
        m = self.cfg.model
        shard = context_shard(model)  # the part of every sample the model computes (or None)
        logits = model(batch.image, output_size=batch.target.shape[2:], resize=False)
        if self._loss is None:  # built once: compiled with the model (training.compile)
            weights = None
            total = self.cfg.affinities.loss_weight  # a class's affinities together; 0: 1 each
            per_offset = total / len(self.affinities.offsets) if total else 1.0
            if m.class_weights or per_offset != 1.0:
                weights = torch.tensor((m.class_weights or [1.0] * len(self.cfg.data.classes))
                                       + [per_offset] * len(self.affinities),
                                       device=logits.device)
            self._loss = build_loss(m.loss, weights, compiled=self.cfg.training.compile)
        target, valid = local_part(shard, batch.target), local_part(shard, batch.valid)
        return self._loss.resized(logits, target.shape[2:], target, valid)

    # -- validation -----------------------------------------------------------------------------

    def _val_volume(self, i: int) -> CropVolume:
        """The ``i``-th validation crop, whole on the training grid (cached: crops are small)."""
        if i not in self._val_cache:
            self._val_cache[i] = self.source.read_volume(self.source.val_crops[i])
        return self._val_cache[i]

    def validate(self, model, ctx: ValidationContext) -> dict[str, float]:
        """Predict each rank's whole validation crops (sliding window), score them with the
        CellMap challenge's 2025 metric over all ranks' crops (``evaluation.combine_scores``, what
        the scoring command prints for the same masks: ``val/score``), and write a GIF
        of each crop's EM, ground truth and prediction to ``dump_folder/visuals`` when the task
        has a picture writer.

        With post-processing set in ``[inference]`` (``torchtitan/postprocess/masks.py``), the
        post-processed masks are scored too and reported as ``val_post/...`` (same names after
        the prefix) beside the raw ``val/...`` scores; the best checkpoint stays the raw one's.
        """
        cfg, inf = self.cfg, self.cfg.inference
        post = PostProcessing.from_config(inf)
        classes = list(cfg.data.classes)
        crops = self.source.val_crops
        mine = range(ctx.dp_rank, len(crops), ctx.dp_degree)  # this rank's crops, by position
        predictor = VolumePredictor.from_config(model, cfg, ctx.device,
                                                num_outputs=len(self.channels),
                                                channel_offsets=self.channel_offsets)
        # Sharded models need the same number of forwards on every rank: count them first.
        forwards = {i: predictor.forward_count(self.source.grid(crops[i])[1]) for i in mine}
        calls = sum(forwards.values())
        idle = most_forwards(calls, ctx) - calls
        per_crop, per_crop_post = [], []
        skipped = 0
        for i in mine:
            try:
                vol = self._val_volume(i)
            except READ_ERRORS as e:
                # Like a training read (data/resampled): warn, count, go on. This rank still
                # runs the crop's forwards (idle) so that sharded ranks stay in step.
                logger.warning("validation crop %s skipped: %s", crops[i].full_name, e)
                skipped += 1
                idle += forwards[i]
                continue
            prob, affinities = predictor.predict_volume(vol.image).numpy(), {}
            if len(self.channels) > len(classes):  # the classes' channels, then the affinities
                prob, affinities = split_outputs(prob, classes, self.affinities)
            pred = prob > inf.threshold
            raw, processed = score_prediction(pred, vol, post, affinities)
            per_crop.append(raw)
            if processed is not None:
                per_crop_post.append(processed)
            if ctx.writes_files and self.visuals is not None:
                self._visualize(ctx, vol, pred, classes)
        predictor.idle_forwards(idle)
        if ctx.dp_group is not None:
            gathered: list = [None] * ctx.dp_degree
            dist.all_gather_object(gathered, (per_crop, per_crop_post, skipped), group=ctx.dp_group)
            per_crop = [c for rank_crops, _, _ in gathered for c in rank_crops]
            per_crop_post = [c for _, rank_crops, _ in gathered for c in rank_crops]
            skipped = sum(n for _, _, n in gathered)
        scores = validation_scores(combine_scores(per_crop), classes) if per_crop else {}
        if per_crop_post:
            post_scores = validation_scores(combine_scores(per_crop_post), classes)
            scores.update({"val_post/" + k.removeprefix("val/"): v for k, v in post_scores.items()})
        scores["val/skipped_crops"] = float(skipped)
        return scores

    def _visualize(self, ctx: ValidationContext, vol: CropVolume, pred, classes) -> None:
        self.visuals(
            Path(self.cfg.job.dump_folder) / "visuals", vol.name, ctx.step,
            vol.image[0].numpy(), vol.target.numpy(), pred, classes,
            valid=vol.valid.numpy(), writer=ctx.writer)

    def summary(self, scores: dict[str, float]) -> None:
        cfg = self.cfg
        print(f"\nsegmentation finished: {cfg.job.dump_folder}")
        print(f"  checkpoints: {cfg.job.dump_folder}/{cfg.checkpoint.folder}")
        print(f"  logs:        {cfg.job.dump_folder}/{cfg.metrics.save_tb_folder} "
              "(metrics.jsonl, TensorBoard)")
        for name in cfg.data.classes:
            if f"val/iou/{name}" in scores:
                print(f"  val IoU {name:>10s}: {scores[f'val/iou/{name}']:.3f}")
        if "val/mean_iou" in scores:
            print(f"  val mean IoU:      {scores['val/mean_iou']:.3f}")
        if "val_post/mean_iou" in scores:
            print(f"  post-processed mean IoU: {scores['val_post/mean_iou']:.3f} "
                  "([inference] post-processing; val_post/... in the logs)")
