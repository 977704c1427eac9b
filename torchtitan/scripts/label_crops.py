"""Label crops of CellMap-layout stores for the picture and slice helpers: the datasets at a
path (a folder of ``<ds>/<ds>.zarr`` stores, or one store), a crop found by name, a whole crop
read on a chosen grid (EM, training targets, validity), and predictions of it read back from a
submission-layout zarr."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from torchtitan.cellmap.grids import closest_level
from torchtitan.cellmap.ome_ngff import read_multiscales
from torchtitan.data.crops.layout import (EM_GROUP, GT_GROUP, DatasetError, EMSource, LabelCrop,
                                          discover, read_crop)
from torchtitan.data.crops.reader import read_linear, read_nearest
from torchtitan.data.crops.reader import crop_grid
from torchtitan.data.io.stores import StoreContext
from torchtitan.data.crops.reader import annotates, read_target
from torchtitan.scoring.stores import prediction_level
from torchtitan.pictures.drawing import CLASS_COLORS


def load_sources(stores: StoreContext, path) -> list[EMSource]:
    """The datasets at ``path``: a folder of ``<ds>/<ds>.zarr`` stores, or one store; they
    read through ``stores``."""
    path = Path(path)
    if not (path / EM_GROUP).is_dir():
        return discover(stores, path)
    levels = read_multiscales(path / EM_GROUP)
    name = path.name[: -len(".zarr")] if path.name.endswith(".zarr") else path.name
    crops = []
    gt = path / GT_GROUP
    if gt.is_dir():
        for crop_dir in sorted(p for p in gt.iterdir() if p.is_dir()):
            crop = read_crop(stores, crop_dir, name)
            if crop is not None:
                crops.append(crop)
    return [EMSource(name, str(path), levels, crops, stores=stores)]


def all_crops(sources: list[EMSource]) -> list[tuple[EMSource, LabelCrop]]:
    """Every (dataset, crop) pair, in crop-number order."""
    pairs = [(s, c) for s in sources for c in s.crops]
    return sorted(pairs, key=lambda sc: (_crop_number(sc[1].name), sc[1].full_name))


def _crop_number(name: str) -> int:
    digits = "".join(ch for ch in name if ch.isdigit())
    return int(digits) if digits else 0


def find_crop(sources: list[EMSource], name: str | None) -> tuple[EMSource, LabelCrop]:
    """The crop called ``name`` (``crop3`` or ``jrc_hela-2/crop3``); the first one if None."""
    pairs = all_crops(sources)
    if not pairs:
        raise DatasetError("no label crops found (expected <ds>.zarr/recon-1/labels/groundtruth/crop<N>)")
    if name is None:
        return pairs[0]
    matches = [(s, c) for s, c in pairs if name in (c.name, c.full_name)]
    if not matches:
        known = ", ".join(c.full_name for _, c in pairs)
        raise DatasetError(f"no crop {name!r}; available: {known}")
    if len(matches) > 1:
        names = ", ".join(c.full_name for _, c in matches)
        raise DatasetError(f"crop name {name!r} is ambiguous ({names}); use <dataset>/<crop>")
    return matches[0]


def canonical_order(classes) -> list[str]:
    """Classes in the usual CellMap order (that of CLASS_COLORS), unknown names last."""
    order = {c: i for i, c in enumerate(CLASS_COLORS)}
    return sorted(set(classes), key=lambda c: (order.get(c, len(order)), c))


def read_crop_volume(source: EMSource, crop: LabelCrop, classes: list[str], voxel_size=None) -> dict:
    """EM, masks and validity of a whole crop on a grid of ``voxel_size`` nm.

    Returns ``em`` (D, H, W) uint8, ``truth`` and ``valid`` (K, D, H, W) bool (a class the crop
    does not annotate, itself or through all its parts, is all invalid), and the grid's
    ``origin``, ``shape`` and ``voxel_size``. The truth is the training target
    (``datasets.targets.read_target``), so the picture shows what the model learns from.
    """
    voxel_size = np.asarray(voxel_size if voxel_size is not None else source.levels[0].scale, float)
    origin, shape = crop_grid(crop, voxel_size)
    level = source.levels[closest_level(source.levels, voxel_size)]
    em, _ = read_linear(source.stores, level, origin, voxel_size, shape)
    truth = np.zeros((len(classes), *shape), bool)
    valid = np.zeros_like(truth)
    for k, cls in enumerate(classes):
        if annotates(crop, cls):
            truth[k], valid[k] = read_target(crop, cls, origin, voxel_size, shape)
    return {"em": np.clip(em, 0, 255).round().astype(np.uint8), "truth": truth, "valid": valid,
            "origin": origin, "shape": shape, "voxel_size": voxel_size}


def read_prediction(pred_root, crop: LabelCrop, classes: list[str], origin, voxel_size, shape) -> np.ndarray:
    """(K, D, H, W) bool predictions of ``crop`` from a submission-layout zarr, resampled
    (nearest) onto the crop's grid, read through the crop's store context (one chunk cache).
    A class without a prediction array is all False."""
    crop_dir = Path(pred_root) / crop.name
    if not crop_dir.is_dir():
        raise DatasetError(f"{pred_root}: no predictions for {crop.name} (expected {crop_dir})")
    pred = np.zeros((len(classes), *shape), bool)
    for k, cls in enumerate(classes):
        path = crop_dir / cls
        if not path.exists():
            print(f"note: no prediction for class {cls!r} in {crop_dir}")
            continue
        level = prediction_level(path)
        values = read_nearest(crop.stores, level, origin, voxel_size, shape, fill=0)
        pred[k] = values.astype(np.float32) > 0.5
    return pred


def prediction_classes(pred_root, crop: LabelCrop) -> list[str]:
    """The classes a submission-layout zarr predicts for ``crop`` (none if it has no group)."""
    crop_dir = Path(pred_root) / crop.name
    return [p.name for p in crop_dir.iterdir() if p.is_dir()] if crop_dir.is_dir() else []
