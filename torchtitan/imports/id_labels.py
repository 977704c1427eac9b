"""Label volumes of object ids (the neuron or body ids of connectomics ground truth) as classes.

Where value-map labels say which class each voxel belongs to (``stack_labels``), an id volume
says which object: 0 is no object, every other value one object (neuron, body, cell). With
``--ids CLASS`` the import stores those objects as the instance class ``CLASS`` (e.g. ``cell``)
and, with ``--boundary CLASS``, derives a semantic class from where they meet (e.g. ``pm``, the
target of boundary models). Per crop (a range of sections):

* **the id class** keeps the objects: ids renumbered to 1..n in order of their values (0 stays
  0, absent), stored as uint16 (n < 65535) or uint32 with the unknown value at the top of the
  dtype, as the import stores the instance classes of value maps;
* **the boundary class**, 0/1: a voxel is a boundary voxel at width 1 when one of its 6 face
  neighbours inside the crop holds another id (0 counts as an id: an object next to no object
  is a boundary); pairs with an unknown voxel do not count, since what lies across is not known.
  At width N > 1 it is every voxel within N - 1 face-neighbour steps (city-block distance
  N - 1, inside the crop) of a width-1 boundary voxel: ``N = 2`` adds the 6 neighbours;
* ``unknown`` ids (``--unknown``) are not annotated in every class: the unknown value there.

Everything that can be refused (class names, the label dtype, negative ids, a crop without any
object) is checked before the import writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchtitan.cellmap.classes import CLASS_IDS, INSTANCE_CLASSES, class_name_hint, is_instance_class
from torchtitan.cellmap.labels import ABSENT, PRESENT, LabelEncoding
from torchtitan.imports.stack_labels import ImageStackError, Values
from torchtitan.imports.volume_files import slabs


@dataclass(frozen=True)
class IdLabels:
    """How an id volume becomes classes: the instance class of its objects, an optional
    boundary class and its width, and the ids that are not annotated."""

    cls: str  # --ids: the instance class the objects are, e.g. "cell"
    boundary: str | None = None  # --boundary: the class of the voxels where objects meet
    width: int = 1  # --boundary_width
    unknown: Values = Values()  # --unknown: ids that are not annotated


def check_id_options(spec: IdLabels) -> None:
    """Class names of the CellMap table (``--ids`` an instance class, ``--boundary`` a semantic
    one) and a width of at least 1."""
    if spec.cls not in CLASS_IDS:
        raise ImageStackError(
            f"--ids {spec.cls}: not a CellMap class{class_name_hint(spec.cls)} Name the instance "
            f"class the objects are, one of {', '.join(INSTANCE_CLASSES)} (neurons, bodies: cell)")
    if not is_instance_class(spec.cls):
        raise ImageStackError(
            f"--ids {spec.cls}: a semantic class; object ids make an instance class, one of "
            f"{', '.join(INSTANCE_CLASSES)} (neurons, bodies: cell). A semantic class derived "
            "from the ids' boundaries is --boundary CLASS")
    if spec.boundary is not None:
        if spec.boundary not in CLASS_IDS:
            raise ImageStackError(
                f"--boundary {spec.boundary}: not a CellMap class{class_name_hint(spec.boundary)} "
                "Name the class of the voxels where objects meet, e.g. pm (plasma membrane)")
        if is_instance_class(spec.boundary):
            raise ImageStackError(
                f"--boundary {spec.boundary}: an instance class; the boundary is stored as a 0/1 "
                "mask, so name a semantic class, e.g. pm (plasma membrane)")
    if spec.width < 1:
        raise ImageStackError(f"--boundary_width {spec.width}: give 1 (the voxels next to "
                              "another id) or N > 1 (also the voxels within N - 1 face-neighbour "
                              "steps of those)")


def unknown_mask(ids: np.ndarray, unknown: Values) -> np.ndarray:
    """Where ``ids`` holds one of the ``unknown`` ids (ranges compared directly: ids may be
    64-bit, far too wide for a lookup table)."""
    mask = np.zeros(ids.shape, bool)
    for a, b in unknown.ranges:
        mask |= (ids >= a) & (ids <= b) if a != b else ids == a
    return mask


def _check_dtype(volume) -> None:
    kind = np.dtype(volume.dtype).kind
    if kind in "ui":
        return
    if kind == "f":
        why = ("floating-point values; object ids must be integers: store them as an unsigned "
               "integer type (e.g. numpy's astype(np.uint64)) after checking they are whole")
    elif kind == "b":
        why = ("a yes/no mask, not object ids; give a volume of ids (0 = no object, one value "
               "per object), or turn the mask into labels of a value map (--class NAME=1)")
    else:
        why = "not integers; object ids must be an unsigned integer volume"
    raise ImageStackError(f"--labels {volume.name} is {np.dtype(volume.dtype).name}: {why}")


def check_id_volume(volume, crops: list[tuple[str, int, int]], spec: IdLabels) -> None:
    """The ids of every crop: an integer dtype, no negative value, at least one object."""
    _check_dtype(volume)
    signed = np.dtype(volume.dtype).kind == "i"
    for name, a, b in crops:
        objects = 0
        for z, slab in slabs(volume, a, b + 1):
            if signed and slab.size and slab.min() < 0:
                at = np.argwhere(slab < 0)[0]
                raise ImageStackError(
                    f"--labels {volume.name}: value {slab[tuple(at)]} at section {z + at[0]} "
                    f"(y {at[1]}, x {at[2]}); object ids must be >= 0 (0 = no object): renumber "
                    "the negative values or store them as ids to --unknown")
            objects += int(np.count_nonzero((slab != 0) & ~unknown_mask(slab, spec.unknown)))
        if objects == 0:
            what = "0 (no object)" + (f" or an --unknown id ({spec.unknown})" if spec.unknown else "")
            raise ImageStackError(
                f"--labels {volume.name}: {name} (sections {a}-{b}) holds no object: every voxel "
                f"is {what}; move the crop (--crop {name}=FIRST-LAST) to sections that hold "
                "objects, or check that this dataset is the id volume")


def _distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values of a 1D array. Ids come in runs (an object covers many
    neighbouring voxels), so the first value of each run is enough, and far fewer to sort."""
    if values.size == 0:
        return values
    starts = np.empty(values.size, bool)
    starts[0] = True
    np.not_equal(values[1:], values[:-1], out=starts[1:])
    return np.unique(values[starts])


def renumber(ids: np.ndarray, unknown: np.ndarray) -> tuple[np.ndarray, LabelEncoding, int]:
    """``ids`` as consecutive object ids 1..n in the order of their values (0 stays 0), the
    ``unknown`` voxels at the top of the smallest dtype that holds them (uint16 or uint32)."""
    objects = (ids != 0) & ~unknown
    found = ids[objects]
    values = _distinct(found)
    n = int(values.size)
    if n >= np.iinfo(np.uint32).max:
        raise ImageStackError(f"{n} objects in one crop: more than uint32 ids can hold; "
                              "cut the volume into smaller crops (--crop)")
    dtype = np.uint16 if n < np.iinfo(np.uint16).max else np.uint32
    enc = LabelEncoding(ABSENT, PRESENT, int(np.iinfo(dtype).max))
    out = np.zeros(ids.shape, dtype)
    out[objects] = (np.searchsorted(values, found) + 1).astype(dtype)
    out[unknown] = enc.unknown
    return out, enc, n


def boundary_mask(ids: np.ndarray, known: np.ndarray, width: int = 1) -> np.ndarray:
    """The boundary voxels of a (z, y, x) id volume (see the module docstring): a face
    neighbour inside the volume with another id, both voxels ``known``; then widened by
    ``width - 1`` face-neighbour steps."""
    edge = np.zeros(ids.shape, bool)
    for axis in range(ids.ndim):
        lo = tuple(slice(None, -1) if d == axis else slice(None) for d in range(ids.ndim))
        hi = tuple(slice(1, None) if d == axis else slice(None) for d in range(ids.ndim))
        differ = (ids[lo] != ids[hi]) & known[lo] & known[hi]
        edge[lo] |= differ
        edge[hi] |= differ
    if width > 1:
        from scipy import ndimage

        faces = ndimage.generate_binary_structure(ids.ndim, 1)
        edge = ndimage.binary_dilation(edge, structure=faces, iterations=width - 1)
    return edge


def id_classes(ids: np.ndarray, spec: IdLabels):
    """``(class, values, encoding, object count or None)`` of each class a crop's ids make:
    the id class, then the boundary class if one is asked for."""
    unknown = unknown_mask(ids, spec.unknown)
    yield (spec.cls, *renumber(ids, unknown))
    if spec.boundary is not None:
        enc = LabelEncoding()
        out = boundary_mask(ids, ~unknown, spec.width).astype(np.uint8)
        out[unknown] = enc.unknown
        yield spec.boundary, out, enc, None
