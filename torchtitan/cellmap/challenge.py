"""The CellMap segmentation challenge's own layouts: its test-crop manifest and its submission.

Facts kept here, once (readers and writers import them):

* ``csc fetch-data`` writes the layout the loader reads (``data/crops/layout.py``):
  ``<dest>/<ds>/<ds>.zarr/recon-1/em/fibsem-uint8`` (OME-NGFF 0.4 levels ``s0 ..``; only
  the chunks around the requested crops, and only levels not finer than the crops' labels,
  hold data) and ``recon-1/labels/groundtruth/crop<N>/<class>/s0 ..`` (one group per class,
  plus ``all``, the crop's label ids; the ``cellmap`` annotation attributes sit on each level
  array).
* The test-crop manifest (the challenge's ``test_crop_manifest.csv``): one row per crop and
  class, ``crop_name,dataset,class_label,voxel_size,translation,shape``, vectors written
  ``[z;y;x]``; ``translation`` is the world position (nm) of the *centre* of voxel 0, as in
  OME-NGFF.
* A submission is one zarr format 2 group (zipped for upload): ``<root>/crop<N>/<class>``,
  each either an array with the attributes ``voxel_size`` and ``translation`` (nm, z/y/x;
  ``shape`` too when written by the challenge's packer) or an OME-NGFF multiscale group
  (level ``s0`` is used). Semantic classes are 0/1 masks (``uint8`` or ``bool``); instance
  classes hold object ids in an integer dtype (the evaluation splits them into connected
  components itself). The geometry should be the test crop's: its voxel size, its
  translation and its shape.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from torchtitan.cellmap.classes import INSTANCE_CLASSES
from torchtitan.cellmap.errors import DatasetError
from torchtitan.cellmap.grids import Grid

# The challenge's test-crop manifest columns (``csc`` writes and reads them in this order).
TEST_MANIFEST_COLUMNS = ("crop_name", "dataset", "class_label", "voxel_size", "translation", "shape")
# The crop group of a fetched crop that holds every class's label ids at once (not a class).
ALL_LABELS_GROUP = "all"
# Attributes a single-scale submission array must carry (nm, z/y/x).
SUBMISSION_ATTRS = ("voxel_size", "translation")
SEMANTIC_DTYPES = ("uint8", "bool")


@dataclass
class ChallengeCrop:
    """One crop to submit: its dataset and, per class to submit, the grid it is scored on."""

    name: str  # crop<N>
    dataset: str
    classes: dict[str, Grid] = field(default_factory=dict)

    @property
    def box_min(self) -> np.ndarray:
        return np.min([g.box_min for g in self.classes.values()], axis=0)

    @property
    def box_max(self) -> np.ndarray:
        return np.max([g.box_max for g in self.classes.values()], axis=0)


def crop_name(text) -> str:
    """``"3"``, ``3`` or ``"crop3"`` -> ``"crop3"``; a DatasetError for anything else."""
    t = str(text).strip()
    number = t.removeprefix("crop")
    if not number.isdigit():
        raise DatasetError(f"{text!r} is not a crop name (crop<N> or <N>)")
    return f"crop{int(number)}"


def _vector(text: str, what: str, where: str) -> tuple[float, float, float]:
    parts = [p for p in text.strip().strip("[]").replace(",", ";").split(";") if p.strip()]
    if len(parts) != 3:
        raise DatasetError(f"{where}: {what} {text!r} is not [z;y;x]")
    return tuple(float(p) for p in parts)  # type: ignore[return-value]


def is_test_manifest(fieldnames) -> bool:
    """Whether CSV columns are the challenge's test-crop manifest columns."""
    return set(TEST_MANIFEST_COLUMNS) <= set(fieldnames or ())


def read_test_manifest(path: str | Path) -> dict[str, ChallengeCrop]:
    """The crops of a challenge test-crop manifest (format: module docstring), by name."""
    path = Path(path)
    crops: dict[str, ChallengeCrop] = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not is_test_manifest(reader.fieldnames):
            raise DatasetError(f"{path}: not a test-crop manifest; expected the columns "
                               + ",".join(TEST_MANIFEST_COLUMNS))
        for line, row in enumerate(reader, start=2):
            where = f"{path}, line {line}"
            try:
                name = crop_name(row["crop_name"])
                scale = _vector(row["voxel_size"], "voxel_size", where)
                translation = _vector(row["translation"], "translation", where)
                shape = tuple(int(round(s)) for s in _vector(row["shape"], "shape", where))
            except ValueError as e:
                raise DatasetError(f"{where}: {e}") from None
            if min(scale) <= 0 or min(shape) < 1:
                raise DatasetError(f"{where}: voxel_size must be > 0 and shape >= 1")
            crop = crops.setdefault(name, ChallengeCrop(name, row["dataset"].strip()))
            if crop.dataset != row["dataset"].strip():
                raise DatasetError(f"{where}: {name} is listed in two datasets "
                                   f"({crop.dataset}, {row['dataset'].strip()})")
            crop.classes[row["class_label"].strip()] = Grid(shape, scale, translation)  # type: ignore[arg-type]
    if not crops:
        raise DatasetError(f"{path} lists no crop")
    return crops


def submission_dtype_problem(class_name: str, dtype) -> str | None:
    """Why ``dtype`` is not accepted for ``class_name`` in a submission, or None."""
    dtype = np.dtype(dtype)
    if class_name in INSTANCE_CLASSES:
        if dtype.kind in "iub":
            return None
        return (f"dtype {dtype} for the instance class {class_name!r}: write object ids as "
                "integers (e.g. uint32), not probabilities")
    if dtype.name in SEMANTIC_DTYPES:
        return None
    return (f"dtype {dtype} for the semantic class {class_name!r}: write a 0/1 mask as "
            "uint8 (threshold probabilities first)")
