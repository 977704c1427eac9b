"""Scoring a prediction store against CellMap-layout ground truth, with the challenge's metric.

    python -m torchtitan.scoring --predictions PRED.zarr --groundtruth DATA_ROOT --out s.json
    python -m torchtitan.scoring ... --metric-version 2024     # the original definition

Reads a prediction store and the ground truth, puts every predicted class on its crop's
ground-truth grid (the s0 level of the crop's class group) in world coordinates and scores
it as the CellMap segmentation challenge scores a submission. Floor 3 beside the metrics of
:mod:`torchtitan.scoring.metrics` (whose matching, Hausdorff distance and normalisation it
uses); it reads stores through :mod:`torchtitan.cellmap` and :mod:`torchtitan.data`.

Prediction layout (the challenge's submission layout, and what ``predict.py`` writes):
``PRED.zarr/crop<N>/<class>``, each either a 3D array with the attributes ``voxel_size`` and
``translation`` (nm, z/y/x; translation = centre of voxel 0) or an OME-NGFF multiscale group
(its level ``s0`` is scored; coarser levels are for viewers).

Metric versions (``--metric-version``), as the challenge defines them:

``2025`` (default; the organisers' revised metric), per class over all scored crops:

* semantic classes: voxel TP/FP/FN pooled over crops, IoU = TP / (TP + FP + FN) (1 when the
  class is empty everywhere and predicted empty); Dice = 2 TP / (2 TP + FP + FN) from the same
  counts is reported beside it;
* instance classes: the prediction is split into connected components (full connectivity),
  matched one-to-one to the true instances for maximal total IoU; TP/FP/FN instance counts
  pooled over crops give F1. Every true instance contributes one Hausdorff distance and every
  unmatched prediction one more at the cap; the cap is half the shortest side of the crop
  (nm). As in the challenge's code, a true instance's distance is taken to its match together
  with any unmatched component whose number equals the instance's stored id (the challenge
  leaves unmatched components their numbers when it gives matches their true ids), so a
  missed instance gets a real distance, not the cap, when such a component exists. Each
  distance is normalised to ``1.01 ** (-d / |voxel_size|)`` and the normalised values are
  averaged over the class (pooled over crops). Class score = sqrt(F1 * mean normalised
  distance). All of it is :mod:`torchtitan.scoring.metrics`'s, which validation logs;
* a crop whose prediction has too many instances (more than ``10 + 50 exp(-n / 5)`` per
  true instance, n the largest true id) contributes nothing to its class;
* a class a crop annotates but the submission leaves out counts every voxel of the crop as
  a false negative (semantic) or every true instance as missed (instance);
* overall: the plain mean of the instance class scores, the plain mean of the semantic
  class IoUs, and their geometric mean. When the classes scored (``--classes``) hold only one
  kind, the other half is "not scored" and the overall score is the half that was (the
  challenge's own code would multiply by 0; its test set always holds both kinds).

``2024`` (the original definition), per crop and class, then averaged over crops weighted by
their voxel counts:

* semantic: IoU and Dice of the crop (1 when both are empty);
* instance: connected components and the same matching; accuracy = fraction of voxels whose
  matched id equals the true id (unmatched predictions are wrong); Hausdorff distance = mean
  over true instances (matched: to their match, unmatched: the cap
  ``|voxel_size| ln(10^4) / ln(1.01)``, where the normalised value is 1e-4), 0 when nothing
  matched; combined = sqrt(accuracy * 1.01 ** (-mean distance / |voxel_size|)); more than 50
  predictions per true instance scores 0;
* a class left out of the submission scores 0;
* overall: the mean over instance classes of the combined score and over semantic classes of
  the IoU, and their geometric mean (a half with no class: as for 2025).

In both, a class of ``NEURON_CLASSES`` (``cell``) also gets the metrics neuron segmentation
is judged by, reported beside its score and not part of it: VOI split and merge and the
adapted Rand error (CREMI's definitions, :mod:`torchtitan.scoring.neuron_metrics`) of the true ids and
the same predicted instances the instance metric scores, each crop's pooled as if the crops lay
side by side in one volume (a class left out counts as predicted background everywhere).

In both, voxels the ground truth marks unknown are set to background in prediction and truth
(the challenge's masks), and only classes of the CellMap class table are scored (a fetched
crop's ``all`` group is not a class).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from torchtitan.cellmap.challenge import ALL_LABELS_GROUP
from torchtitan.cellmap.classes import CLASS_IDS, INSTANCE_CLASSES, NEURON_CLASSES, check_class_names
from torchtitan.cellmap.errors import DatasetError
from torchtitan.cellmap.grids import ScaleLevel
from torchtitan.cellmap.labels import holds_instance_ids, label_to_ids, label_to_target
from torchtitan.cellmap.ome_ngff import read_multiscales
from torchtitan.data.crops import layout, reader
from torchtitan.data.io.stores import StoreContext
from torchtitan.choices import PROBABILITY_THRESHOLD
from torchtitan.errors import UserError
from torchtitan.scoring.metrics import (
    classes_and_overall,
    combine_scores,
    instance_overlaps,
    match_instances,
    predicted_instances,
    score_class,
    scores_by_class,
    semantic_crop_scores,
    truth_instances,
)
from torchtitan.scoring.hausdorff import normalize_distance, pair_hausdorff
from torchtitan.scoring.neuron_metrics import neuron_scores, pool_neuron_scores

METRIC_VERSIONS = {
    "2025": "cellmap-2025 (revised: counts pooled per class; instance F1 x per-instance Hausdorff)",
    "2024": "cellmap-2024 (original: per-crop scores, voxel-weighted; instance accuracy x Hausdorff)",
}
DEFAULT_METRIC_VERSION = "2025"


class SubmissionError(UserError, ValueError):
    """A problem with the prediction store or the command's arguments; says what to fix."""


def metric_name(version: str) -> str:
    return METRIC_VERSIONS[version].split(" ")[0]


# ---------------------------------------------------------------------------------------------
# Reading a prediction store
# ---------------------------------------------------------------------------------------------


def _crop_number(name: str) -> int:
    return int(name[4:]) if name.startswith("crop") and name[4:].isdigit() else -1


def _crop_name(text: str) -> str:
    """``"3"`` or ``"crop3"`` -> ``"crop3"``."""
    text = text.strip()
    name = text if text.startswith("crop") else f"crop{text}"
    if _crop_number(name) < 0:
        raise SubmissionError(f"--crops: {text!r} is not a crop number (expected e.g. 1,2 or crop1,crop2)")
    return name


def open_submission(path) -> tuple[Path, list[str]]:
    """Check that ``path`` is a zarr group and list its ``crop<N>`` groups (sorted by N)."""
    root = Path(path)
    if not root.is_dir():
        raise SubmissionError(
            f"prediction store {str(root)!r} does not exist or is not a folder; expected a zarr "
            "group laid out as PRED.zarr/crop<N>/<class>"
        )
    if not ((root / ".zgroup").is_file() or (root / "zarr.json").is_file()):
        raise SubmissionError(f"prediction store {str(root)!r} is not a zarr group (no .zgroup or zarr.json)")
    crops = [p.name for p in root.iterdir() if p.is_dir() and _crop_number(p.name) >= 0]
    return root, sorted(crops, key=_crop_number)


def prediction_level(node: Path) -> ScaleLevel:
    """The ``ScaleLevel`` (path, voxel size, translation, shape) of one predicted class."""
    import zarr

    try:
        obj = zarr.open(str(node), mode="r")
    except Exception as e:  # noqa: BLE001 - re-raised with the path
        raise SubmissionError(f"{node}: not a readable zarr array or group ({e})") from e
    if isinstance(obj, zarr.Array):
        attrs = dict(obj.attrs)
        missing = [k for k in ("voxel_size", "translation") if k not in attrs]
        if missing:
            raise SubmissionError(
                f"{node}: a prediction array needs the attributes 'voxel_size' and 'translation' "
                f"(nm, z/y/x; translation = centre of voxel 0); missing {missing}"
            )
        scale, translation = attrs["voxel_size"], attrs["translation"]
        if obj.ndim != 3 or len(scale) != 3 or len(translation) != 3:
            raise SubmissionError(
                f"{node}: expected a 3D (z, y, x) array with 3-element voxel_size and translation, "
                f"got shape {obj.shape}, voxel_size {scale}, translation {translation}"
            )
        return ScaleLevel(shape=tuple(obj.shape), scale=tuple(map(float, scale)),
                          translation=tuple(map(float, translation)), path=str(node))
    try:
        return read_multiscales(node)[0]
    except DatasetError as e:
        raise SubmissionError(f"{node}: a prediction group needs OME-NGFF multiscales metadata ({e})") from e


def check_prediction_grid(pred: ScaleLevel, truth: ScaleLevel, warn) -> ScaleLevel:
    """``pred`` when its grid can be the crop's: a voxel size 100x off the crop's is an error
    (micrometres or voxels, not nm), a box covering less than half the crop a warning
    (``translation`` in voxels, or another crop's)."""
    ratio = max(max(p / t, t / p) for p, t in zip(pred.scale, truth.scale))
    if ratio >= 100:
        raise SubmissionError(
            f"{pred.path}: voxel_size {list(pred.scale)} is {ratio:.0f}x off the crop's "
            f"{list(truth.scale)} nm; voxel_size and translation must be in nm (z, y, x)")
    overlap = np.clip(np.minimum(pred.box_max, truth.box_max)
                      - np.maximum(pred.box_min, truth.box_min), 0, None)
    covered = float(np.prod(overlap / (truth.box_max - truth.box_min)))
    if covered < 0.5:
        warn(f"{pred.path} covers {covered:.0%} of its crop (prediction "
             f"{pred.box_min.tolist()}..{pred.box_max.tolist()} nm, crop "
             f"{truth.box_min.tolist()}..{truth.box_max.tolist()} nm); the rest scores as "
             "background: check its translation (nm, centre of voxel 0)")
    return pred


def resample_prediction(stores: StoreContext, level, name: str, origin, voxel_size,
                        shape) -> np.ndarray:
    """One predicted class on a ground-truth grid (``origin`` = outer corner of voxel 0, nm),
    read through ``stores``.

    Instance ids (integer arrays wider than uint8, or with values above 1) are sampled by
    nearest neighbour; for a semantic class they then count as foreground where nonzero.
    Binary masks and probabilities are interpolated linearly and thresholded at 0.5.
    """
    dtype = stores.open_array(level.path).dtype
    if dtype.kind in "iu":
        nearest = reader.read_nearest(stores, level, origin, voxel_size, shape, fill=0)
        if dtype.itemsize > 1 or (nearest.size and nearest.max() > 1):
            return nearest if name in INSTANCE_CLASSES else nearest > 0
    elif dtype.kind not in "fb":
        raise SubmissionError(f"{level.path}: unsupported dtype {dtype}; use bool, integers or floats")
    image, _ = reader.read_linear(stores, level, origin, voxel_size, shape, fill=0)
    return image > PROBABILITY_THRESHOLD


def read_truth(crop, name: str):
    """Ground truth of one class of a crop on its own s0 grid: (truth, valid, level), read
    through the crop's store context.

    ``truth`` is a boolean mask, or instance ids for an instance class stored with ids; what
    the stored values mean is ``torchtitan.cellmap.labels``' rule (unknown voxels invalid).
    """
    level = crop.classes[name][0]
    raw = np.asarray(crop.stores.open_array(level.path)[...])
    encoding = crop.encoding_of(name)
    foreground, valid = label_to_target(raw, encoding)
    if name in INSTANCE_CLASSES and holds_instance_ids(raw, encoding):
        return label_to_ids(raw, encoding), valid, level
    return foreground, valid, level


# ---------------------------------------------------------------------------------------------
# One class of one crop
# ---------------------------------------------------------------------------------------------


RATIO_CUTOFF_2024 = 50.0


def hausdorff_cap_2024(voxel_size) -> float:
    """The 2024 metric's distance (nm) for unmatched true instances (normalised value 1e-4)."""
    return float(np.linalg.norm(np.asarray(voxel_size, dtype=float)) * math.log(1e4) / math.log(1.01))


def _instance_2024(pred, truth, voxel_size) -> dict:
    truth_ids, stored = truth_instances(truth)
    n_true = int(stored.size)
    pred_ids, n_pred = predicted_instances(pred)
    cap = hausdorff_cap_2024(voxel_size)
    out = {"n_true": n_true, "n_pred": n_pred, "hausdorff_cap_nm": cap, "status": "scored"}
    if n_true and n_pred / n_true > RATIO_CUTOFF_2024:
        return {**out, "status": "skipped_too_many_instances", "accuracy": 0.0,
                "hausdorff_nm": math.inf, "normalized_hausdorff": 0.0, "score": 0.0}
    rows, cols, iou, _, _ = instance_overlaps(truth_ids, n_true, pred_ids, n_pred)
    matched_t, matched_p, _ = match_instances(rows, cols, iou, n_true, n_pred)
    hd = np.minimum(pair_hausdorff(truth_ids, pred_ids, matched_t, matched_p, voxel_size), cap)
    tp = len(matched_t)
    fp, fn = n_pred - tp, n_true - tp
    # Ids of matched predictions become their true ids; unmatched ones never agree.
    lut = np.full(n_pred + 1, -1, np.int64)
    lut[0] = 0
    lut[matched_p] = matched_t
    accuracy = float(np.mean(lut[pred_ids] == truth_ids)) if truth_ids.size else 1.0
    distances = np.concatenate([hd, np.full(fn, cap)]) if tp else np.zeros(0)
    mean_hd = float(distances.mean()) if distances.size else 0.0
    normalized = float(normalize_distance(mean_hd, voxel_size))
    return {**out, "instance_tp": tp, "instance_fp": fp, "instance_fn": fn, "accuracy": accuracy,
            "hausdorff_nm": mean_hd, "normalized_hausdorff": normalized,
            "score": float(math.sqrt(accuracy * normalized))}


def _neuron_scores(pred, truth, name: str) -> dict:
    """VOI and ARAND of an instance class among ``NEURON_CLASSES`` (else nothing) from the
    instances the instance metric scores; ``pred`` None (left out): all background."""
    if name not in NEURON_CLASSES or name not in INSTANCE_CLASSES:
        return {}
    pred_ids = np.zeros(truth.shape, np.int32) if pred is None else predicted_instances(pred)[0]
    return neuron_scores(truth_instances(truth)[0], pred_ids)


def score_label(pred, truth, valid, voxel_size, name: str, version: str = DEFAULT_METRIC_VERSION) -> dict:
    """The challenge's scores of one class in one crop (``pred`` None: left out of the
    submission). ``truth`` holds a mask or ids, ``valid`` the annotated voxels. The 2025
    scores are :func:`torchtitan.scoring.metrics.score_class`'s, the ones validation logs."""
    if version not in METRIC_VERSIONS:
        raise SubmissionError(f"--metric-version {version!r}: expected one of {sorted(METRIC_VERSIONS)}")
    truth = np.where(valid, truth, 0)
    kind = "instance" if name in INSTANCE_CLASSES else "semantic"
    num_voxels = int(truth.size)
    if pred is None:
        out = {"type": kind, "predicted": False, "num_voxels": num_voxels,
               **semantic_crop_scores(np.zeros(truth.shape, bool), truth)}
        if version == "2025" and kind == "semantic":  # every voxel a false negative
            out.update(tp=0, fp=0, fn=num_voxels, iou=0.0, dice=0.0)
        if kind == "instance":
            n_true = int(truth_instances(truth)[1].size)
            if version == "2025":
                out.update(instance_tp=0, instance_fp=0, instance_fn=n_true, hausdorff_norm_sum=0.0,
                           n_hausdorff=0, f1=0.0, normalized_hausdorff=0.0, score=0.0, n_true=n_true)
            else:
                out.update(accuracy=0.0, hausdorff_nm=0.0, normalized_hausdorff=0.0, score=0.0,
                           instance_tp=0, instance_fp=0, instance_fn=n_true, n_true=n_true)
            out.update(_neuron_scores(None, truth, name))
        elif version == "2024":
            out.update(iou=0.0, dice=0.0)
        return out
    pred = np.asarray(pred)
    if pred.shape != truth.shape:
        raise ValueError(f"class {name!r}: prediction {pred.shape} and ground truth {truth.shape} "
                         "must have one shape (resample the prediction to the crop's grid)")
    if version == "2025":
        return {"predicted": True, "num_voxels": num_voxels,
                **score_class(pred, truth, valid, voxel_size, kind == "instance", name in NEURON_CLASSES)}
    if pred.dtype.kind == "f":
        pred = pred > PROBABILITY_THRESHOLD
    pred = np.where(valid, pred, 0)
    out = {"type": kind, "predicted": True, "num_voxels": num_voxels, **semantic_crop_scores(pred, truth)}
    if kind == "instance":
        out.update(_instance_2024(pred, truth, voxel_size), **_neuron_scores(pred, truth, name))
    return out


# ---------------------------------------------------------------------------------------------
# Many crops
# ---------------------------------------------------------------------------------------------


def _weighted(entries, key) -> float | None:
    pairs = [(e[key], e["num_voxels"]) for e in entries if e.get(key) is not None
             and math.isfinite(e[key])]
    total = sum(w for _, w in pairs)
    return float(sum(v * w for v, w in pairs) / total) if total else None


def combine_challenge_scores(crops: list[dict], version: str = DEFAULT_METRIC_VERSION) -> dict:
    """Per-class and overall scores over ``score_label`` results (``[{"classes": {...}}]``),
    by the rules of ``version`` (module docstring). 2025: validation's own
    :func:`torchtitan.scoring.metrics.combine_scores`."""
    if version == "2025":
        return combine_scores(crops)
    classes = {}
    for name, entries in scores_by_class(crops).items():
        kind = entries[0]["type"]
        out = {"type": kind, "crops": len(entries),
               "iou": _weighted(entries, "iou"), "dice": _weighted(entries, "dice")}
        if kind == "instance":
            out.update(accuracy=_weighted(entries, "accuracy"),
                       hausdorff_nm=_weighted(entries, "hausdorff_nm"),
                       normalized_hausdorff=_weighted(entries, "normalized_hausdorff"),
                       score=_weighted(entries, "score"))
        neuron = [e for e in entries if "voi_split" in e]
        if neuron:
            out.update(pool_neuron_scores(neuron))
        classes[name] = out
    return classes_and_overall(classes)


def _truth_crops(stores: StoreContext, groundtruth) -> dict:
    out = {}
    for source in layout.discover(stores, groundtruth):
        for crop in source.crops:
            if crop.name in out:
                raise SubmissionError(
                    f"{crop.name} is in two ground-truth datasets ({out[crop.name].dataset}, "
                    f"{crop.dataset}) under {groundtruth}; crop numbers must be unique"
                )
            out[crop.name] = crop
    return out


def score_submission(predictions, groundtruth, crops=None, classes=None, warn=None,
                     metric_version: str = DEFAULT_METRIC_VERSION) -> dict:
    """Score a prediction store against the CellMap-layout ground truth under ``groundtruth``.

    ``crops``: crop names or numbers to score (default: every crop of the prediction store);
    a requested crop missing from the predictions has every class left out. ``classes``:
    restrict to these classes (default: every CellMap class each crop annotates). Returns
    ``{"metric", "metric_description", "crops": {name: {"dataset", "classes"}}, "classes",
    "overall"}``.
    """
    if metric_version not in METRIC_VERSIONS:
        raise SubmissionError(f"--metric-version {metric_version!r}: expected one of "
                              f"{sorted(METRIC_VERSIONS)}")
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    root, predicted_crops = open_submission(predictions)
    stores = StoreContext()  # reads the ground truth and the predictions
    truth_crops = _truth_crops(stores, groundtruth)
    if crops:
        names = [_crop_name(str(c)) for c in crops]
        unknown = [n for n in names if n not in truth_crops]
        if unknown:
            raise SubmissionError(f"--crops: {unknown} not found in the ground truth under {groundtruth}")
        for n in names:
            if n not in predicted_crops:
                warn(f"{n} is not in {root}; every class scored as left out")
    else:
        names = [n for n in predicted_crops if n in truth_crops]
        skipped = [n for n in predicted_crops if n not in truth_crops]
        if skipped:
            warn(f"{skipped} of {root} have no ground truth under {groundtruth}; skipped")
        if not names:
            raise SubmissionError(
                f"no crop<N> group of {root} has ground truth under {groundtruth} "
                f"(predicted: {predicted_crops or 'none'})"
            )
    wanted = set(classes) if classes else None
    if classes:  # a misspelt class is an error, as in training, not "not annotated"
        check_class_names(classes, {c for t in truth_crops.values() for c in t.classes}, "--classes")

    per_crop = {}
    for name in names:
        crop = truth_crops[name]
        result = {"dataset": crop.dataset, "classes": {}}
        for cls in crop.classes:
            if wanted is not None and cls not in wanted:
                continue
            if wanted is None and (cls == ALL_LABELS_GROUP or cls not in CLASS_IDS):
                continue  # e.g. the fetched crops' "all" group of label ids
            truth, valid, level = read_truth(crop, cls)
            if not valid.any():
                continue  # every voxel unknown: nothing to score
            node = root / name / cls
            pred = None
            if node.exists():
                plevel = check_prediction_grid(prediction_level(node), level, warn)
                pred = resample_prediction(stores, plevel, cls, level.box_min, level.scale,
                                           level.shape)
            entry = score_label(pred, truth, valid, level.scale, cls, metric_version)
            entry["voxel_size"] = list(level.scale)
            result["classes"][cls] = entry
        per_crop[name] = result
    if wanted is not None:
        annotated = {c for r in per_crop.values() for c in r["classes"]}
        if wanted - annotated:
            warn(f"--classes {sorted(wanted - annotated)} not annotated in any scored crop")
    return {"metric": metric_name(metric_version), "metric_description": METRIC_VERSIONS[metric_version],
            "predictions": str(root), "groundtruth": str(groundtruth), "crops": per_crop,
            **combine_challenge_scores(list(per_crop.values()), metric_version)}


def format_table(result: dict) -> str:
    """A short text table: the metric, one row per crop and class, then per class (VOI split,
    merge and ARAND: "-" for a class not scored with them)."""

    def num(value, fmt="{:.3f}"):
        return "-" if value is None or (isinstance(value, float) and not math.isfinite(value)) \
            else fmt.format(value)

    def half(value):  # a half of the overall score with no class in it
        return "not scored" if value is None else num(value)

    header = (f"{'crop':<8} {'class':<10} {'type':<8} {'IoU':>6} {'Dice':>6} {'F1/acc':>6} "
              f"{'HDnorm':>6} {'score':>6} {'VOIspl':>6} {'VOImrg':>6} {'ARAND':>6}")
    lines = [f"metric: {result['metric_description']}", header, "-" * len(header)]

    def row(crop, name, s):
        lines.append(
            f"{crop:<8} {name:<10} {s['type']:<8} {num(s.get('iou')):>6} {num(s.get('dice')):>6} "
            f"{num(s.get('f1', s.get('accuracy'))):>6} {num(s.get('normalized_hausdorff')):>6} "
            f"{num(s.get('score')):>6} {num(s.get('voi_split')):>6} {num(s.get('voi_merge')):>6} "
            f"{num(s.get('arand')):>6}"
        )

    for crop, r in result["crops"].items():
        for name, s in r["classes"].items():
            row(crop, name, s)
    lines.append("-" * len(header))
    for name, s in result["classes"].items():
        row("all", name, s)
    o = result["overall"]
    lines.append(
        f"semantic score {half(o['mean_semantic_iou'])}  instance score {half(o['mean_instance_score'])}  "
        f"overall score {num(o['score'])}  ({result['metric']})"
    )
    return "\n".join(lines)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(argv=None, prog: str = "python -m torchtitan.scoring") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Score predictions (PRED.zarr/crop<N>/<class>) against CellMap-layout ground "
                    "truth with the CellMap challenge's metric.",
    )
    parser.add_argument("--predictions", required=True,
                        help="zarr store PRED.zarr/crop<N>/<class>: arrays with 'voxel_size' and "
                             "'translation' attributes (nm, z/y/x, centre of voxel 0) or OME-NGFF groups")
    parser.add_argument("--groundtruth", required=True,
                        help="folder of <dataset>/<dataset>.zarr stores with recon-1/labels/groundtruth/crop<N>")
    parser.add_argument("--crops", default=None, help="comma-separated crop numbers (default: all predicted)")
    parser.add_argument("--classes", default=None, help="comma-separated class names (default: all annotated)")
    parser.add_argument("--metric-version", "--metric_version", dest="metric_version",
                        choices=sorted(METRIC_VERSIONS), default=DEFAULT_METRIC_VERSION,
                        help="the challenge's metric: 2025 (revised, default) or 2024 (original)")
    parser.add_argument("--out", default=None, help="write the scores as JSON here")
    args = parser.parse_args(argv)
    if args.out and Path(args.out).is_dir():
        print(f"error: --out {args.out} is a folder; give the path of the JSON file to write, "
              f"e.g. {Path(args.out) / 'scores.json'}", file=sys.stderr)
        return 2

    split = lambda text: [t.strip() for t in text.split(",") if t.strip()] if text else None  # noqa: E731
    try:
        result = score_submission(args.predictions, args.groundtruth, split(args.crops),
                                  split(args.classes), metric_version=args.metric_version)
    except UserError as e:  # SubmissionError, DatasetError, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(_json_safe(result), indent=2, allow_nan=False))
        print(f"scores written to {out}")
    return 0
