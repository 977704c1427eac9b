"""How quality moves with training time: finished runs of ``bench/quality.py`` (or of the
trainer) gathered per model and budget, as a table and a plot.

    python bench/budget_plot.py --metric val/mean_iou --out docs/budget_vnc.png \\
        --series "recipe=8:outputs/r41_clock/vit_s0,outputs/r41_clock/vit_s1;24:outputs/r41_24/vit_s0" \\
        --series "plain U-Net=8:outputs/r41_clock/unet2d_plain_s0;24:outputs/r41_24/unet2d_plain_s0"

Each ``--series NAME=MINUTES:RUN,RUN;MINUTES:RUN,...`` names one model's runs (dump folders)
at each budget in minutes of training. A run's score is the last record holding ``--metric``
in its ``logs/metrics.jsonl`` (the final validation); a run given as ``=VALUE`` is a score an
earlier run recorded (BENCHMARKS.md gives its command) whose folder is not at hand. It trains
nothing: the runs say how they were made (see BENCHMARKS.md for their commands). Prints a
markdown table (each seed, the mean and the spread of the seeds per budget) and draws the
means against minutes, each seed a dot (``bench/quality.py``'s plot).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from quality import plot_series


def final_score(run: Path, metric: str) -> float:
    """The last value of ``metric`` that the run logged (its final validation); ``=VALUE``:
    that value, recorded earlier."""
    if str(run).startswith("="):
        try:
            return float(str(run)[1:])
        except ValueError:
            raise SystemExit(f"{run}: a recorded score is =NUMBER, e.g. =1.856") from None
    path = run / "logs" / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{run}: no logs/metrics.jsonl; is it a finished run's dump folder?")
    values = [r[metric] for r in map(json.loads, path.read_text().splitlines())
              if metric in r]
    if not values:
        raise SystemExit(f"{path} holds no {metric!r}")
    return float(values[-1])


def parse_series(text: str) -> tuple[str, dict[float, list[Path]]]:
    """``NAME=MINUTES:RUN,RUN;MINUTES:RUN`` -> (name, {minutes: [runs]})."""
    name, _, rest = text.partition("=")
    if not rest:
        raise SystemExit(f"--series {text!r}: expected NAME=MINUTES:RUN,RUN;MINUTES:RUN")
    budgets: dict[float, list[Path]] = {}
    for part in rest.split(";"):
        minutes, _, runs = part.partition(":")
        budgets[float(minutes)] = [Path(r) for r in runs.split(",") if r]
    return name, budgets


def table(summary: dict[str, dict], metric: str) -> str:
    rows = [f"| model | minutes | {metric} per seed | mean | spread |", "|---|---|---|---|---|"]
    for name, cells in summary.items():
        for minutes, c in sorted(cells.items()):
            seeds = " / ".join(f"{v:.3f}" for v in c["seeds"])
            spread = max(c["seeds"]) - min(c["seeds"])
            rows.append(f"| {name} | {minutes:g} | {seeds} | **{c['mean']:.3f}** | {spread:.3f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--series", action="append", required=True, metavar="NAME=MIN:RUN,...;...")
    p.add_argument("--metric", default="val/mean_iou")
    p.add_argument("--label", default="", help="the y axis' label (default: the metric)")
    p.add_argument("--decimals", type=int, default=2, help="the y axis' grid: 10^-decimals")
    p.add_argument("--out", type=Path, help="the plot (PNG)")
    args = p.parse_args(argv)
    summary: dict[str, dict] = {}
    for text in args.series:
        name, budgets = parse_series(text)
        summary[name] = {}
        for minutes, runs in budgets.items():
            seeds = [final_score(r, args.metric) for r in runs]
            summary[name][minutes] = {"mean": statistics.fmean(seeds), "seeds": seeds}
    print(table(summary, args.metric))
    if args.out:
        minutes = sorted({m for cells in summary.values() for m in cells})
        minutes = [int(m) if float(m).is_integer() else m for m in minutes]  # axis labels
        plot_series(summary, minutes, float, "minutes of training",
                    args.label or args.metric, args.out, decimals=args.decimals)
        print(f"plot: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
