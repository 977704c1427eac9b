"""Post-processing, measured: semantic IoU/Dice and instance F1 raw vs after each step.

    python predict.py --checkpoint RUN/checkpoint --crops all --probabilities --out PRED.zarr
    python bench/postprocess.py --predictions PRED.zarr --groundtruth DATA_ROOT \\
        [--config RUN/config.toml] [--min_object_nm3 1e5,1e6] [--fill_holes planes] \\
        [--fill_holes_classes nuc,mito] [--neck_ratio 0.3,0.5,0.7] [--crops crop1,crop5] \\
        [--boundary_seed_nm 20,40,60]
    python bench/postprocess.py --timing 256     # seconds per step on a synthetic 256^3 mask

Trains nothing. For every predicted crop that has ground truth and every class it annotates,
the probabilities (``predict.py --probabilities``) are put on the class's ground-truth grid
(linear interpolation, as the scoring command does) and thresholded at 0.5; then each
post-processing setting of :mod:`torchtitan.postprocess.masks` is applied on that grid with its voxel
size, and every result is scored with the metrics of :mod:`torchtitan.scoring.metrics` (the
validation's own). Semantic counts are pooled over crops; instance F1 and score are averaged
over the crops that annotate the class.

``--timing SIDE`` measures speed instead: each step on one synthetic SIDE^3 mask at 8 nm
(smoothed noise thresholded into touching blobs, about 40% foreground), median of 3 runs.

Settings compared (rows ``step``): ``raw``; ``min_object=<v>`` for each ``--min_object_nm3``
value; ``fill_holes_<mode>`` with ``--fill_holes``; ``watershed(neck=<r>)`` for each
``--neck_ratio`` value; ``boundaries(seed=<nm>)`` for each ``--boundary_seed_nm`` value
(``inference.boundary_instances``: an instance class cut by its predicted membrane class, cell
by pm, so those rows post-process each crop's classes together, on one grid; the small-object
size is the first ``--min_object_nm3``); and ``all``: every step together with the first value
of each list (or the run's ``[inference]`` settings with ``--config``, when they post-process
at all).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import numpy as np

from torchtitan.config.manager import ConfigManager
from torchtitan.data.crops import layout, reader
from torchtitan.data.io.stores import StoreContext
from torchtitan.errors import UserError
from torchtitan.cellmap.classes import INSTANCE_CLASSES
from torchtitan.choices import PROBABILITY_THRESHOLD
from torchtitan.postprocess.masks import FILL_HOLES_MODES, PostProcessing, postprocess
from torchtitan.scoring.metrics import combine_scores, score_crop
from torchtitan.scoring.stores import open_submission, prediction_level, read_truth


def steps(pp: PostProcessing) -> dict[str, PostProcessing]:
    """``raw``, each step that ``pp`` enables on its own, and ``all`` (``pp`` itself) when more
    than one step is enabled: what :func:`measure` compares for a :class:`PostProcessing`."""
    raw = PostProcessing(watershed_neck_ratio=pp.watershed_neck_ratio,
                         boundary_seed_nm=pp.boundary_seed_nm)
    out = {"raw": raw}
    if pp.min_object_nm3 > 0:
        out["min_object"] = replace(raw, min_object_nm3=pp.min_object_nm3)
    if pp.fill_holes != "none":
        out[f"fill_holes_{pp.fill_holes}"] = replace(
            raw, fill_holes=pp.fill_holes, fill_holes_classes=pp.fill_holes_classes)
    if pp.instances != "components":
        out[pp.instances] = replace(raw, instances=pp.instances)
    if pp.boundary_instances:
        out["boundaries"] = replace(raw, boundary_instances=True)
    if len(out) > 2:
        out["all"] = pp
    return out


def measure(probabilities: dict, truth: dict, voxel_size, pp, valid: dict | None = None,
            threshold: float = PROBABILITY_THRESHOLD,
            instance_classes=INSTANCE_CLASSES) -> dict[str, dict]:
    """Scores of one crop raw and after each post-processing step.

    ``probabilities``: ``{class: probabilities or boolean mask}`` on the grid of ``truth``
    (``{class: mask or instance ids}``, the classes the crop annotates); ``valid``:
    ``{class: voxels that count}`` (missing: all); ``voxel_size``: nm per axis of that grid.
    ``pp``: a :class:`PostProcessing` (compared step by step, :func:`steps`)
    or ``{step name: PostProcessing}`` to compare any settings. Returns ``{step:
    score_crop result}`` (:func:`torchtitan.scoring.metrics.score_crop`).
    """
    steps_ = steps(pp) if isinstance(pp, PostProcessing) else dict(pp)
    masks = {}
    for name, p in probabilities.items():
        p = np.asarray(p)
        masks[name] = p > threshold if p.dtype.kind == "f" else p.astype(bool)
    return {step: score_crop(postprocess(masks, voxel_size, settings, instance_classes), truth,
                             valid or {}, voxel_size, instance_classes)
            for step, settings in steps_.items()}


def combine_steps(measured: list[dict[str, dict]]) -> dict[str, dict]:
    """Pool several crops' :func:`measure` results: ``{step: combine_scores result}``."""
    steps = list(measured[0]) if measured else []
    return {step: combine_scores([m[step] for m in measured]) for step in steps}


def format_table(combined: dict[str, dict], classes=None) -> str:
    """A text table (Markdown) of per-class IoU, Dice, instance F1 and instance score (and,
    for the classes scored as neurons, VOI split + merge and ARAND) for each step of
    :func:`combine_steps`, with the change against ``raw``."""
    raw = combined.get("raw", {}).get("classes", {})
    names = list(classes) if classes else sorted({c for r in combined.values() for c in r["classes"]})
    keys = ["iou", "dice", "f1", "score"]
    header = "| class | step | IoU | Dice | instance F1 | instance score |"
    if any("voi" in c for r in combined.values() for c in r["classes"].values()):
        keys += ["voi", "arand"]
        header += " VOI | ARAND |"
    lines = [header, "|---" * (len(keys) + 2) + "|"]

    def cell(scores, base, key):
        value = scores.get(key)
        if value is None:
            return "-"
        ref = base.get(key) if base else None
        if ref is None or scores is base:
            return f"{value:.3f}"
        return f"{value:.3f} ({value - ref:+.3f})"

    for name in names:
        for step, result in combined.items():
            scores = result["classes"].get(name)
            if scores is None:
                continue
            base = raw.get(name)
            lines.append(f"| {name} | {step} | " + " | ".join(
                cell(scores, base, k) for k in keys) + " |")
    for step, result in combined.items():
        o = result["overall"]
        mean_iou, mean_instance = (f"{v:.3f}" if v is not None else "-"
                                   for v in (o["mean_semantic_iou"], o["mean_instance_score"]))
        lines.append(f"| mean | {step} | {mean_iou} (semantic classes) | | | {mean_instance} |"
                     + " |" * (len(keys) - 4))
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas") from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--predictions",
                   help="prediction store of predict.py --probabilities (PRED.zarr/crop<N>/<class>)")
    p.add_argument("--groundtruth", help="data root with the crops' labels")
    p.add_argument("--timing", type=int, default=0, metavar="SIDE",
                   help="time each step on a synthetic SIDE^3 mask instead (no stores needed)")
    p.add_argument("--config", help="a run's config.toml: its [inference] post-processing is "
                                    "the 'all' row")
    p.add_argument("--crops", help="crops to measure, e.g. crop1,crop5 (default: all predicted)")
    p.add_argument("--min_object_nm3", type=_floats, default=[1e5, 1e6],
                   help="object sizes to remove below, nm^3, comma-separated (default 1e5,1e6)")
    p.add_argument("--fill_holes", choices=FILL_HOLES_MODES, default="planes",
                   help="hole filling to measure (default planes)")
    p.add_argument("--fill_holes_classes", default="",
                   help="classes to fill, comma-separated (default: every class)")
    p.add_argument("--neck_ratio", type=_floats, default=[0.3, 0.5, 0.7],
                   help="watershed neck ratios, comma-separated (default 0.3,0.5,0.7)")
    p.add_argument("--boundary_seed_nm", type=_floats, default=[],
                   help="seed distances (nm) of neurons cut by their predicted membranes "
                        "(inference.boundary_instances), comma-separated (default: none)")
    return p.parse_args(argv)


def settings(args) -> dict[str, PostProcessing]:
    """The post-processing settings to compare, by row name."""
    fill_classes = tuple(c for c in args.fill_holes_classes.split(",") if c)
    steps = {"raw": PostProcessing()}
    for v in args.min_object_nm3:
        steps[f"min_object={v:g}"] = PostProcessing(min_object_nm3=v)
    if args.fill_holes != "none":
        steps[f"fill_holes_{args.fill_holes}"] = PostProcessing(
            fill_holes=args.fill_holes, fill_holes_classes=fill_classes)
    for r in args.neck_ratio:
        steps[f"watershed(neck={r:g})"] = PostProcessing(instances="watershed", watershed_neck_ratio=r)
    every = PostProcessing(
        min_object_nm3=args.min_object_nm3[0] if args.min_object_nm3 else 0.0,
        fill_holes=args.fill_holes, fill_holes_classes=fill_classes,
        instances="watershed" if args.neck_ratio else "components",
        watershed_neck_ratio=args.neck_ratio[0] if args.neck_ratio else 0.5)
    if args.config:
        cfg = ConfigManager().parse_args(["--job.config_file", args.config])
        configured = PostProcessing.from_config(cfg.inference)
        if configured.enabled:
            every = configured
    steps["all"] = every
    return steps


def boundary_settings(args) -> dict[str, PostProcessing]:
    """The rows of ``--boundary_seed_nm``: classes post-processed together."""
    size = args.min_object_nm3[0] if args.min_object_nm3 else 0.0
    return {f"boundaries(seed={v:g})": PostProcessing(min_object_nm3=size, boundary_instances=True,
                                                      boundary_seed_nm=v)
            for v in args.boundary_seed_nm}


def run(args) -> dict:
    steps, joint_steps = settings(args), boundary_settings(args)
    root, predicted = open_submission(args.predictions)
    wanted = [c if c.startswith("crop") else f"crop{c}" for c in args.crops.split(",")] \
        if args.crops else predicted
    stores = StoreContext()  # reads the ground truth and the predictions
    truth_crops = {c.name: c for s in layout.discover(stores, args.groundtruth) for c in s.crops}
    per_crop_class, per_crop, classes = [], [], []
    seconds = {step: 0.0 for step in {**steps, **joint_steps}}
    for name in wanted:
        if name not in truth_crops or name not in predicted:
            raise UserError(f"{name}: needs a prediction in {root} and ground truth under "
                            f"{args.groundtruth} (predicted: {', '.join(predicted) or 'none'})")
        crop = truth_crops[name]
        together: dict[str, tuple] = {}
        for cls in crop.classes:
            node = root / name / cls
            if not node.exists():
                continue
            level = prediction_level(node)
            if stores.open_array(level.path).dtype.kind != "f":
                raise UserError(f"{node}: holds masks or ids, not probabilities; predict with "
                                "predict.py --probabilities")
            truth, valid, grid = read_truth(crop, cls)
            prob, _ = reader.read_linear(stores, level, grid.box_min, grid.scale, grid.shape,
                                          fill=0)
            # One {step: score_crop result} per (crop, class): what combine_steps pools.
            result = {}
            for step, pp in steps.items():
                t0 = time.perf_counter()
                result.update(measure({cls: prob}, {cls: truth}, grid.scale, {step: pp},
                                      valid={cls: valid}))
                seconds[step] += time.perf_counter() - t0
            per_crop_class.append(result)
            together[cls] = (prob, truth, valid, grid)
            if cls not in classes:
                classes.append(cls)
        if joint_steps and together:
            per_crop.append(_measure_together(name, together, joint_steps, seconds))
    combined = combine_steps(per_crop_class)
    if per_crop:
        combined.update(combine_steps(per_crop))
    return {"combined": combined, "classes": classes, "seconds": seconds,
            "steps": {**steps, **joint_steps}, "crops": wanted}


def _measure_together(name: str, together: dict, steps: dict, seconds: dict) -> dict:
    """One crop's classes post-processed together (the boundary rows), on their one grid."""
    grids = {cls: g for cls, (_, _, _, g) in together.items()}
    first = next(iter(grids.values()))
    if any(tuple(g.shape) != tuple(first.shape) for g in grids.values()):
        raise UserError(f"{name}: --boundary_seed_nm needs the crop's classes on one grid "
                        f"(shapes {', '.join(f'{c} {tuple(g.shape)}' for c, g in grids.items())})")
    result = {}
    for step, pp in steps.items():
        t0 = time.perf_counter()
        result.update(measure({c: t[0] for c, t in together.items()},
                              {c: t[1] for c, t in together.items()}, first.scale, {step: pp},
                              valid={c: t[2] for c, t in together.items()}))
        seconds[step] += time.perf_counter() - t0
    return result


def timing(side: int, repeats: int = 3) -> dict[str, float]:
    """Median seconds of each step on a synthetic ``side``^3 mask (8 nm voxels)."""
    import numpy as np
    import scipy.ndimage as ndi

    from torchtitan.postprocess.masks import fill_holes, label_instances, remove_small_objects, watershed_instances

    rng = np.random.default_rng(0)
    mask = ndi.gaussian_filter(rng.random((side,) * 3, dtype=np.float32), 3.0) > 0.505
    v = (8.0, 8.0, 8.0)
    steps = {
        "min_object_nm3=1e5": lambda: remove_small_objects(mask, v, 1e5),
        "fill_holes planes": lambda: fill_holes(mask, "planes"),
        "fill_holes volume": lambda: fill_holes(mask, "volume"),
        "components": lambda: label_instances(mask),
        "watershed": lambda: watershed_instances(mask, v, 0.5),
    }
    out = {"foreground": float(mask.mean())}
    for name, step in steps.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out[name] = sorted(times)[len(times) // 2]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.timing:
        result = timing(args.timing)
        print(f"{args.timing}^3 mask, {result.pop('foreground'):.0%} foreground, median of 3:")
        for name, seconds in result.items():
            print(f"  {name:>20s}: {seconds:.2f} s")
        return 0
    if not (args.predictions and args.groundtruth):
        print("error: --predictions and --groundtruth are needed (or --timing SIDE)", file=sys.stderr)
        return 2
    try:
        out = run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"post-processing measured on {', '.join(out['crops'])} "
          f"({len(out['classes'])} classes: {', '.join(out['classes'])})")
    for step, pp in out["steps"].items():
        print(f"  {step:>22s}: {pp}  ({out['seconds'][step]:.2f} s, scoring included)")
    print()
    print(format_table(out["combined"], out["classes"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
