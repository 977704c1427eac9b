"""Segmentation quality at equal wall-clock budget: our ViT configs against MONAI's U-Nets.

    .venv/bin/pip install --no-deps monai==1.6.1      # benchmark only, not a project dependency
    python bench/quality.py                           # demo data, 8 minutes per model
    python bench/quality.py --budget 480 --data /path/to/cellmap \\
        --model ours=train_configs/quickstart_segmentation_2d.toml \\
        --model "vit_ms=train_configs/quickstart_segmentation_2d.toml --model.head multiscale" \\
        --model unet2d=train_configs/quickstart_segmentation_2d.toml
    python bench/quality.py --budget 480 --data data/mine --seeds 0,1 \\
        --model unet2d=train_configs/own_em_segmentation_2d.toml \\
        --model unet2d_plain=train_configs/own_em_segmentation_2d.toml

Every model but the ``*_plain`` ones (below) is trained by the project's own trainer
(torchrun, same processes), on the same data, with the same sampler, augmentation, loss and
learning-rate schedule (each config's), and all are scored by the same validation
(sliding-window prediction of the held-out crops, per-class IoU and Dice the CellMap way,
instance F1 for instance classes). A model named ``unet2d`` / ``unet3d`` is MONAI's
``BasicUNet`` (features 16-32-64-128-256, instance norm, the config's loss, crop and classes)
in place of the ViT, through a task that differs from ours only in ``build_model``.

A model named ``unet2d_plain`` / ``unet3d_plain`` is the same U-Net trained the way MONAI's own
users train it, outside our trainer: ``bench/unet_standalone.py`` (MONAI's default
``BasicUNet``, a plain loop in one process on both cores, uniform random windows with random
flips, BCE on the annotated voxels, Adam at a constant 1e-3, then MONAI's
``sliding_window_inference``). It reads the config only for the data, crop, batch size and
``[inference]``, and is scored by the same validation code, so that the comparison does not
rest on our trainer suiting a U-Net.

Equal budget: each model first trains ``--calibrate`` steps to measure its step time here,
then trains ``budget / step time`` steps (so that each finishes its own LR schedule within the
budget) and validates at the end. A ``*_plain`` model is not calibrated: it trains until its
budget is spent and reports the steps that took. The table gives the wall time each run took.
``--steps N`` trains every model for N steps instead (equal steps, e.g. to compare
initialisations).

Pretraining: ``--pretrain NAME=CONFIG [FLAGS]`` runs an MAE pretraining (``train_mae.py``) once,
before the models; a model named ``MODEL@NAME`` starts from its encoder (loaded into the
backbone, as ``./run_demo.sh`` does), so ``vit`` and ``vit@mae`` with the same config compare
scratch and MAE initialisation. The pretraining's wall time is reported beside the table.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
UNETS = {"unet2d": 2, "unet3d": 3}
PLAIN_UNETS = {"unet2d_plain": 2, "unet3d_plain": 3}  # bench/unet_standalone.py, no trainer
# Scores beside IoU and Dice in the table: instance scores, and the neuron metrics of cell.
SCORED_EXTRAS = ("f1", "instance", "voi", "arand")
DEFAULT_MODELS = [
    "vit_linear=train_configs/quickstart_segmentation_2d.toml",
    "vit_multiscale=train_configs/quickstart_segmentation_2d.toml --model.head multiscale",
    "unet2d=train_configs/quickstart_segmentation_2d.toml",
]


# --------------------------------------------------------------------------- the peer model
class UNetModel(nn.Module):
    """MONAI's BasicUNet with the interface our trainer and validation use."""

    def __init__(self, ndim: int, in_chans: int, num_classes: int):
        super().__init__()
        from monai.networks.nets import BasicUNet

        self.net = BasicUNet(spatial_dims=ndim, in_channels=in_chans, out_channels=num_classes,
                             features=(16, 32, 64, 128, 256, 16), norm="instance")

    @torch.no_grad()
    def init_weights(self) -> None:
        for module in self.modules():
            if hasattr(module, "reset_parameters") and module is not self:
                module.reset_parameters()

    def forward(self, x: torch.Tensor, output_size=None, resize: bool = True) -> torch.Tensor:
        """Logits at the input's size; ``output_size`` resizes them unless ``resize`` is
        False (the training loss resizes logits itself, as for the ViT's heads)."""
        logits = self.net(x)
        if resize and output_size is not None and tuple(logits.shape[2:]) != tuple(output_size):
            mode = "bilinear" if x.ndim == 4 else "trilinear"
            logits = nn.functional.interpolate(logits, size=tuple(output_size), mode=mode)
        return logits


def unet_task():
    from torchtitan.tasks import SegmentationTask

    class UNetTask(SegmentationTask):
        """Our segmentation task with MONAI's U-Net in place of the ViT."""

        name = "segmentation (MONAI BasicUNet)"

        def build_model(self):
            m = self.cfg.model
            return UNetModel(m.ndim, m.in_chans, len(self.cfg.data.classes))

        def flops_per_sample(self, model) -> float:
            return 0.0  # not needed here

    return UNetTask


# --------------------------------------------------------------------------- the runs
def launch(name: str, spec: str, argv: list[str], nproc: int, log: Path,
           entry_script: str = "train_segmentation.py") -> float:
    """Train one model with torchrun; returns the wall time in seconds."""
    config, *extra = shlex.split(spec)
    kind = name.split("@")[0]
    if kind in UNETS:
        entry = [str(Path(__file__).resolve()), "--unet-worker"]
        extra += ["--model.ndim", str(UNETS[kind])]
    else:
        entry = [str(REPO / entry_script)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), *entry, "--job.config_file", config, *extra, *argv]
    return run_logged(name, cmd, log)


def run_logged(name: str, cmd: list[str], log: Path) -> float:
    """Run ``cmd`` in the repository, its output into ``log``; returns the wall time."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        result = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed (exit {result.returncode}); see {log}")
    return time.perf_counter() - t0


def records(dump: Path) -> list[dict]:
    path = dump / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def calibrate(name, spec, data, out, nproc, steps) -> float:
    """Median seconds per training step after the first log interval."""
    dump = out / f"{name}_calibrate"
    launch(name, spec, ["--data.dataset_path", str(data), "--job.dump_folder", str(dump),
                        "--training.steps", str(steps), "--metrics.log_freq", "2",
                        "--metrics.eval_freq", "0", "--no-checkpoint.enable_checkpoint",
                        "--no-metrics.progress_bar", "--training.warmup_steps", "0"],
           nproc, out / f"{name}_calibrate.log")
    times = [r["step_time_s"] for r in records(dump) if "step_time_s" in r and r["step"] > 2]
    return statistics.median(times)


def pretrain(name, spec, data, out, nproc) -> tuple[Path, float]:
    """One MAE pretraining (its config's steps); returns its checkpoint folder and wall time."""
    dump = out / f"pretrain_{name}"
    wall = launch(name, spec, ["--data.dataset_path", str(data), "--job.dump_folder", str(dump),
                               "--metrics.eval_freq", "0", "--no-metrics.progress_bar",
                               "--checkpoint.enable_checkpoint"],
                  nproc, out / f"pretrain_{name}.log", entry_script="train_mae.py")
    return dump / "checkpoint", wall


def init_flags(name: str, pretrained: dict[str, Path]) -> list[str]:
    """Flags that start model ``MODEL@PRETRAIN`` from that pretraining's encoder."""
    if "@" not in name:
        return []
    source = name.split("@", 1)[1]
    if source not in pretrained:
        raise SystemExit(f"model {name!r}: no --pretrain named {source!r} "
                         f"(given: {', '.join(pretrained) or 'none'})")
    return ["--checkpoint.initial_load_path", str(pretrained[source]),
            "--checkpoint.initial_load_prefix_map", "encoder.=backbone."]


def train(name, spec, data, out, nproc, steps, extra=()) -> tuple[float, dict]:
    dump = out / name
    wall = launch(name, spec, ["--data.dataset_path", str(data), "--job.dump_folder", str(dump),
                               "--training.steps", str(steps), "--metrics.eval_freq", "0",
                               "--no-checkpoint.enable_checkpoint", "--no-metrics.progress_bar",
                               *extra],
                  nproc, out / f"{name}.log")
    scores = {}
    for r in records(dump):
        if any(k.startswith("val/") for k in r):
            scores = r
    return wall, scores


def train_plain(name, ndim, spec, data, out, budget, steps, extra=()) -> tuple[int, float, dict]:
    """A ``*_plain`` model: ``bench/unet_standalone.py`` in one process for ``budget`` seconds
    (``steps`` steps instead when given); returns the steps it trained, its wall time and its
    scores."""
    config, *flags = shlex.split(spec)
    dump = out / name
    limit = ["--steps", str(steps)] if steps else ["--budget", str(budget)]
    cmd = [sys.executable, str(REPO / "bench" / "unet_standalone.py"), "--config", config,
           *flags, "--model.ndim", str(ndim), "--data.dataset_path", str(data),
           "--out", str(dump), *limit, *extra]
    wall = run_logged(name, cmd, out / f"{name}.log")
    scores = records(dump)[-1]
    return int(scores["step"]), wall, scores


def seed_runs(name: str, seeds: list[int]) -> list[tuple[str, list[str]]]:
    """(run name, flags) of each seed of a model; the model's own name when no seeds are given."""
    if not seeds:
        return [(name, [])]
    return [(f"{name}_s{seed}", ["--training.seed", str(seed)]) for seed in seeds]


def seed_mean(runs: list[tuple[int, float, dict]]) -> tuple[int, float, dict]:
    """Mean steps (the same for every seed, except where a budget decided them, as for the
    ``*_plain`` models), mean wall time and the mean of every score the runs share."""
    keys = set.intersection(*(set(r[2]) for r in runs))
    scores = {k: statistics.fmean(r[2][k] for r in runs) for k in sorted(keys)
              if all(isinstance(r[2][k], (int, float)) for r in runs)}
    return (round(statistics.fmean(r[0] for r in runs)), statistics.fmean(r[1] for r in runs),
            scores)


def table(results: dict[str, tuple[int, float, dict]], classes: list[str]) -> str:
    names = list(results)
    rows = [["", *names], ["steps", *(str(results[n][0]) for n in names)],
            ["wall s", *(f"{results[n][1]:.0f}" for n in names)]]
    def add(label: str, key: str) -> None:
        rows.append([label, *(f"{results[n][2].get(key, math.nan):.3f}" for n in names)])

    for metric in ("iou", "dice"):
        for c in classes:
            add(f"{metric} {c}", f"val/{metric}/{c}")
    add("mean iou", "val/mean_iou")
    extra = sorted({k for n in names for k in results[n][2]
                    if k.startswith("val/") and any(m in k for m in SCORED_EXTRAS)})
    for k in extra:
        add(k[4:], k)
    # Scores after post-processing (inference.min_object_nm3, fill_holes, instances), when on.
    post = sorted({k for n in names for k in results[n][2] if k.startswith("val_post/")
                   and any(m in k for m in ("iou", *SCORED_EXTRAS))})
    for k in post:
        add("post " + k[len("val_post/"):], k)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO / "data" / "demo",
                        help="CellMap-layout data (default: the demo data, made if missing)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "quality")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds of training per model")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--calibrate", type=int, default=12, help="steps to time each model")
    parser.add_argument("--steps", type=int, default=0,
                        help="train every model this many steps (default: the budget decides)")
    parser.add_argument("--seeds", default="",
                        help="comma-separated training.seed values: one run per model and seed, "
                             "plus the mean (default: each config's own seed)")
    parser.add_argument("--pretrain", action="append", default=[], metavar="NAME=CONFIG [FLAGS]",
                        help="an MAE pretraining, run first; models named MODEL@NAME start "
                             "from its encoder")
    parser.add_argument("--model", action="append", default=None, metavar="NAME=CONFIG [FLAGS]",
                        help="a model to train: NAME=CONFIG plus config flags; NAME unet2d or "
                             "unet3d trains MONAI's BasicUNet with that config in our trainer, "
                             "unet2d_plain or unet3d_plain in a plain loop "
                             "(bench/unet_standalone.py)")
    args = parser.parse_args(argv)
    models = dict(m.split("=", 1) for m in (args.model or DEFAULT_MODELS))
    if not args.data.exists():
        subprocess.run([sys.executable, str(REPO / "helpers" / "make_demo_data.py"), "--out",
                        str(args.data)], check=True)
    args.out.mkdir(parents=True, exist_ok=True)
    pretrained: dict[str, Path] = {}
    for item in args.pretrain:
        pname, pspec = item.split("=", 1)
        pretrained[pname], wall = pretrain(pname, pspec, args.data, args.out, args.nproc)
        print(f"pretraining {pname}: {wall:.0f} s", flush=True)
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    results = {}
    classes: list[str] = []
    for name, spec in models.items():
        flags = init_flags(name, pretrained)
        plain = PLAIN_UNETS.get(name.split("@")[0])  # its ndim
        if plain and flags:
            raise SystemExit(f"model {name!r}: a plain U-Net trains from scratch only")
        if args.steps or plain:
            step_time, steps = math.nan, args.steps
        else:
            step_time = calibrate(name, spec, args.data, args.out, args.nproc, args.calibrate)
            steps = max(1, int(args.budget / step_time))
        for run, seed_flags in seed_runs(name, seeds):
            if plain:
                steps, wall, scores = train_plain(run, plain, spec, args.data, args.out,
                                                  args.budget, args.steps, seed_flags)
            else:
                wall, scores = train(run, spec, args.data, args.out, args.nproc, steps,
                                     [*flags, *seed_flags])
            results[run] = (steps, wall, scores)
            classes = classes or [k.split("/")[-1] for k in scores if k.startswith("val/iou/")]
            timed = "" if math.isnan(step_time) else f"{step_time:.3f} s/step -> "
            print(f"{run}: {timed}{steps} steps, {wall:.0f} s, mean IoU "
                  f"{scores.get('val/mean_iou', math.nan):.3f}", flush=True)
        if len(seeds) > 1:
            results[f"{name} mean"] = seed_mean([results[r] for r, _ in seed_runs(name, seeds)])
    basis = f"{args.steps} steps" if args.steps else f"budget {args.budget:.0f} s"
    print(f"\n{basis} per model, data {args.data}, {args.nproc} processes\n")
    print(table(results, classes))
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--unet-worker":
        from functools import partial

        from torchtitan.tools.visualization import write_validation_visuals
        from torchtitan.trainer import run

        sys.exit(run(partial(unet_task(), visuals=write_validation_visuals), sys.argv[2:]))
    sys.exit(main())
