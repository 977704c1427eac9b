"""The original torchtitan-segmentation's slices datasets (its
``helpers/create_slice_dataset_cellmap.py``, which made e.g. ``eminorhan/cellmap-2d``): how
their columns and CellMap class ids map onto this project's targets and validity.

One row per plane (z, y and x) of each CellMap crop at the label array's own resolution:
``image`` (EM, 8-bit greyscale PNG; the later versions stretch each slice to its 1-99 %
percentiles and drop uniform slices), ``label`` (8-bit PNG of the crop's ``all`` array: one
CellMap class id per voxel, 0 = background), ``crop_name`` (``"<dataset>/<recon>/<crop>"``),
``axis`` (``"z"``, ``"y"``, ``"x"``) and ``slice`` (int32, the plane's index along ``axis``).
No voxel size, crop grid or validity.

What counts as annotated (:class:`CellMapIdLabels`): a voxel holding a class id is annotated
for every class (ids are the finest annotated class, and atomic classes do not overlap),
except that a composite id only partly inside a class (e.g. ``mito`` for ``mito_mem``) is
unknown for it, as are ids outside the CellMap table. Background (0) says "none of the classes
annotated here", and the schema does not say which those are, so background is a negative for
class ``c`` only in slices that hold ``c`` whole: its own id, or ids of its parts covering
every atomic part of ``c``. Elsewhere it is invalid for ``c``.

Missing geometry: slices are taken to be at ``data.voxel_size`` (nominal), training rows are
independent 2D samples (``slice_index.SliceIndex``), and each held-out crop (``data.val_crops``
/ ``data.val_fraction`` over ``crop_name``) is validated as the stack of its planes along one
axis (z when it has any; :func:`stack_held_out`); planes the helper dropped are simply absent
from the stack.
"""

from __future__ import annotations

import logging
import numpy as np

from torchtitan.cellmap.classes import CLASS_IDS, atoms
from torchtitan.cellmap.errors import DatasetError

logger = logging.getLogger(__name__)

COLUMNS = ("image", "label", "crop_name", "axis", "slice")
# Its whole-3D-crop datasets (helpers/create_volume_dataset_cellmap.py), refused by name.
VOLUME_COLUMNS = ("volume", "label", "crop_name", "shape")


def check_classes(name: str, classes) -> None:
    """The labels are CellMap class ids: ``data.classes`` must name CellMap classes."""
    unknown = [c for c in classes if c not in CLASS_IDS]
    if unknown:
        raise DatasetError(
            f"data.classes {unknown} are not CellMap classes, and the labels of "
            f"{name!r} (the original schema) are CellMap class ids; see "
            "torchtitan/cellmap/classes.py for the names"
        )


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



def stack_held_out(index, name: str, val: list, voxel_size) -> list:
    """The held-out crops of an original-schema dataset, each made the stack of its planes
    (logged: the schema has no geometry, so this is the fallback). ``index`` is the dataset's
    ``index.SliceIndex``, ``val`` and the result are lists of its ``SliceCrop``; this module
    does not import ``index``, which imports it."""
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
        ", ".join(COLUMNS), list(voxel_size))
    if gaps:
        logger.warning("slices dataset %s: planes missing from the validation stacks of %s "
                       "(the original helper drops uniform slices); the planes present are "
                       "stacked", name, ", ".join(gaps))
    return stacked
