"""CellMap / OME-NGFF layout discovery and reading in world (nanometre) coordinates.

The CellMap challenge stores every dataset as a zarr store:

    <root>/<ds>/<ds>.zarr/recon-1/em/fibsem-uint8/s0..sN                  EM, multiscale
    <root>/<ds>/<ds>.zarr/recon-1/labels/groundtruth/crop<N>/<class>/s0..  label crops

Each multiscale group carries OME-NGFF ``multiscales`` metadata (0.4 in zarr format 2, or 0.5
under the ``ome`` key of a zarr format 3 ``zarr.json``): per level a ``scale`` (nm per voxel)
and a ``translation`` (nm position of the *centre* of voxel 0). Label crops sit
anywhere inside the EM volume and may use a finer or coarser grid than the EM. Everything
here therefore works in world coordinates and converts to voxel indices only when reading.
The metadata is read by ``torchtitan.cellmap.ome_ngff``, grids and levels are
``torchtitan.cellmap.grids``, and what label values mean is ``torchtitan.cellmap.labels``.

A "training grid" is described by an origin (world position of the corner of the first
voxel, nm) plus a voxel size and a shape; voxel ``i`` has its centre at
``origin + (i + 0.5) * voxel_size``.

EM intensities: uint8 EM is used as stored. Other EM (uint16, float, ...) is mapped linearly
onto the uint8 scale (then normalised like uint8) from an intensity range: ``data.em_range``
if set, else the range stored with the EM group (OME-NGFF ``omero.channels[0].window``:
``start``/``end``, else ``min``/``max``), else for integer EM its dtype's range (logged once).
Float EM without either is a DatasetError. Values outside the range are clipped, with one
warning per dataset; NaN in EM is a DatasetError naming the array (checked on a small box of
each volume at startup and on every sample read).

``data.dataset_path`` is either a folder in the layout above or a split list (CSV or TOML)
naming EM volumes and crops one by one, each crop marked train or val (``split_lists.py``).
Folders and the paths in split lists may be URLs (``s3://``, ``gs://``, ``http(s)://``):
locations are strings handled by ``stores.py``. Everything here that reads takes the
:class:`~torchtitan.data.io.stores.StoreContext` to read through (it lists remote folders,
from an index file, reads metadata and keeps the open arrays), and the datasets and crops
found keep the context they were discovered with, for every later read.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from torchtitan.cellmap.errors import DatasetError
from torchtitan.choices import VOXEL_RTOL
from torchtitan.cellmap.grids import AXES, ScaleLevel, box_inside, voxel_positions
from torchtitan.cellmap.labels import DEFAULT_ENCODING, LabelEncoding
from torchtitan.cellmap.ome_ngff import (
    is_multiscale_group,
    read_attrs,
    read_multiscales,
    stored_intensity_range,
)
from torchtitan.data.io.stores import (
    StoreContext,
    check_location,
    is_url,
    join,
    name_of,
    parent_of,
)
from torchtitan.data.sources.split_lists import SplitEntry, read_split_entries

EM_GROUP = "recon-1/em/fibsem-uint8"
EM_GROUP_UINT16 = "recon-1/em/fibsem-uint16"  # used when a store has no uint8 EM
logger = logging.getLogger(__name__)
GT_GROUP = "recon-1/labels/groundtruth"


class ChunkReadError(DatasetError):
    """A chunk of a zarr array could not be read or decoded (corrupt or truncated file).

    Raised by the region reader with the array path and the index region; the sample builder
    catches it and draws another sample instead of stopping the run.
    """

    def __init__(self, array_path: str, lo=None, hi=None, cause: BaseException | None = None):
        if lo is None:  # rebuilt from its message alone (unpickling, DataLoader workers)
            self.array_path, self.region = "", None
            super().__init__(array_path)
            return
        self.array_path = str(array_path)
        self.region = (tuple(int(v) for v in lo), tuple(int(v) for v in hi))
        region = ", ".join(f"{a}:{b}" for a, b in zip(*self.region))
        super().__init__(
            f"cannot read zarr array {self.array_path} at voxel region [{region}] (z, y, x): "
            f"{type(cause).__name__ if cause else 'error'}: {cause}. A chunk file there is "
            "probably corrupt or truncated; re-copy or re-write that array"
        )


@dataclass
class LabelCrop:
    """One annotated crop: the classes it annotates, each as a multiscale label image."""

    name: str  # e.g. "crop3"
    dataset: str  # e.g. "jrc_hela-2"
    classes: dict[str, list[ScaleLevel]]
    # Per class group, the label values it uses (groups without one use the default).
    encoding: dict[str, LabelEncoding] = field(default_factory=dict)
    # "train" or "val" when a split list (CSV / TOML) assigned the crop; None for a folder.
    split: str | None = None
    # The part of the crop whose labels are used, (min, max) corners in nm, or None for all of
    # it (see ``label_slab``); labels outside it read as unknown.
    bounds: tuple[np.ndarray, np.ndarray] | None = None
    # The groups whose attributes declare object ids (instance segmentation), by name.
    id_groups: frozenset[str] = frozenset()
    # The context the crop was discovered with: its labels are read through it.
    stores: StoreContext = field(kw_only=True, repr=False, compare=False)

    @property
    def full_name(self) -> str:
        return f"{self.dataset}/{self.name}"

    def encoding_of(self, group: str) -> LabelEncoding:
        """The label encoding of one class group of the crop."""
        return self.encoding.get(group, DEFAULT_ENCODING)

    @property
    def box_min(self) -> np.ndarray:
        lo = np.min([lv[0].box_min for lv in self.classes.values()], axis=0)
        return lo if self.bounds is None else np.maximum(lo, self.bounds[0])

    @property
    def box_max(self) -> np.ndarray:
        hi = np.max([lv[0].box_max for lv in self.classes.values()], axis=0)
        return hi if self.bounds is None else np.minimum(hi, self.bounds[1])


def label_slab(crop: LabelCrop, fraction: float, voxel_size) -> LabelCrop:
    """The crop with its labels limited to ``fraction`` of its sections (z planes of the
    training grid of ``voxel_size``), at least one: a slab in the middle of the crop along z,
    so that its EM context above and below is the crop's own. ``fraction`` 1 keeps it whole."""
    if fraction >= 1:
        return crop
    vz = float(voxel_size[0])
    z0, z1 = float(crop.box_min[0]), float(crop.box_max[0])
    sections = max(1, int(round((z1 - z0) / vz)))
    keep = max(1, int(round(fraction * sections)))
    start = z0 + (sections - keep) // 2 * vz
    lo, hi = np.full(3, -np.inf), np.full(3, np.inf)
    lo[0], hi[0] = start, start + keep * vz
    return replace(crop, bounds=(lo, hi))


@dataclass
class EMSource:
    """One dataset: its EM multiscale image and its label crops."""

    name: str
    store: str  # path of <ds>.zarr
    levels: list[ScaleLevel]
    crops: list[LabelCrop]
    # Intensity range mapped onto 0..255 (see the module doc); None: uint8 EM used as stored.
    em_range: tuple[float, float] | None = None
    # The context the dataset was discovered with: its EM is read through it.
    stores: StoreContext = field(kw_only=True, repr=False, compare=False)


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------


def read_crop(stores: StoreContext, crop_path: str | os.PathLike, dataset: str,
              only: list[str] | None = None) -> LabelCrop | None:
    """One label crop folder (``crop<N>``, local or URL) of ``dataset``: its annotated class
    groups (all, or those named in ``only``: then the crop is not listed), or None when it
    holds none."""
    classes: dict[str, list[ScaleLevel]] = {}
    encoding: dict[str, LabelEncoding] = {}
    id_groups = set()
    names = sorted(only) if only is not None else stores.list_dirs(crop_path)
    for name in names:
        class_dir = join(crop_path, name)
        attrs = read_attrs(class_dir, stores.read_json)
        if not is_multiscale_group(attrs):
            continue  # not a class group
        classes[name] = read_multiscales(class_dir, stores.read_json)
        encoding[name] = LabelEncoding.from_attrs(attrs)
        if LabelEncoding.declares_ids(attrs):
            id_groups.add(name)
    if not classes:
        return None
    return LabelCrop(name_of(crop_path), dataset, classes, encoding,
                     id_groups=frozenset(id_groups), stores=stores)


def discover(stores: StoreContext, dataset_path: str | os.PathLike) -> list[EMSource]:
    """Find every CellMap-layout dataset (``<ds>/<ds>.zarr``) below ``dataset_path``, or read
    the datasets and crops a split list (``.csv`` or ``.toml`` file) names; they read through
    ``stores`` from then on."""
    root = str(dataset_path)
    check_location(root, "data.dataset_path")
    if not is_url(root) and Path(root).is_file():
        return read_split_list(stores, root)
    if not (stores.list_dirs(root) if is_url(root) else Path(root).is_dir()):
        raise DatasetError(
            f"data.dataset_path {root!r} does not exist or is not a folder; point it at a "
            "folder (or URL) of <dataset>/<dataset>.zarr stores or at a split list (.csv / "
            ".toml) (run `python helpers/make_demo_data.py` for the built-in demo data)"
        )
    sources = []
    for name in stores.list_dirs(root):
        store = join(root, name, f"{name}.zarr")
        if not stores.is_dir(store):
            continue
        em_group = join(store, EM_GROUP)
        if not stores.is_dir(em_group) and stores.is_dir(join(store, EM_GROUP_UINT16)):
            em_group = join(store, EM_GROUP_UINT16)
        if not stores.is_dir(em_group):
            raise DatasetError(
                f"{store}: no EM group '{EM_GROUP}'; expected the CellMap layout "
                f"<ds>.zarr/{EM_GROUP}/s0.."
            )
        levels = read_multiscales(em_group, stores.read_json)
        crops = []
        gt = join(store, GT_GROUP)
        if stores.is_dir(gt):
            for crop_name in stores.list_dirs(gt):
                crop = read_crop(stores, join(gt, crop_name), name)
                if crop is not None:
                    crops.append(crop)
        sources.append(EMSource(name, store, levels, crops, stores=stores))
    if not sources:
        raise DatasetError(
            f"data.dataset_path {root!r} holds no <dataset>/<dataset>.zarr store; expected "
            f"the CellMap layout <root>/<ds>/<ds>.zarr/{EM_GROUP}"
        )
    return sources


# ---------------------------------------------------------------------------------------------
# Split lists (read by split_lists.py): opening the EM volumes and crops they name
# ---------------------------------------------------------------------------------------------


def _zarr_store(path: str) -> str | None:
    """The enclosing ``*.zarr`` folder of a group location (path or URL), if any."""
    parts = str(path).rstrip("/").split("/")
    for n in range(len(parts), 0, -1):
        if parts[n - 1].endswith(".zarr") and len(parts[n - 1]) > len(".zarr"):
            return "/".join(parts[:n])
    return None


def _sources_from_entries(stores: StoreContext, entries: list[SplitEntry]) -> list[EMSource]:
    sources: dict[str, EMSource] = {}
    em_groups: dict[str, str] = {}
    listed: dict[str, SplitEntry] = {}  # crop full name -> the entry that listed it
    for e in entries:
        store = _zarr_store(e.em)
        name = e.name or (name_of(store)[: -len(".zarr")] if store else None)
        if name is None:
            raise DatasetError(
                f"{e.where}: EM group {e.em} is not inside a .zarr store, so it has no dataset "
                "name; give one (TOML: name = \"...\")"
            )
        if name not in sources:
            if not stores.is_dir(e.em):
                raise DatasetError(
                    f"{e.where}: EM group {e.em} does not exist; fix the path (EM store + group, "
                    f"e.g. <ds>.zarr/{EM_GROUP})"
                )
            levels = read_multiscales(e.em, stores.read_json)
            sources[name] = EMSource(name, store or e.em, levels, [], stores=stores)
            em_groups[name] = e.em
        elif em_groups[name] != e.em:
            raise DatasetError(
                f"{e.where}: dataset {name!r} already has the EM group {em_groups[name]}, now "
                f"{e.em}; one dataset has one EM volume: list the same EM group for all its "
                "crops, or give the other volume its own name"
            )
        if e.crop is None:
            continue
        if not stores.is_dir(e.crop):
            raise DatasetError(f"{e.where}: label crop {e.crop} does not exist; fix the path")
        if e.classes is not None:
            missing = [c for c in e.classes if not stores.is_dir(join(e.crop, c))]
            if missing:
                present = stores.list_dirs(e.crop)
                raise DatasetError(
                    f"{e.where}: label crop {e.crop} has no class group {missing} (it has "
                    f"{present}); remove those classes from the list or add their labels"
                )
        only = list(e.classes) if e.classes is not None else None
        crop = read_crop(stores, e.crop, name, only=only)
        if crop is None:
            raise DatasetError(
                f"{e.where}: {e.crop} holds no class group with OME-NGFF multiscales; point "
                "the entry at a crop folder (.../groundtruth/crop<N>) of per-class groups"
            )
        crop.split = e.split
        if crop.full_name in listed:
            first = listed[crop.full_name]
            raise DatasetError(
                f"{e.where}: crop {crop.full_name} ({e.crop}) is already listed at {first.where} "
                f"({first.crop}, {first.split}); list every crop once, as train or as val"
            )
        listed[crop.full_name] = e
        sources[name].crops.append(crop)
    return list(sources.values())


def read_split_list(stores: StoreContext, path: str | os.PathLike) -> list[EMSource]:
    """The datasets and crops a split list (.csv or .toml, see ``split_lists.py``) names,
    read through ``stores``; every crop carries its ``split`` ("train" or "val")."""
    return _sources_from_entries(stores, read_split_entries(Path(path)))


def check_crop_inside(source: EMSource, crop: LabelCrop) -> None:
    """A label crop must lie inside its EM volume (world coordinates, nm)."""
    em_min, em_max = source.levels[0].box_min, source.levels[0].box_max
    if not box_inside(crop.box_min, crop.box_max, em_min, em_max):
        cls = next(iter(crop.classes))
        raise DatasetError(
            f"{source.store}: label crop {crop.name} spans {crop.box_min.tolist()}..."
            f"{crop.box_max.tolist()} nm, outside its EM volume {em_min.tolist()}..."
            f"{em_max.tolist()} nm (EM {parent_of(source.levels[0].path)}); check the "
            f"'translation' and 'scale' of the crop's levels (e.g. {crop.classes[cls][0].path}) "
            "against the EM's: both are in nm and give the centre of voxel 0"
        )


# How far the training voxel size may be from the EM levels on any axis: up to 2x finer than
# the finest level (e.g. 16 nm z sections read on an 8 nm grid) or 2x coarser than the coarsest.
MAX_RESAMPLE_FACTOR = 2.0


def check_voxel_size(source: EMSource, voxel_size) -> None:
    """``data.voxel_size`` must be servable by some EM level of ``source``: interpolating more
    than 2x finer than the finest level invents detail, reading more than 2x coarser than the
    coarsest level aliases."""
    v = np.asarray(voxel_size, dtype=float)
    scales = np.asarray([lv.scale for lv in source.levels], dtype=float)
    finest, coarsest = scales.min(axis=0), scales.max(axis=0)
    tol = VOXEL_RTOL
    too_fine = v * MAX_RESAMPLE_FACTOR < finest * (1 - tol)
    too_coarse = v > coarsest * MAX_RESAMPLE_FACTOR * (1 + tol)
    if too_fine.any() or too_coarse.any():
        levels = ", ".join(f"{name_of(lv.path)}={list(lv.scale)}" for lv in source.levels)
        what = "finer than half the finest" if too_fine.any() else "coarser than twice the coarsest"
        axes = "".join(a for a, bad in zip(AXES, too_fine | too_coarse) if bad)
        raise DatasetError(
            f"{source.store}: data.voxel_size {v.tolist()} nm is {what} EM level on axis "
            f"{axes} (EM {parent_of(source.levels[0].path)} levels, nm: {levels}); choose "
            f"a data.voxel_size within {MAX_RESAMPLE_FACTOR:g}x of an available level on "
            "every axis"
        )


# ---------------------------------------------------------------------------------------------
# Reading a box of the training grid
# ---------------------------------------------------------------------------------------------

def _read_region(stores: StoreContext, level: ScaleLevel, lo: list[int], hi: list[int],
                 fill) -> np.ndarray:
    """Read index box [lo, hi) of a level through ``stores``; parts outside the array are
    ``fill``.

    A chunk missing on disk reads as the array's fill value (zarr's sparse storage; for EM
    the fill value is usually 0 = background). A chunk that exists but cannot be decoded
    raises :class:`ChunkReadError`, which the sample builders catch to draw another sample.
    """
    try:
        arr = stores.open_array(level.path)
    except DatasetError as e:
        if not is_url(level.path):
            raise
        raise ChunkReadError(level.path, list(lo), list(hi), e) from e  # the network, mid-run
    if all(0 <= l and h <= n for l, h, n in zip(lo, hi, level.shape)):  # inside: no padding
        src = tuple(slice(l, h) for l, h in zip(lo, hi))
        try:
            return np.asarray(arr[src])
        except Exception as e:  # noqa: BLE001 - codec errors have no common type across codecs
            raise ChunkReadError(level.path, list(lo), list(hi), e) from e
    out = np.full([h - l for l, h in zip(lo, hi)], fill, dtype=arr.dtype)
    src, dst = [], []
    for ax in range(3):
        a, b = max(lo[ax], 0), min(hi[ax], level.shape[ax])
        if a >= b:
            return out
        src.append(slice(a, b))
        dst.append(slice(a - lo[ax], b - lo[ax]))
    try:
        data = arr[tuple(src)]
    except Exception as e:  # noqa: BLE001 - codec errors have no common type across codecs
        raise ChunkReadError(level.path, [s.start for s in src], [s.stop for s in src], e) from e
    out[tuple(dst)] = data
    return out


def read_nearest(stores: StoreContext, level: ScaleLevel, origin, voxel_size, shape,
                 fill) -> np.ndarray:
    """Sample ``level`` at the training grid by nearest neighbour (labels), read through
    ``stores``."""
    pos = voxel_positions(level, origin, voxel_size, shape)
    # Indices outside the array read the fill value; clipped to one voxel beyond each side, so
    # that a grid far larger than the array (e.g. a voxel size in um, not nm) reads no more.
    idx = [np.clip(np.floor(p + 0.5).astype(np.int64), -1, n) for p, n in zip(pos, level.shape)]
    lo = [int(i.min()) for i in idx]
    hi = [int(i.max()) + 1 for i in idx]
    region = _read_region(stores, level, lo, hi, fill)
    if all(_consecutive(i) for i in idx):  # the grids coincide: the region is the answer
        return region
    local = [i - l for i, l in zip(idx, lo)]
    return region[np.ix_(*local)]


def _consecutive(idx: np.ndarray) -> bool:
    """Whether integer indices are ``a, a + 1, a + 2, ...``."""
    return len(idx) < 2 or bool(np.all(np.diff(idx) == 1))


def read_linear(stores: StoreContext, level: ScaleLevel, origin, voxel_size, shape,
                fill=0) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``level`` at the training grid by separable linear interpolation (EM), read
    through ``stores``.

    Returns the image and a boolean mask of the voxels that lie inside the array. When the
    grids coincide (the usual case: the EM level matches the training voxel size and the
    sample origin is snapped to it) this is a plain slice in the array's own dtype (uint8 for
    EM); otherwise the interpolated image is float32.
    """
    pos = voxel_positions(level, origin, voxel_size, shape)
    inside = [(p > -0.5) & (p < level.shape[ax] - 0.5) for ax, p in enumerate(pos)]
    valid = inside[0][:, None, None] & inside[1][None, :, None] & inside[2][None, None, :]
    i0 = [np.floor(p).astype(np.int64) for p in pos]
    w = [(p - i).astype(np.float32) for p, i in zip(pos, i0)]
    exact = [bool(np.all(wa == 0)) for wa in w]
    # Both neighbours of a position outside the array read the fill value: clipped to two
    # voxels beyond each side (see read_nearest).
    i0 = [np.clip(i, -2, n) for i, n in zip(i0, level.shape)]
    lo = [int(i.min()) for i in i0]
    # An axis without interpolation needs no extra voxel (which could cost a whole chunk).
    hi = [int(i.max()) + (1 if e else 2) for i, e in zip(i0, exact)]
    region = _read_region(stores, level, lo, hi, fill)
    if all(exact) and all(_consecutive(i) for i in i0):
        return region, valid
    img = region.astype(np.float32)
    for ax in range(3):
        a = i0[ax] - lo[ax]
        if exact[ax]:
            img = np.take(img, a, axis=ax)
            continue
        bshape = [1, 1, 1]
        bshape[ax] = -1
        wa = w[ax].reshape(bshape)
        img = np.take(img, a, axis=ax) * (1 - wa) + np.take(img, a + 1, axis=ax) * wa
    return img, valid


# ---------------------------------------------------------------------------------------------
# EM intensities: uint8 as stored, anything else mapped onto the uint8 scale from a range
# ---------------------------------------------------------------------------------------------

_WARNED_OUT_OF_RANGE: set[str] = set()  # datasets already warned about clipped EM values
NAN_CHECK_BOX = 32  # voxels per axis of the box each EM volume is checked for NaN at startup


def resolve_em_range(source: EMSource, configured) -> tuple[float, float] | None:
    """The range that maps ``source``'s EM onto 0..255, or None for uint8 EM used as stored."""
    level0 = source.levels[0]
    dtype = np.dtype(source.stores.open_array(level0.path).dtype)
    if configured:
        return float(configured[0]), float(configured[1])
    if dtype == np.uint8:
        return None
    if dtype.kind not in "iuf":
        raise DatasetError(f"EM array {level0.path} has dtype {dtype}; expected uint8, another "
                           "integer type or float")
    group = parent_of(level0.path)
    stored = stored_intensity_range(group, source.stores.read_json)
    if stored is not None:
        logger.info("%s: %s EM mapped from its stored range [%g, %g] (omero window) to 0..255",
                    source.name, dtype, *stored)
        return stored
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        logger.warning("%s: %s EM has no stored intensity range (OME-NGFF omero window); "
                       "normalising from the dtype's range [%d, %d]; set data.em_range = "
                       "[min, max] to use the data's own range", source.name, dtype,
                       info.min, info.max)
        return float(info.min), float(info.max)
    raise DatasetError(
        f"EM array {level0.path} is {dtype} and its group stores no intensity range (OME-NGFF "
        "'omero' channels[0].window); set data.em_range = [min, max] to the values that should "
        "map to black and white"
    )


def check_em_finite(img: np.ndarray, array_path: str) -> None:
    """Raise a DatasetError when float EM read from ``array_path`` holds NaN (or inf)."""
    if img.dtype.kind == "f" and not np.all(np.isfinite(img)):
        bad = int(np.count_nonzero(~np.isfinite(img)))
        raise DatasetError(
            f"EM array {array_path} holds NaN or inf ({bad} of {img.size} voxels of one read); "
            "replace them (e.g. by the background value) in the store before training"
        )


def set_em_ranges(sources: list[EMSource], configured) -> None:
    """Resolve each source's EM range (``configured`` = data.em_range, may be empty) and check
    a small central box of each non-uint8 volume for NaN, before any process group exists."""
    for source in sources:
        source.em_range = resolve_em_range(source, configured)
        level0 = source.levels[0]
        if np.dtype(source.stores.open_array(level0.path).dtype).kind != "f":
            continue
        lo = [max(0, (n - NAN_CHECK_BOX) // 2) for n in level0.shape]
        hi = [min(n, a + NAN_CHECK_BOX) for n, a in zip(level0.shape, lo)]
        check_em_finite(_read_region(source.stores, level0, lo, hi, 0), level0.path)


def em_to_uint8_scale(img: np.ndarray, source: EMSource, array_path: str,
                      inside: np.ndarray | None = None) -> np.ndarray:
    """EM as read from ``array_path`` on the uint8 scale (float32 0..255, or the uint8 read
    itself when the source has no range). Values outside the range are clipped, with one
    warning per dataset; NaN is a DatasetError."""
    check_em_finite(img, array_path)
    if source.em_range is None:
        return img
    lo, hi = source.em_range
    out = (img.astype(np.float32) - np.float32(lo)) * np.float32(255.0 / (hi - lo))
    checked = out if inside is None else out[inside]
    if checked.size and (checked.min() < -0.5 or checked.max() > 255.5):
        if source.name not in _WARNED_OUT_OF_RANGE:
            _WARNED_OUT_OF_RANGE.add(source.name)
            logger.warning("%s: EM values of %s lie outside the intensity range [%g, %g] and are "
                           "clipped (set data.em_range to widen it; warned once per dataset)",
                           source.name, array_path, lo, hi)
    np.clip(out, 0.0, 255.0, out=out)
    return out
