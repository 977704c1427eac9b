"""How much the initial weights alone move a short segmentation training.

    python bench/init_seeds.py --data /path/to/imported/store --steps 150 \\
        --config train_configs/own_em_segmentation_2d.toml --crop 128,128 --batch 8 \\
        --run 0:0 --run 0:1 --run 1:0 --run 1:1

Each ``--run BACKBONE:HEAD`` initialises the backbone's tensors from seed BACKBONE and the
head's from seed HEAD (the trainer's seeded init, ``parallelisms/seeded_init.py``), then
trains in one process exactly as the trainer does on one rank: the same batches (data seed =
the config's ``training.seed``), optimizer, schedule, loss and clipping. It prints the loss of
the steps 1, 50, 100, ... of every run side by side. Equal batches make the rows comparable
step by step: what differs is only where the weights started.

Why it matters: the seeded init gives a tensor the same values in every model where it has
the same name and shape, so models that share a head's first layers (every patch size and
width of the ``multiscale`` head) also share their luck. Comparisons of models or recipes at
a few hundred steps need several seeds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from torchtitan.config.manager import ConfigManager
from torchtitan.data.sampling.augment import Augmenter
from torchtitan.data.sampling.loader import build_loader
from torchtitan.optimizer import build_lr_scheduler, build_optimizer
from torchtitan.parallelisms.parallelize import clip_grad_norm_
from torchtitan.parallelisms.seeded_init import init_model, model_tensors
from torchtitan.tasks import SegmentationTask

REPO = Path(__file__).resolve().parents[1]


def build(task: SegmentationTask, backbone_seed: int, head_seed: int) -> torch.nn.Module:
    with torch.device("meta"):
        model = task.build_model()
    model.to_empty(device="cpu")
    names = [e.name for e in model_tensors(model)]
    head = [n for n in names if not n.startswith("backbone.")]
    backbone = [n for n in names if n.startswith("backbone.")]
    init_model(model, backbone_seed, skip=head)
    init_model(model, head_seed, skip=backbone)
    return model.train()


def train(task, cfg, loader_batches, steps: int, log_every: int, seeds) -> dict[int, float]:
    model = build(task, *seeds)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg)
    losses = {}
    for step, batch in enumerate(loader_batches[:steps], start=1):
        loss_sum, count = task.loss_terms(model, batch)
        loss = loss_sum / count.clamp_min(1)
        loss.backward()
        clip_grad_norm_(model.parameters(), cfg.training.max_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step % log_every == 0:
            losses[step] = loss.item()
    return losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a store in the CellMap layout")
    p.add_argument("--config", default=str(REPO / "train_configs" / "own_em_segmentation_2d.toml"))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--crop", default="128,128")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--run", action="append", default=None, metavar="BACKBONE:HEAD",
                   help="seeds of the backbone's and the head's initial weights")
    args, flags = p.parse_known_args(argv)  # the rest: config flags, e.g. --data.val_crops a
    runs = [tuple(int(s) for s in r.split(":")) for r in (args.run or ["0:0", "0:1", "1:0"])]
    cfg = ConfigManager().parse_args(
        ["--job.config_file", args.config, "--data.dataset_path", args.data,
         "--model.crop_size", args.crop, "--training.batch_size", str(args.batch),
         "--training.steps", str(args.steps), "--data.num_workers", "0", *flags])
    torch.manual_seed(cfg.training.seed)
    task = SegmentationTask(cfg)
    task.prepare()
    loader = build_loader(task.train_dataset(), args.batch, 0, 1, 0, 0)
    batches = []
    for batch in loader:  # the trainer's batches of a one-rank run, drawn once for every run
        batches.append(Augmenter.device(batch.to(torch.device("cpu"))))
        if len(batches) == args.steps:
            break
    results = {seeds: train(task, cfg, batches, args.steps, args.log_every, seeds)
               for seeds in runs}
    steps = sorted(next(iter(results.values())))
    print("| backbone:head seeds | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for (b, h), losses in results.items():
        print(f"| {b}:{h} | " + " | ".join(f"{losses[s]:.4f}" for s in steps) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
