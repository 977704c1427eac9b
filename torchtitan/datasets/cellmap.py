"""CellMap / OME-NGFF layout discovery and reading in world (nanometre) coordinates.

The CellMap challenge stores every dataset as a zarr store:

    <root>/<ds>/<ds>.zarr/recon-1/em/fibsem-uint8/s0..sN                  EM, multiscale
    <root>/<ds>/<ds>.zarr/recon-1/labels/groundtruth/crop<N>/<class>/s0..  label crops

Each multiscale group carries OME-NGFF 0.4 ``multiscales`` metadata: per level a ``scale``
(nm per voxel) and a ``translation`` (nm position of the *centre* of voxel 0). Label crops sit
anywhere inside the EM volume and may use a finer or coarser grid than the EM. Everything
here therefore works in world coordinates and converts to voxel indices only when reading.

A "training grid" is described by an origin (world position of the corner of the first
voxel, nm) plus a voxel size and a shape; voxel ``i`` has its centre at
``origin + (i + 0.5) * voxel_size``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

EM_GROUP = "recon-1/em/fibsem-uint8"
GT_GROUP = "recon-1/labels/groundtruth"
AXES = ("z", "y", "x")
UNKNOWN = 255  # CellMap's "unknown" label value


class DatasetError(ValueError):
    """A problem with the data on disk or its description; the message says what to fix."""


@dataclass(frozen=True)
class ScaleLevel:
    """One resolution level of an OME-NGFF multiscale image."""

    path: str  # filesystem path of the zarr array
    scale: tuple[float, float, float]  # nm per voxel (z, y, x)
    translation: tuple[float, float, float]  # nm, centre of voxel 0
    shape: tuple[int, int, int]

    @property
    def box_min(self) -> np.ndarray:
        """World position (nm) of the outer corner of voxel 0."""
        return np.asarray(self.translation) - np.asarray(self.scale) / 2

    @property
    def box_max(self) -> np.ndarray:
        return self.box_min + np.asarray(self.shape) * np.asarray(self.scale)


@dataclass
class LabelCrop:
    """One annotated crop: the classes it annotates, each as a multiscale label image."""

    name: str  # e.g. "crop3"
    dataset: str  # e.g. "jrc_hela-2"
    classes: dict[str, list[ScaleLevel]]
    encoding: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def full_name(self) -> str:
        return f"{self.dataset}/{self.name}"

    @property
    def box_min(self) -> np.ndarray:
        return np.min([lv[0].box_min for lv in self.classes.values()], axis=0)

    @property
    def box_max(self) -> np.ndarray:
        return np.max([lv[0].box_max for lv in self.classes.values()], axis=0)


@dataclass
class EMSource:
    """One dataset: its EM multiscale image and its label crops."""

    name: str
    store: str  # path of <ds>.zarr
    levels: list[ScaleLevel]
    crops: list[LabelCrop]


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------


def _read_attrs(group_path: Path) -> dict:
    """Attributes of a zarr group, format 2 (.zattrs) or 3 (zarr.json)."""
    v2 = group_path / ".zattrs"
    if v2.is_file():
        return json.loads(v2.read_text())
    v3 = group_path / "zarr.json"
    if v3.is_file():
        return json.loads(v3.read_text()).get("attributes", {})
    return {}


def _array_shape(array_path: Path) -> tuple[int, ...]:
    v2 = array_path / ".zarray"
    if v2.is_file():
        return tuple(json.loads(v2.read_text())["shape"])
    v3 = array_path / "zarr.json"
    if v3.is_file():
        meta = json.loads(v3.read_text())
        if meta.get("node_type") == "array":
            return tuple(meta["shape"])
    raise DatasetError(f"{array_path}: not a zarr array (no .zarray or zarr.json)")


def read_multiscales(group_path: str | os.PathLike) -> list[ScaleLevel]:
    """Read the OME-NGFF 0.4 ``multiscales`` of a group: one ScaleLevel per dataset path."""
    group_path = Path(group_path)
    attrs = _read_attrs(group_path)
    ms = attrs.get("multiscales") or attrs.get("ome", {}).get("multiscales")
    if not ms:
        raise DatasetError(
            f"{group_path}: no OME-NGFF 'multiscales' attribute; every EM and label group must "
            "describe its levels (scale and translation in nm)"
        )
    ms = ms[0]
    axes = ms.get("axes", [])
    names = tuple(a["name"] if isinstance(a, dict) else a for a in axes)
    if names != AXES:
        raise DatasetError(f"{group_path}: axes are {names}, expected {AXES}")
    for a in axes:
        unit = a.get("unit") if isinstance(a, dict) else None
        if unit not in (None, "nanometer"):
            raise DatasetError(
                f"{group_path}: axis {a['name']!r} has unit {unit!r}; only 'nanometer' is supported"
            )
    levels = []
    for ds in ms["datasets"]:
        scale, translation = (1.0, 1.0, 1.0), (0.0, 0.0, 0.0)
        for t in ds.get("coordinateTransformations", []):
            if t["type"] == "scale":
                scale = tuple(float(s) for s in t["scale"])
            elif t["type"] == "translation":
                translation = tuple(float(s) for s in t["translation"])
        path = group_path / ds["path"]
        shape = _array_shape(path)
        if len(shape) != 3:
            raise DatasetError(f"{path}: expected a 3D (z, y, x) array, got shape {shape}")
        levels.append(ScaleLevel(str(path), scale, translation, shape))
    return levels


def read_crop(crop_path: Path, dataset: str) -> LabelCrop | None:
    """One label crop folder (``crop<N>``) of ``dataset``: its annotated class groups, or
    None when it holds none."""
    classes: dict[str, list[ScaleLevel]] = {}
    encoding: dict[str, dict[str, int]] = {}
    for class_dir in sorted(p for p in crop_path.iterdir() if p.is_dir()):
        attrs = _read_attrs(class_dir)
        if "multiscales" not in attrs and "ome" not in attrs:
            continue  # not a class group
        classes[class_dir.name] = read_multiscales(class_dir)
        ann = attrs.get("cellmap", {}).get("annotation", {})
        encoding[class_dir.name] = ann.get("annotation_type", {}).get(
            "encoding", {"absent": 0, "present": 1, "unknown": UNKNOWN}
        )
    if not classes:
        return None
    return LabelCrop(crop_path.name, dataset, classes, encoding)


def discover(dataset_path: str | os.PathLike) -> list[EMSource]:
    """Find every CellMap-layout dataset (``<ds>/<ds>.zarr``) below ``dataset_path``."""
    root = Path(dataset_path)
    if not root.is_dir():
        raise DatasetError(
            f"data.dataset_path {str(root)!r} does not exist or is not a folder; point it at a "
            "folder of <dataset>/<dataset>.zarr stores (run `python helpers/make_demo_data.py` "
            "for the built-in demo data)"
        )
    sources = []
    for ds_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        store = ds_dir / f"{ds_dir.name}.zarr"
        if not store.is_dir():
            continue
        em_group = store / EM_GROUP
        if not em_group.is_dir():
            raise DatasetError(
                f"{store}: no EM group '{EM_GROUP}'; expected the CellMap layout "
                f"<ds>.zarr/{EM_GROUP}/s0.."
            )
        levels = read_multiscales(em_group)
        crops = []
        gt = store / GT_GROUP
        if gt.is_dir():
            for crop_dir in sorted(p for p in gt.iterdir() if p.is_dir()):
                crop = read_crop(crop_dir, ds_dir.name)
                if crop is not None:
                    crops.append(crop)
        sources.append(EMSource(ds_dir.name, str(store), levels, crops))
    if not sources:
        raise DatasetError(
            f"data.dataset_path {str(root)!r} holds no <dataset>/<dataset>.zarr store; expected "
            f"the CellMap layout <root>/<ds>/<ds>.zarr/{EM_GROUP}"
        )
    return sources


def check_crop_inside(source: EMSource, crop: LabelCrop) -> None:
    em_min, em_max = source.levels[0].box_min, source.levels[0].box_max
    tol = 1e-3
    if np.any(crop.box_min < em_min - tol) or np.any(crop.box_max > em_max + tol):
        raise DatasetError(
            f"{source.store}: label crop {crop.name} spans {crop.box_min.tolist()}..."
            f"{crop.box_max.tolist()} nm, outside its EM volume {em_min.tolist()}..."
            f"{em_max.tolist()} nm"
        )


def closest_level(levels: list[ScaleLevel], voxel_size) -> int:
    """Index of the level whose voxel size is closest to ``voxel_size`` (log distance)."""
    v = np.asarray(voxel_size, dtype=float)
    dist = [float(np.abs(np.log(np.asarray(lv.scale) / v)).sum()) for lv in levels]
    return int(np.argmin(dist))


# ---------------------------------------------------------------------------------------------
# Reading a box of the training grid
# ---------------------------------------------------------------------------------------------

_ARRAY_CACHE: dict[str, object] = {}


def open_array(path: str):
    """Open a zarr array once per process (handles are cheap; chunk data is never cached)."""
    arr = _ARRAY_CACHE.get(path)
    if arr is None:
        import zarr

        try:
            arr = zarr.open_array(path, mode="r")
        except Exception as e:  # noqa: BLE001 - re-raised with the path
            raise DatasetError(f"cannot open zarr array {path}: {e}") from e
        _ARRAY_CACHE[path] = arr
    return arr


def _positions(level: ScaleLevel, origin, voxel_size, shape) -> list[np.ndarray]:
    """Continuous voxel coordinates (in ``level``'s index space) of the training grid centres."""
    out = []
    for ax in range(3):
        centres = origin[ax] + (np.arange(shape[ax]) + 0.5) * voxel_size[ax]
        out.append((centres - level.translation[ax]) / level.scale[ax])
    return out


def _read_region(level: ScaleLevel, lo: list[int], hi: list[int], fill) -> np.ndarray:
    """Read index box [lo, hi) of a level; parts outside the array are ``fill``."""
    arr = open_array(level.path)
    out = np.full([h - l for l, h in zip(lo, hi)], fill, dtype=arr.dtype)
    src, dst = [], []
    for ax in range(3):
        a, b = max(lo[ax], 0), min(hi[ax], level.shape[ax])
        if a >= b:
            return out
        src.append(slice(a, b))
        dst.append(slice(a - lo[ax], b - lo[ax]))
    out[tuple(dst)] = arr[tuple(src)]
    return out


def read_nearest(level: ScaleLevel, origin, voxel_size, shape, fill) -> np.ndarray:
    """Sample ``level`` at the training grid by nearest neighbour (labels)."""
    pos = _positions(level, origin, voxel_size, shape)
    idx = [np.floor(p + 0.5).astype(np.int64) for p in pos]
    lo = [int(i.min()) for i in idx]
    hi = [int(i.max()) + 1 for i in idx]
    region = _read_region(level, lo, hi, fill)
    local = [i - l for i, l in zip(idx, lo)]
    return region[np.ix_(*local)]


def read_linear(level: ScaleLevel, origin, voxel_size, shape, fill=0) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``level`` at the training grid by separable linear interpolation (EM).

    Returns the float32 image and a boolean mask of the voxels that lie inside the array.
    When the grids coincide (the usual case: the EM level matches the training voxel size and
    the sample origin is snapped to it) this reduces to a plain slice.
    """
    pos = _positions(level, origin, voxel_size, shape)
    inside = [(p > -0.5) & (p < level.shape[ax] - 0.5) for ax, p in enumerate(pos)]
    valid = inside[0][:, None, None] & inside[1][None, :, None] & inside[2][None, None, :]
    i0 = [np.floor(p).astype(np.int64) for p in pos]
    w = [(p - i).astype(np.float32) for p, i in zip(pos, i0)]
    lo = [int(i.min()) for i in i0]
    hi = [int(i.max()) + 2 for i in i0]
    img = _read_region(level, lo, hi, fill).astype(np.float32)
    for ax in range(3):
        a = i0[ax] - lo[ax]
        if np.all(w[ax] == 0):
            img = np.take(img, a, axis=ax)
            continue
        bshape = [1, 1, 1]
        bshape[ax] = -1
        wa = w[ax].reshape(bshape)
        img = np.take(img, a, axis=ax) * (1 - wa) + np.take(img, a + 1, axis=ax) * wa
    return img, valid


def read_label_class(crop: LabelCrop, cls: str, origin, voxel_size, shape) -> tuple[np.ndarray, np.ndarray]:
    """Binary target and validity mask of one class of a crop, on the training grid.

    Voxels outside the crop or marked unknown are invalid.
    """
    levels = crop.classes[cls]
    # The coarsest level that is still at least as fine as the training grid: nearest sampling
    # from it loses no detail. If every level is coarser, take the closest one.
    finer = [lv for lv in levels if np.all(np.asarray(lv.scale) <= np.asarray(voxel_size) + 1e-6)]
    if finer:
        level = max(finer, key=lambda lv: float(np.prod(lv.scale)))
    else:
        level = levels[closest_level(levels, voxel_size)]
    enc = crop.encoding.get(cls, {})
    unknown = int(enc.get("unknown", UNKNOWN))
    present = int(enc.get("present", 1))
    raw = read_nearest(level, origin, voxel_size, shape, fill=unknown)
    valid = raw != unknown
    target = (raw == present) & valid
    return target, valid


def grid_origin_snapped(level: ScaleLevel, voxel_size, approx_origin) -> np.ndarray:
    """Move ``approx_origin`` (nm) onto the voxel corners of ``level`` when its voxel size equals
    the training voxel size, so reading needs no interpolation."""
    origin = np.asarray(approx_origin, dtype=float).copy()
    for ax in range(3):
        if math.isclose(level.scale[ax], voxel_size[ax], rel_tol=1e-6):
            corner0 = level.translation[ax] - level.scale[ax] / 2
            k = np.round((origin[ax] - corner0) / voxel_size[ax])
            origin[ax] = corner0 + k * voxel_size[ax]
    return origin
