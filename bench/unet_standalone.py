"""MONAI's BasicUNet trained the way its own users train it: the plain-PyTorch peer of
``bench/quality.py``.

    python bench/unet_standalone.py --config TOML [--section.key value ...] \\
        --budget SECONDS [--seed N] --out DUMP
    python bench/unet_standalone.py --config train_configs/own_em_segmentation_2d.toml \\
        --data.dataset_path data/mine --budget 480 --seed 0 --out outputs/unet2d_plain

``bench/quality.py``'s ``unet2d`` / ``unet3d`` rows put BasicUNet inside this project's trainer
(its sampler, augmentation, loss, schedule and processes). A U-Net may well want other things
than a ViT does, so this row trains it as a MONAI tutorial would, and the comparison does not
rest on our trainer suiting it:

* one process, on both CPU cores (``torch.set_num_threads(2)``);
* ``BasicUNet(spatial_dims, in_channels, out_channels)`` and nothing else: MONAI's default
  features (32, 32, 64, 128, 256, 32), instance norm and LeakyReLU;
* the training crops read whole into memory once; each step a batch of
  ``training.batch_size`` random windows of ``model.crop_size``: a crop drawn uniformly, a
  place in it uniformly (a 2D model takes one z-section), a crop smaller than the window
  centred in it and the rest left unannotated;
* a random flip of every spatial axis, each with probability 1/2 (``RandFlipd`` per axis);
* binary cross-entropy on the logits, one sigmoid per class, averaged over the voxels the
  labels annotate (unknown and not-annotated voxels, the project's validity masks, count
  nowhere);
* Adam at a constant learning rate of 1e-3 (no warm-up, no schedule, no weight decay, no
  clipping), until ``--budget`` seconds of training are spent (no step starts that would end
  past it, judged by the mean step time so far) or ``--steps`` steps are done; with
  ``--budgets 480,1440`` the one run is scored at each budget, the clock stopped while it
  validates (at a constant rate, the weights at 480 s are those of a 480 s run);
* then every validation crop predicted by ``monai.inferers.sliding_window_inference`` (window
  ``model.crop_size``, ``inference.overlap`` and ``inference.blend``, 0.25 and gaussian by
  default, ``inference.batch_size`` windows per forward; a 2D model's sections go through as
  one batch), sigmoid, masks at ``inference.threshold``, and scored exactly as the trainer's
  validation scores a crop (``score_prediction``, ``combine_scores``, ``validation_scores``;
  the post-processed scores as ``val_post/...``).

The config is read with the project's own parser (the TOML and ``--section.key value``
overrides, checked as the trainer checks them), for what both rows must share: the data
(``data.*``: path, voxel size, classes, validation crops), ``model.ndim``, ``model.crop_size``,
``model.in_chans``, ``training.batch_size`` and ``[inference]``. Its optimizer, schedule,
augmentation, loss and model are not used: those this row does its own way. ``--seed``
(default ``training.seed``) seeds the initialisation, the sampler and the flips.

Output: ``DUMP/logs/metrics.jsonl`` with one record per budget (one in all without
``--budgets``), like a trainer run's last validation: ``step`` (steps trained), the ``val/...``
and ``val_post/...`` scores, ``loss`` (mean of the last 50 steps), ``train_time_s`` (the
budgeted loop so far), ``budget_s`` and ``wall_time_s`` (the whole script up to the record).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from torchtitan.config.manager import ConfigManager
from torchtitan.data.volume_source import build_source
from torchtitan.scoring.metrics import combine_scores, validation_scores
from torchtitan.logging_metrics import MetricLogger
from torchtitan.postprocess.masks import PostProcessing
from torchtitan.tasks.segmentation import score_prediction

THREADS = 2  # the benchmark machine's cores, all of them for the one process
LR = 1e-3
LOG_EVERY = 50  # steps between progress lines; the logged loss is the mean of the last ones

logger = logging.getLogger("unet_standalone")


# --------------------------------------------------------------------------- data
def window(array: torch.Tensor, starts, size) -> torch.Tensor:
    """``array[:, starts : starts + size]`` (C, *spatial), zero (False) where the window leaves
    the array: a negative start or a window past the end reads padding."""
    out = array.new_zeros((array.shape[0], *size))
    src, dst = [slice(None)], [slice(None)]
    for start, n, extent in zip(starts, size, array.shape[1:]):
        lo, hi = max(start, 0), min(start + n, extent)
        src.append(slice(lo, hi))
        dst.append(slice(lo - start, hi - start))
    out[tuple(dst)] = array[tuple(src)]
    return out


class UniformWindows:
    """Random training windows of ``size`` from whole crops in memory, flipped at random.

    A crop is drawn uniformly, then a place in it uniformly along every axis; an axis shorter
    than the window is centred in it (the padding is EM 0 and not annotated, so the loss skips
    it). A 2D model (``len(size) == 2``) draws one z-section of the crop first.
    """

    def __init__(self, volumes, size, rng: np.random.Generator):
        self.volumes = volumes
        self.size = tuple(int(n) for n in size)
        self.rng = rng

    def sample(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        vol = self.volumes[self.rng.integers(len(self.volumes))]
        arrays = (vol.image, vol.target, vol.valid)  # (C, D, H, W) each
        if len(self.size) == 2:
            z = int(self.rng.integers(vol.shape[0]))
            arrays = tuple(a[:, z] for a in arrays)
        extents = arrays[0].shape[1:]
        starts = [int(self.rng.integers(e - n + 1)) if e >= n else -((n - e) // 2)
                  for e, n in zip(extents, self.size)]
        out = [window(a, starts, self.size) for a in arrays]
        flips = [1 + axis for axis in range(len(self.size)) if self.rng.random() < 0.5]
        return tuple(a.flip(flips) if flips else a for a in out)

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(image, target, valid), each (n, C or K, *size) float32."""
        samples = [self.sample() for _ in range(n)]
        return tuple(torch.stack([s[i] for s in samples]).float() for i in range(3))


# --------------------------------------------------------------------------- training
def masked_bce(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``BCEWithLogitsLoss`` per class and voxel, averaged over the annotated voxels only."""
    per_voxel = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    return (per_voxel * valid).sum() / valid.sum().clamp_min(1.0)


def train(model, windows: UniformWindows, batch_size: int, budgets: list[float], max_steps: int,
          on_budget=None):
    """The plain loop; returns (steps, seconds spent, mean loss of the last steps).

    ``budgets``: seconds of training, ascending; the loop ends at the last. At each earlier one
    (the first step boundary past which another step would end beyond it, judged by the mean
    step so far), ``on_budget(budget, steps, seconds, loss)`` is called with the clock stopped
    (its validation is not training time), then the loop goes on with the model in training
    mode: the weights at a budget are those a run of that budget alone ends with, since the
    rate is constant."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model.train()
    losses: list[float] = []
    pending = list(budgets)
    step, elapsed = 0, 0.0
    start = time.perf_counter()
    while True:
        image, target, valid = windows.batch(batch_size)
        loss = masked_bce(model(image), target, valid)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        losses.append(loss.item())
        elapsed = time.perf_counter() - start
        if step % LOG_EVERY == 0:
            logger.info("step %d: loss %.4f, %.0f s", step, statistics.fmean(losses[-LOG_EVERY:]),
                        elapsed)
        if max_steps and step >= max_steps:
            break
        while pending and elapsed + elapsed / step > pending[0]:
            budget = pending.pop(0)
            if not pending:
                break
            if on_budget is not None:
                paused = time.perf_counter()
                on_budget(budget, step, elapsed, statistics.fmean(losses[-LOG_EVERY:]))
                model.train()
                start += time.perf_counter() - paused  # the clock stood still meanwhile
        if budgets and not pending:
            break
    return step, elapsed, statistics.fmean(losses[-LOG_EVERY:])


# --------------------------------------------------------------------------- validation
@torch.no_grad()
def predict_probabilities(model, vol, cfg) -> torch.Tensor:
    """Per-class probabilities (K, D, H, W) of one whole crop, by MONAI's sliding window."""
    from monai.inferers import sliding_window_inference

    inf, ndim = cfg.inference, cfg.model.ndim
    # A 2D model sees the crop's z-sections as a batch of images (D, C, H, W).
    inputs = vol.image.movedim(1, 0) if ndim == 2 else vol.image[None]
    logits = sliding_window_inference(inputs, roi_size=tuple(cfg.model.crop_size),
                                      sw_batch_size=inf.batch_size, predictor=model,
                                      overlap=inf.overlap, mode=inf.blend)
    prob = torch.sigmoid(logits.float())
    return prob.movedim(0, 1) if ndim == 2 else prob[0]


def validate(model, source, cfg) -> dict[str, float]:
    """``val/...`` and ``val_post/...`` scores of every validation crop, combined as the
    trainer's validation (``SegmentationTask.validate``) combines them."""
    model.eval()
    inf, classes = cfg.inference, list(cfg.data.classes)
    post = PostProcessing.from_config(inf)
    per_crop, per_crop_post = [], []
    for crop in source.val_crops:
        vol = source.read_volume(crop)
        prob = predict_probabilities(model, vol, cfg)  # kept for post-processing that wants it
        raw, processed = score_prediction((prob > inf.threshold).numpy(), vol, post)
        per_crop.append(raw)
        if processed is not None:
            per_crop_post.append(processed)
        logger.info("validated %s %s", vol.name, tuple(vol.shape))
    scores = validation_scores(combine_scores(per_crop), classes) if per_crop else {}
    if per_crop_post:
        post_scores = validation_scores(combine_scores(per_crop_post), classes)
        scores.update({"val_post/" + k.removeprefix("val/"): v for k, v in post_scores.items()})
    return scores


# --------------------------------------------------------------------------- the run
def parse(argv):
    """This script's flags, and the project's config from ``--config`` plus every other flag
    (``--section.key value``), parsed and checked by the project's own parser."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--config", required=True, help="a train_configs/*.toml (segmentation)")
    parser.add_argument("--budget", type=float, default=0.0, help="seconds of training")
    parser.add_argument("--budgets", default="", metavar="S,S,...",
                        help="several budgets in seconds, ascending: one run scored at each "
                             "(a record per budget, with its train_time_s); replaces --budget")
    parser.add_argument("--steps", type=int, default=0,
                        help="train this many steps (with --budget: whichever comes first)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the initialisation, sampler and flips "
                             "(default: the config's training.seed)")
    parser.add_argument("--out", type=Path, required=True, help="dump folder (DUMP/logs/...)")
    args, overrides = parser.parse_known_args(argv)
    args.budgets = ([float(b) for b in args.budgets.split(",") if b.strip()] if args.budgets
                    else [args.budget] if args.budget > 0 else [])
    if args.budgets != sorted(set(args.budgets)) or any(b <= 0 for b in args.budgets):
        parser.error(f"--budgets {args.budgets}: positive seconds, ascending")
    if not args.budgets and args.steps <= 0:
        parser.error("give --budget SECONDS, --budgets S,S,... or --steps N")
    cfg = ConfigManager().parse_args(["--job.config_file", args.config, *overrides])
    return args, cfg


def main(argv=None) -> int:
    wall_start = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args, cfg = parse(sys.argv[1:] if argv is None else argv)
    from monai.networks.nets import BasicUNet

    torch.set_num_threads(THREADS)
    seed = cfg.training.seed if args.seed is None else args.seed
    torch.manual_seed(seed)
    m = cfg.model
    source = build_source(cfg)
    volumes = [source.read_volume(crop) for crop in source.train_crops]
    windows = UniformWindows(volumes, m.crop_size, np.random.default_rng(seed))
    model = BasicUNet(spatial_dims=m.ndim, in_channels=m.in_chans,
                      out_channels=len(cfg.data.classes))
    logger.info("BasicUNet %dD, %.1fM parameters; %d training crops in memory, windows %s, "
                "batch %d, budgets %s s, seed %d", m.ndim,
                sum(p.numel() for p in model.parameters()) / 1e6, len(volumes), m.crop_size,
                cfg.training.batch_size, args.budgets or "none", seed)
    (args.out / "logs" / "metrics.jsonl").unlink(missing_ok=True)  # a rerun replaces its records
    metrics = MetricLogger(str(args.out), "logs", enable_tensorboard=False, rank=0)

    def record(budget, steps, train_time, loss) -> dict[str, float]:
        scores = validate(model, source, cfg)
        extra = {"budget_s": budget} if budget else {}
        metrics.log(steps, {**scores, "loss": loss, "train_time_s": train_time, **extra,
                            "wall_time_s": time.perf_counter() - wall_start})
        logger.info("%s: %d steps, %.0f s of training, mean IoU %.3f",
                    f"budget {budget:.0f} s" if budget else "trained", steps, train_time,
                    scores.get("val/mean_iou", float("nan")))
        return scores

    steps, train_time, loss = train(model, windows, cfg.training.batch_size, args.budgets,
                                    args.steps, on_budget=record)
    logger.info("trained %d steps in %.0f s (%.3f s/step), loss %.4f", steps, train_time,
                train_time / steps, loss)
    record(args.budgets[-1] if args.budgets else 0.0, steps, train_time, loss)
    metrics.close()
    logger.info("scores: %s", args.out / "logs" / "metrics.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
