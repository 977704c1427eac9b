"""Instances from predicted affinities: neurons cut the way connectomics cuts them.

A model with ``[affinities]`` predicts, for each offset, the probability that a voxel and its
partner at that offset belong to the same object (:mod:`torchtitan.cellmap.affinities`). Two
cuts turn these into object ids, each with a library the field keeps:

* ``mutex`` (Wolf et al. 2018, ``mwatershed``): every offset is an edge of the voxel graph,
  weighted ``affinity - threshold`` (``mutex_threshold_nearest`` for face neighbours,
  ``mutex_threshold_long`` for long-range offsets). Edges are taken in order of decreasing
  weight magnitude: a positive one joins its two clusters unless a negative one already
  forbids it (a mutex), a negative one forbids the pair ever being joined. Long-range edges
  thereby keep two objects apart across a gap in their predicted boundary. As in Wolf et al.,
  only face neighbours join and long-range edges only repel (a long-range weight above 0
  counts as 0, which joins nothing): every object is one face-connected piece, where a join
  across 9 voxels could make one id of pieces that do not touch (the challenge's instance
  score counts each such piece as an object; docs/benchmarks/neurons.md).
  No seeds, no threshold on sizes: one pass over the edges.
* ``mutex_graph``: the same mutex watershed on the region graph of watershed fragments
  (waterz's basins of the face-neighbour affinities) rather than on voxels: each edge between
  two fragments weighted by its mean affinity minus the same thresholds, fragments joined only
  where they touch.

The graph cut shares its graph and its agglomeration with the blockwise run
(:mod:`torchtitan.postprocess.region_graph`), which therefore gives its objects block by
block (:mod:`torchtitan.postprocess.blockwise_affinities`); the pixel ``mutex`` cut decides
with context wider than any block's halo and is only approximated there.

All give ids over the whole volume; voxels outside the class's own predicted mask (``inside``)
get 0. Objects smaller than ``min_object_nm3`` are absorbed, as the boundary cut
(:mod:`torchtitan.postprocess.neurons`) drops seeds of that size, by every cut alike and block
by block the same: each joins the neighbour it shares the highest mean face-neighbour affinity
with (on the medulla model 0.01-0.02 bits of VOI better than giving its voxels to the nearest
large object; docs/benchmarks/neurons.md).

Floor 3: numpy, scipy, mwatershed and waterz; of ours the domain's affinity layout, the region
graph and the evaluation's relabelling.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence

import numpy as np

from torchtitan.errors import optional_import
from torchtitan.cellmap.affinities import is_nearest
from torchtitan.choices import AFFINITY_CUTS
from torchtitan.postprocess.region_graph import (RegionGraph, agglomerate_graph, block_edges,
                                                 first_voxels)
from torchtitan.scoring.metrics import label_instances

def _check(affinities: np.ndarray, offsets: Sequence[Sequence[int]]) -> np.ndarray:
    affinities = np.asarray(affinities)
    if affinities.ndim < 3 or affinities.shape[0] != len(offsets):
        raise ValueError(f"affinities of shape {affinities.shape} for {len(offsets)} offsets: "
                         "expected (offsets, *spatial)")
    if any(len(o) != affinities.ndim - 1 for o in offsets):
        raise ValueError(f"offsets {[tuple(o) for o in offsets]} do not match "
                         f"{affinities.ndim - 1}-D affinities")
    return affinities


def mutex_weights(affinities, offsets, threshold_nearest: float = 0.5,
                  threshold_long: float = 0.5, long_stride: int = 1,
                  origin: Sequence[int] | None = None) -> np.ndarray:
    """The signed edge weights (float64, ``affinities``' shape) of the pixel mutex watershed
    (module docstring): ``affinity - threshold``, long-range weights clipped to <= 0 and 0 off
    the stride's grid. An edge of weight 0 is taken last and joins nothing (mwatershed joins
    on > 0).
    ``long_stride``: long-range edges only from the voxels whose index in the volume (the
    box's ``origin`` added) is a multiple of it along every axis, so that a block of a larger
    volume takes the same edges as the whole."""
    affinities = _check(affinities, offsets)
    bias = np.array([threshold_nearest if is_nearest(o) else threshold_long for o in offsets])
    weights = affinities.astype(np.float64) - bias.reshape(-1, *([1] * (affinities.ndim - 1)))
    far = [c for c, o in enumerate(offsets) if not is_nearest(o)]
    for c in far:
        np.minimum(weights[c], 0.0, out=weights[c])
    if long_stride > 1:
        origin = (0,) * (affinities.ndim - 1) if origin is None else tuple(origin)
        grid = np.ones(affinities.shape[1:], bool)
        for axis, (start, n) in enumerate(zip(origin, affinities.shape[1:])):
            on = (np.arange(start, start + n) % long_stride) == 0
            grid &= on.reshape([-1 if a == axis else 1 for a in range(len(origin))])
        for c in far:
            weights[c][~grid] = 0.0
    return weights


def mutex_objects(weights: np.ndarray, offsets) -> np.ndarray:
    """Object ids (uint64, 1..) of mwatershed's mutex watershed of signed edge ``weights`` (C,
    *spatial) along ``offsets``; a voxel that no edge joins is an object of its own."""
    mwatershed = optional_import("mwatershed", "neurons", "The mutex watershed of affinities")
    ids = mwatershed.agglom(weights, [[int(v) for v in o] for o in offsets])
    alone = ids == 0  # mwatershed leaves the voxels that nothing joined at 0
    if alone.any():
        ids[alone] = ids.max() + np.arange(1, int(alone.sum()) + 1, dtype=ids.dtype)
    return ids


def mutex_watershed(affinities, offsets, threshold_nearest: float = 0.5,
                    threshold_long: float = 0.5, long_stride: int = 1,
                    origin: Sequence[int] | None = None) -> np.ndarray:
    """Object ids (uint64, 1..) of the mutex watershed of ``affinities`` (C, *spatial)
    probabilities along ``offsets`` (module docstring; the weights of
    :func:`mutex_weights`); a voxel that no edge joins is an object of its own, for the size
    rule to absorb."""
    return mutex_objects(mutex_weights(affinities, offsets, threshold_nearest, threshold_long,
                                       long_stride, origin), offsets)


@contextlib.contextmanager
def _quiet_stdout():
    """Silence what a C++ library prints on the process's standard output (waterz reports
    every step of its work there)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def waterz_affinities(affinities: np.ndarray, offsets) -> np.ndarray:
    """The face-neighbour channels of ``affinities`` (C, *spatial) as waterz reads them:
    float32 (3, z, y, x), channel d at voxel v the affinity between v and v - e_d (ours joins v
    and v + offset: each channel moves by one voxel along its axis); a 2D input becomes one
    plane without z affinities."""
    ndim = affinities.ndim - 1
    given = [tuple(int(v) for v in o) for o in offsets]
    nearest = np.zeros((3, *affinities.shape[1:]), np.float32)
    for axis in range(ndim):
        unit = tuple(int(a == axis) for a in range(ndim))
        if unit not in given:
            raise ValueError(f"agglomeration needs the face-neighbour offset {unit}; the "
                             f"offsets are {given}")
        lead = (slice(None),) * axis
        nearest[3 - ndim + axis][lead + (slice(1, None),)] = \
            affinities[given.index(unit)][lead + (slice(0, -1),)]
    return np.ascontiguousarray(nearest[:, None] if ndim == 2 else nearest)


def basins(affinities, offsets) -> np.ndarray:
    """Fragment ids (uint64, 0 = none) of ``affinities`` (C, *spatial): waterz's watershed
    of the face-neighbour channels, nothing merged."""
    waterz = optional_import("waterz", "neurons", "Watershed fragments of affinities")
    affinities = _check(affinities, offsets)
    with _quiet_stdout():
        ids = next(iter(waterz.agglomerate(waterz_affinities(affinities, offsets),
                                           thresholds=[0.0])))
    return ids[0] if affinities.ndim == 3 else ids


def region_graph(affinities, offsets, fragments=None) -> tuple[RegionGraph, np.ndarray]:
    """The region graph of the whole volume's fragments (``fragments``, ids > 0 and 0 for
    none; by default :func:`basins`), and the fragments named as the graph names them
    (int64, 0 = none)."""
    affinities = _check(affinities, offsets)
    offsets = [tuple(int(v) for v in o) for o in offsets]
    fragments = basins(affinities, offsets) if fragments is None else np.asarray(fragments)
    if fragments.shape != affinities.shape[1:]:
        raise ValueError(f"fragments of shape {fragments.shape} for affinities of shape "
                         f"{affinities.shape}: expected the affinities' spatial shape")
    shape, origin = fragments.shape, (0,) * fragments.ndim
    ids, names, sizes = first_voxels(fragments, origin, shape)
    rename = np.zeros(int(fragments.max()) + 1, np.int64)
    rename[ids] = names
    named = rename[fragments]
    edges = block_edges(named, origin, shape,
                        lambda lo, hi: named[tuple(slice(a, b) for a, b in zip(lo, hi))],
                        affinities, offsets, shape)
    order = np.argsort(names)
    return RegionGraph(names[order], sizes[order], edges["near"], edges["far"]), named


def graph_instances(affinities, offsets, method: str, *, min_voxels: int = 0,
                    threshold_nearest: float = 0.5, threshold_long: float = 0.5,
                    fragments=None) -> np.ndarray:
    """Object ids (uint32, 1..n in raster order of their first voxel; 0 where no fragment) of
    a graph cut (``mutex_graph``, module docstring; ``keep``: each fragment an object) of the
    whole volume:
    fragments (``fragments``, by default :func:`basins`), their region graph, its
    agglomeration, small objects absorbed."""
    graph, named = region_graph(affinities, offsets, fragments)
    number = agglomerate_graph(graph, method, threshold_nearest=threshold_nearest,
                               threshold_long=threshold_long, min_voxels=min_voxels)
    out = np.zeros(named.shape, np.uint32)
    on = named > 0
    out[on] = number[np.searchsorted(graph.names, named[on])]
    return out


def absorb_small(ids: np.ndarray, affinities: np.ndarray, offsets, min_voxels: int
                 ) -> np.ndarray:
    """``ids`` (every voxel an object) renumbered 1..n in raster order, each object of fewer
    than ``min_voxels`` joined to the neighbour it shares the highest mean face-neighbour
    affinity with, smallest first: the graph cuts' rule
    (:func:`torchtitan.postprocess.region_graph.absorb_small`) on the region graph of the
    objects' face contacts, which the blockwise cut applies too."""
    if min_voxels <= 1:
        return label_instances(ids)[0]
    near = [c for c, o in enumerate(offsets) if is_nearest(o)]
    return graph_instances(affinities[near], [offsets[c] for c in near], "keep",
                           min_voxels=min_voxels, fragments=ids)


def affinity_instances(affinities, offsets, method: str, voxel_size, *, inside=None,
                       min_object_nm3: float = 0.0, threshold_nearest: float = 0.5,
                       threshold_long: float = 0.5, long_stride: int = 1,
                       fragments=None) -> tuple[np.ndarray, int]:
    """Instance ids (int32, 1..n) and their count cut from predicted ``affinities`` (C,
    *spatial) along ``offsets`` by ``method`` (:data:`AFFINITY_CUTS`); 0 outside ``inside``
    (the class's mask; None: everywhere). ``fragments``: the graph cuts' over-segmentation
    (default: :func:`basins`)."""
    min_voxels = int(np.ceil(min_object_nm3 / float(np.prod(np.asarray(voxel_size, float)))))
    if method == "mutex":
        ids = mutex_watershed(affinities, offsets, threshold_nearest, threshold_long,
                              long_stride)
        ids = absorb_small(ids, affinities, offsets, min_voxels)
    elif method in AFFINITY_CUTS:
        ids = graph_instances(affinities, offsets, method, min_voxels=min_voxels,
                              threshold_nearest=threshold_nearest, threshold_long=threshold_long,
                              fragments=fragments)
    else:
        raise ValueError(f"affinity cut {method!r}: must be one of {', '.join(AFFINITY_CUTS)}")
    if inside is not None:
        inside = np.asarray(inside, dtype=bool)
        if inside.shape != ids.shape:
            raise ValueError(f"affinities {ids.shape} and mask {inside.shape} differ in shape")
        ids = np.where(inside, ids, 0)
    return label_instances(ids)
