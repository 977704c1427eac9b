"""2D training samples from a Hugging Face dataset of EM slices (``data.dataset_name``).

``data.dataset_name`` names a ``datasets`` table: a ``save_to_disk`` folder, or a Hub dataset
(its ``train`` split). Two schemas carry labels:

* **this project's** (``helpers/create_slice_dataset.py``): one row per plane of each label
  crop, cut on the crop's grid: ``image`` (EM, 8-bit), per class ``label_<class>`` and
  ``valid_<class>`` (1-bit images), ``annotated`` (classes the crop annotates), ``dataset``,
  ``crop``, ``axis``, ``index``, ``voxel_size``, ``origin``, ``shape`` (the crop grid).
* **the original torchtitan-segmentation's** (its ``helpers/create_slice_dataset_cellmap.py``,
  which made e.g. ``eminorhan/cellmap-2d``): one row per plane (z, y and x) of each CellMap
  crop at the label array's own resolution: ``image`` (EM, 8-bit greyscale PNG; the later
  versions stretch each slice to its 1-99 % percentiles and drop uniform slices), ``label``
  (8-bit PNG of the crop's ``all`` array: one CellMap class id per voxel, 0 = background),
  ``crop_name`` (``"<dataset>/<recon>/<crop>"``), ``axis`` (``"z"``, ``"y"``, ``"x"``) and
  ``slice`` (int32, the plane's index along ``axis``). No voxel size, crop grid or validity.

  What counts as annotated there (:class:`CellMapIdLabels`): a voxel holding a class id is
  annotated for every class (ids are the finest annotated class, and atomic classes do not
  overlap), except that a composite id only partly inside a class (e.g. ``mito`` for
  ``mito_mem``) is unknown for it, as are ids outside the CellMap table. Background (0) says
  "none of the classes annotated here", and the schema does not say which those are, so
  background is a negative for class ``c`` only in slices that hold ``c`` whole: its own id,
  or ids of its parts covering every atomic part of ``c``. Elsewhere it is invalid for ``c``.

  Missing geometry: slices are taken to be at ``data.voxel_size`` (nominal), training rows
  are independent 2D samples, and each held-out crop (``data.val_crops`` /
  ``data.val_fraction`` over ``crop_name``) is validated as the stack of its planes along one
  axis (z when it has any); planes the helper dropped are simply absent from the stack.

MAE reads only ``image``, so it also takes the original's EM-only sets (e.g.
``eminorhan/openorganelle-2d``) or any dataset with an ``image`` column
(:class:`SliceMAESamples`).

Training draws samples like :class:`~torchtitan.datasets.samples.SegmentationSamples`: item
``g`` is decided by ``sample_rng(seed, g)`` alone (which slice, where in it, the augmentation
plan of ``augment.py``), so the global batch sampler, exact resume and parallelism-independent
losses carry over. Slices are drawn uniformly (``data.class_balanced`` is not supported), from
the planes ``data.planes`` allows.

Validation needs no zarr either: the slices of a held-out crop along one axis are the planes
of its whole grid, so stacking them (:class:`SliceReader`) gives back the volume that
validation on the zarr stores reads (``crop_grid`` + ``samples.CropReader.read``), and the
held-out crops are predicted and scored the same way.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from torchtitan.datasets.augment import (
    NO_AUGMENTATION,
    AugmentParams,
    apply_flips,
    intensity_params,
    draw_plan,
    read_shape,
    resample,
    resample_matrix,
)
from torchtitan.datasets.batch import Sample
from torchtitan.cellmap.errors import DatasetError
from torchtitan.cellmap.grids import AXES
from torchtitan.errors import redact_secrets
from torchtitan.cellmap.classes import CLASS_IDS, atoms
from torchtitan.datasets.loader import split_crops
from torchtitan.datasets.samples import (
    FOREGROUND_DRAWS,
    foreground_fraction,
    normalize_em,
    sample_rng,
)

logger = logging.getLogger(__name__)

# Schemas (see the module docstring).
OURS = "torchtitan"
ORIGINAL = "original"
IMAGES = "images"  # only an image column: MAE only
META_COLUMNS = ("annotated", "dataset", "crop", "axis", "index", "voxel_size", "origin", "shape")
ORIGINAL_COLUMNS = ("image", "label", "crop_name", "axis", "slice")
ORIGINAL_3D_COLUMNS = ("volume", "label", "crop_name", "shape")
EXPECTED_COLUMNS = (
    "this project's (helpers/create_slice_dataset.py): image, label_<class> and valid_<class> "
    f"per class, {', '.join(META_COLUMNS)}; or the original torchtitan-segmentation's "
    "(helpers/create_slice_dataset_cellmap.py, e.g. eminorhan/cellmap-2d): "
    f"{', '.join(ORIGINAL_COLUMNS)}"
)


@dataclass(frozen=True)
class SliceCrop:
    """A label crop as a slices dataset describes it: enough for the train/val split
    (``split_crops``), ``crop_grid`` and scoring, like a :class:`LabelCrop`."""

    name: str
    dataset: str
    classes: tuple[str, ...]  # the classes (of those in the dataset) the crop annotates
    origin: tuple[float, float, float]  # nm, corner of voxel 0 of the crop grid
    # None where the dataset does not record it (the original schema; validation crops get
    # the shape of their stack of planes)
    shape: tuple[int, int, int] | None
    voxel_size: tuple[float, float, float]

    @property
    def full_name(self) -> str:
        return f"{self.dataset}/{self.name}" if self.dataset else self.name

    @property
    def box_min(self) -> np.ndarray:
        return np.asarray(self.origin, dtype=float)

    @property
    def box_max(self) -> np.ndarray:
        return self.box_min + np.asarray(self.shape) * np.asarray(self.voxel_size, dtype=float)


# ---------------------------------------------------------------------------------------------
# Opening: which schema
# ---------------------------------------------------------------------------------------------


def detect_schema(ds) -> str | None:
    """OURS, ORIGINAL, IMAGES (an ``image`` column, nothing else known) or None."""
    import datasets

    columns = set(ds.column_names)
    if "image" not in columns or not isinstance(ds.features["image"], datasets.Image):
        return None
    if set(META_COLUMNS) <= columns:
        return OURS
    if set(ORIGINAL_COLUMNS) <= columns and isinstance(ds.features["label"], datasets.Image):
        return ORIGINAL
    return IMAGES


def _load(name: str):
    """The ``datasets.Dataset`` named by ``data.dataset_name``: a ``save_to_disk`` folder, or
    else a Hugging Face Hub dataset (its ``train`` split)."""
    import datasets

    path = Path(name).expanduser()
    if path.exists():
        try:
            ds = datasets.load_from_disk(str(path))
        except FileNotFoundError as e:
            raise DatasetError(
                f"data.dataset_name {name!r} is a folder but not a saved dataset ({e}); make one "
                "with `python helpers/create_slice_dataset.py --zarr DATA --out FOLDER`"
            ) from e
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DatasetError(f"data.dataset_name {name!r} has splits {list(ds)}, no 'train'")
            ds = ds["train"]
        return ds
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise DatasetError(
            f"data.dataset_name {name!r}: no such folder; make one with `python "
            "helpers/create_slice_dataset.py --zarr DATA --out FOLDER`, or give a Hub name "
            "(user/dataset)"
        )
    try:
        return datasets.load_dataset(name, split="train")
    except Exception as e:  # noqa: BLE001 - any Hub failure becomes one clear message
        raise DatasetError(
            f"data.dataset_name {name!r}: no such folder here, and loading it from the "
            f"Hugging Face Hub failed: {type(e).__name__}: {redact_secrets(str(e))}"
        ) from None  # the chained exception could quote the token


def open_slices(name: str, need: str = "labels"):
    """(dataset, schema) of ``data.dataset_name``. ``need="labels"`` (segmentation) accepts
    OURS and ORIGINAL, ``need="image"`` (MAE) anything with an ``image`` column of images."""
    ds = _load(name)
    schema = detect_schema(ds)
    found = list(ds.column_names)
    if set(ORIGINAL_3D_COLUMNS) <= set(found):
        raise DatasetError(
            f"data.dataset_name {name!r} holds whole 3D crops (columns {found}, as the original "
            "torchtitan-segmentation's helpers/create_volume_dataset_cellmap.py writes, e.g. "
            "eminorhan/cellmap-3d), which are not read here; use its 2D slices (e.g. "
            "eminorhan/cellmap-2d) or the zarr stores (data.dataset_path)"
        )
    if need == "image" and schema is None:
        raise DatasetError(
            f"data.dataset_name {name!r} has no 'image' column of images (it has the columns "
            f"{found}); MAE reads the EM images of a slices dataset: {EXPECTED_COLUMNS}, or any "
            "dataset with an 'image' column"
        )
    if need == "labels" and schema not in (OURS, ORIGINAL):
        raise DatasetError(
            f"data.dataset_name {name!r} has the columns {found}, which match no slices "
            f"dataset schema; expected either {EXPECTED_COLUMNS}"
        )
    return ds, schema


def dataset_classes(ds) -> list[str]:
    """The classes a slices dataset of this project's schema holds (its ``label_<class>``
    columns)."""
    return [c[len("label_"):] for c in ds.column_names if c.startswith("label_")]


# ---------------------------------------------------------------------------------------------
# Labels: per class target and validity of one row
# ---------------------------------------------------------------------------------------------


class MaskColumns:
    """This project's schema: a 1-bit label and validity image per class."""

    def __init__(self, classes):
        self.classes = list(classes)
        self.columns = [f"{kind}_{c}" for c in self.classes for kind in ("label", "valid")]

    def __call__(self, batch: dict, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(target, valid) (K, h, w) bool of row ``i`` of a decoded batch."""
        target = np.stack([np.asarray(batch[f"label_{c}"][i], dtype=bool) for c in self.classes])
        valid = np.stack([np.asarray(batch[f"valid_{c}"][i], dtype=bool) for c in self.classes])
        return target, valid


class CellMapIdLabels:
    """The original schema: one CellMap class id per voxel (see the module docstring for what
    counts as annotated). Two lookup tables per class map an id to present / known."""

    columns = ["label"]

    def __init__(self, classes):
        self.classes = list(classes)
        self.wanted = [atoms(c) for c in self.classes]
        id_atoms = {cid: atoms(name) for name, cid in CLASS_IDS.items() if cid < 256}
        self.present = np.zeros((len(self.classes), 256), dtype=bool)
        self.known = np.zeros((len(self.classes), 256), dtype=bool)
        # per class: the ids made only of its parts (its own id included), with their atoms
        self.parts: list[list[tuple[int, frozenset[str]]]] = []
        for k, want in enumerate(self.wanted):
            self.parts.append([(i, a) for i, a in id_atoms.items() if a <= want])
            for i, a in id_atoms.items():
                self.present[k, i] = a <= want
                self.known[k, i] = a <= want or not (a & want)

    def holds(self, counts: np.ndarray, k: int) -> bool:
        """Whether a slice with these id counts holds class ``k`` whole, so that its
        background is a negative for it."""
        covered: set[str] = set()
        for i, a in self.parts[k]:
            if counts[i]:
                covered |= a
        return covered >= self.wanted[k]

    def targets(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(target, valid) (K, h, w) bool of one (h, w) uint8 id image."""
        counts = np.bincount(ids.ravel(), minlength=256)
        target, valid = self.present[:, ids], self.known[:, ids]
        background = ids == 0
        for k in range(len(self.classes)):
            if self.holds(counts, k):
                valid[k] |= background
        return target, valid

    def __call__(self, batch: dict, i: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(batch["label"][i])
        if ids.ndim != 2:
            raise DatasetError(f"a label image of mode {batch['label'][i].mode!r} is not one "
                               "class id per pixel")
        if ids.dtype != np.uint8:  # ids past 255 are outside the table: unknown
            ids = np.clip(ids, 0, 255).astype(np.uint8)
        return self.targets(ids)


def _gray(image) -> np.ndarray:
    """(h, w) uint8 of a decoded PIL image (8-bit greyscale as the helpers write it)."""
    if image.mode != "L":
        image = image.convert("L")
    return np.asarray(image, dtype=np.uint8)


def _image_size(entry: dict) -> tuple[int, int]:
    """(h, w) of an undecoded image entry ({"bytes", "path"}) from its header alone."""
    from PIL import Image

    src = io.BytesIO(entry["bytes"]) if entry.get("bytes") is not None else entry["path"]
    with Image.open(src) as im:
        return im.size[1], im.size[0]


# ---------------------------------------------------------------------------------------------
# Indexing
# ---------------------------------------------------------------------------------------------


class SliceIndex:
    """A slices dataset plus a table of its rows: which crop, axis and plane each one is.

    ``classes`` and ``voxel_size`` fill in what the original schema does not record (every
    crop is taken to annotate ``classes``: validity decides, see :class:`CellMapIdLabels`).
    """

    def __init__(self, ds, schema: str = OURS, classes=(), voxel_size=(1.0, 1.0, 1.0)):
        self.ds = ds
        self.schema = schema
        self.crops: dict[str, SliceCrop] = {}
        # held-out crops of the original schema: (axis, rows in stack order), see stack_crop
        self.stacks: dict[str, tuple[int, np.ndarray]] = {}
        if schema == OURS:
            meta = ds.select_columns(list(META_COLUMNS)).to_dict()
            names = [f"{d}/{c}" for d, c in zip(meta["dataset"], meta["crop"])]
            for i, full in enumerate(names):
                if full not in self.crops:
                    self.crops[full] = SliceCrop(
                        meta["crop"][i], meta["dataset"][i], tuple(meta["annotated"][i]),
                        tuple(meta["origin"][i]), tuple(meta["shape"][i]),
                        tuple(meta["voxel_size"][i]))
            index = meta["index"]
        else:
            meta = ds.select_columns(["crop_name", "axis", "slice"]).to_dict()
            names = list(meta["crop_name"])
            for full in dict.fromkeys(names):
                dataset, _, name = full.rpartition("/")
                self.crops[full] = SliceCrop(name, dataset, tuple(classes), (0.0, 0.0, 0.0),
                                             None, tuple(float(v) for v in voxel_size))
            index = meta["slice"]
        self.row_crop = np.asarray(names, dtype=object)
        self.row_axis = np.asarray(meta["axis"], dtype=object)
        self.row_index = np.asarray(index, dtype=np.int64)

    def rows(self, crops: list[SliceCrop], axes) -> np.ndarray:
        """Row numbers of the slices of ``crops`` normal to any of ``axes``."""
        names = {c.full_name for c in crops}
        keep = np.array([n in names for n in self.row_crop], dtype=bool)
        keep &= np.isin(self.row_axis.astype(str), list(axes))
        return np.flatnonzero(keep)

    def volume_rows(self, crop: SliceCrop) -> tuple[int, np.ndarray]:
        """(axis, rows in plane order) of one complete stack of ``crop``'s planes, preferring
        z; a DatasetError if no axis has them all."""
        if crop.full_name in self.stacks:
            return self.stacks[crop.full_name]
        for ax, axis in enumerate(AXES):
            rows = self.rows([crop], axis)
            planes = self.row_index[rows]
            if sorted(planes.tolist()) == list(range(crop.shape[ax])):
                return ax, rows[np.argsort(planes)]
        raise DatasetError(
            f"data.dataset_name: crop {crop.full_name} has no complete set of slices along any "
            f"axis (grid {list(crop.shape)}), so it cannot be validated; remake the dataset"
        )

    def stack_crop(self, crop: SliceCrop) -> tuple[SliceCrop, int]:
        """A held-out crop of the original schema made a volume: the stack of its planes along
        z (else y, else x) in plane order. Returns the crop with that stack's shape and the
        number of planes missing from it (the original helper drops uniform slices)."""
        import datasets

        ax = next((a for a, axis in enumerate(AXES) if len(self.rows([crop], axis))), None)
        if ax is None:
            raise DatasetError(f"data.dataset_name: crop {crop.full_name} has no z, y or x slices")
        axis = AXES[ax]
        rows = self.rows([crop], axis)
        rows = rows[np.argsort(self.row_index[rows], kind="stable")]
        # Image sizes from the PNG headers: no pixel is decoded before the first validation.
        entries = self.ds.select_columns(["image"]).cast_column(
            "image", datasets.Image(decode=False))[[int(r) for r in rows]]["image"]
        sizes = {_image_size(e) for e in entries}
        if len(sizes) != 1:
            raise DatasetError(
                f"data.dataset_name: the {axis} slices of crop {crop.full_name} have different "
                f"sizes {sorted(sizes)}, so they do not stack into its volume for validation; "
                "name other data.val_crops"
            )
        shape = list(sizes.pop())
        shape.insert(ax, len(rows))
        planes = self.row_index[rows]
        missing = int(planes.max() - planes.min() + 1 - len(np.unique(planes)))
        stacked = replace(crop, shape=tuple(shape))
        self.crops[crop.full_name] = stacked
        self.stacks[crop.full_name] = (ax, rows)
        return stacked, missing


# ---------------------------------------------------------------------------------------------
# Windows of a slice
# ---------------------------------------------------------------------------------------------


def _window(arr: np.ndarray, start, size, fill) -> np.ndarray:
    """The (..., *size) window of a (..., h, w) array whose first voxel is at ``start`` (may
    lie outside the array: what falls outside is ``fill``)."""
    out = np.full((*arr.shape[:-2], *size), fill, dtype=arr.dtype)
    src, dst = [], []
    for n, s, o in zip(arr.shape[-2:], size, start):
        a, b = max(o, 0), min(o + s, n)
        if a >= b:
            return out
        src.append(slice(a, b))
        dst.append(slice(a - o, b - o))
    out[(..., *dst)] = arr[(..., *src)]
    return out


def _place(rng: np.random.Generator, hw, crop_size) -> np.ndarray:
    """First voxel of a window placed uniformly inside a slice of ``hw``; centred along an
    axis where the slice is smaller (the rest is padding)."""
    return np.asarray([int(rng.integers(n - s + 1)) if n >= s else -((s - n) // 2)
                       for n, s in zip(hw, crop_size)])


def _cut(arrays: dict[str, np.ndarray], start, crop_size, plan, vox,
         fills: dict[str, float]) -> dict[str, np.ndarray]:
    """The window at ``start`` of every (C, h, w) array with ``plan`` applied (rotation and
    zoom resample a larger window around the same centre: EM linearly, the rest by nearest
    neighbour; then flips). What falls outside the slice reads ``fills[key]``."""
    matrix = resample_matrix(plan, vox)
    if matrix is None:
        out = {k: _window(a, start, crop_size, fills[k]) for k, a in arrays.items()}
    else:
        size = np.asarray(crop_size)
        big = np.asarray(read_shape(crop_size, matrix))
        centre = start + size / 2
        big_start = np.floor(centre - big / 2).astype(int)
        shift = centre - (big_start + big / 2)
        out = {}
        for k, a in arrays.items():
            window = _window(a.astype(np.float32), big_start, tuple(big), float(fills[k]))
            out[k] = resample(window, matrix, crop_size, shift, 1 if k == "image" else 0,
                              float(fills[k]))
    return {k: apply_flips(a, plan) for k, a in out.items()}


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _sample(arrays: dict[str, np.ndarray], index: int, aug: AugmentParams, plan, vox,
            rng: np.random.Generator) -> Sample:
    """The :class:`Sample` of a cut window (float32 arrays); with intensity augmentation also
    what was drawn for it (made on the device by ``augment.augment_on_device``)."""
    target = arrays.get("target")
    sample = Sample(image=_tensor(arrays["image"]), valid=_tensor(arrays["valid"]),
                    target=None if target is None else _tensor(target), index=int(index))
    if aug.intensity:
        sample.intensity, sample.noise_seed = intensity_params(plan, aug, vox, rng)
    return sample


class SliceReader:
    """EM, targets and validity of slices: rows decoded into arrays, and whole crops stacked
    from their slices for validation (built once by the task; no training dataset needed)."""

    def __init__(self, index: "SliceIndex", classes: list[str]):
        self.index = index
        self.classes = list(classes)
        self.labels = (MaskColumns if index.schema == OURS else CellMapIdLabels)(self.classes)
        # Decode only what a sample needs (a row of our schema holds every class it has).
        self.columns = index.ds.select_columns(["image", *self.labels.columns])

    def arrays(self, rows) -> dict[str, np.ndarray]:
        """EM (N, 1, h, w) float32 (normalized) and targets / validity (N, K, h, w) bool."""
        rows = [int(r) for r in rows]
        batch = self.columns[rows]
        images, targets, valids = [], [], []
        for i, row in enumerate(rows):
            image = _gray(batch["image"][i])
            target, valid = self.labels(batch, i)
            if target.shape[1:] != image.shape:
                raise DatasetError(
                    f"data.dataset_name: row {row} ({self.index.row_crop[row]}, "
                    f"{self.index.row_axis[row]} {self.index.row_index[row]}) has a label of "
                    f"{list(target.shape[1:])} pixels for an image of {list(image.shape)}"
                )
            images.append(image)
            targets.append(target)
            valids.append(valid)
        return {"image": normalize_em(np.stack(images)[:, None]), "target": np.stack(targets),
                "valid": np.stack(valids)}

    def read(self, crop: SliceCrop, origin, shape) -> dict[str, np.ndarray]:
        """A whole crop on its grid, stacked from its slices: ``image`` (1, D, H, W) and
        ``target`` / ``valid`` (K, D, H, W) float32, as ``CropReader.read`` gives for
        ``crop_grid(crop)``. ``origin`` is ignored; ``shape`` must be the crop's."""
        if tuple(int(s) for s in shape) != crop.shape:
            raise DatasetError(
                f"{crop.full_name}: a slices dataset holds it on a {list(crop.shape)} grid, "
                f"not {list(shape)}; data.voxel_size must be the dataset's {list(crop.voxel_size)}"
            )
        ax, rows = self.index.volume_rows(crop)
        arrays = self.arrays(rows)  # (N, C, a, b): planes first
        return {k: np.moveaxis(v, 0, 1 + ax).astype(np.float32) for k, v in arrays.items()}


# ---------------------------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------------------------


class SliceSamples(Dataset):
    """Random 2D crops of the slices of the training crops, with binary targets and
    per-class validity masks: the item contract of ``SegmentationSamples``.

    Item ``g`` is a :class:`~torchtitan.datasets.batch.Sample`: ``image`` (1, H, W),
    ``target`` and ``valid`` (K, H, W) float32, ``index`` (the global sample index) and
    ``resampled`` (always 0: nothing here fails to read). A window is placed uniformly inside the slice; along an axis where the slice is
    smaller it is centred, and the padding is invalid for every class (EM reads 0 there, as
    outside an EM volume).
    """

    FILLS = {"image": -1.0, "target": False, "valid": False}  # -1: EM 0, normalized

    def __init__(self, index: SliceIndex, crops: list[SliceCrop], classes: list[str], crop_size,
                 seed: int, augment: bool = True, *, augmentation: AugmentParams | None = None,
                 axes=("z",)):
        if len(crop_size) != 2:
            raise DatasetError(
                f"a slices dataset (data.dataset_name) trains 2D models; model.crop_size "
                f"{list(crop_size)} is not 2D"
            )
        self.index = index
        self.classes = list(classes)
        self.crop_size = tuple(int(c) for c in crop_size)
        self.seed = seed
        self.aug = (augmentation or AugmentParams()) if augment else NO_AUGMENTATION
        self.train_rows = index.rows(crops, axes)
        if len(self.train_rows) == 0:
            raise DatasetError(
                f"no training slices normal to data.planes axes {list(axes)} in the training crops "
                f"({', '.join(c.full_name for c in crops) or 'none'}); make the dataset with "
                "--axes covering them, or change data.planes"
            )
        self.reader = SliceReader(index, self.classes)

    def __len__(self) -> int:
        return 2**62  # indexed by global sample index; the sampler decides what is drawn

    def _plane_voxel_size(self, row: int) -> np.ndarray:
        """nm per voxel along the two image axes of a row's slice."""
        crop = self.index.crops[self.index.row_crop[row]]
        normal = AXES.index(self.index.row_axis[row])
        return np.asarray([v for a, v in enumerate(crop.voxel_size) if a != normal], dtype=float)

    def __getitem__(self, index: int) -> Sample:
        rng = sample_rng(self.seed, index)
        row = int(self.train_rows[int(rng.integers(len(self.train_rows)))])
        arrays = {k: v[0] for k, v in self.reader.arrays([row]).items()}  # (C, h, w)
        start = _place(rng, arrays["image"].shape[-2:], self.crop_size)
        vox = self._plane_voxel_size(row)
        plan = draw_plan(rng, self.aug, self.crop_size, vox)
        arrays = _cut(arrays, start, self.crop_size, plan, vox, self.FILLS)
        return _sample(arrays, index, self.aug, plan, vox, rng)

    def read(self, crop: SliceCrop, origin, shape) -> dict[str, np.ndarray]:
        """:meth:`SliceReader.read` (what validation reads of a whole crop)."""
        return self.reader.read(crop, origin, shape)


class SliceMAESamples(Dataset):
    """Random 2D EM crops of the slices of a dataset, for MAE: the item contract of
    :class:`~torchtitan.datasets.samples.MAESamples` (a ``Sample``: ``image`` and ``valid``
    (1, H, W), 0 in the padding where a slice is smaller than the crop; ``noise`` for the
    masking; ``index``, ``resampled``), decided by ``sample_rng(seed, g)`` alone. Every row is an
    independent image at ``voxel_size``; with ``foreground_threshold`` > 0 the row and place
    are redrawn (up to FOREGROUND_DRAWS times, keeping the best) as ``MAESamples`` does."""

    FILLS = {"image": -1.0, "valid": 0.0}

    def __init__(self, ds, rows: np.ndarray, row_axis: np.ndarray | None, crop_size, voxel_size,
                 seed: int, augment: bool = True, num_patches: int = 0, *,
                 augmentation: AugmentParams | None = None, foreground_threshold: float = 0.0):
        if len(crop_size) != 2:
            raise DatasetError(
                f"a slices dataset (data.dataset_name) trains 2D models; model.crop_size "
                f"{list(crop_size)} is not 2D"
            )
        self.images = ds.select_columns(["image"])
        self.rows = np.asarray(rows, dtype=np.int64)
        self.row_axis = row_axis
        self.crop_size = tuple(int(c) for c in crop_size)
        self.voxel_size = np.asarray(voxel_size, dtype=float)
        self.seed = seed
        self.aug = (augmentation or AugmentParams()) if augment else NO_AUGMENTATION
        self.num_patches = num_patches
        self.foreground_threshold = float(foreground_threshold)

    def __len__(self) -> int:
        return 2**62

    def _plane_voxel_size(self, row: int) -> np.ndarray:
        normal = 0 if self.row_axis is None else AXES.index(self.row_axis[row])
        return np.delete(self.voxel_size, normal)

    def _draw_once(self, rng: np.random.Generator):
        row = int(self.rows[int(rng.integers(len(self.rows)))])
        image = normalize_em(_gray(self.images[row]["image"])[None])
        start = _place(rng, image.shape[-2:], self.crop_size)
        vox = self._plane_voxel_size(row)
        plan = draw_plan(rng, self.aug, self.crop_size, vox)
        arrays = {"image": image, "valid": np.ones_like(image)}
        return _cut(arrays, start, self.crop_size, plan, vox, self.FILLS), plan, vox

    def __getitem__(self, index: int) -> Sample:
        rng = sample_rng(self.seed, index)
        drawn = self._draw_once(rng)
        if self.foreground_threshold > 0:
            best, best_fraction = drawn, foreground_fraction(drawn[0]["image"])
            for _ in range(FOREGROUND_DRAWS - 1):
                if best_fraction >= self.foreground_threshold:
                    break
                drawn = self._draw_once(rng)
                fraction = foreground_fraction(drawn[0]["image"])
                if fraction > best_fraction:
                    best, best_fraction = drawn, fraction
            drawn = best
        arrays, plan, vox = drawn
        sample = _sample(arrays, index, self.aug, plan, vox, rng)
        if self.num_patches:
            sample.noise = torch.from_numpy(rng.random(self.num_patches, dtype=np.float32))
        return sample


# ---------------------------------------------------------------------------------------------
# From the config
# ---------------------------------------------------------------------------------------------


def _check_min_fraction(index: SliceIndex, crops: list[SliceCrop], axes, crop_size,
                        min_fraction: float) -> None:
    """Like the zarr path: some training slice must hold ``min_fraction`` of a model crop."""
    best, where = 0.0, "-"
    for c in crops:
        for axis in axes:
            ax = AXES.index(axis)
            plane = [s for i, s in enumerate(c.shape) if i != ax]
            frac = float(np.prod([min(p, s) / s for p, s in zip(plane, crop_size)]))
            if frac > best:
                best, where = frac, f"{c.full_name} ({axis} slices of {plane[0]}x{plane[1]})"
    if best + 1e-6 < min_fraction:
        raise DatasetError(
            f"model.crop_size {list(crop_size)} is larger than every training slice (the largest "
            f"fraction that fits is {best:.2f}, in {where}, below data.min_label_fraction="
            f"{min_fraction}); use a smaller model.crop_size or a lower data.min_label_fraction"
        )


def _check_voxel_sizes(name: str, sizes, voxel_size) -> None:
    """The voxel sizes a dataset of this project's schema was cut at must be data.voxel_size."""
    sizes = sorted({tuple(s) for s in sizes})
    if any(not np.allclose(s, voxel_size, rtol=1e-6) for s in sizes):
        raise DatasetError(
            f"the slices dataset {name!r} was cut at voxel size "
            f"{' / '.join(str(list(s)) for s in sizes)} nm, but data.voxel_size is "
            f"{list(voxel_size)}; set data.voxel_size to match or remake it with --voxel_size"
        )


def _check_2d(cfg, what: str) -> None:
    if cfg.model.ndim != 2:
        raise DatasetError(
            f"data.dataset_name {cfg.data.dataset_name!r} is a dataset of 2D slices, but "
            f"model.ndim = {cfg.model.ndim}; train 3D {what} from the zarr stores "
            "(data.dataset_path, with data.dataset_name empty)"
        )


def _check_ours(index: SliceIndex, cfg, train: list[SliceCrop], val: list[SliceCrop]) -> None:
    """What this project's schema records, checked against the config."""
    d = cfg.data
    for cls in d.classes:
        if not any(cls in c.classes for c in train):
            raise DatasetError(
                f"data.classes: class {cls!r} is annotated by no training crop of "
                f"{d.dataset_name!r} (check data.val_crops / data.val_fraction)"
            )
    _check_min_fraction(index, train, tuple(d.planes), cfg.model.crop_size, d.min_label_fraction)
    for c in val:
        index.volume_rows(c)  # fail now, not at the first validation


def _stack_original(index: SliceIndex, name: str, val: list[SliceCrop],
                    voxel_size) -> list[SliceCrop]:
    """The held-out crops of an original-schema dataset, each made the stack of its planes
    (logged: the schema has no geometry, so this is the fallback)."""
    stacked, gaps = [], []
    for c in val:
        crop, missing = index.stack_crop(c)
        stacked.append(crop)
        if missing:
            gaps.append(f"{crop.full_name} ({missing})")
    logger.info(
        "slices dataset %s has the original torchtitan-segmentation schema (%s): labels are "
        "CellMap class ids, background counting as a negative only in slices that hold the "
        "class whole; it records no voxel size or crop grid, so every slice is taken to be at "
        "data.voxel_size %s nm, training slices are independent 2D samples, and each held-out "
        "crop is validated as the stack of its planes along one axis", name,
        ", ".join(ORIGINAL_COLUMNS), list(voxel_size))
    if gaps:
        logger.warning("slices dataset %s: planes missing from the validation stacks of %s "
                       "(the original helper drops uniform slices); the planes present are "
                       "stacked", name, ", ".join(gaps))
    return stacked


def load_slice_data(cfg) -> tuple[SliceIndex, list[SliceCrop], list[SliceCrop]]:
    """Open ``data.dataset_name``, check it against the config and split its crops into
    (train, val) by crop name, as ``load_segmentation_data`` does for zarr stores. Every
    problem is a DatasetError, raised before any process group exists."""
    d = cfg.data
    _check_2d(cfg, "models")
    if d.class_balanced:
        raise DatasetError(
            "data.class_balanced is not supported with data.dataset_name (slices are drawn "
            "uniformly); set data.class_balanced = false, or train from the zarr stores"
        )
    ds, schema = open_slices(d.dataset_name)
    if schema == OURS:
        have = dataset_classes(ds)
        missing = [c for c in d.classes if c not in have]
        if missing:
            raise DatasetError(
                f"data.classes {missing} are not in the slices dataset {d.dataset_name!r}, which "
                f"holds {', '.join(have) or '(none)'}; pick among those or remake it with --classes"
            )
    else:
        unknown = [c for c in d.classes if c not in CLASS_IDS]
        if unknown:
            raise DatasetError(
                f"data.classes {unknown} are not CellMap classes, and the labels of "
                f"{d.dataset_name!r} (the original schema) are CellMap class ids; see "
                "torchtitan/cellmap/classes.py for the names"
            )
    index = SliceIndex(ds, schema, d.classes, d.voxel_size)
    # In discover()'s order (dataset, then crop folder name), so that the split picks the same
    # validation crops as it does from the zarr stores.
    crops = sorted(index.crops.values(), key=lambda c: (c.dataset, c.name))
    if not crops:
        raise DatasetError(f"data.dataset_name {d.dataset_name!r} holds no slices")
    if schema == OURS:
        _check_voxel_sizes(d.dataset_name, [c.voxel_size for c in crops], d.voxel_size)
    train, val = split_crops(crops, d.classes, d.val_crops, d.val_fraction, cfg.training.seed)
    if schema == OURS:
        _check_ours(index, cfg, train, val)
    else:
        val = _stack_original(index, d.dataset_name, val, d.voxel_size)
    axes = tuple(d.planes)  # "z" or "zyx"
    logger.info("slices dataset %s: %d slices of %d crops; %d training slices (%s planes) of %d "
                "crops, %d validation crops (%s)", d.dataset_name, len(index.ds), len(crops),
                len(index.rows(train, axes)), ",".join(axes), len(train), len(val),
                ", ".join(c.full_name for c in val) or "none")
    return index, train, val


def build_slice_samples(cfg, index: SliceIndex | None = None,
                        train_crops: list[SliceCrop] | None = None) -> SliceSamples:
    """The training samples of ``data.dataset_name`` (opened and split here unless given)."""
    if index is None or train_crops is None:
        index, train_crops, _ = load_slice_data(cfg)
    return SliceSamples(index, train_crops, cfg.data.classes, cfg.model.crop_size,
                        cfg.training.seed,
                        augmentation=AugmentParams.from_config(cfg.augmentation),
                        axes=tuple(cfg.data.planes))


@dataclass(frozen=True)
class MAESlices:
    """The rows of a slices dataset that MAE draws from."""

    ds: object
    rows: np.ndarray
    row_axis: np.ndarray | None  # "z" / "y" / "x" per row, None without an axis column


def load_mae_slices(cfg) -> MAESlices:
    """The EM slices of ``data.dataset_name`` for MAE: the rows normal to ``data.planes``
    (every row when the dataset has no ``axis`` column). DatasetErrors before any process
    group exists."""
    d = cfg.data
    _check_2d(cfg, "MAE")
    ds, schema = open_slices(d.dataset_name, need="image")
    if schema == OURS:
        _check_voxel_sizes(d.dataset_name, ds.select_columns(["voxel_size"]).to_dict()[
            "voxel_size"], d.voxel_size)
    axes = tuple(d.planes)
    if "axis" in ds.column_names:
        row_axis = np.asarray(ds.select_columns(["axis"]).to_dict()["axis"], dtype=object)
        rows = np.flatnonzero(np.isin(row_axis.astype(str), list(axes)))
        which = f"{len(rows)} of its {len(ds)} slices ({','.join(axes)} planes)"
    else:
        row_axis, rows = None, np.arange(len(ds))
        which = f"all {len(ds)} images (no axis column: data.planes does not apply)"
    if len(rows) == 0:
        raise DatasetError(
            f"data.dataset_name {d.dataset_name!r} has no slices normal to data.planes axes "
            f"{list(axes)}; change data.planes"
        )
    logger.info("MAE data: slices dataset %s (%s schema): %s, each an independent 2D image at "
                "data.voxel_size %s nm", d.dataset_name, schema, which, list(d.voxel_size))
    return MAESlices(ds, rows, row_axis)


def build_slice_mae_samples(cfg, data: MAESlices, seed_offset: int = 0, num_patches: int = 0,
                            augment: bool = True) -> SliceMAESamples:
    """MAE samples of a slices dataset; ``augment=False`` for the held-out validation
    stream (``seed_offset``), as ``loader.build_mae_samples``."""
    return SliceMAESamples(data.ds, data.rows, data.row_axis, cfg.model.crop_size,
                           cfg.data.voxel_size, cfg.training.seed + seed_offset, augment=augment,
                           num_patches=num_patches,
                           augmentation=AugmentParams.from_config(cfg.augmentation),
                           foreground_threshold=cfg.data.foreground_threshold)
