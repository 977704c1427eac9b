"""A Hugging Face dataset of EM slices (``data.dataset_name``): opening it, telling its schema,
decoding a row's labels, and the table of its rows (which crop, axis and plane each one is).

``data.dataset_name`` names a ``datasets`` table: a ``save_to_disk`` folder, or a Hub dataset
(its ``train`` split). Two schemas carry labels:

* **this project's** (``helpers/create_slice_dataset.py``): one row per plane of each label
  crop, cut on the crop's grid: ``image`` (EM, 8-bit), per class ``label_<class>`` and
  ``valid_<class>`` (1-bit images, :class:`MaskColumns`), ``annotated`` (classes the crop
  annotates), ``dataset``, ``crop``, ``axis``, ``index``, ``voxel_size``, ``origin``,
  ``shape`` (the crop grid).
* **the original torchtitan-segmentation's** (e.g. ``eminorhan/cellmap-2d``): one CellMap
  class id per voxel and no geometry; its adapter is ``slices_original.py``.

A dataset with only an ``image`` column (e.g. ``eminorhan/openorganelle-2d``) serves MAE.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from torchtitan.cellmap.errors import DatasetError
from torchtitan.cellmap.grids import AXES
from torchtitan.data.slices import original as slices_original
from torchtitan.errors import optional_import, redact_secrets

# Schemas (see the module docstring).
OURS = "torchtitan"
ORIGINAL = "original"
IMAGES = "images"  # only an image column: MAE only
META_COLUMNS = ("annotated", "dataset", "crop", "axis", "index", "voxel_size", "origin", "shape")
EXPECTED_COLUMNS = (
    "this project's (helpers/create_slice_dataset.py): image, label_<class> and valid_<class> "
    f"per class, {', '.join(META_COLUMNS)}; or the original torchtitan-segmentation's "
    "(helpers/create_slice_dataset_cellmap.py, e.g. eminorhan/cellmap-2d): "
    f"{', '.join(slices_original.COLUMNS)}"
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
    datasets = optional_import("datasets", "slices", "A slice dataset (data.dataset_name)")
    columns = set(ds.column_names)
    if "image" not in columns or not isinstance(ds.features["image"], datasets.Image):
        return None
    if set(META_COLUMNS) <= columns:
        return OURS
    if set(slices_original.COLUMNS) <= columns and isinstance(ds.features["label"], datasets.Image):
        return ORIGINAL
    return IMAGES


def _load(name: str):
    """The ``datasets.Dataset`` named by ``data.dataset_name``: a ``save_to_disk`` folder, or
    else a Hugging Face Hub dataset (its ``train`` split)."""
    datasets = optional_import("datasets", "slices", "A slice dataset (data.dataset_name)")
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
    if set(slices_original.VOLUME_COLUMNS) <= set(found):
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
# Decoding a row
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


def gray_image(image) -> np.ndarray:
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
    crop is taken to annotate ``classes``: validity decides, see
    ``slices_original.CellMapIdLabels``).
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
        datasets = optional_import("datasets", "slices", "A slice dataset (data.dataset_name)")
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
