"""Objects cut from predicted affinities block by block: memory set by the block, not the volume.

The whole-volume cuts (:mod:`torchtitan.postprocess.affinities`) hold the volume's affinities in
memory. Here the same methods run on a region too large for that, in the steps the field's
blockwise pipelines use (lsd, volara), spread over the ranks:

1. **Fragments** (per block): each block is read with a halo and cut by the method's first
   stage: for the graph cut (``mutex_graph``) the watershed basins of the
   face-neighbour affinities, with a halo of at least :data:`BASIN_HALO` voxels; for
   ``mutex`` the block's own mutex watershed, with a halo of :data:`MUTEX_HALO` voxels. The
   block's own part is kept, numbered block-unique (block ``k`` owns ids ``k * capacity + 1
   ...``), and the block also keeps, for each face it shares with a later block, its
   fragments on that block's first plane.
2. **Region graph** (per block): the edges of :func:`torchtitan.postprocess.region_graph.block_edges`
   from each of the block's voxels to its partners at every offset (in this block or another),
   each fragment's size and name (the raster index of its first voxel), and the
   **stitches**: a fragment of this block and one of the next block along a face are one
   fragment cut by the face when, on the plane both saw, their overlap is most of either.
3. **One agglomeration** (rank 0): stitched basins
   become one fragment, named by its first voxel, the graph is kept (``graph.npz`` in the
   step's tables: names, sizes, ``near_*`` and ``far_*`` edge tables) and goes through
   :func:`torchtitan.postprocess.region_graph.agglomerate_graph`, the function the whole-volume
   graph cut calls. For ``mutex`` the stitched objects are the objects (only small ones are
   absorbed); with :data:`MUTEX_JOIN` ``graph`` they are joined instead by the graph's mutex
   watershed, two fragments of one block kept apart.
4. **Relabelling** (per block): fragment ids through the table, 0 outside the class's mask.

**Which cuts match the whole volume.** The graph cut agrees with the whole-volume run wherever the
stitched basins agree with the whole volume's basins: the graph is then the same bit for bit
(:mod:`torchtitan.postprocess.region_graph`), and so are the objects. A watershed basin depends on
the affinities near it only: with :data:`BASIN_HALO` voxels of context, blocks of 32^3 to 128^3 give
the whole medulla validation crop's objects exactly (docs/benchmarks/findings.md). The pixel
``mutex`` cut has no such locality: it takes the edges in one global order, so a decision near a
block's face can hinge on edges far beyond any halo; with 48 voxels of context 95-99.8 % of the
medulla crop's voxels keep their whole-volume object (the neurons score as well against the truth),
but 74-85 % of a 250^3 cube's, fewer the more blocks a region holds: the neurons' interiors are
joined by affinities above 0.95 across more than any halo, so no block holds a part of the cut that
its own edges decide (docs/benchmarks/findings.md). Choose ``mutex_graph`` where blockwise ids must
be the whole volume's. The price of the graph cut is step 3's memory: basins are small (about nine
voxels on the medulla model, three graph edges per voxel), so the graph that one process
agglomerates grows with the region, where the pixel cut's memory is set by the block. Every step
writes its own output and is repeated whole when run again, so a killed run is simply run again.

Floor 3: numpy, scipy, zarr, mwatershed and waterz, beside :mod:`torchtitan.postprocess.blockwise`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import scipy.sparse
import scipy.sparse.csgraph

from torchtitan.cellmap.affinities import is_nearest
from torchtitan.postprocess.affinities import basins, mutex_watershed
from torchtitan.postprocess.blockwise_labels import (Blocks, Ranks, box_slices, fresh_tables,
                                                    inner_slices)
from torchtitan.postprocess.masks import PostProcessing, min_object_voxels
from torchtitan.postprocess.region_graph import (RegionGraph, agglomerate_graph, block_edges,
                                                 concat_tables, first_voxels, rename_table)

AffinityReader = Callable[[tuple, tuple], np.ndarray]  # (lo, hi) -> (C, *box) in [0, 1]
MaskReader = Callable[[tuple, tuple], np.ndarray]

# Voxels of context for a block's watershed basins, beyond which a basin is taken to be
# decided. On the medulla validation crop's predicted affinities the stitched basins give the
# whole crop's objects with the offsets' own reach (9 voxels) already
# (docs/benchmarks/findings.md); 24 is a margin for affinities with wider plateaus.
BASIN_HALO = 24
# The pixel ``mutex`` cut's blocks: their context (MUTEX_HALO voxels, at least the offsets'
# reach) and how their objects are joined: ``overlap`` (stitched like basins, each stitched
# object kept whole) or ``graph`` (the graph mutex watershed of their mean affinities, two
# objects of one block kept apart). On the medulla model ``overlap`` with 48 voxels cuts
# neurons as good as the whole volume's (VOI 1.71 in blocks of 64^3, 1.80 whole) where
# ``graph`` with the offsets' reach loses 0.3 bits, and keeps more voxels' whole-volume neuron
# (79-99 % against 76-86 %), for 2-5x the memory of a block (docs/benchmarks/findings.md).
MUTEX_JOIN = "overlap"
MUTEX_HALO = 48
TABLES = ("near", "far")


def _stitched(pp: PostProcessing) -> bool:
    """Whether the cut's fragments are stitched across block faces: watershed basins, or the
    pixel cut's objects joined by ``overlap``."""
    return pp.affinity_cut != "mutex" or MUTEX_JOIN == "overlap"


def _fragments(affinities: np.ndarray, offsets, pp: PostProcessing, origin) -> np.ndarray:
    """Step 1 on one box (its first voxel at ``origin`` of the volume): the over-segmentation
    the method agglomerates (0 = none)."""
    if pp.affinity_cut == "mutex":
        return mutex_watershed(affinities, offsets, pp.mutex_threshold_nearest,
                               pp.mutex_threshold_long, pp.mutex_long_stride, origin)
    return basins(affinities, offsets)


def _block_ids(values: np.ndarray, x: np.ndarray, base: int) -> np.ndarray:
    """Fragment ids ``x`` as block ids ``base + 1 + (rank among the nonzero ``values``)``;
    0 where ``x`` is 0 or not among ``values``."""
    values = values[values > 0]
    if not len(values):
        return np.zeros(x.shape, np.uint64)
    pos = np.minimum(np.searchsorted(values, x), len(values) - 1)
    found = (values[pos] == x) & (x > 0)
    return np.where(found, pos.astype(np.uint64) + np.uint64(base + 1), np.uint64(0))


def _face(box: tuple, axis: int, index: int) -> tuple:
    """The plane ``index`` along ``axis`` of ``box`` = (lo, hi), as a box."""
    lo, hi = list(box[0]), list(box[1])
    lo[axis], hi[axis] = index, index + 1
    return tuple(lo), tuple(hi)


def _stitches(mine: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """Pairs (a, b) of fragments that label one plane in two blocks' views (``mine``: the
    earlier block's basins there, computed with context; ``theirs``: the later block's own),
    where the pair covers most of the plane's voxels of either: one basin cut by the face.
    Either, not both: a large basin that one block's context splits in two (its connection
    lies beyond the halo) is whole in the other's, and each half is most of itself there."""
    on = (mine > 0) & (theirs > 0)
    if not on.any():
        return np.zeros((0, 2), np.int64)
    pairs, n_ab = np.unique(np.stack([mine[on], theirs[on]]).astype(np.int64), axis=1,
                            return_counts=True)
    a_ids, n_a = np.unique(mine[mine > 0], return_counts=True)
    b_ids, n_b = np.unique(theirs[theirs > 0], return_counts=True)
    n_a = n_a[np.searchsorted(a_ids, pairs[0])]
    n_b = n_b[np.searchsorted(b_ids, pairs[1])]
    keep = (2 * n_ab > n_a) | (2 * n_ab > n_b)
    return pairs[:, keep].T


def _fragment_blocks(read_affinities: AffinityReader, offsets, blocks: Blocks,
                     pp: PostProcessing, ranks: Ranks, scratch, faces) -> None:
    """Step 1: each block's fragments into ``scratch``, and (graph cut) its view of the
    first plane of each later neighbour into ``faces``."""
    ndim, shape = len(blocks.shape), blocks.shape
    halo = [max(abs(o[a]) for o in offsets) for a in range(ndim)]
    halo = [max(h, MUTEX_HALO if pp.affinity_cut == "mutex" else BASIN_HALO) for h in halo]
    for k in ranks.mine(len(blocks)):
        lo, hi = blocks.box(k)
        olo = tuple(max(0, l - h) for l, h in zip(lo, halo))
        ohi = tuple(min(s, e + h) for e, h, s in zip(hi, halo, shape))
        frag = _fragments(read_affinities(olo, ohi), offsets, pp, olo)
        core = frag[inner_slices((olo, ohi), (lo, hi))]
        values = np.unique(core)
        base = k * blocks.capacity
        scratch[box_slices(lo, hi)] = _block_ids(values, core, base)
        views = {}
        for axis in range(ndim) if _stitched(pp) else ():
            if hi[axis] < shape[axis]:
                plane = frag[inner_slices((olo, ohi), _face((lo, hi), axis, hi[axis]))]
                views[f"axis{axis}"] = _block_ids(values, plane, base)
        np.savez(faces / f"{k}.npz", **views)


def _graph_blocks(read_affinities: AffinityReader, read_fragments, offsets, blocks: Blocks,
                  ranks: Ranks, faces, tables, channels: list[int] | None = None) -> None:
    """Step 2: each block's edges along the offsets of ``channels`` (None: every offset),
    fragments (ids, names, sizes) and stitches into ``tables``."""
    if channels is not None:
        offsets = [offsets[i] for i in channels]
    ndim, shape = len(blocks.shape), blocks.shape
    for k in ranks.mine(len(blocks)):
        lo, hi = blocks.box(k)
        here = read_fragments(lo, hi)
        affinities = read_affinities(lo, hi)
        if channels is not None:  # a copy of the block, only where channels are left out
            affinities = affinities[channels]
        edges = block_edges(here, lo, hi, read_fragments, affinities, offsets, shape)
        ids, names, sizes = first_voxels(here, lo, shape)
        views = np.load(faces / f"{k}.npz")
        stitches = [_stitches(views[f"axis{a}"], read_fragments(*_face((lo, hi), a, hi[a])))
                    for a in range(ndim) if f"axis{a}" in views.files]
        np.savez(tables / f"{k}.npz", ids=ids, names=names, sizes=sizes,
                 stitches=np.concatenate(stitches) if stitches else np.zeros((0, 2), np.int64),
                 **{f"{kind}_{i}": a for kind in TABLES for i, a in enumerate(edges[kind])})


def _agglomerate_blocks(blocks: Blocks, voxel_size, pp: PostProcessing, tables) -> None:
    """Step 3 (one process): stitched fragments, the region graph (kept as ``graph.npz``),
    its agglomeration, and the lookup of every block fragment's object (``lookup.npz``)."""
    parts = [np.load(tables / f"{k}.npz") for k in range(len(blocks))]
    ids = np.concatenate([p["ids"] for p in parts])  # sorted: block k's ids, then k + 1's
    names = np.concatenate([p["names"] for p in parts])
    sizes = np.concatenate([p["sizes"] for p in parts])
    pairs = np.searchsorted(ids, np.concatenate([p["stitches"] for p in parts]).reshape(-1, 2))
    links = scipy.sparse.coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])),
                                    shape=(len(ids), len(ids)))
    _, group = scipy.sparse.csgraph.connected_components(links, directed=False)
    group_name = np.full(group.max() + 1 if len(group) else 0, np.iinfo(np.int64).max)
    np.minimum.at(group_name, group, names)
    canonical = group_name[group]  # each fragment's name: its stitched basin's first voxel

    def rename(x):
        return canonical[np.searchsorted(ids, x)]

    graph_names, inverse = np.unique(canonical, return_inverse=True)
    inverse = inverse.ravel()
    graph = RegionGraph(
        graph_names, np.bincount(inverse, weights=sizes).astype(np.int64),
        *(concat_tables(rename_table(tuple(p[f"{kind}_{i}"] for i in range(4)), rename)
                        for p in parts) for kind in TABLES))
    np.savez(tables / "graph.npz", names=graph.names, sizes=graph.sizes,
             **{f"{kind}_{i}": a for kind in TABLES for i, a in enumerate(getattr(graph, kind))})
    apart, method = None, pp.affinity_cut
    if method == "mutex" and _stitched(pp):
        method = "keep"  # the stitched objects are the objects
    elif method == "mutex":  # each name is one block's fragment: apart in one block
        method = "mutex_graph"
        block_of = np.zeros(len(graph_names), np.int64)
        block_of[inverse] = ids // blocks.capacity

        def apart(u, v):
            return (block_of[np.searchsorted(graph_names, u)]
                    == block_of[np.searchsorted(graph_names, v)])

    number = agglomerate_graph(
        graph, method,
        threshold_nearest=pp.mutex_threshold_nearest, threshold_long=pp.mutex_threshold_long,
        min_voxels=min_object_voxels(pp.min_object_nm3, voxel_size), apart=apart)
    np.savez(tables / "lookup.npz", fragments=ids.astype(np.uint64), final=number[inverse])


def affinity_ids_blockwise(read_affinities: AffinityReader, offsets, inside: MaskReader | None,
                           blocks: Blocks, voxel_size, pp: PostProcessing, ranks: Ranks, work,
                           name: str) -> Callable[[tuple, tuple], np.ndarray]:
    """Objects cut from affinities block by block (module docstring); returns ``ids(lo, hi)``
    (uint32, 1..n) for whole blocks of ``blocks``. ``inside``: the class's mask (None: all).
    Collective over the ranks; scratch in ``work`` (a local zarr group)."""
    offsets = [tuple(int(v) for v in o) for o in offsets]
    scratch = work.create_array(f"{name}.fragments", shape=blocks.shape, chunks=blocks.block,
                                dtype="uint64", fill_value=0, overwrite=True) \
        if ranks.rank == 0 else None
    ranks.barrier()
    scratch = scratch if scratch is not None else work[f"{name}.fragments"]

    def read_fragments(lo, hi):
        return np.asarray(scratch[box_slices(lo, hi)])

    faces = fresh_tables(work, f"{name}.faces", ranks)
    _fragment_blocks(read_affinities, offsets, blocks, pp, ranks, scratch, faces)
    ranks.barrier()
    tables = fresh_tables(work, f"{name}.graph", ranks)
    # the stitched pixel cut keeps its objects: only their face contacts (small objects) count
    keep = pp.affinity_cut == "mutex" and _stitched(pp)
    channels = [i for i, o in enumerate(offsets) if is_nearest(o)] if keep else None
    _graph_blocks(read_affinities, read_fragments, offsets, blocks, ranks, faces, tables,
                  channels)
    ranks.barrier()
    if ranks.rank == 0:
        _agglomerate_blocks(blocks, voxel_size, pp, tables)
    ranks.barrier()
    table = np.load(tables / "lookup.npz")
    fragments, final = table["fragments"], table["final"]

    # 4. relabelling
    def ids_of(lo, hi):
        raw = read_fragments(lo, hi)
        out = np.zeros(raw.shape, np.uint32)
        on = raw > 0
        out[on] = final[np.searchsorted(fragments, raw[on])]
        if inside is not None:
            out[~inside(lo, hi)] = 0
        return out

    return ids_of
