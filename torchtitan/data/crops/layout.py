"""Where the data lies: CellMap / OME-NGFF datasets, their EM levels and label crops, found in a
folder or named by a split list, in world (nanometre) coordinates.

The CellMap challenge stores every dataset as a zarr store:

    <root>/<ds>/<ds>.zarr/recon-1/em/fibsem-uint8/s0..sN                  EM, multiscale
    <root>/<ds>/<ds>.zarr/recon-1/labels/groundtruth/crop<N>/<class>/s0..  label crops

Each multiscale group carries OME-NGFF ``multiscales`` metadata (0.4 in zarr format 2, or 0.5
under the ``ome`` key of a zarr format 3 ``zarr.json``): per level a ``scale`` (nm per voxel)
and a ``translation`` (nm position of the *centre* of voxel 0). Label crops sit anywhere
inside the EM volume and may use a finer or coarser grid than the EM, so everything here is
in world coordinates; ``reader.py`` converts to voxel indices when it reads. The metadata is
read by ``torchtitan.cellmap.ome_ngff``, grids and levels are ``torchtitan.cellmap.grids``,
and what label values mean is ``torchtitan.cellmap.labels``.

``data.dataset_path`` is either a folder in the layout above or a split list (CSV or TOML)
naming EM volumes and crops one by one, each crop marked train or val (``split_lists.py``).
Folders and the paths in split lists may be URLs (``s3://``, ``gs://``, ``http(s)://``):
locations are strings handled by ``io/stores.py``. Discovery takes the
:class:`~torchtitan.data.io.stores.StoreContext` to read through (it lists remote folders,
from an index file, reads metadata and keeps the open arrays), and the datasets and crops
found keep it for every later read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from torchtitan.cellmap.errors import DatasetError
from torchtitan.choices import VOXEL_RTOL
from torchtitan.cellmap.grids import AXES, ScaleLevel, box_inside
from torchtitan.cellmap.labels import DEFAULT_ENCODING, LabelEncoding
from torchtitan.cellmap.ome_ngff import is_multiscale_group, read_attrs, read_multiscales
from torchtitan.data.io.stores import (
    StoreContext,
    check_location,
    is_url,
    join,
    name_of,
    parent_of,
)
from torchtitan.data.crops.split_lists import SplitEntry, read_split_entries

EM_GROUP = "recon-1/em/fibsem-uint8"
EM_GROUP_UINT16 = "recon-1/em/fibsem-uint16"  # used when a store has no uint8 EM
GT_GROUP = "recon-1/labels/groundtruth"


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

    # The box the crop's labels span, (min, max) corners in nm: the union of its classes'
    # finest levels, within ``bounds``. Set once (read-only arrays); ``replace`` sets it again.
    box_min: np.ndarray = field(init=False, repr=False, compare=False)
    box_max: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        lo = np.min([lv[0].box_min for lv in self.classes.values()], axis=0)
        hi = np.max([lv[0].box_max for lv in self.classes.values()], axis=0)
        if self.bounds is not None:
            lo, hi = np.maximum(lo, self.bounds[0]), np.minimum(hi, self.bounds[1])
        lo.setflags(write=False)
        hi.setflags(write=False)
        self.box_min, self.box_max = lo, hi


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
