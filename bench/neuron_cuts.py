"""Neurons of trained runs cut several ways: one prediction per run, every cut scored and timed.

    python bench/neuron_cuts.py --run vit_aff_s0=outputs/neurons/vit_aff_s0 \\
        --run vit_aff_s1=outputs/neurons/vit_aff_s1 \\
        --cut "mutex=--inference.affinity_cut mutex" \\
        --cut "mutex_graph=--inference.affinity_cut mutex_graph" \\
        --cut "boundary=--inference.affinity_cut boundary --inference.boundary_instances true"

Trains nothing. Each run's last checkpoint predicts its validation crops once (the run's
``[inference]`` window plan, as validation does); then each ``--cut`` (flags over the run's
config, ``[inference]`` options) post-processes that prediction and is scored by validation's
own code (:func:`torchtitan.tasks.segmentation.score_prediction`: VOI split / merge and ARAND
of the neurons, the challenge's instance score, boundary IoU), and the cut's post-processing is
timed. Runs named ``MODEL_s<seed>`` are also averaged per model; runs of ``bench/quality.py``'s
in-trainer U-Net (named ``unet3d...``) are rebuilt as that U-Net. ``--json`` writes every number.
``--picture OUT.png`` draws the first run's first crop cut by the first ``--cut``: a few
sections of EM, the true neurons and the predicted ones (each neuron its own colour).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from torchtitan.cellmap.affinities import AffinitySpec, split_outputs
from torchtitan.checkpoint.reading import resolve_step_folder
from torchtitan.config.manager import ConfigManager
from torchtitan.data.volume_source import build_source
from torchtitan.inference.sliding_window import VolumePredictor
from torchtitan.postprocess.masks import PostProcessing, postprocess
from torchtitan.scoring.metrics import combine_scores, validation_scores
from torchtitan.tasks import SegmentationTask
from torchtitan.tasks.segmentation import score_prediction
from torchtitan.prediction.runs import load_weights

# (row label, score key, class or None)
ROWS = (("VOI split", "voi_split", "cell"), ("VOI merge", "voi_merge", "cell"),
        ("VOI (split + merge)", "voi", "cell"), ("ARAND", "arand", "cell"),
        ("cell instance score", "instance_score", "cell"), ("IoU pm", "iou", "pm"))


def run_config(dump: Path, flags: list[str]):
    return ConfigManager().parse_args(["--job.config_file", str(dump / "config.toml"), *flags])


def run_task(name: str):
    """The task that trained the run ``name``: MONAI's U-Net for the runs ``bench/quality.py``
    names ``unet2d`` / ``unet3d`` (with their seed suffix), else ours."""
    from quality import UNETS, model_kind, unet_task

    return unet_task() if model_kind(name) in UNETS else SegmentationTask


def predict_run(dump: Path, extra_flags: list[str], task_class=SegmentationTask
                ) -> tuple[object, list]:
    """(config, [(crop volume, class probabilities, {class: (affinities, offsets)})])."""
    cfg = run_config(dump, extra_flags)
    task = task_class(cfg)
    model = task.build_model()
    load_weights(model, str(resolve_step_folder(dump / cfg.checkpoint.folder)))
    model.eval()
    source = build_source(cfg)
    predictor = VolumePredictor.from_config(model, cfg, torch.device("cpu"))
    spec = AffinitySpec.from_config(cfg)
    out = []
    for crop in source.val_crops:
        vol = source.read_volume(crop)
        prob = predictor.predict_volume(vol.image).numpy()
        classes, affinities = split_outputs(prob, cfg.data.classes, spec)
        out.append((vol, classes, affinities))
    return cfg, out


def score_cut(dump: Path, predicted: list, cfg, flags: list[str],
              picture: Path | None = None) -> dict[str, float]:
    """Validation's post-processed scores of one cut, and its seconds (``time_s``); with
    ``picture``, the first crop's neurons drawn there."""
    cut_cfg = run_config(dump, flags)
    post = PostProcessing.from_config(cut_cfg.inference)
    per_crop, timing = [], {}
    for vol, prob, affinities in predicted:
        pred = prob > cut_cfg.inference.threshold
        per_crop.append(score_prediction(pred, vol, post, affinities, timing)[1])
        if picture is not None and "cell" in vol.instance_ids:
            masks = {n: pred[k] for k, n in enumerate(vol.classes)}
            cut = postprocess(masks, vol.voxel_size, post, affinities=affinities)["cell"]
            draw_neurons(picture, vol.image[0].numpy(), vol.instance_ids["cell"], cut)
            picture = None
    scores = validation_scores(combine_scores(per_crop), list(cfg.data.classes))
    return {**{k.removeprefix("val/"): v for k, v in scores.items()},
            "time_s": timing.get("post_s", 0.0)}


def _colours(ids: np.ndarray) -> np.ndarray:
    """A fixed pseudo-random colour per id (0 black)."""
    h = (ids.astype(np.uint64) * np.uint64(2654435761)) % np.uint64(2**24)
    rgb = np.stack([(h >> np.uint64(s)) & np.uint64(255) for s in (16, 8, 0)], -1).astype(np.uint8)
    rgb = 64 + (rgb.astype(np.uint16) * 3 // 4).astype(np.uint8)
    rgb[ids == 0] = 0
    return rgb


def draw_neurons(path: Path, em: np.ndarray, truth: np.ndarray, pred: np.ndarray,
                 sections: int = 3) -> None:
    """Rows of sections (evenly through z): EM, true neurons, predicted neurons."""
    from PIL import Image

    zs = np.linspace(0, em.shape[0] - 1, sections + 2)[1:-1].astype(int)
    grey = np.clip((em + 1) * 127.5, 0, 255).astype(np.uint8)
    rows = [np.concatenate([np.repeat(grey[z][..., None], 3, -1), _colours(truth[z]),
                            _colours(pred[z])], axis=1) for z in zs]
    gap = np.full((4, rows[0].shape[1], 3), 255, np.uint8)
    image = np.concatenate([r for row in rows for r in (row, gap)][:-1])
    Image.fromarray(image).save(path)


def table(results: dict[str, dict[str, dict]], cuts: list[str]) -> str:
    """Markdown: a row per (cut, score), a column per run and per model's mean."""
    runs = list(results)
    models: dict[str, list[str]] = {}
    for r in runs:
        models.setdefault(re.sub(r"_s\d+$", "", r), []).append(r)
    means = {m: rs for m, rs in models.items() if len(rs) > 1}
    header = "| cut | score | " + " | ".join(runs + [f"**{m}, mean**" for m in means]) + " |"
    lines = [header, "|---" * (2 + len(runs) + len(means)) + "|"]
    for cut in cuts:
        for label, key, cls in (*ROWS, ("post-processing s", "time_s", None)):
            name = f"{key}/{cls}" if cls else key
            values = [results[r][cut].get(name) for r in runs]
            cells = [f"{v:.3f}" if v is not None else "-" for v in values]
            for rs in means.values():
                got = [results[r][cut].get(name) for r in rs]
                cells.append(f"**{statistics.fmean(got):.3f}**" if None not in got else "-")
            lines.append(f"| {cut} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="NAME=DUMP_FOLDER")
    p.add_argument("--cut", action="append", required=True, metavar="NAME=FLAGS")
    p.add_argument("--flags", default="", help="flags over every run's config before predicting "
                                               "(e.g. --data.dataset_path data/medulla)")
    p.add_argument("--json", type=Path, help="write every score here")
    p.add_argument("--picture", type=Path, help="PNG of the first run's neurons, first cut")
    args = p.parse_args(argv)
    cuts = dict(c.split("=", 1) for c in args.cut)
    results: dict[str, dict[str, dict]] = {}
    for spec in args.run:
        name, dump = spec.split("=", 1)
        dump = Path(dump)
        t0 = time.perf_counter()
        cfg, predicted = predict_run(dump, shlex.split(args.flags), run_task(name))
        print(f"{name}: predicted {len(predicted)} crop(s) in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
        results[name] = {}
        for cut, flags in cuts.items():
            first = len(results) == 1 and cut == next(iter(cuts))  # first run, first cut
            picture = args.picture if first else None
            results[name][cut] = score_cut(dump, predicted, cfg,
                                           shlex.split(args.flags) + shlex.split(flags), picture)
            r = results[name][cut]
            print(f"  {cut}: VOI {r.get('voi/cell', float('nan')):.3f} ARAND "
                  f"{r.get('arand/cell', float('nan')):.3f} ({r['time_s']:.1f} s)",
                  file=sys.stderr, flush=True)
    print(table(results, list(cuts)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
