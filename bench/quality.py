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
    python bench/quality.py --out outputs/recipes --budgets 480,1440 --seeds 0,1,2 \\
        --stack vnc=data/vnc --stack "medulla2d=data/medulla --data.classes pm ..." \\
        --reference shipped --model shipped=train_configs/own_em_segmentation_2d.toml \\
        --model "hm16=train_configs/own_em_segmentation_2d.toml --model.head_min_channels 16" \\
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
budget) and validates at the end. Its clock has the last word: every trainer run also gets
``--training.time_budget_s budget``, which ends it (finished: saved and validated) at the first
step boundary past which another step would end beyond the budget, by the same rule as the
plain loop's; a run whose schedule is constant after its warmup (``lr_scheduler.decay_type =
"constant"``) is given twice the calibrated steps, so that the clock alone decides where it
stops, whatever the machine's speed does after the calibration. A ``*_plain`` model is not
calibrated: it trains until its budget is spent. The table gives the steps each run trained and
the wall time it took.
``--steps N`` trains every model for N steps instead (equal steps, e.g. to compare
initialisations). ``--calibrate-only`` stops after the calibrations: each model's step time and
the steps the budget buys it (e.g. to compare precisions or oneDNN's instruction sets, through
``--training.mixed_precision_param`` and ``ONEDNN_MAX_CPU_ISA``).

Pretraining: ``--pretrain NAME=CONFIG [FLAGS]`` runs an MAE pretraining (``train_mae.py``) once,
before the models; a model named ``MODEL@NAME`` starts from its encoder (loaded into the
backbone, as ``./run_demo.sh`` does), so ``vit`` and ``vit@mae`` with the same config compare
scratch and MAE initialisation. The pretraining's wall time and its final validation (the
reconstruction loss on held-out EM, and that of the trivial reconstruction) are reported
beside the table. Flags of a spec win over the benchmark's own ``--data.dataset_path``, so a
pretraining may read other EM than the models.

Label efficiency: ``--label-fractions 1/16,1/8,1/4,1`` trains every model (and seed) once per
fraction of the training labels (``--data.train_label_fraction``: that share of each training
crop's sections, in its middle), prints a table per fraction and one of mean IoU against the
fraction (seed by seed, and the gain of each ``MODEL@PRETRAIN`` over ``MODEL``), and draws the
latter (``label_efficiency.png`` in ``--out``: one line per model). ``--equal-time`` adds, at
the smallest fraction, each scratch ``MODEL`` trained for its steps plus the steps that its
pretrained twin's pretraining time would have bought it (from the median step time of its own
runs): the comparison at equal total time, pretraining included.

The decision protocol (docs/benchmarks/recipes.md): ``--budgets 480,1440`` trains every
model on every ``--stack NAME=PATH [FLAGS]`` (the flags that describe that data: voxel size,
classes, validation crops; they come after a model's) for each seed and scores it at each
budget. A model whose rate is constant after its warmup trains one run per seed: it reaches the
first budget, is validated and saved, and is resumed (exactly) for the rest of the next; the
plain U-Nets are scored at each budget of one run with their clock stopped; any other schedule
trains a run per budget, sized by its calibration; where the clock stopped such a run before
97 % of its steps (its schedule had not ended: the calibration was faster than the run), it is
trained again at the rate it ran, which then sizes that model's other runs. Everything finished lands in ``--out/protocol.json`` and is not run
again, so the protocol can be filled a piece at a time. The summary (``--out/protocol.md``)
gives each ``--metric`` per stack and budget (seed mean, range, steps), the margin over the
better plain U-Net and, with ``--reference NAME``, over that model: a lever is kept only where
it is better at every stack and budget.

``--reuse`` keeps a run already in ``--out`` (a pretraining, a model at a fraction and seed)
when its resolved ``config.toml`` equals the one its command gives now and its last step was
validated: a benchmark interrupted, or widened by more fractions or models, runs only what is
missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from fractions import Fraction
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
            return UNetModel(m.ndim, m.in_chans, len(self.channels))

        def flops_per_sample(self, model) -> float:
            return 0.0  # not needed here

    return UNetTask


# --------------------------------------------------------------------------- the runs
REUSE = False  # --reuse: keep the finished runs of the same config (finished_run)
KEEP_CHECKPOINT = False  # --keep-checkpoint: each run keeps its last step (bench/neuron_cuts.py)
WALL = "bench_wall_s"  # a run's wall time, beside its config.toml


def model_kind(run: str) -> str:
    """The model of a run name: without its pretraining (``@NAME``), label fraction
    (``_f1-16``) and seed (``_s0``), e.g. ``unet3d`` for ``unet3d_f1-16_s1``."""
    return re.sub(r"(_f\d+-\d+)?(_s\d+)?$", "", run).split("@")[0]


def launch(name: str, spec: str, argv: list[str], nproc: int, log: Path,
           entry_script: str = "train_segmentation.py", data: Path | None = None) -> float:
    """Train one model with torchrun; returns the wall time in seconds. ``data`` is the
    dataset unless the spec's flags name another. With ``--reuse`` a finished run of the
    same config in ``--job.dump_folder`` is kept (its wall time as recorded)."""
    config, *extra = shlex.split(spec)
    kind = model_kind(name)
    if kind in UNETS:
        entry = [str(Path(__file__).resolve()), "--unet-worker"]
        extra += ["--model.ndim", str(UNETS[kind])]
    else:
        entry = [str(REPO / entry_script)]
    default = ["--data.dataset_path", str(data)] if data is not None else []
    flags = ["--job.config_file", config, *default, *extra, *argv]
    dump = Path(argv[argv.index("--job.dump_folder") + 1])
    if REUSE and finished_run(dump, flags):
        print(f"{name}: reused (a finished run of the same config in {dump})", flush=True)
        return recorded_wall(dump)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), *entry, *flags]
    wall = run_logged(name, cmd, log)
    (dump / WALL).write_text(f"{wall!r}\n")
    return wall


def constant_schedule(spec: str, data) -> bool:
    """Whether the config of ``spec`` keeps its learning rate constant after the warmup."""
    from torchtitan.config.manager import ConfigManager

    config, *extra = shlex.split(spec)
    default = ["--data.dataset_path", str(data)] if data is not None else []
    with contextlib.chdir(REPO):
        cfg = ConfigManager().parse_args(["--job.config_file", config, *default, *extra])
    return cfg.lr_scheduler.decay_type == "constant"


def finished_run(dump: Path, flags: list[str]) -> bool:
    """Whether ``dump`` holds a run of exactly the config that ``flags`` resolve to (its
    first launch's ``config.toml``), validated at its last step."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.config.parsing import config_to_dict, read_toml

    saved = dump / "config.toml"
    if not saved.is_file() or not (dump / "logs" / "metrics.jsonl").is_file():
        return False
    with contextlib.chdir(REPO):  # config paths are relative to the repository, as in runs
        config = ConfigManager().parse_args(flags)
    if config_to_dict(config) != read_toml(str(saved)):
        return False
    validated = [r for r in records(dump) if any(k.startswith("val/") for k in r)]
    if config.training.time_budget_s > 0:  # the clock decided its last step
        return bool(validated)
    return any(r.get("step") == config.training.steps for r in validated)


def recorded_wall(dump: Path) -> float:
    """A finished run's wall time: as recorded, or (a run from before the record) the time
    from its config to its last metrics."""
    if (dump / WALL).is_file():
        return float((dump / WALL).read_text())
    metrics = dump / "logs" / "metrics.jsonl"
    return metrics.stat().st_mtime - (dump / "config.toml").stat().st_mtime


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
    launch(name, spec, ["--job.dump_folder", str(dump),
                        "--training.steps", str(steps), "--metrics.log_freq", "2",
                        "--metrics.eval_freq", "0", "--no-checkpoint.enable_checkpoint",
                        "--no-metrics.progress_bar", "--training.warmup_steps", "0"],
           nproc, out / f"{name}_calibrate.log", data=data)
    return step_time(dump)


def calibrate_only(args, models: dict[str, str]) -> int:
    """``--calibrate-only``: each model's step time here and the steps the budget buys it."""
    args.out.mkdir(parents=True, exist_ok=True)
    for name, spec in models.items():
        if PLAIN_UNETS.get(model_kind(name)):
            raise SystemExit(f"model {name!r}: a plain U-Net runs by the clock, not calibrated")
        step_s = calibrate(name, spec, args.data, args.out, args.nproc, args.calibrate)
        print(f"{name}: {step_s:.3f} s/step -> {max(1, int(args.budget / step_s))} steps in "
              f"{args.budget:.0f} s", flush=True)
    return 0


def step_time(dump: Path) -> float:
    """Median seconds per training step of a run, after its first two steps (of all of them
    in a shorter run)."""
    times = {r["step"]: r["step_time_s"] for r in records(dump) if "step_time_s" in r}
    return statistics.median([t for s, t in times.items() if s > 2] or times.values())


def pretrain(name, spec, data, out, nproc) -> tuple[Path, float, dict]:
    """One MAE pretraining (its config's steps); returns its checkpoint folder, wall time and
    final validation scores."""
    dump = out / f"pretrain_{name}"
    wall = launch(name, spec, ["--job.dump_folder", str(dump), "--metrics.eval_freq", "0",
                               "--no-metrics.progress_bar", "--checkpoint.enable_checkpoint"],
                  nproc, out / f"pretrain_{name}.log", entry_script="train_mae.py", data=data)
    scores = [r for r in records(dump) if "val/reconstruction_loss" in r]
    return dump / "checkpoint", wall, scores[-1] if scores else {}


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


def train(name, spec, data, out, nproc, steps, extra=(), dump=None) -> tuple[float, dict]:
    dump = dump or out / name
    checkpoint = (["--checkpoint.enable_checkpoint", "--checkpoint.interval", str(steps),
                   "--checkpoint.keep_latest_k", "1"] if KEEP_CHECKPOINT
                  else ["--no-checkpoint.enable_checkpoint"])
    wall = launch(name, spec, ["--job.dump_folder", str(dump),
                               "--training.steps", str(steps), "--metrics.eval_freq", "0",
                               *checkpoint, "--no-metrics.progress_bar", *extra],
                  nproc, out / f"{name}.log", data=data)
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


def parse_fractions(text: str) -> list[Fraction | None]:
    """``1/16,1/4,1`` -> fractions in (0, 1], ascending; empty -> [None] (every label, no
    flag)."""
    if not text.strip():
        return [None]
    fractions = sorted({Fraction(x.strip()) for x in text.split(",") if x.strip()})
    if not all(0 < f <= 1 for f in fractions):
        raise SystemExit(f"--label-fractions {text!r}: each must be in (0, 1], e.g. 1/16,1/4,1")
    return fractions


def fraction_tag(fraction: Fraction | None) -> str:
    """The part of a run name that says its label fraction (folder-safe)."""
    return "" if fraction is None else f"_f{fraction.numerator}-{fraction.denominator}"


def run_models(args, models: dict[str, str], pretrained: dict[str, Path], seeds: list[int],
               fraction: Fraction | None, steps: int = 0) -> tuple[dict, list[str]]:
    """Every model (each seed) at one label fraction, for ``steps`` steps (default: as
    ``args`` say); returns {run: (steps, wall, scores)}, with a ``MODEL mean`` entry per
    model when there are several seeds, and the classes."""
    results, classes = {}, []
    limit = [] if fraction is None else ["--data.train_label_fraction", str(float(fraction))]
    for name, spec in models.items():
        flags = init_flags(name, pretrained)
        plain = PLAIN_UNETS.get(name.split("@")[0])  # its ndim
        if plain and (flags or limit):
            raise SystemExit(f"model {name!r}: a plain U-Net trains from scratch on every label")
        clock = []
        if steps or args.steps or plain:
            step_s, model_steps = math.nan, steps or args.steps
        else:  # each model its own calibration and clock
            step_s = calibrate(name, spec, args.data, args.out, args.nproc, args.calibrate)
            model_steps = max(1, int(args.budget / step_s))
            if constant_schedule(spec, args.data):
                model_steps *= 2
            clock = ["--training.time_budget_s", str(args.budget)]
        runs = seed_runs(name + fraction_tag(fraction), seeds)
        for run, seed_flags in runs:
            if plain:
                trained, wall, scores = train_plain(run, plain, spec, args.data, args.out,
                                                    args.budget, args.steps, seed_flags)
            else:
                wall, scores = train(run, spec, args.data, args.out, args.nproc, model_steps,
                                     [*flags, *limit, *seed_flags, *clock])
                trained = int(scores.get("step", model_steps))
            results[run] = (trained, wall, scores)
            classes = classes or [k.split("/")[-1] for k in scores if k.startswith("val/iou/")]
            timed = "" if math.isnan(step_s) else f"{step_s:.3f} s/step -> "
            print(f"{run}: {timed}{trained} steps, {wall:.0f} s, mean IoU "
                  f"{scores.get('val/mean_iou', math.nan):.3f}", flush=True)
        if len(seeds) > 1:
            results[f"{name + fraction_tag(fraction)} mean"] = seed_mean(
                [results[r] for r, _ in runs])
    return results, classes


def equal_time_runs(args, models, pretrained, walls, seeds, fraction,
                    results) -> tuple[list[str], dict]:
    """At ``fraction``: each scratch MODEL whose ``MODEL@P`` is benchmarked too, trained (as
    ``MODEL+Ptime``) for its steps plus ``P``'s pretraining wall time at its own median step
    time. Returns those names and their runs."""
    names, out = [], {}
    for name in models:
        base, _, source = name.partition("@")
        if not source or base not in models:
            continue
        runs = [r for r, _ in seed_runs(base + fraction_tag(fraction), seeds)]
        step_s = statistics.median(step_time(args.out / r) for r in runs)
        steps = results[runs[0]][0] + round(walls[source] / step_s)
        timed = f"{base}+{source}time"
        print(f"{timed}: {walls[source]:.0f} s of pretraining at {step_s:.3f} s/step -> "
              f"{steps} steps", flush=True)
        out.update(run_models(args, {timed: models[base]}, pretrained, seeds, fraction,
                              steps)[0])
        names.append(timed)
    return names, out


def mean_iou(results: dict, run: str) -> float:
    return results[run][2].get("val/mean_iou", math.nan)


def label_efficiency(names, seeds, fractions, results) -> dict[str, dict]:
    """{model: {fraction: {"mean": mean IoU over seeds, "seeds": [...], "steps": n}}} of the
    fractions at which each model ran."""
    summary: dict[str, dict] = {}
    for name in names:
        for fraction in fractions:
            runs = [r for r, _ in seed_runs(name + fraction_tag(fraction), seeds)]
            if not all(r in results for r in runs):
                continue
            values = [mean_iou(results, r) for r in runs]
            summary.setdefault(name, {})[fraction] = {
                "mean": statistics.fmean(values), "seeds": values, "steps": results[runs[0]][0]}
    return summary


def label_efficiency_table(summary: dict[str, dict], fractions) -> str:
    """Rows: fractions; per model its mean IoU (seeds), and each MODEL@P's gain over MODEL."""
    names = list(summary)
    gains = [n for n in names if "@" in n and n.split("@")[0] in summary]
    head = ["labels", *names, *(f"{n} - {n.split('@')[0]}" for n in gains)]
    rows = [head]
    for fraction in fractions:
        row = [str(fraction)]
        for n in names:
            cell = summary[n].get(fraction)
            row.append("" if cell is None else
                       f"{cell['mean']:.3f} ({', '.join(f'{v:.3f}' for v in cell['seeds'])}; "
                       f"{cell['steps']} steps)")
        for n in gains:
            a, b = summary[n].get(fraction), summary[n.split("@")[0]].get(fraction)
            row.append("" if a is None or b is None else f"{a['mean'] - b['mean']:+.3f}")
        rows.append(row)
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("---" for _ in head) + "|")
    return "\n".join(lines)


PLOT_COLOURS = [(230, 120, 40), (60, 130, 220), (80, 180, 90), (200, 70, 160), (150, 150, 150),
                (220, 200, 60)]


def plot_label_efficiency(summary: dict[str, dict], fractions, out: Path) -> Path:
    """``out/label_efficiency.png``: mean IoU against the fraction of labels (log2 axis), one
    line per model through its seed means, each seed a dot; a model run at one fraction only
    (equal time) is a ring."""
    return plot_series(summary, fractions, math.log2, "fraction of the training labels",
                       "mean IoU on the validation crop", out / "label_efficiency.png")


def plot_series(summary: dict[str, dict], xs_given, x_of, x_label: str, y_label: str,
                path: Path, decimals: int = 1) -> Path:
    """A PNG at ``path``: for each series of ``summary`` (``{name: {x: {"mean": m, "seeds":
    [...]}}}``) a line through its means at ``x_of(x)``, each seed a dot; a series with one
    point is a ring. ``xs_given``: the x values labelled on the axis; the y axis spans the
    values in steps of ``10 ** -decimals``."""
    from PIL import Image, ImageDraw

    from torchtitan.pictures.drawing import default_font

    width, height, left, right, top, bottom = 720, 440, 60, 200, 30, 50
    font = default_font(13)
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    xs = [x_of(f) for f in xs_given]
    values = [v for s in summary.values() for c in s.values() for v in (c["mean"], *c["seeds"])]
    finite = [v for v in values if math.isfinite(v)] or [0.0, 1.0]
    unit = 10.0 ** -decimals
    lo, hi = math.floor(min(finite) / unit) * unit, math.ceil(max(finite) / unit) * unit
    hi = hi if hi > lo else lo + unit

    def at(x: float, y: float) -> tuple[float, float]:
        span = (max(xs) - min(xs)) or 1.0
        return (left + (x - min(xs)) / span * (width - left - right),
                height - bottom - (y - lo) / (hi - lo) * (height - top - bottom))

    draw.rectangle([left, top, width - right, height - bottom], outline=(90, 90, 90))
    for k in range(int(round((hi - lo) / unit)) + 1):
        y = lo + k * unit
        _, py = at(min(xs), y)
        draw.line([left, py, width - right, py], fill=(225, 225, 225))
        draw.text((left - 45, py - 7), f"{y:.{decimals}f}", fill="black", font=font)
    for f, x in zip(xs_given, xs):
        px, _ = at(x, lo)
        draw.text((px - 12, height - bottom + 8), str(f), fill="black", font=font)
    draw.text((left, height - 22), x_label, fill="black", font=font)
    draw.text((left, 8), y_label, fill="black", font=font)
    for k, (name, cells) in enumerate(summary.items()):
        colour = PLOT_COLOURS[k % len(PLOT_COLOURS)]
        points = [(at(x_of(f), c["mean"]), c) for f, c in sorted(cells.items())]
        if len(points) > 1:
            draw.line([p for p, _ in points], fill=colour, width=3)
        for (px, py), c in points:
            for v in c["seeds"]:
                _, sy = at(min(xs), v)
                draw.ellipse([px - 3, sy - 3, px + 3, sy + 3], fill=colour)
            r = 6
            draw.ellipse([px - r, py - r, px + r, py + r], outline=colour, width=2,
                         fill=colour if len(points) > 1 else None)
        ly = top + 10 + 22 * k
        draw.line([width - right + 15, ly + 7, width - right + 40, ly + 7], fill=colour, width=3)
        draw.text((width - right + 46, ly), name, fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


# --------------------------------------------------------------------------- the protocol
# A recipe's lever is judged at equal wall-clock time, at several budgets, on every stack, over
# seeds, beside the plain U-Net, and kept only where it helps on each stack (not on their mean).
LOWER_IS_BETTER = ("voi", "arand")  # score names where less is better (neuron metrics)
PROTOCOL_LEDGER = "protocol.json"
# A decaying schedule stopped by the clock before this share of its steps did not end: it is
# trained again at the rate it ran (kept in NAME_step_s beside the runs, for its other runs).
SCHEDULE_END = 0.97
RATE = "step_s"


def parse_stacks(items: list[str], data: Path) -> dict[str, tuple[Path, list[str]]]:
    """``--stack NAME=PATH [FLAGS]`` -> {name: (path, flags)}; none: ``--data`` as one stack
    named after its folder. A stack's flags come after a model's, so what describes the data
    (voxel size, classes, validation crops, a window that fits its sections) is the stack's."""
    if not items:
        return {data.name: (data, [])}
    stacks = {}
    for item in items:
        name, _, rest = item.partition("=")
        path, *flags = shlex.split(rest)
        if not name or not path or name in stacks:
            raise SystemExit(f"--stack {item!r}: give NAME=PATH [FLAGS], each NAME once")
        stacks[name] = (Path(path), flags)
    return stacks


def parse_budgets(text: str) -> list[float]:
    budgets = [float(b) for b in text.split(",") if b.strip()]
    if not budgets or budgets != sorted(set(budgets)) or budgets[0] <= 0:
        raise SystemExit(f"--budgets {text!r}: seconds, positive and ascending, e.g. 480,1440")
    return budgets


def better(metric: str, a: float, b: float) -> float:
    """How much ``a`` is better than ``b`` on ``metric`` (positive: better)."""
    return (b - a) if any(m in metric for m in LOWER_IS_BETTER) else (a - b)


def best_of(metric: str, values: list[float]) -> float:
    """The best of ``values`` on ``metric`` (NaN where none is known)."""
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return math.nan
    return min(known) if any(m in metric for m in LOWER_IS_BETTER) else max(known)


def budget_launches(spec: str, data: Path, budgets: list[float]) -> list[tuple[float, float]]:
    """(budget, seconds for this launch) of a trainer model's runs at ``budgets``: a constant
    schedule trains one run, relaunched (resumed, exactly) for each next budget's remaining
    seconds, and is scored at the end of every launch; any other schedule depends on where it
    ends, so each budget is a run of its own (marked by a launch of its whole budget)."""
    if constant_schedule(spec, data):
        return [(b, b - a) for a, b in zip([0.0, *budgets], budgets)]
    return [(b, b) for b in budgets]


def protocol_trainer_runs(name, spec, data, out, args, seeds, budgets, ledger, key):
    """Every seed of one trainer model at every budget, into ``ledger[key][run][budget]``."""
    runs = seed_runs(name, seeds)
    if all(str(b) in ledger.get(key, {}).get(run, {}) for run, _ in runs for b in budgets):
        return
    rate = out / f"{name}_{RATE}"
    step_s = (float(rate.read_text()) if rate.is_file()
              else calibrate(name, spec, data, out, args.nproc, args.calibrate))
    launches = budget_launches(spec, data, budgets)
    resumed = launches[-1][1] != budgets[-1] or len(budgets) == 1
    held = constant_schedule(spec, data)
    for run, seed_flags in runs:
        done = ledger.setdefault(key, {}).setdefault(run, {})
        if resumed and not (out / run / "checkpoint").is_dir() and any(
                str(b) not in done for b in budgets):
            done.clear()  # nothing to resume from: the run starts again from its first budget
        for i, (budget, seconds) in enumerate(launches):
            if str(budget) in done:
                continue
            dump = out / (run if resumed else f"{run}_b{budget:.0f}")
            if (not resumed or i == 0) and dump.exists():
                shutil.rmtree(dump)  # a run begins afresh (a later budget resumes it)
            for attempt in range(2):
                steps = max(1, int((budgets[-1] if resumed else budget) / step_s))
                # A held rate: the clock, not the step count, ends each launch (room for a
                # machine that runs faster than it did while calibrating).
                steps *= 4 if held else 1
                wall, scores = train(f"{run}_b{budget:.0f}" if not resumed else run, spec,
                                     data, out, args.nproc, steps,
                                     [*seed_flags, "--training.time_budget_s", str(seconds),
                                      "--checkpoint.enable_checkpoint", "--checkpoint.interval",
                                      str(steps), "--checkpoint.keep_latest_k", "1"], dump=dump)
                trained = int(scores.get("step", steps))
                if held or attempt or trained >= SCHEDULE_END * steps:
                    break
                # The clock stopped a decaying schedule short of its end: the calibration was
                # faster than the run. The run's own rate sizes this budget again, and the
                # model's other runs.
                step_s = seconds / trained
                rate.write_text(f"{step_s!r}\n")
                print(f"{key} {run} at {budget:.0f} s: the clock stopped it at step {trained} "
                      f"of {steps}, before its schedule ended; again at its own rate, "
                      f"{step_s:.3f} s/step", flush=True)
                shutil.rmtree(dump)
            done[str(budget)] = {"steps": trained, "wall_s": wall,
                                 "step_s": step_s, "scores": scores}
            save_ledger(out.parent, ledger)
            print(f"{key} {run} at {budget:.0f} s: {done[str(budget)]['steps']} steps, mean IoU "
                  f"{scores.get('val/mean_iou', math.nan):.3f}", flush=True)


def protocol_plain_runs(name, ndim, spec, data, out, seeds, budgets, ledger, key):
    """Every seed of a plain U-Net: one run, scored at each budget (constant rate)."""
    for run, seed_flags in seed_runs(name, seeds):
        done = ledger.setdefault(key, {}).setdefault(run, {})
        if all(str(b) in done for b in budgets):
            continue
        train_plain(run, ndim, spec, data, out, 0, 0,
                    ["--budgets", ",".join(str(b) for b in budgets), *seed_flags])
        for record in records(out / run):
            done[str(float(record["budget_s"]))] = {
                "steps": int(record["step"]), "wall_s": record["wall_time_s"],
                "step_s": record["train_time_s"] / record["step"], "scores": record}
        save_ledger(out.parent, ledger)


def save_ledger(out: Path, ledger: dict) -> None:
    path = out / PROTOCOL_LEDGER
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ledger, indent=1))
    tmp.replace(path)


def protocol_summary(ledger: dict, stacks, models, seeds, budgets, metrics: list[str],
                     reference: str | None) -> str:
    """Per metric: each model's seed mean (and range) at each stack and budget, its steps, then
    its margin over the better plain U-Net and over ``reference``; a lever is kept where its
    margin over the reference is positive at every stack and budget."""
    seed_names = lambda m: [r for r, _ in seed_runs(m, seeds)]
    cells = [(st, b) for st in stacks for b in budgets]
    head = ["model", *(f"{st} {b / 60:g} min" if b >= 60 else f"{st} {b:g} s"
                       for st, b in cells)]

    def values(model, st, b, metric):
        runs = ledger.get(st, {})
        got = [runs[r][str(b)]["scores"].get(metric) for r in seed_names(model)
               if str(b) in runs.get(r, {})]
        return [v for v in got if v is not None]

    def mean(model, st, b, metric):
        v = values(model, st, b, metric)
        return statistics.fmean(v) if v else math.nan

    lines = []
    plains = [m for m in models if model_kind(m) in PLAIN_UNETS]
    for metric in metrics:
        rows = [head]
        for m in models:
            row = [m]
            for st, b in cells:
                v = values(m, st, b, metric)
                runs = ledger.get(st, {})
                steps = [runs[r][str(b)]["steps"] for r in seed_names(m) if str(b) in runs.get(r, {})]
                row.append(f"{statistics.fmean(v):.3f} ({min(v):.3f}-{max(v):.3f}; "
                           f"{statistics.fmean(steps):.0f} steps; n={len(v)})" if v else "-")
            rows.append(row)
        margins = []
        for m in models:
            if m in plains:
                continue
            if plains:
                margins.append([f"{m} - best plain U-Net", *(
                    f"{better(metric, mean(m, st, b, metric), best_of(metric, [mean(u, st, b, metric) for u in plains])):+.3f}"
                    for st, b in cells)])
            if reference and m != reference:
                deltas = [better(metric, mean(m, st, b, metric), mean(reference, st, b, metric))
                          for st, b in cells]
                verdict = ("better at every stack and budget" if all(d > 0 for d in deltas)
                           else "not better everywhere" if not any(math.isnan(d) for d in deltas)
                           else "incomplete")
                margins.append([f"{m} - {reference} ({verdict})",
                                *(f"{d:+.3f}" for d in deltas)])
        widths = [max(len(r[i]) for r in rows + margins) for i in range(len(head))]
        fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
        lines += [f"\n{metric} (seed mean (min-max; steps; seeds))\n", fmt(rows[0]),
                  "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                  *map(fmt, rows[1:]), *map(fmt, margins)]
    return "\n".join(lines)


def protocol(args, models: dict[str, str], seeds: list[int]) -> int:
    """``--budgets``: every model (each seed) on every ``--stack`` at every budget, results in
    ``--out/protocol.json`` (kept across invocations: what is there is not run again), then
    the summary."""
    stacks = parse_stacks(args.stack, args.data)
    budgets = parse_budgets(args.budgets)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / PROTOCOL_LEDGER
    ledger = json.loads(path.read_text()) if path.is_file() else {}
    for st, (data, flags) in stacks.items():
        out = args.out / st
        out.mkdir(exist_ok=True)
        for name, spec in models.items():
            full = f"{spec} {shlex.join(flags)}".strip()
            plain = PLAIN_UNETS.get(model_kind(name))
            if plain:
                protocol_plain_runs(name, plain, full, data, out, seeds, budgets, ledger, st)
            else:
                protocol_trainer_runs(name, full, data, out, args, seeds, budgets, ledger, st)
    metrics = args.metric or ["val/mean_iou"]
    summary = protocol_summary(ledger, stacks, list(models), seeds, budgets, metrics,
                               args.reference)
    print(summary)
    (args.out / "protocol.md").write_text(summary + "\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO / "data" / "demo",
                        help="CellMap-layout data (default: the demo data, made if missing)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "quality")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds of training per model")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--calibrate", type=int, default=12, help="steps to time each model")
    parser.add_argument("--calibrate-only", action="store_true",
                        help="time each model's step (--calibrate steps) and print the steps "
                             "--budget buys it; train nothing")
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
    parser.add_argument("--label-fractions", default="", metavar="F,F,...",
                        help="fractions of the training labels (e.g. 1/16,1/8,1/4,1): every "
                             "model trains once per fraction; a table and a plot of mean IoU "
                             "against the fraction (default: all labels)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the runs already in --out whose resolved config equals "
                             "their command's and whose last step was validated")
    parser.add_argument("--equal-time", action="store_true",
                        help="at the smallest fraction, also train each scratch MODEL of a "
                             "MODEL@PRETRAIN pair for its pretrained twin's total time")
    parser.add_argument("--stack", action="append", default=[], metavar="NAME=PATH [FLAGS]",
                        help="with --budgets: a dataset and the flags that describe it (voxel "
                             "size, classes, validation crops); several stacks, each model on "
                             "each (default: --data)")
    parser.add_argument("--budgets", default="", metavar="S,S,...",
                        help="the decision protocol: every model on every --stack at each of "
                             "these training budgets (seconds, e.g. 480,1440), each --seeds; "
                             "results kept in --out/protocol.json across invocations")
    parser.add_argument("--reference", default=None, metavar="NAME",
                        help="with --budgets: the model whose levers are judged (a model is "
                             "kept where it beats this one on every stack and budget)")
    parser.add_argument("--metric", action="append", default=None,
                        help="with --budgets: the scores of the summary (default val/mean_iou; "
                             "VOI and ARAND count lower as better)")
    parser.add_argument("--keep-checkpoint", action="store_true",
                        help="each run keeps the checkpoint of its last step, e.g. to cut its "
                             "neurons other ways with bench/neuron_cuts.py")
    args = parser.parse_args(argv)
    global REUSE, KEEP_CHECKPOINT
    REUSE, KEEP_CHECKPOINT = args.reuse, args.keep_checkpoint
    models = dict(m.split("=", 1) for m in (args.model or DEFAULT_MODELS))
    fractions = parse_fractions(args.label_fractions)
    if args.equal_time and not args.steps:
        raise SystemExit("--equal-time compares at equal fine-tuning steps first: give --steps")
    if args.calibrate_only:
        return calibrate_only(args, models)
    if args.budgets:
        return protocol(args, models, [int(x) for x in args.seeds.split(",") if x.strip()])
    if not args.data.exists():
        subprocess.run([sys.executable, str(REPO / "helpers" / "make_demo_data.py"), "--out",
                        str(args.data)], check=True)
    args.out.mkdir(parents=True, exist_ok=True)
    pretrained: dict[str, Path] = {}
    walls, pretraining = {}, {}
    for item in args.pretrain:
        pname, pspec = item.split("=", 1)
        pretrained[pname], walls[pname], scores = pretrain(pname, pspec, args.data, args.out,
                                                           args.nproc)
        pretraining[pname] = {"wall_s": walls[pname], **scores}
        print(f"pretraining {pname}: {walls[pname]:.0f} s, held-out reconstruction loss "
              f"{scores.get('val/reconstruction_loss', math.nan):.4f} (trivial "
              f"{scores.get('val/baseline_loss', math.nan):.4f})", flush=True)
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    results, by_fraction, classes = {}, {}, []
    for fraction in fractions:
        by_fraction[fraction], classes = run_models(args, models, pretrained, seeds, fraction)
        results.update(by_fraction[fraction])
    timed_names, timed = (equal_time_runs(args, models, pretrained, walls, seeds, fractions[0],
                                          by_fraction[fractions[0]])
                          if args.equal_time else ([], {}))
    results.update(timed)
    basis = f"{args.steps} steps" if args.steps else f"budget {args.budget:.0f} s"
    for fraction in fractions:
        rows = {**by_fraction[fraction], **(timed if fraction == fractions[0] else {})}
        label = "" if fraction is None else f", labels {fraction}"
        print(f"\n{basis} per model{label}, data {args.data}, {args.nproc} processes\n")
        print(table(rows, classes))
    summary = {}
    if fractions != [None]:
        summary = label_efficiency([*models, *timed_names], seeds, fractions, results)
        print("\nmean IoU against the fraction of training labels\n")
        print(label_efficiency_table(summary, fractions))
        print(f"\nplot: {plot_label_efficiency(summary, fractions, args.out)}")
    (args.out / "results.json").write_text(json.dumps(
        {"runs": results, "pretraining": pretraining,
         "label_efficiency": {k: {str(f): v for f, v in s.items()} for k, s in summary.items()}},
        indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--unet-worker":
        from functools import partial

        from torchtitan.pictures.visualization import write_validation_visuals
        from torchtitan.trainer import run

        sys.exit(run(partial(unet_task(), visuals=write_validation_visuals), sys.argv[2:]))
    sys.exit(main())
