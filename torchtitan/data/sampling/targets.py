"""Binary targets and validity masks of the requested classes, on a training grid.

For each requested class of a crop:

1. the crop annotates the class itself (a group of that name): read it;
2. otherwise, if annotated groups together cover every atomic part of the class (its own
   parts, or composite groups made only of its parts, e.g. ``er`` from ``er_mem``, ``er_lum``,
   ``eres`` and ``ne``): the target is their union, valid where every one is valid (and
   wherever one of them is present: then the union is present whatever the others say);
3. otherwise the class is invalid everywhere (it counts neither in the loss nor in metrics).

What a stored value means (absent, present, unknown, instance id) is decided by
:func:`torchtitan.cellmap.labels.label_to_target` alone: an instance group gives its binary
mask. The ids themselves are read by :func:`read_instance_ids` for instance evaluation.

Affinity targets (``[affinities]``, :func:`compose_affinities`) come from the object ids of a
class's own group, when the crop stores that group with ids; elsewhere they are invalid. They
depend on neighbouring voxels, so they are composed from label values already in the sample's
frame (after every flip, turn and resampling).
"""

from __future__ import annotations

import numpy as np

from torchtitan.cellmap.affinities import AffinitySpec, affinities
from torchtitan.cellmap.classes import atoms
from torchtitan.cellmap.grids import label_level, voxel_centres
from torchtitan.cellmap.labels import label_to_ids, label_to_target
from torchtitan.data.sources.cellmap import LabelCrop, read_nearest


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
