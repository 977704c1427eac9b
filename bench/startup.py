"""Start-up of a large model under FSDP: time to the first step and peak host memory per rank,
fresh and resumed, for this checkout and, side by side, another one (e.g. the previous commit).

    git worktree add /tmp/startup_base HEAD        # the code to compare with
    python bench/startup.py --data data/demo --backbone dinov3_vith16plus \\
        --baseline /tmp/startup_base

For each checkout it launches ``torchrun --nproc_per_node 2`` (gloo, CPU processes, FSDP over
both) of that checkout's ``train_segmentation.py`` with the debug 2D config and the given
backbone on 32x32 crops, batch 2: a fresh run of one step that saves a full checkpoint, then a
run of one more step that resumes from it. Every rank runs the entry script through this file
(``--worker``; the checkout comes first on ``PYTHONPATH``, and the ``torchtitan`` actually
imported is checked), which records without changing the trainer:

* seconds from the launch to the first ``train_step`` call, and from ``Trainer.setup`` to it;
* the peak RSS (``ru_maxrss``) at that call: the start-up's peak (model, initialisation and,
  on a resume, the loaded checkpoint; no activation or gradient yet), and at the end of the
  fresh run (its one step adds gradients and AdamW state: at least 4 x parameters x 4 bytes
  over the ranks); the resumed run stops at its first step;
* how many times ``init_weights`` of the model ran.

The end-of-run validation is skipped (it is not start-up, and takes minutes for a ViT-H+ on
CPU). Memory is compared with a full float32 copy of the model and its AdamW state
(3 x parameters x 4 bytes). The table is printed as Markdown (docs/benchmarks/startup.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "train_configs/debug_segmentation_2d.toml"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class _StopAtFirstStep(SystemExit):
    pass


def worker(tree: Path, record: Path, t_launch: float, argv: list[str],
           stop_at_first_step: bool = False) -> None:
    """One rank: run ``tree``'s train_segmentation.py with ``argv``, recording start-up
    (and, with ``stop_at_first_step``, leaving at the first step, before it runs)."""
    import torchtitan
    import torchtitan.trainer as trainer_module
    from torchtitan.models.segmentation import SegmentationModel

    imported = Path(torchtitan.__file__).resolve()
    if not imported.is_relative_to(tree.resolve()):
        raise SystemExit(f"torchtitan is imported from {imported}, not from {tree}: put "
                         f"{tree} first on PYTHONPATH")
    rank = int(os.environ.get("RANK", 0))
    out: dict = {"rank": rank, "torchtitan": str(imported), "init_weights_calls": 0}
    Trainer = trainer_module.Trainer
    setup, train_step = Trainer.setup, Trainer.train_step
    init_weights = SegmentationModel.init_weights

    def counted_init_weights(self):
        out["init_weights_calls"] += 1
        return init_weights(self)

    def timed_setup(self):
        out["rss_before_setup_mib"] = _rss_mib()
        out["setup_started"] = time.time()
        return setup(self)

    def recorded_train_step(self, batch, step):
        if "first_step" not in out:
            out["first_step"] = time.time()
            out["maxrss_first_step_mib"] = _maxrss_mib()
            out["num_params"] = self.num_params
            out["start_step"] = step - 1
            if stop_at_first_step:
                raise _StopAtFirstStep(0)
        return train_step(self, batch, step)

    SegmentationModel.init_weights = counted_init_weights
    Trainer.setup = timed_setup
    Trainer.train_step = recorded_train_step
    Trainer.validate = lambda self, step: {}  # the final validation is not start-up
    sys.argv = [str(tree / "train_segmentation.py"), *argv]
    code = 0
    try:
        runpy.run_path(str(tree / "train_segmentation.py"), run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
    out["maxrss_end_mib"] = None if stop_at_first_step else _maxrss_mib()
    out["time_to_first_step_s"] = out.get("first_step", float("nan")) - t_launch
    out["setup_to_first_step_s"] = (out.get("first_step", float("nan"))
                                    - out.get("setup_started", float("nan")))
    out["exit_code"] = code
    Path(f"{record}.rank{rank}").write_text(json.dumps(out) + "\n")
    sys.exit(code)


def launch(tree: Path, train_args: list[str], nproc: int = 2, timeout: int = 3600,
           stop_at_first_step: bool = False) -> tuple[list[dict], subprocess.CompletedProcess]:
    """One torchrun job of ``tree``'s trainer through :func:`worker`; returns the records of
    every rank (sorted by rank) and the completed process."""
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "record"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(nproc), str(Path(__file__).resolve()), "--worker",
               "--tree", str(tree), "--record", str(record), "--t-launch", repr(time.time()),
               *(["--stop-at-first-step"] if stop_at_first_step else []), "--", *train_args]
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout)
        records = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("record.rank*"))]
    return sorted(records, key=lambda r: r["rank"]), proc


def train_args(data: Path, dump: Path, backbone: str, steps: int, *extra: str) -> list[str]:
    return ["--job.config_file", CONFIG, "--data.dataset_path", str(data),
            "--job.dump_folder", str(dump), "--model.backbone", backbone,
            "--model.patch_size", "16", "--model.crop_size", "32,32",
            "--training.batch_size", "2", "--training.steps", str(steps),
            "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1",
            "--metrics.log_freq", "1", "--no-metrics.progress_bar", "--data.num_workers", "0",
            *extra]


def measure_tree(name: str, tree: Path, data: Path, backbone: str, work: Path) -> list[dict]:
    """A fresh run (1 step, saves step-1), then one that resumes from it and stops at its
    first step (the start-up is measured; its step would only add the memory of the first)."""
    dump = work / name
    shutil.rmtree(dump, ignore_errors=True)
    rows = []
    for run, steps in (("fresh", 1), ("resumed", 2)):
        records, proc = launch(tree, train_args(data, dump, backbone, steps),
                               stop_at_first_step=run == "resumed")
        if proc.returncode != 0 or len(records) != 2:
            sys.exit(f"{name} {run} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        for r in records:
            rows.append({"code": name, "run": run, **r})
        print(f"{name} {run}: " + "; ".join(
            f"rank {r['rank']} {r['time_to_first_step_s']:.1f} s, "
            f"{r['maxrss_first_step_mib'] / 1024:.2f} GiB" for r in records), flush=True)
    shutil.rmtree(dump, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    full_gib = 3 * rows[0]["num_params"] * 4 / 2**30
    lines = [
        f"Full float32 model + AdamW state: {full_gib:.2f} GiB "
        f"({rows[0]['num_params'] / 1e6:.0f}M parameters).",
        "",
        "| code | run | rank | launch -> first step (s) | setup -> first step (s) | "
        "peak RSS at first step (GiB) | / full model + AdamW | peak RSS whole run (GiB) | "
        "init_weights calls |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = r["maxrss_first_step_mib"] / 1024
        end = "-" if r["maxrss_end_mib"] is None else f"{r['maxrss_end_mib'] / 1024:.2f}"
        lines.append(
            f"| {r['code']} | {r['run']} | {r['rank']} | {r['time_to_first_step_s']:.1f} | "
            f"{r['setup_to_first_step_s']:.1f} | {peak:.2f} | {peak / full_gib:.2f} | {end} | "
            f"{r['init_weights_calls']} |")
    return "\n".join(lines)


def goals(rows: list[dict]) -> str:
    full_mib = 3 * rows[0]["num_params"] * 4 / 2**20
    pick = {(r["code"], r["run"], r["rank"]): r for r in rows}
    out = []
    fresh0 = pick[("this", "fresh", 0)]["maxrss_first_step_mib"] / full_mib
    out.append(f"rank-0 start-up peak RSS, fresh: {fresh0:.2f} x the full model + AdamW "
               f"(goal <= 0.6): {'met' if fresh0 <= 0.6 else 'NOT met'}")
    resumed0 = pick[("this", "resumed", 0)]["maxrss_first_step_mib"] / full_mib
    out.append(f"rank-0 start-up peak RSS, resumed: {resumed0:.2f} x (goal <= 0.6): "
               f"{'met' if resumed0 <= 0.6 else 'NOT met'}")
    if ("baseline", "resumed", 0) in pick:
        for what, label in (("time_to_first_step_s", "launch -> first step"),
                            ("setup_to_first_step_s", "setup -> first step")):
            ratio = (max(pick[("this", "resumed", k)][what] for k in (0, 1))
                     / max(pick[("baseline", "resumed", k)][what] for k in (0, 1)))
            out.append(f"resumed, {label} (slowest rank): {ratio:.2f} x the baseline's "
                       f"(goal <= 0.5): {'met' if ratio <= 0.5 else 'NOT met'}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        p = argparse.ArgumentParser()
        p.add_argument("--worker", action="store_true")
        p.add_argument("--tree", type=Path, required=True)
        p.add_argument("--record", type=Path, required=True)
        p.add_argument("--t-launch", type=float, required=True)
        p.add_argument("--stop-at-first-step", action="store_true")
        split = argv.index("--")
        a = p.parse_args(argv[:split])
        worker(a.tree, a.record, a.t_launch, argv[split + 1:], a.stop_at_first_step)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=REPO / "data" / "demo",
                   help="dataset (e.g. the demo set of helpers/make_demo_data.py)")
    p.add_argument("--backbone", default="dinov3_vith16plus")
    p.add_argument("--baseline", type=Path, default=None,
                   help="another checkout to measure side by side (git worktree add DIR REV)")
    p.add_argument("--work", type=Path, default=None,
                   help="folder for the runs' checkpoints (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=None, help="also write the records as JSON")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        rows = measure_tree("this", REPO, a.data.resolve(), a.backbone, work)
        if a.baseline is not None:
            rows += measure_tree("baseline", a.baseline.resolve(), a.data.resolve(),
                                 a.backbone, work)
    print(f"\n{a.backbone}, FSDP over 2 CPU processes (gloo)\n")
    print(table(rows))
    print()
    print(goals(rows))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
