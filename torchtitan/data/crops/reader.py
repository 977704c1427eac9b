"""The one reader of a crop: EM and labels of a box of the training grid, in world coordinates.

Everything that reads a label crop or its EM goes through here: training samples
(``sampling/``), validation's whole crops (``volume_source.py``), the predictor, the export and
the slice-dataset helper. On the training grid of ``data.voxel_size`` (origin = the world
position of the corner of voxel 0, nm; ``torchtitan.cellmap.grids``):

* **regions**: an index box of one scale level, padded outside the array; a chunk that cannot
  be decoded raises :class:`ChunkReadError` (in :data:`READ_ERRORS`: a sample builder draws
  another sample instead of stopping the run);
* **EM**: the level closest to the grid (:func:`em_level`), read by separable linear
  interpolation (a plain slice where the grids coincide), mapped onto the uint8 scale
  (uint8 as stored; other dtypes through an intensity range: ``data.em_range``, else the
  range stored with the EM group (OME-NGFF ``omero.channels[0].window``: ``start``/``end``,
  else ``min``/``max``), else an integer dtype's own range; float EM without either is a
  DatasetError; values outside are clipped, with one warning per dataset; NaN is a
  DatasetError), and then the model's input (:func:`em_to_model_input`);
* **labels**: each class group's level closest to the grid, read by nearest neighbour, unknown
  outside the crop (and outside its ``bounds``); the binary targets and validity of the
  requested classes composed from those stored values:

  1. the crop annotates the class itself (a group of that name): read it;
  2. otherwise, if annotated groups together cover every atomic part of the class (its own
     parts, or composite groups made only of its parts, e.g. ``er`` from ``er_mem``,
     ``er_lum``, ``eres`` and ``ne``): the target is their union, valid where every one is
     valid (and wherever one of them is present: then the union is present whatever the
     others say);
  3. otherwise the class is invalid everywhere (it counts neither in the loss nor in metrics).

  What a stored value means (absent, present, unknown, instance id) is decided by
  :func:`torchtitan.cellmap.labels.label_to_target` alone: an instance group gives its binary
  mask; its ids are read by :func:`read_instance_ids` for instance evaluation. Affinity
  targets (``[affinities]``, :func:`compose_affinities`) come from the object ids of a class's
  own group, when the crop stores that group with ids; elsewhere they are invalid. Targets are
  composed from stored values, so a sample may move the values first (flips, turns,
  resampling by nearest neighbour) and compose after.

:class:`CropReader` puts these together for a list of datasets and classes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from torchtitan.cellmap.affinities import AffinitySpec, affinities
from torchtitan.cellmap.classes import atoms
from torchtitan.cellmap.errors import DatasetError
from torchtitan.cellmap.grids import (ScaleLevel, centred_grid, closest_level, label_level,
                                      voxel_centres, voxel_positions)
from torchtitan.cellmap.labels import label_to_ids, label_to_target
from torchtitan.cellmap.ome_ngff import stored_intensity_range
from torchtitan.choices import EM_SCALE
from torchtitan.data.crops.layout import EMSource, LabelCrop
from torchtitan.data.io.stores import StoreContext, is_url, parent_of

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Regions of a scale level
# ---------------------------------------------------------------------------------------------


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


# Read failures that replace a sample instead of stopping the run.
READ_ERRORS: tuple[type[BaseException], ...] = (ChunkReadError,)


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


def em_to_model_input(em, source: EMSource | None = None, array_path: str = "",
                      inside: np.ndarray | None = None):
    """EM as the model takes it: float32, ``em / EM_SCALE - 1`` on the uint8 scale.

    ``em`` as read from ``source``'s array at ``array_path`` (numpy, any dtype; mapped onto
    the uint8 scale first, :func:`em_to_uint8_scale`, checked where ``inside``), or, without
    ``source``, EM already on the uint8 scale: numpy, or a torch tensor on any device (how a
    batch's raw uint8 EM is made model input on the device, bit for bit as on the host)."""
    if isinstance(em, torch.Tensor):
        return em.float().div_(EM_SCALE).sub_(1.0) if em.dtype != torch.float32 \
            else em.div(EM_SCALE).sub_(1.0)
    if source is not None:
        em = em_to_uint8_scale(em, source, array_path, inside)
    out = np.divide(em, np.float32(EM_SCALE), dtype=np.float32)
    out -= np.float32(1.0)
    return out


def model_input_of(value: float) -> float:
    """The model's input (a Python float) for EM of ``value`` on the uint8 scale, e.g. a
    threshold to compare model inputs with."""
    return value / EM_SCALE - 1.0


def model_input_to_uint8(image: np.ndarray) -> np.ndarray:
    """The uint8-scale values (float, unrounded) of model input ``image``: the inverse of
    :func:`em_to_model_input`."""
    return (image + 1.0) * EM_SCALE


def em_input_affine(em_range: tuple[float, float] | None) -> tuple[float, float]:
    """(gain, offset) of :func:`em_to_model_input` after :func:`em_to_uint8_scale` as one
    linear map of the stored EM, ``input = stored * gain + offset`` (EM clipped to
    ``em_range`` first, when there is one): how a bioimage.io package writes it."""
    if em_range is None:
        return 1 / EM_SCALE, -1.0
    lo, hi = em_range
    scale = 255.0 / EM_SCALE  # the uint8 scale's top as model input, less its bottom
    return scale / (hi - lo), -1.0 - scale * lo / (hi - lo)


def em_level(source: EMSource, voxel_size) -> ScaleLevel:
    """The scale level of ``source`` that EM on the grid of ``voxel_size`` is read from."""
    return source.levels[closest_level(source.levels, np.asarray(voxel_size, dtype=float))]


def read_em(source: EMSource, voxel_size, origin, shape,
            raw: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """EM of a box of the training grid and where it lies inside the volume: the model's
    input (float32), or with ``raw`` the uint8 values (only exact when the grids coincide,
    see ``sampling.samples.SampleDataset``)."""
    level = em_level(source, voxel_size)
    img, inside = read_linear(source.stores, level, origin, np.asarray(voxel_size, dtype=float),
                              shape)
    if raw:
        img = em_to_uint8_scale(img, source, level.path, inside)
        if img.dtype != np.uint8:
            img = np.clip(np.rint(img), 0, 255).astype(np.uint8)
        return img, inside
    return em_to_model_input(img, source, level.path, inside), inside


# ---------------------------------------------------------------------------------------------
# Labels: stored values, targets and validity of the classes, affinities, instance ids
# ---------------------------------------------------------------------------------------------


def unknown_value(crop: LabelCrop, group: str) -> int:
    """The value that marks unknown voxels in ``group`` (also what reads outside the crop)."""
    return crop.encoding_of(group).unknown


def read_raw(crop: LabelCrop, group: str, origin, voxel_size, shape) -> np.ndarray:
    """Stored values of one class group on the grid, read through the crop's store context;
    outside the crop (and outside its ``bounds``, when its labels are limited) they read as
    unknown."""
    level = label_level(crop.classes[group], voxel_size)
    unknown = unknown_value(crop, group)
    values = read_nearest(crop.stores, level, origin, voxel_size, shape, fill=unknown)
    if crop.bounds is None:
        return values
    return np.where(_inside(crop.bounds, origin, voxel_size, shape), values, unknown).astype(
        values.dtype, copy=False)


def _inside(bounds, origin, voxel_size, shape) -> np.ndarray:
    """Boolean (z, y, x) mask of the grid voxels whose centres lie within ``bounds``."""
    masks = []
    for ax in range(3):
        centres = voxel_centres(origin[ax], voxel_size[ax], np.arange(shape[ax]))
        masks.append((centres >= bounds[0][ax]) & (centres < bounds[1][ax]))
    return masks[0][:, None, None] & masks[1][None, :, None] & masks[2][None, None, :]


def target_groups(crop: LabelCrop, cls: str) -> tuple[str, ...] | None:
    """The crop's groups whose union is ``cls``, or None when the crop does not annotate it."""
    if cls in crop.classes:
        return (cls,)
    wanted = atoms(cls)
    # Annotated groups made only of parts of cls, largest first (fewest reads).
    candidates = sorted(
        (g for g in crop.classes if atoms(g) <= wanted), key=lambda g: (-len(atoms(g)), g)
    )
    chosen, covered = [], frozenset()
    for g in candidates:
        if not atoms(g) <= covered:
            chosen.append(g)
            covered |= atoms(g)
    return tuple(chosen) if covered == wanted else None


def annotates(crop: LabelCrop, cls: str) -> bool:
    """Whether the crop annotates ``cls``, itself or through all of its parts."""
    return target_groups(crop, cls) is not None


def groups_to_read(crop: LabelCrop, classes) -> list[str]:
    """Every group of ``crop`` the targets of ``classes`` need, each once, in first-use order."""
    seen: dict[str, None] = {}
    for cls in classes:
        for g in target_groups(crop, cls) or ():
            seen.setdefault(g, None)
    return list(seen)


def compose_targets(crop: LabelCrop, classes, raw: dict[str, np.ndarray],
                    shape) -> tuple[np.ndarray, np.ndarray]:
    """uint8 0/1 (target, valid) of shape (K, *shape) for ``classes``, from the stored values
    ``raw[group]`` of the groups :func:`groups_to_read` names (see the module docstring).

    Targets are a voxel-wise function of the stored values, so they can be composed after any
    nearest-neighbour resampling, flip or transpose of ``raw`` (which may be strided views):
    each output is written once, contiguously.
    """
    target = np.empty((len(classes), *shape), dtype=np.uint8)
    valid = np.empty_like(target)
    contiguous: dict[str, np.ndarray] = {}
    for k, cls in enumerate(classes):
        t, v = target[k].view(bool), valid[k].view(bool)
        groups = target_groups(crop, cls)
        if groups is None:
            t[...] = False
            v[...] = False
            continue
        for i, g in enumerate(groups):
            # One copy first: numpy runs a ufunc in the output's order, and for a view whose
            # last axis is not contiguous (a 90 degree rotation through z) every comparison
            # would hop across the whole source.
            if g not in contiguous:
                contiguous[g] = np.ascontiguousarray(raw[g])
            if i == 0:
                label_to_target(contiguous[g], crop.encoding_of(g), out=(t, v))
                continue
            tg, vg = label_to_target(contiguous[g], crop.encoding_of(g))
            t |= tg
            v &= vg
        if len(groups) > 1:  # present in one part: the union is present whatever the others say
            v |= t
    return target, valid


def has_ids(crop: LabelCrop, cls: str) -> bool:
    """Whether the crop stores ``cls`` as a group of its own with object ids (what affinity
    targets are made of)."""
    return cls in crop.id_groups and cls in crop.classes


def compose_affinities(crop: LabelCrop, spec: AffinitySpec, raw: dict[str, np.ndarray],
                       shape) -> tuple[np.ndarray, np.ndarray]:
    """uint8 0/1 (target, valid) of shape (len(spec), *shape): the affinities of each class of
    ``spec`` along its offsets (:func:`torchtitan.cellmap.affinities.affinities`), from the
    stored ids ``raw[cls]``; invalid for a class the crop does not store with ids."""
    n = len(spec.offsets)
    target = np.zeros((len(spec), *shape), dtype=np.uint8)
    valid = np.zeros_like(target)
    for k, cls in enumerate(spec.classes):
        if not has_ids(crop, cls):
            continue
        values = np.ascontiguousarray(raw[cls])
        _, known = label_to_target(values, crop.encoding_of(cls))
        affinities(label_to_ids(values, crop.encoding_of(cls)), known, spec.offsets,
                   out=(target[k * n:(k + 1) * n], valid[k * n:(k + 1) * n]))
    return target, valid


def read_target(crop: LabelCrop, cls: str, origin, voxel_size,
                shape) -> tuple[np.ndarray, np.ndarray]:
    """Boolean (target, valid) of one class on the grid (see the module docstring)."""
    raw = {g: read_raw(crop, g, origin, voxel_size, shape) for g in groups_to_read(crop, [cls])}
    target, valid = compose_targets(crop, [cls], raw, tuple(shape))
    return target[0].view(bool), valid[0].view(bool)


def read_instance_ids(crop: LabelCrop, cls: str, origin, voxel_size, shape) -> np.ndarray | None:
    """The stored ids of ``cls`` on the grid (0 where absent, unknown or outside the crop),
    for instance evaluation; None when the crop has no group of that name. A semantic group
    gives 0/1, which ``evaluation.label_instances`` splits into connected components."""
    if cls not in crop.classes:
        return None
    return label_to_ids(read_raw(crop, cls, origin, voxel_size, shape), crop.encoding_of(cls))


# ---------------------------------------------------------------------------------------------
# The grid of a crop, and the reader
# ---------------------------------------------------------------------------------------------


def grid_shape(crop_size) -> tuple[int, int, int]:
    """The 3D (z, y, x) read shape of a model crop: 2D crops are one plane thick."""
    crop_size = tuple(int(c) for c in crop_size)
    return (1, *crop_size) if len(crop_size) == 2 else crop_size  # type: ignore[return-value]


def crop_grid(crop: LabelCrop, voxel_size) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Origin (nm) and shape of the training grid that covers a whole label crop."""
    return centred_grid(crop.box_min, crop.box_max, voxel_size, cover=False)


@dataclass
class CropArrays:
    """What a reader gives for one box: ``image`` (1, *shape) (the model's input, or raw uint8
    EM), ``target`` and ``valid`` (K, *shape) (uint8 0/1, one channel per class, then the
    affinities)."""

    image: np.ndarray
    target: np.ndarray
    valid: np.ndarray


class CropReader:
    """EM, targets and validity of boxes of the training grid in label crops of ``sources``:
    what a segmentation sample reads, and what validation reads of a whole held-out crop."""

    def __init__(self, sources: list[EMSource], classes: list[str], voxel_size,
                 affinities: AffinitySpec | None = None):
        self.by_name = {s.name: s for s in sources}
        self.classes = list(classes)
        self.voxel_size = np.asarray(voxel_size, dtype=float)
        # Affinity targets after the classes' (training only; validation scores instances).
        self.affinities = affinities if affinities is not None and len(affinities) else None

    def groups(self, crop: LabelCrop) -> list[str]:
        """The label groups of ``crop`` that the classes (and affinities) need."""
        return groups_to_read(crop, self.classes)

    def read(self, crop: LabelCrop, origin, shape, raw_em: bool = False) -> CropArrays:
        """One box of the training grid (3D arrays), EM and targets."""
        image, labels = self.read_stored(crop, self.groups(crop), origin, shape, raw_em)
        return CropArrays(image, *self.compose(crop, labels, image.shape[1:]))

    def read_stored(self, crop: LabelCrop, groups: list[str], origin, shape,
                    raw_em: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """EM (1, *shape) and the stored values of each label group in ``groups`` ((1, *shape)
        each; outside the crop they read as the group's unknown value)."""
        image, _ = read_em(self.by_name[crop.dataset], self.voxel_size, origin, shape, raw=raw_em)
        labels = {g: read_raw(crop, g, origin, self.voxel_size, shape)[None] for g in groups}
        return image[None], labels

    def compose(self, crop: LabelCrop, labels: dict[str, np.ndarray],
                shape) -> tuple[np.ndarray, np.ndarray]:
        """(target, valid) of the classes (and affinities) on spatial ``shape``, from stored
        values ``labels`` ((1, *shape) per group, in the sample's frame: moved already)."""
        raw = {g: a[0] for g, a in labels.items()}
        target, valid = compose_targets(crop, self.classes, raw, shape)
        if self.affinities is not None:
            at, av = compose_affinities(crop, self.affinities, raw, shape)
            target, valid = np.concatenate([target, at]), np.concatenate([valid, av])
        return target, valid
