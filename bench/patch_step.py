"""Training-step time of the segmentation model against its patch size (4, 8, 16), side by side.

    python bench/patch_step.py [--backbone vit_tiny] [--head multiscale] [--repeats 7]

One process, float32, AdamW: forward + backward + optimizer step of the same backbone and head
on the same input at each patch size, repeats interleaved (patch 4, 8, 16, 4, 8, 16, ...), so
that the machine's noise falls on every size alike. Prints the median seconds per step (with
min and max), the ratio to patch 16, the token count and the analytic training FLOPs per
sample (``torchtitan.models.flops``). Cases: 2D 64^2 (batch 8) and 3D 32^3 (batch 2); the
``--crop2d`` / ``--crop3d`` / ``--batch2d`` / ``--batch3d`` flags change them.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from torchtitan.models import build_backbone
from torchtitan.models.flops import training_flops_per_sample
from torchtitan.models.segmentation import SegmentationModel


def build(backbone: str, head: str, ndim: int, patch: int, classes: int) -> SegmentationModel:
    model = SegmentationModel(build_backbone(backbone, ndim=ndim, in_chans=1, patch_size=patch),
                              classes, head=head)
    model.init_weights()
    return model


def step_fn(model: SegmentationModel, x: torch.Tensor, target: torch.Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def step() -> None:
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def run_case(args, ndim: int, crop: int, batch: int) -> list[str]:
    torch.manual_seed(0)
    x = torch.randn(batch, 1, *([crop] * ndim))
    target = (torch.rand(batch, 4, *([crop] * ndim)) > 0.5).float()
    steps, rows = {}, []
    for patch in args.patches:
        model = build(args.backbone, args.head, ndim, patch, 4)
        steps[patch] = (model, step_fn(model, x, target))
        for _ in range(2):  # warm-up
            steps[patch][1]()
    times: dict[int, list[float]] = {p: [] for p in args.patches}
    for _ in range(args.repeats):
        for patch in args.patches:
            t0 = time.perf_counter()
            steps[patch][1]()
            times[patch].append(time.perf_counter() - t0)
    ref = statistics.median(times[max(args.patches)])
    for patch in args.patches:
        model = steps[patch][0]
        t = times[patch]
        tokens = (crop // patch) ** ndim
        gflops = training_flops_per_sample(model, (1, *([crop] * ndim))) / 1e9
        rows.append(f"| {ndim}D {crop}^{ndim} x{batch} | {patch} | {tokens} | {gflops:.2f} | "
                    f"{statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f}) | "
                    f"{statistics.median(t) / ref:.2f} |")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="vit_tiny")
    parser.add_argument("--head", default="multiscale", choices=("linear", "upconv", "multiscale"))
    parser.add_argument("--patches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--crop2d", type=int, default=64)
    parser.add_argument("--batch2d", type=int, default=8)
    parser.add_argument("--crop3d", type=int, default=32)
    parser.add_argument("--batch3d", type=int, default=2)
    parser.add_argument("--cases", default="2d,3d", help="comma-separated: 2d, 3d")
    args = parser.parse_args(argv)
    if any(args.crop2d % p or args.crop3d % p for p in args.patches):
        parser.error("every patch size must divide --crop2d and --crop3d")
    print(f"{args.backbone} + {args.head} head, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} (min-max)\n")
    print("| case | patch | tokens | train GFLOP/sample | s/step | vs largest patch |")
    print("|---|---|---|---|---|---|")
    cases = {"2d": (2, args.crop2d, args.batch2d), "3d": (3, args.crop3d, args.batch3d)}
    for name in args.cases.split(","):
        for row in run_case(args, *cases[name]):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
