"""Scoring a submission against CellMap-layout ground truth: ``python -m torchtitan.tools.scoring``.

    python -m torchtitan.tools.scoring --predictions PRED.zarr --groundtruth DATA_ROOT --out s.json

Reads a prediction store and the ground truth, puts every predicted class on its crop's
ground-truth grid and scores it with the CellMap metrics of :mod:`torchtitan.evaluation`
(the same functions the trainer's validation uses). A tool: the core never imports it.

Submission layout (as in the CellMap challenge): PRED.zarr/crop<N>/<class>, each either

- a 3D array with attributes ``voxel_size`` (nm per voxel) and ``translation`` (nm, the world
  position of the *centre* of voxel 0), both in axis order (z, y, x), or
- a group with OME-NGFF ``multiscales`` metadata, of which the first level (s0) is used.

Every scored class is compared on its ground-truth grid (the s0 level of the crop's label
group); predictions are resampled to it in world coordinates. What label values mean, grids
and OME-NGFF metadata come from the domain layer (``torchtitan.cellmap``); array reading from
``torchtitan.datasets.cellmap``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from torchtitan.cellmap.classes import INSTANCE_CLASSES
from torchtitan.cellmap.errors import DatasetError
from torchtitan.cellmap.grids import ScaleLevel
from torchtitan.cellmap.labels import holds_instance_ids, label_to_ids, label_to_target
from torchtitan.cellmap.ome_ngff import read_multiscales
from torchtitan.datasets import cellmap
from torchtitan.errors import UserError
from torchtitan.evaluation import THRESHOLD, combine_scores, score_crop


class SubmissionError(UserError, ValueError):
    """A problem with the prediction store or the command's arguments; says what to fix."""


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


def prediction_level(node: Path):
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


def resample_prediction(level, name: str, origin, voxel_size, shape) -> np.ndarray:
    """One predicted class on a ground-truth grid (``origin`` = outer corner of voxel 0, nm).

    Instance ids (integer arrays wider than uint8, or with values above 1) are sampled by
    nearest neighbour; for a semantic class they then count as foreground where nonzero.
    Binary masks and probabilities are interpolated linearly and thresholded at 0.5.
    """
    dtype = cellmap.open_array(level.path).dtype
    if dtype.kind in "iu":
        nearest = cellmap.read_nearest(level, origin, voxel_size, shape, fill=0)
        if dtype.itemsize > 1 or (nearest.size and nearest.max() > 1):
            return nearest if name in INSTANCE_CLASSES else nearest > 0
    elif dtype.kind not in "fb":
        raise SubmissionError(f"{level.path}: unsupported dtype {dtype}; use bool, integers or floats")
    image, _ = cellmap.read_linear(level, origin, voxel_size, shape, fill=0)
    return image > THRESHOLD


def read_truth(crop, name: str):
    """Ground truth of one class of a crop on its own s0 grid: (truth, valid, level).

    ``truth`` is a boolean mask, or instance ids for an instance class stored with ids; what
    the stored values mean is ``torchtitan.cellmap.labels``' rule (unknown voxels invalid).
    """
    level = crop.classes[name][0]
    raw = np.asarray(cellmap.open_array(level.path)[...])
    encoding = crop.encoding_of(name)
    foreground, valid = label_to_target(raw, encoding)
    if name in INSTANCE_CLASSES and holds_instance_ids(raw, encoding):
        return label_to_ids(raw, encoding), valid, level
    return foreground, valid, level


def score_submission(predictions, groundtruth, crops=None, classes=None, warn=None) -> dict:
    """Score a prediction store against the CellMap-layout ground truth under ``groundtruth``.

    ``crops``: crop names or numbers to score (default: every crop of the prediction store);
    a requested crop missing from the predictions is scored as an empty prediction.
    ``classes``: restrict to these classes (default: all that each crop annotates). A class
    missing from the predictions counts as predicted empty. Returns ``{"crops": {name:
    {"dataset", "classes"}}, "classes": ..., "overall": ...}`` (see ``combine_scores``).
    """
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    root, predicted_crops = open_submission(predictions)
    truth_crops = {}
    for source in cellmap.discover(groundtruth):
        for crop in source.crops:
            if crop.name in truth_crops:
                raise SubmissionError(
                    f"{crop.name} is in two ground-truth datasets ({truth_crops[crop.name].dataset}, "
                    f"{crop.dataset}) under {groundtruth}; crop numbers must be unique"
                )
            truth_crops[crop.name] = crop

    if crops:
        names = [_crop_name(str(c)) for c in crops]
        unknown = [n for n in names if n not in truth_crops]
        if unknown:
            raise SubmissionError(f"--crops: {unknown} not found in the ground truth under {groundtruth}")
        for n in names:
            if n not in predicted_crops:
                warn(f"{n} is not in {root}; every class scored as an empty prediction")
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

    per_crop = {}
    for name in names:
        crop = truth_crops[name]
        result = {"dataset": crop.dataset, "classes": {}}
        for cls in crop.classes:
            if wanted is not None and cls not in wanted:
                continue
            truth, valid, level = read_truth(crop, cls)
            node = root / name / cls
            pred = None
            if node.exists():
                pred = resample_prediction(prediction_level(node), cls, level.box_min, level.scale, level.shape)
            scores = score_crop({cls: pred} if pred is not None else {}, {cls: truth}, {cls: valid}, level.scale)
            if cls in scores["classes"]:  # skipped when every voxel is unknown
                entry = scores["classes"][cls]
                entry.update(predicted=pred is not None, voxel_size=list(level.scale))
                result["classes"][cls] = entry
        per_crop[name] = result
    if wanted is not None:
        annotated = {c for r in per_crop.values() for c in r["classes"]}
        if wanted - annotated:
            warn(f"--classes {sorted(wanted - annotated)} not annotated in any scored crop")
    return {"predictions": str(root), "groundtruth": str(groundtruth), "crops": per_crop,
            **combine_scores(list(per_crop.values()))}


def format_table(result: dict) -> str:
    """A short text table: one row per crop and class, then per class over all crops."""

    def num(value, fmt="{:.3f}"):
        return "-" if value is None else fmt.format(value)

    header = f"{'crop':<8} {'class':<10} {'type':<8} {'IoU':>6} {'Dice':>6} {'F1':>6} {'HD nm':>8} {'inst':>6}"
    lines = [header, "-" * len(header)]

    def row(crop, name, s):
        lines.append(
            f"{crop:<8} {name:<10} {s['type']:<8} {num(s['iou']):>6} {num(s['dice']):>6} "
            f"{num(s.get('f1')):>6} {num(s.get('mean_hausdorff_nm'), '{:.1f}'):>8} {num(s.get('score')):>6}"
        )

    for crop, r in result["crops"].items():
        for name, s in r["classes"].items():
            row(crop, name, s)
    lines.append("-" * len(header))
    for name, s in result["classes"].items():
        row("all", name, s)
    o = result["overall"]
    lines.append(
        f"mean semantic IoU {num(o['mean_semantic_iou'])}  mean instance score "
        f"{num(o['mean_instance_score'])}  overall score {num(o['score'])}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan.tools.scoring",
        description="Score predictions (PRED.zarr/crop<N>/<class>) against CellMap-layout ground truth.",
    )
    parser.add_argument("--predictions", required=True,
                        help="zarr store PRED.zarr/crop<N>/<class>: arrays with 'voxel_size' and "
                             "'translation' attributes (nm, z/y/x, centre of voxel 0) or OME-NGFF groups")
    parser.add_argument("--groundtruth", required=True,
                        help="folder of <dataset>/<dataset>.zarr stores with recon-1/labels/groundtruth/crop<N>")
    parser.add_argument("--crops", default=None, help="comma-separated crop numbers (default: all predicted)")
    parser.add_argument("--classes", default=None, help="comma-separated class names (default: all annotated)")
    parser.add_argument("--out", default=None, help="write the scores as JSON here")
    args = parser.parse_args(argv)

    split = lambda text: [t.strip() for t in text.split(",") if t.strip()] if text else None  # noqa: E731
    try:
        result = score_submission(args.predictions, args.groundtruth, split(args.crops), split(args.classes))
    except UserError as e:  # SubmissionError, DatasetError, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, allow_nan=False))
        print(f"scores written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
