"""CellMap challenge submissions: writing one from a prediction store, and checking one.

    python predict.py --checkpoint RUN/checkpoint --manifest test_crop_manifest.csv \
        --out pred.zarr --instances --submission submission.zarr
    python -m torchtitan.prediction.submission --check submission.zarr --manifest test_crop_manifest.csv
    python -m torchtitan.prediction.submission --check submission.zarr --groundtruth data --crops 1,2

A submission (layout: :mod:`torchtitan.cellmap.challenge`) holds, for every test crop and
class, one array on the crop's own grid (its voxel size, translation and shape), with the
attributes ``voxel_size``, ``translation`` and ``shape``: a uint8 0/1 mask for a semantic
class, uint32 object ids for an instance class. :func:`write_submission` resamples a
prediction store (``predict.py``'s output, any voxel size, OME-NGFF pyramids: ``s0`` is
used) onto those grids in world coordinates, exactly as scoring does
(:func:`torchtitan.scoring.stores.resample_prediction`), and zips it for upload.

:func:`check_submission` is the linter: before anything is uploaded it says why the
submission would be rejected or scored as zero. Errors: not a zarr format 2 group, a test
crop missing, an array without ``voxel_size``/``translation``, a wrong voxel size (scale), a
wrong translation (ROI), a wrong shape, a wrong dtype. Warnings: a class left out (scored as
zero), crops that are not test crops. The challenge's evaluator resamples arrays whose
geometry differs; the linter insists on the test crops' own grids, which is what the
challenge's packer (``csc pack-results``) writes, so that nothing is resampled twice.
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchtitan.cellmap.challenge import (
    ALL_LABELS_GROUP,
    SUBMISSION_ATTRS,
    ChallengeCrop,
    crop_name,
    read_test_manifest,
    submission_dtype_problem,
)
from torchtitan.cellmap.classes import CLASS_IDS, INSTANCE_CLASSES
from torchtitan.cellmap.errors import DatasetError
from torchtitan.choices import same_voxel_size
from torchtitan.cellmap.grids import Grid
from torchtitan.cellmap.ome_ngff import VIEW_CHUNKS, read_attrs, read_multiscales
from torchtitan.data.crops.layout import discover
from torchtitan.data.io.stores import StoreContext
from torchtitan.errors import UserError
from torchtitan.scoring.metrics import label_instances
from torchtitan.scoring.stores import prediction_level, resample_prediction


# ---------------------------------------------------------------------------------------------
# Which crops and classes a submission must hold
# ---------------------------------------------------------------------------------------------


def crops_from_groundtruth(groundtruth, crops=None) -> dict[str, ChallengeCrop]:
    """The label crops under ``groundtruth`` (all, or the named ones) as submission targets:
    every CellMap class each crop annotates, on the grid of its level ``s0``."""
    wanted = {crop_name(c) for c in crops} if crops else None
    out = {}
    for source in discover(StoreContext(), groundtruth):
        for crop in source.crops:
            if wanted is not None and crop.name not in wanted:
                continue
            classes = {cls: Grid(lv[0].shape, lv[0].scale, lv[0].translation)
                       for cls, lv in crop.classes.items()
                       if cls != ALL_LABELS_GROUP and cls in CLASS_IDS}
            out[crop.name] = ChallengeCrop(crop.name, crop.dataset, classes)
    if wanted is not None and wanted - set(out):
        raise DatasetError(f"crops {sorted(wanted - set(out))} are not label crops under {groundtruth}")
    return out


def crops_from_boxes(boxes, classes) -> dict[str, ChallengeCrop]:
    """Submission targets from our own crop manifest (``predictor.ManifestCrop`` rows with a
    voxel size): ``classes`` on the box's grid."""
    out = {}
    for b in boxes:
        v = np.asarray(b.voxel_size, dtype=float)
        shape = tuple(int(round(s)) for s in (b.box_max - b.box_min) / v)
        grid = Grid(shape, tuple(v.tolist()), tuple((b.box_min + v / 2).tolist()))
        out[b.name] = ChallengeCrop(b.name, b.dataset, {c: grid for c in classes})
    return out


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


SUBMISSION_ATTR = "torchtitan_submission"  # on the root of every submission written here


def write_submission(predictions, out, crops: dict[str, ChallengeCrop], zip_it: bool = True) -> list[str]:
    """Write the submission ``out`` (zarr format 2) from the prediction store
    ``predictions``: every class of every crop that the store predicts, resampled onto the
    crop's grid. Returns notes on what was left out (classes the store does not hold)."""
    import zarr

    pred_root = Path(predictions)
    stores = StoreContext()  # reads the predictions
    root = zarr.open_group(str(out), mode="w", zarr_format=2)
    root.attrs[SUBMISSION_ATTR] = True  # predict.py replaces only stores that carry it
    notes = []
    for name, crop in crops.items():
        group = root.require_group(name)
        for cls, grid in crop.classes.items():
            node = pred_root / name / cls
            if not node.exists():
                notes.append(f"{name}/{cls}: not predicted (the model has no such class)")
                continue
            level = prediction_level(node)
            data = resample_prediction(stores, level, cls, grid.box_min, grid.scale, grid.shape)
            if cls in INSTANCE_CLASSES:
                data = data if data.dtype.kind in "iu" and data.dtype != np.uint8 else label_instances(data)[0]
                data = np.asarray(data, dtype=np.uint32)
            else:
                data = (np.asarray(data) > 0).astype(np.uint8)
            chunks = tuple(min(c, s) for c, s in zip(VIEW_CHUNKS, grid.shape))
            arr = group.create_array(cls, data=data, chunks=chunks, fill_value=0, overwrite=True)
            arr.attrs.update(voxel_size=list(map(float, grid.scale)),
                             translation=list(map(float, grid.translation)),
                             shape=list(map(int, grid.shape)))
    if zip_it:
        zip_store(out)
    return notes


def zip_store(path) -> Path:
    """``X.zarr`` -> ``X.zip`` holding the store's files at its root (the upload format)."""
    path = Path(path)
    target = path.with_suffix(".zip")
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(path.rglob("*")):
            if f.is_file():
                zf.write(f, f.relative_to(path).as_posix())
    return target


# ---------------------------------------------------------------------------------------------
# Checking (the linter)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    severity: str  # "error" (would be rejected) or "warning" (scored as zero / ignored)
    where: str  # crop<N>/<class>, crop<N>, or the store
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.where}: {self.message}"


def _geometry(node: Path):
    """(scale, translation, shape, dtype) of one submitted class, or a Problem message."""
    attrs = read_attrs(node)
    if (node / ".zarray").is_file():
        meta = json.loads((node / ".zarray").read_text())
        missing = [k for k in SUBMISSION_ATTRS if k not in attrs]
        if missing:
            return (f"array without the attribute(s) {missing}; add 'voxel_size' and "
                    "'translation' (nm, z/y/x, translation = centre of voxel 0)")
        return attrs["voxel_size"], attrs["translation"], tuple(meta["shape"]), np.dtype(meta["dtype"])
    if (node / ".zgroup").is_file():
        try:
            level = read_multiscales(node)[0]
        except DatasetError as e:
            return f"group without valid OME-NGFF multiscales ({e})"
        meta = json.loads((Path(level.path) / ".zarray").read_text())
        return level.scale, level.translation, level.shape, np.dtype(meta["dtype"])
    return "neither a zarr format 2 array (.zarray) nor a group (.zgroup)"


def check_submission(path, crops: dict[str, ChallengeCrop]) -> list[Problem]:
    """Everything that would get the submission at ``path`` rejected (errors) or scored as
    zero (warnings), checked against the crops and classes it must hold."""
    path = Path(path)
    if not path.is_dir():
        return [Problem("error", str(path), "does not exist or is not a folder (unzip it first)")]
    if not (path / ".zgroup").is_file():
        kind = "a zarr format 3 store" if (path / "zarr.json").is_file() else "not a zarr group"
        return [Problem("error", str(path), f"{kind}: the challenge reads one zarr format 2 group "
                                            "(.zgroup at its root)")]
    problems = []
    for name, crop in crops.items():
        if not (path / name).is_dir():
            problems.append(Problem("error", name, f"missing crop (test crop of {crop.dataset})"))
            continue
        for cls, grid in crop.classes.items():
            where = f"{name}/{cls}"
            node = path / name / cls
            if not node.is_dir():
                problems.append(Problem("warning", where, "class left out: scored as zero"))
                continue
            geometry = _geometry(node)
            if isinstance(geometry, str):
                problems.append(Problem("error", where, geometry))
                continue
            scale, translation, shape, dtype = geometry
            if len(scale) != 3 or not same_voxel_size(scale, grid.scale):
                problems.append(Problem("error", where, f"wrong scale: voxel_size {list(scale)} nm, "
                                                        f"the test crop's is {list(grid.scale)}"))
            elif len(translation) != 3 or not np.allclose(
                    translation, grid.translation, rtol=0, atol=1e-3 * min(grid.scale)):
                problems.append(Problem("error", where, f"wrong ROI: translation {list(translation)} "
                                                        f"nm, the test crop's is {list(grid.translation)}"))
            if tuple(shape) != tuple(grid.shape):
                problems.append(Problem("error", where, f"wrong shape: {list(shape)}, the test "
                                                        f"crop's is {list(grid.shape)}"))
            reason = submission_dtype_problem(cls, dtype)
            if reason:
                problems.append(Problem("error", where, f"wrong dtype: {reason}"))
    extra = sorted(p.name for p in path.iterdir() if p.is_dir() and p.name not in crops)
    if extra:
        problems.append(Problem("warning", str(path), f"{extra} are not test crops; ignored"))
    return problems


def format_report(problems: list[Problem], crops: dict[str, ChallengeCrop], path) -> str:
    errors = [p for p in problems if p.severity == "error"]
    lines = [str(p) for p in problems]
    n_arrays = sum(len(c.classes) for c in crops.values())
    if errors:
        lines.append(f"submission {path} would be REJECTED: {len(errors)} error(s)")
    else:
        lines.append(f"submission {path} OK: {len(crops)} crop(s), {n_arrays} class array(s) "
                     f"checked, {len(problems)} warning(s)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtitan.prediction.submission",
                                description="Check a CellMap challenge submission before upload.")
    p.add_argument("--check", required=True, metavar="SUBMISSION",
                   help="the submission zarr (format 2) to check")
    p.add_argument("--manifest", help="the challenge's test-crop manifest CSV (crop_name, dataset, "
                                      "class_label, voxel_size, translation, shape)")
    p.add_argument("--groundtruth", help="or: a CellMap-layout data folder whose label crops "
                                         "are the crops to submit")
    p.add_argument("--crops", help="with --groundtruth: only these crops (e.g. 1,2)")
    args = p.parse_args(argv)
    try:
        if bool(args.manifest) == bool(args.groundtruth):
            raise UserError("give the crops to check against: --manifest CSV or --groundtruth DATA")
        if args.manifest:
            crops = read_test_manifest(args.manifest)
        else:
            crops = crops_from_groundtruth(args.groundtruth, args.crops.split(",") if args.crops else None)
    except (UserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problems = check_submission(args.check, crops)
    print(format_report(problems, crops, args.check))
    return 1 if any(p.severity == "error" for p in problems) else 0


if __name__ == "__main__":
    sys.exit(main())
