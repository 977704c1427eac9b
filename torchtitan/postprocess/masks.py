"""Post-processing of predicted masks: tiny objects, holes, and instance separation.

Everything here works on the masks of one class (numpy, boolean, one volume) and knows the
voxel size, so that every size is in world units (nm) and a setting holds across scales.

Steps, in the order they are applied (each optional; :class:`PostProcessing` holds the
settings, the ``[inference]`` section of the config sets them):

1. **Small objects** (``min_object_nm3``): connected components (full connectivity, 26 in
   3D, as the instance metrics count objects) whose volume, ``voxels * prod(voxel_size)``, is
   below ``min_object_nm3`` are removed. Every class.
2. **Holes** (``fill_holes``): background regions that do not reach the border of the volume
   are filled: ``"volume"`` fills cavities enclosed in 3D; ``"planes"`` fills holes of each yx
   plane on its own (what a 2D model predicts plane by plane, where a hole is rarely closed in
   z). Background counts as connected across faces only (the dual of the full connectivity
   of objects). The classes in ``fill_holes_classes``, or every class when that is empty.
3. **Instances** (instance classes, ``torchtitan.cellmap.classes.INSTANCE_CLASSES``):
   ``"components"`` are the connected components of the mask, exactly as
   :func:`torchtitan.scoring.metrics.label_instances` finds them; ``"watershed"`` separates
   touching objects at narrow necks (:func:`watershed_instances`). With
   ``boundary_instances``, a class whose membrane class is predicted too
   (``cellmap.classes.MEMBRANE_OF``: ``cell`` with ``pm``) is cut into objects by the
   predicted membrane instead (:func:`torchtitan.postprocess.neurons.boundary_instances`, after steps 1-2
   on both masks). A class whose affinities the model predicts (``[affinities]``) is cut from
   them by ``affinity_cut`` (:mod:`torchtitan.postprocess.affinities`), unless that is
   ``"boundary"``.

The watershed is a flooding of the distance-to-background map by levels, from the deepest
voxels outwards (immersion): at each level, the newly covered voxels join the basin they touch;
a region that touches no basin starts a new one (a local maximum of the distance: a seed). Two
basins that meet are kept apart only when the level at which they meet (the half-width of the
neck between them) is below ``watershed_neck_ratio`` times the depth (the largest half-width)
of the shallower one; otherwise they merge. Basins kept apart stop growing where they meet,
and at the end every voxel left goes to the nearest basin (Euclidean distance), which parts
two touching balls where they touch, whatever their sizes. A part that ends up smaller than ``min_object_nm3``
joins its nearest neighbour (a split never makes an object that step 1 would remove). So a
dumbbell splits at its waist, while the bumps of one irregular object, or the two halves of a
cylinder, stay one object, at any scale.
``scipy.ndimage.watershed_ift`` is not used: it weighs each step by the difference between
neighbouring values, which on a distance map is about the same everywhere, so the order in
which basins grow degenerates and one seed can take every object it touches.

:func:`measure` scores one crop raw and after each step (semantic IoU/Dice for every class,
instance F1 and score for instance classes, with :mod:`torchtitan.scoring.metrics`);
:func:`combine_steps` pools crops; :func:`format_table` prints the comparison.

Floor 3: imports the CellMap domain (instance classes), ``evaluation`` and ``errors``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.ndimage as ndi

from torchtitan.cellmap.classes import INSTANCE_CLASSES, MEMBRANE_OF
from torchtitan.choices import AFFINITY_CUTS
from torchtitan.errors import UserError
from torchtitan.scoring.metrics import label_instances
from torchtitan.postprocess.affinities import affinity_instances
from torchtitan.postprocess.neurons import boundary_instances

FILL_HOLES_MODES = ("none", "planes", "volume")
INSTANCE_METHODS = ("components", "watershed")

# The flood descends in at most this many levels (finer than one voxel is never needed).
_MAX_LEVELS = 32


class PostProcessingError(UserError, ValueError):
    """Invalid post-processing settings; the message names the option and its allowed values."""


@dataclass(frozen=True)
class PostProcessing:
    """Post-processing settings (see the module docstring); the defaults change nothing."""

    min_object_nm3: float = 0.0
    fill_holes: str = "none"
    fill_holes_classes: tuple[str, ...] = field(default_factory=tuple)
    instances: str = "components"
    watershed_neck_ratio: float = 0.5
    boundary_instances: bool = False
    boundary_seed_nm: float = 10.0
    affinity_cut: str = "mutex"
    mutex_threshold_nearest: float = 0.5
    mutex_threshold_long: float = 0.5
    mutex_long_stride: int = 1

    def __post_init__(self):
        if not np.isfinite(self.min_object_nm3) or self.min_object_nm3 < 0:
            raise PostProcessingError(
                f"inference.min_object_nm3 = {self.min_object_nm3}: must be >= 0 (nm^3; 0 keeps "
                "every object)")
        if self.fill_holes not in FILL_HOLES_MODES:
            raise PostProcessingError(
                f"inference.fill_holes = {self.fill_holes!r}: must be one of "
                f"{', '.join(map(repr, FILL_HOLES_MODES))}")
        if self.instances not in INSTANCE_METHODS:
            raise PostProcessingError(
                f"inference.instances = {self.instances!r}: must be one of "
                f"{', '.join(map(repr, INSTANCE_METHODS))}")
        if not 0 < self.watershed_neck_ratio <= 1:
            raise PostProcessingError(
                f"inference.watershed_neck_ratio = {self.watershed_neck_ratio}: must be in (0, 1]")
        if not np.isfinite(self.boundary_seed_nm) or self.boundary_seed_nm < 0:
            raise PostProcessingError(
                f"inference.boundary_seed_nm = {self.boundary_seed_nm}: must be >= 0 (nm)")
        if int(self.mutex_long_stride) != self.mutex_long_stride or self.mutex_long_stride < 1:
            raise PostProcessingError(
                f"inference.mutex_long_stride = {self.mutex_long_stride}: must be an integer >= 1")
        if self.affinity_cut not in AFFINITY_CUTS + ("boundary",):
            raise PostProcessingError(
                f"inference.affinity_cut = {self.affinity_cut!r}: must be one of "
                f"{', '.join(map(repr, AFFINITY_CUTS + ('boundary',)))}")
        object.__setattr__(self, "fill_holes_classes", tuple(self.fill_holes_classes))

    @classmethod
    def from_config(cls, inference) -> PostProcessing:
        """The settings of a config's ``[inference]`` section."""
        return cls(min_object_nm3=inference.min_object_nm3, fill_holes=inference.fill_holes,
                   fill_holes_classes=tuple(inference.fill_holes_classes),
                   instances=inference.instances,
                   watershed_neck_ratio=inference.watershed_neck_ratio,
                   boundary_instances=inference.boundary_instances,
                   boundary_seed_nm=inference.boundary_seed_nm,
                   affinity_cut=inference.affinity_cut,
                   mutex_threshold_nearest=inference.mutex_threshold_nearest,
                   mutex_threshold_long=inference.mutex_threshold_long,
                   mutex_long_stride=inference.mutex_long_stride)

    @property
    def enabled(self) -> bool:
        """Whether any step changes a prediction."""
        return (self.min_object_nm3 > 0 or self.fill_holes != "none"
                or self.instances != "components" or self.boundary_instances)

    def cuts_affinities(self, affinities: dict | None) -> bool:
        """Whether predicted ``affinities`` (``{class: (probabilities, offsets)}``) cut some
        class into objects."""
        return bool(affinities) and self.affinity_cut != "boundary"

    def cut(self, affinities, offsets, voxel_size, inside) -> tuple[np.ndarray, int]:
        """Instance ids of one class cut from its predicted ``affinities`` by ``affinity_cut``
        (:func:`torchtitan.postprocess.affinities.affinity_instances`)."""
        return affinity_instances(
            affinities, offsets, self.affinity_cut, voxel_size, inside=inside,
            min_object_nm3=self.min_object_nm3, threshold_nearest=self.mutex_threshold_nearest,
            threshold_long=self.mutex_threshold_long, long_stride=self.mutex_long_stride)

    def membrane(self, name: str, classes) -> str | None:
        """The class whose predicted boundaries cut ``name`` into objects, when
        ``boundary_instances`` is on and that class is among ``classes``; else None."""
        membrane = MEMBRANE_OF.get(name)
        return membrane if self.boundary_instances and membrane in classes else None

    def fills(self, name: str) -> bool:
        return self.fill_holes != "none" and (not self.fill_holes_classes
                                              or name in self.fill_holes_classes)


# ---------------------------------------------------------------------------------------------
# The steps, one class at a time
# ---------------------------------------------------------------------------------------------


def _full(ndim: int) -> np.ndarray:
    return np.ones((3,) * ndim, dtype=bool)


def min_object_voxels(min_object_nm3: float, voxel_size) -> int:
    """The fewest voxels an object of at least ``min_object_nm3`` holds at ``voxel_size``."""
    voxel = float(np.prod(np.asarray(voxel_size, dtype=float)))
    return int(np.ceil(min_object_nm3 / voxel - 1e-9)) if min_object_nm3 > 0 else 0


def remove_small_objects(mask, voxel_size, min_object_nm3: float) -> np.ndarray:
    """``mask`` without the connected components (full connectivity) of a volume below
    ``min_object_nm3`` (nm^3)."""
    mask = np.asarray(mask, dtype=bool)
    least = min_object_voxels(min_object_nm3, voxel_size)
    if least <= 1 or not mask.any():
        return mask
    labels, _ = ndi.label(mask, structure=_full(mask.ndim))
    sizes = np.bincount(labels.ravel())
    keep = sizes >= least
    keep[0] = False
    return keep[labels]


def fill_holes(mask, mode: str) -> np.ndarray:
    """``mask`` with its holes filled: ``"volume"`` (3D cavities), ``"planes"`` (the holes of
    each plane along the first axis, on its own) or ``"none"``."""
    mask = np.asarray(mask, dtype=bool)
    if mode == "none" or not mask.any():
        return mask
    if mode == "volume" or mask.ndim < 3:
        return ndi.binary_fill_holes(mask)
    if mode != "planes":
        raise PostProcessingError(f"fill_holes mode {mode!r}: must be one of {FILL_HOLES_MODES}")
    # Planes along the first axis, all at once: background is connected only within a plane,
    # and a foreground plane above and below keeps the first and last planes from counting as
    # border everywhere.
    padded = np.pad(mask, [(1, 1)] + [(0, 0)] * (mask.ndim - 1), constant_values=True)
    structure = np.zeros((3,) * mask.ndim, dtype=bool)
    structure[1] = ndi.generate_binary_structure(mask.ndim - 1, 1)
    return ndi.binary_fill_holes(padded, structure=structure)[1:-1]


def _split_nearest(labels: np.ndarray, region: np.ndarray, sampling, seeds: np.ndarray) -> None:
    """Give every voxel of ``region`` outside ``seeds`` the label of the nearest voxel of
    ``seeds & region`` (in place)."""
    seeds = seeds & region
    nearest = ndi.distance_transform_edt(~seeds, sampling=sampling, return_distances=False,
                                         return_indices=True)
    todo = region & ~seeds
    labels[todo] = labels[tuple(i[todo] for i in nearest)]


def flood_component(mask: np.ndarray, depth: np.ndarray, sampling: np.ndarray, neck_ratio: float,
           min_voxels: int) -> np.ndarray:
    """Basin labels (1..) of one connected ``mask`` by immersion of its ``depth`` map."""
    full = _full(mask.ndim)
    labels = np.zeros(mask.shape, np.int32)
    deepest = float(depth[mask].max())
    # No voxel is shallower than the smallest voxel side: the last level.
    shallowest = float(sampling.min())
    step = max(shallowest, deepest / _MAX_LEVELS)
    levels = [*np.arange(deepest, shallowest, -step).tolist(), shallowest]
    # Per basin (index = label; 0 unused): its depth, one of its voxels, whether it lives.
    top, seed, alive = [0.0], [np.zeros(mask.ndim, np.intp)], [False]
    for level in levels:
        covered = mask & (depth >= level - 1e-9)
        regions, n = ndi.label(covered, structure=full)
        # A basin is connected and covered, so it lies in one region: the one of its seed.
        live = np.flatnonzero(alive)
        region_of = regions[tuple(np.array(seed)[live].T)] if live.size else live
        touches = np.bincount(region_of, minlength=n + 1)
        lut = np.zeros(n + 1, np.int32)
        # A region that touches no basin starts one (a local maximum of the depth).
        new = np.flatnonzero(touches[1:] == 0) + 1
        if new.size:
            lut[new] = np.arange(len(top), len(top) + new.size, dtype=np.int32)
            # The deepest voxel of each new region (lowest flat index on ties) is its seed.
            where = np.flatnonzero(lut[regions] > 0)
            owner, values = regions.ravel()[where], depth.ravel()[where]
            order = np.lexsort((where, -values, owner))
            first = order[np.r_[True, owner[order][1:] != owner[order][:-1]]]
            top += values[first].tolist()
            seed += list(np.stack(np.unravel_index(where[first], mask.shape), axis=1))
            alive += [True] * new.size
        alone = touches[region_of] == 1
        lut[region_of[alone]] = live[alone]
        fresh = covered & (labels == 0)
        labels[fresh] = lut[regions[fresh]]
        # A region that touches several basins: the deepest stays; each other one stays apart
        # when this level is a narrow neck for it, else it joins the deepest. Basins that
        # stay apart grow no further: their voxels from here down are shared out at the end.
        several = np.flatnonzero(touches >= 2)
        if several.size:
            merge = np.arange(len(top), dtype=np.int32)
            for r in several:
                order = sorted(live[region_of == r].tolist(), key=lambda b: (-top[b], b))
                for b in order[1:]:
                    if not level < neck_ratio * top[b]:
                        merge[b] = order[0]
                        alive[b] = False
            if (merge != np.arange(len(top))).any():
                labels[covered] = merge[labels[covered]]
    # The voxels below where basins met go to the nearest basin: each basin as it was when
    # it met the others (so two touching balls part where they touch, whatever their sizes).
    _split_nearest(labels, mask, sampling, labels > 0)
    # Basins smaller than min_voxels go to their nearest neighbours (all to the deepest one,
    # when every basin is that small).
    sizes = np.bincount(labels[mask])
    small = sizes < min_voxels
    small[0] = False
    if small.any():
        large = (sizes > 0) & ~small
        large[0] = False
        if large.any():
            _split_nearest(labels, mask, sampling, large[labels])
        else:
            labels[mask] = 1
    return labels


def watershed_instances(mask, voxel_size, neck_ratio: float = 0.5,
                        min_object_nm3: float = 0.0) -> tuple[np.ndarray, int]:
    """Instance ids (int32, 1..n) of ``mask``, touching objects split at narrow necks.

    Immersion of the distance-to-background map (module docstring), one connected component
    at a time (on its bounding box): levels from its deepest voxel down, at most
    ``_MAX_LEVELS`` and never finer than the smallest voxel side. Two basins that meet at
    level ``L`` stay apart when ``L < neck_ratio * depth`` of the shallower one; a part
    smaller than ``min_object_nm3`` then joins its nearest neighbour (a split never makes an
    object that the small-object step would remove). Deterministic; a component without a
    narrow neck is one instance, exactly as with connected components.
    """
    mask = np.asarray(mask, dtype=bool)
    sampling = np.asarray(voxel_size, dtype=float)
    full = _full(mask.ndim)
    components, n = ndi.label(mask, structure=full)
    if n == 0:
        return components, 0
    depth = ndi.distance_transform_edt(mask, sampling=sampling)
    # Only a component with two or more maxima of its depth (regional: plateaus count once)
    # can hold a neck; every other one is one instance as it is.
    peaks, n_peaks = ndi.label(mask & (depth >= ndi.maximum_filter(depth, footprint=full)),
                               structure=full)
    peak_component = np.zeros(n_peaks + 1, np.intp)
    on_peak = peaks > 0
    peak_component[peaks[on_peak]] = components[on_peak]
    several = np.bincount(peak_component[1:], minlength=n + 1) >= 2
    ids = components.astype(np.int64)
    next_id = n + 1
    boxes = ndi.find_objects(components)
    for c in np.flatnonzero(several):
        box = boxes[c - 1]
        own = components[box] == c
        basins = flood_component(own, depth[box], sampling, neck_ratio,
                        min_object_voxels(min_object_nm3, sampling))
        part = ids[box]
        part[own & (basins > 1)] = basins[own & (basins > 1)] + (next_id - 2)
        next_id += int(basins.max()) - 1
    return label_instances(ids)


def separate_instances(mask, voxel_size, pp: PostProcessing,
                       membrane=None) -> tuple[np.ndarray, int]:
    """Instance ids (int32, 1..n) of one instance class's mask: cut by its predicted
    ``membrane`` mask (cleaned like the class's) when given (see ``pp.membrane``), else with
    ``pp.instances``."""
    if membrane is not None:
        return boundary_instances(membrane, voxel_size, pp.boundary_seed_nm, inside=mask,
                                  min_object_nm3=pp.min_object_nm3)
    if pp.instances == "watershed":
        return watershed_instances(mask, voxel_size, pp.watershed_neck_ratio, pp.min_object_nm3)
    return label_instances(np.asarray(mask, dtype=bool))


def clean_mask(mask, name: str, voxel_size, pp: PostProcessing) -> np.ndarray:
    """Steps 1 and 2 (small objects, holes) on one class's boolean mask."""
    mask = np.asarray(mask, dtype=bool)
    if pp.min_object_nm3 > 0:
        mask = remove_small_objects(mask, voxel_size, pp.min_object_nm3)
    if pp.fills(name):
        mask = fill_holes(mask, pp.fill_holes)
    return mask


def postprocess(masks: dict, voxel_size, pp: PostProcessing,
                instance_classes=INSTANCE_CLASSES,
                affinities: dict | None = None) -> dict[str, np.ndarray]:
    """Every step on a crop's masks (``{class: boolean mask}``): boolean masks for semantic
    classes, instance ids (int32) for ``instance_classes`` and for the classes of
    ``affinities`` (``{class: (probabilities (C, *spatial), offsets)}``, cut from them)."""
    cleaned = {name: clean_mask(mask, name, voxel_size, pp) for name, mask in masks.items()}
    out = {}
    for name, mask in cleaned.items():
        if pp.cuts_affinities(affinities) and name in affinities:
            probabilities, offsets = affinities[name]
            mask = pp.cut(probabilities, offsets, voxel_size, mask)[0]
        elif name in instance_classes:
            membrane = pp.membrane(name, cleaned)
            mask = separate_instances(mask, voxel_size, pp,
                                      None if membrane is None else cleaned[membrane])[0]
        out[name] = mask
    return out
