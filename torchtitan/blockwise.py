"""Post-processing of a predicted region block by block: memory set by the block, not the volume.

:mod:`torchtitan.postprocess` cleans masks and labels instances of one volume held in memory.
Here the same steps run on a region stored in zarr (a prediction's ``<region>/<class>/s0``),
block by block, spread over the ranks, and give the same result as the whole-region functions
on a region that fits in memory (``tests/test_blockwise.py``):

* **Connected components across blocks** (:func:`label_blockwise`): each block is labelled
  (``cc3d``: 4x faster than ``scipy.ndimage.label`` on a 256^3 mask, the same numbering; scipy
  for in-plane connectivity) into block-unique ids; the ids touching across each block's lower
  faces (a two-voxel slab, one voxel wider for edge and corner neighbours) are joined by
  ``scipy.sparse.csgraph.connected_components``, and the objects, their sizes and border
  contacts summed, are numbered in raster order of their first voxel: ``ndimage.label``'s.
* **Small objects** (``min_object_nm3``): objects whose summed size is below the limit are
  dropped from the table: exact.
* **Holes** (``fill_holes``): background components (face connectivity; within each yx plane
  for ``"planes"``) that touch no border of the region (for ``"planes"``: no y or x border) are
  the holes: exact.
* **Instances, components**: the components of the cleaned mask, numbered as above: the same
  ids as :func:`torchtitan.evaluation.label_instances`, not only the same objects.
* **Instances, watershed** (``instances = "watershed"``): object by object (round-robin over
  the ranks), on the object's box padded until its distance map is exact (the computed depth of
  every voxel is at most the padding), so the split is that of
  :func:`torchtitan.postprocess.watershed_instances`, with the same numbering. Memory: the
  largest object's box.
* **Neurons cut by their membrane** (``boundary_instances``): the seeds (interior voxels farther
  than ``boundary_seed_nm`` from the membrane) are found per block with a halo of
  ``boundary_seed_nm`` and labelled across blocks (exact, the same numbering); each part of
  the interior (face-connected, between membranes) that holds one seed is that neuron, and a
  part with several is flooded from them on its box (exact: the whole-region flood fills a
  part from its own seeds before it crosses a membrane); the membrane voxels, the parts
  without a seed and the parts too large for a box are flooded per block with a halo of
  ``halo_nm``, which equals the whole-region flood on regions of one block or within the halo
  and differs on a few percent of the voxels of real EM elsewhere (:func:`boundary_ids`;
  BENCHMARKS.md, "Prediction at any size").

Scratch data lives in ``<region>/_work`` (zarr arrays of ids, one chunk per block, and small
tables in ``_work/tables/``); the results go to ``<class>/_post`` and replace ``s0`` by renaming
at the end. Every step is idempotent on its own output (cleaning a cleaned mask changes nothing,
and instances are labelled from ``s0 > 0``), so a run killed at any point is simply run again.

Floor 3: numpy, scipy, cc3d, scikit-image and zarr; uses :mod:`torchtitan.postprocess`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Callable

import cc3d
import numpy as np
import scipy.ndimage as ndi
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from torchtitan.cellmap.classes import INSTANCE_CLASSES
from torchtitan.postprocess import (
    PostProcessing,
    flood_component,
    min_object_voxels,
)

WORK = "_work"  # scratch group of a region
POST = "_post"  # a class's post-processed array, before it replaces s0
RAW = "_raw"  # s0 while it is being replaced

# How far the flood of the neuron watershed may reach outside a block (see the docstring).
DEFAULT_HALO_NM = 400.0

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (lo, hi) voxel corners
MaskReader = Callable[[tuple, tuple], np.ndarray]  # (lo, hi) -> the mask of that box


# ---------------------------------------------------------------------------------------------
# The block grid and the ranks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Blocks:
    """A region of ``shape`` voxels cut into blocks of ``block`` voxels (the last ones smaller)."""

    shape: tuple[int, ...]
    block: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "block", tuple(min(int(b), s) for b, s in
                                                zip(self.block, self.shape)))

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(-(-s // b) for s, b in zip(self.shape, self.block))

    def __len__(self) -> int:
        return int(np.prod(self.counts))

    @property
    def capacity(self) -> int:
        """Ids per block in the scratch arrays: block ``k`` owns ``k * capacity + 1 ..``."""
        return int(np.prod(self.block)) + 1

    def box(self, k: int) -> Box:
        index = np.unravel_index(k, self.counts)
        lo = tuple(int(i * b) for i, b in zip(index, self.block))
        hi = tuple(min(l + b, s) for l, b, s in zip(lo, self.block, self.shape))
        return lo, hi



@dataclass
class Ranks:
    """This process's share of the work: items ``rank, rank + world, ...``; ``barrier`` waits
    for every rank (a no-op in one process)."""

    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = lambda: None

    def mine(self, n: int) -> range:
        return range(self.rank, n, self.world)


def _sl(lo, hi) -> tuple[slice, ...]:
    return tuple(slice(int(l), int(h)) for l, h in zip(lo, hi))


def _inner(outer: Box, inner: Box) -> tuple[slice, ...]:  # ``inner`` in an array of ``outer``
    return tuple(slice(i - o, j - o) for o, i, j in zip(outer[0], inner[0], inner[1]))


# ---------------------------------------------------------------------------------------------
# Connected components across blocks
# ---------------------------------------------------------------------------------------------

CONNECTIVITIES = ("full", "faces", "planes")


def _label_block(mask: np.ndarray, connectivity: str) -> tuple[np.ndarray, int]:
    """Components of one block, numbered in raster order of their first voxel."""
    if connectivity == "planes":  # within each yx plane (faces), never across z
        structure = np.zeros((3, 3, 3), bool)
        structure[1] = ndi.generate_binary_structure(2, 1)
        labels, n = ndi.label(mask, structure=structure, output=np.uint32)
        return labels, int(n)
    labels, n = cc3d.connected_components(mask, connectivity=26 if connectivity == "full" else 6,
                                          out_dtype=np.uint32, return_N=True)
    return labels, int(n)


def _offsets(axis: int, connectivity: str, ndim: int = 3) -> list[tuple[int, ...]]:
    """Neighbour offsets that cross a lower face along ``axis`` (+1 along it)."""
    if connectivity == "planes" and axis == 0:
        return []
    return [d for d in product((-1, 0, 1), repeat=ndim) if d[axis] == 1 and (
        connectivity == "full" or not any(d[a] for a in range(ndim) if a != axis))]


@dataclass
class Components:
    """Objects of a mask labelled block by block (:func:`label_blockwise`): ``ids(lo, hi)``
    reads their final ids (uint32, 1..n in raster order of the first voxel; 0 for background
    and dropped objects) in any box."""

    blocks: Blocks
    scratch: object  # zarr array of block-unique ids (uint64), one chunk per block
    starts: np.ndarray  # entry k: index of block k's first label in ``final``
    final: np.ndarray  # final id of every label (uint32), in block order
    count: int
    sizes: np.ndarray  # voxels of each final object (index id - 1)
    first: np.ndarray  # raster index of each final object's first voxel
    lo: np.ndarray | None = None  # bounding boxes of the final objects (n, ndim), when asked
    hi: np.ndarray | None = None

    def ids(self, lo, hi) -> np.ndarray:
        raw = np.asarray(self.scratch[_sl(lo, hi)])
        out = np.zeros(raw.shape, np.uint32)
        on = raw > 0
        if on.any():
            values = raw[on]
            block, local = np.divmod(values, self.blocks.capacity)
            out[on] = self.final[self.starts[block.astype(np.intp)] + local.astype(np.intp) - 1]
        return out


def label_blockwise(read_mask: Callable[[tuple, tuple], np.ndarray], blocks: Blocks,
                    ranks: Ranks, work, name: str, connectivity: str = "full",
                    keep: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                    boxes: bool = False) -> Components:
    """Connected components of the mask that ``read_mask(lo, hi)`` returns, across blocks.

    ``connectivity``: ``"full"`` (26), ``"faces"`` (6) or ``"planes"`` (faces within yx
    planes). ``keep(sizes, border)`` -> bool per object (its size in voxels; whether it touches
    the region's border: any face, or for ``"planes"`` a y or x face) chooses the objects that
    get ids (default: all). ``boxes``: also keep each object's bounding box. Collective: every
    rank calls it; ``work`` is the zarr group of the scratch arrays (``work/name``) and of the
    tables (``work/tables/``, files).
    """
    ndim = len(blocks.shape)
    scratch = work.create_array(name, shape=blocks.shape, chunks=blocks.block, dtype="uint64",
                                fill_value=0, overwrite=True) if ranks.rank == 0 else None
    ranks.barrier()
    if scratch is None:
        scratch = work[name]
    tables = _fresh_tables(work, name, ranks)
    flat_stride = np.cumprod((1, *blocks.shape[::-1]))[:-1][::-1]  # raster index of a voxel
    border_axes = range(1, ndim) if connectivity == "planes" else range(ndim)
    # Pass 1: label each block; its labels' sizes, first voxels, border contacts, boxes.
    for k in ranks.mine(len(blocks)):
        lo, hi = blocks.box(k)
        labels, n = _label_block(np.asarray(read_mask(lo, hi), dtype=bool), connectivity)
        base = np.uint64(k * blocks.capacity)
        scratch[_sl(lo, hi)] = np.where(labels > 0, labels.astype(np.uint64) + base, 0)
        flat = labels.ravel()
        sizes = np.bincount(flat, minlength=n + 1)[1:]
        on = np.flatnonzero(flat)
        values = flat[on]
        # Labels are numbered in raster order of their first voxel: label l first appears
        # where the running maximum first reaches l.
        new = np.r_[True, values[1:] > np.maximum.accumulate(values)[:-1]] if on.size else on
        first_local = np.stack(np.unravel_index(on[new], labels.shape), axis=1)
        first = (first_local + np.asarray(lo)) @ flat_stride if n else np.zeros(0, np.int64)
        border = np.zeros(n + 1, bool)
        for axis in border_axes:
            for side, edge in ((0, lo[axis] == 0), (-1, hi[axis] == blocks.shape[axis])):
                if edge:
                    border[np.take(labels, side, axis=axis).ravel()] = True
        extra = {}
        if boxes and n:
            found = ndi.find_objects(labels)
            extra["lo"] = np.array([[s.start + o for s, o in zip(f, lo)] for f in found])
            extra["hi"] = np.array([[s.stop + o for s, o in zip(f, lo)] for f in found])
        np.savez(tables / f"block{k}.npz", n=n, sizes=sizes, first=first.astype(np.int64),
                 border=border[1:], **extra)
    ranks.barrier()
    # Pass 2: ids that touch across each block's lower faces.
    for k in ranks.mine(len(blocks)):
        pairs = [np.zeros((0, 2), np.uint64)]
        lo, hi = blocks.box(k)
        for axis in range(ndim):
            offsets = _offsets(axis, connectivity, ndim)
            if lo[axis] == 0 or not offsets:
                continue
            slab_lo = [max(0, l - 1) for l in lo]
            slab_hi = [min(s, h + 1) for h, s in zip(hi, blocks.shape)]
            slab_lo[axis], slab_hi[axis] = lo[axis] - 1, lo[axis] + 1
            slab = np.asarray(scratch[_sl(slab_lo, slab_hi)])
            for d in offsets:
                a = slab[tuple(slice(max(0, -o), n - max(0, o)) for o, n in zip(d, slab.shape))]
                b = slab[tuple(slice(max(0, o), n - max(0, -o)) for o, n in zip(d, slab.shape))]
                touch = (a > 0) & (b > 0) & (a != b)
                if touch.any():
                    pairs.append(np.unique(np.stack([a[touch], b[touch]], axis=1), axis=0))
        np.save(tables / f"pairs{k}.npy", np.concatenate(pairs))
    ranks.barrier()
    # Rank 0 joins the parts and numbers the objects; the other ranks read its table.
    if ranks.rank == 0:
        _resolve(tables, blocks, keep, boxes)
    ranks.barrier()
    with np.load(tables / "objects.npz") as t:
        extra = {"lo": t["lo"], "hi": t["hi"]} if boxes else {}
        return Components(blocks, scratch, t["starts"], t["final"], int(t["count"]), t["sizes"],
                          t["first"], **extra)


def _resolve(tables: Path, blocks: Blocks, keep, boxes: bool) -> None:
    """Join the parts of every block into objects, keep some and number them (rank 0)."""
    parts = [np.load(tables / f"block{k}.npz") for k in range(len(blocks))]
    counts = np.array([int(p["n"]) for p in parts], np.int64)
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    total = int(counts.sum())
    sizes = np.concatenate([p["sizes"] for p in parts]) if total else np.zeros(0, np.int64)
    first = np.concatenate([p["first"] for p in parts]) if total else np.zeros(0, np.int64)
    border = np.concatenate([p["border"] for p in parts]) if total else np.zeros(0, bool)
    pairs = np.concatenate([np.load(tables / f"pairs{k}.npy") for k in range(len(blocks))])

    def index(ids):
        block, local = np.divmod(ids, blocks.capacity)
        return starts[block.astype(np.intp)] + local.astype(np.intp) - 1

    if total:
        a, b = index(pairs[:, 0]), index(pairs[:, 1])
        graph = coo_matrix((np.ones(a.size, np.int8), (a, b)), shape=(total, total))
        n, root = connected_components(graph, directed=False)
    else:
        n, root = 0, np.zeros(0, np.int64)
    obj_sizes = np.bincount(root, weights=sizes, minlength=n).astype(np.int64)
    obj_first = np.full(n, np.iinfo(np.int64).max)
    np.minimum.at(obj_first, root, first)
    obj_border = np.zeros(n, bool)
    np.logical_or.at(obj_border, root, border)
    kept = keep(obj_sizes, obj_border) if keep is not None else np.ones(n, bool)
    order = np.flatnonzero(kept)[np.argsort(obj_first[kept], kind="stable")]
    number = np.zeros(n, np.uint32)
    number[order] = np.arange(1, order.size + 1, dtype=np.uint32)
    extra = {}
    if boxes:
        ndim = len(blocks.shape)
        lo_all = np.concatenate([p["lo"] if int(p["n"]) else np.zeros((0, ndim), int)
                                 for p in parts])
        hi_all = np.concatenate([p["hi"] if int(p["n"]) else np.zeros((0, ndim), int)
                                 for p in parts])
        obj_lo = np.full((n, ndim), np.iinfo(np.int64).max)
        obj_hi = np.zeros((n, ndim), np.int64)
        for axis in range(ndim):
            np.minimum.at(obj_lo[:, axis], root, lo_all[:, axis])
            np.maximum.at(obj_hi[:, axis], root, hi_all[:, axis])
        extra = {"lo": obj_lo[order], "hi": obj_hi[order]}
    np.savez(tables / "objects.npz", starts=starts, final=number[root], count=order.size,
             sizes=obj_sizes[order], first=obj_first[order], **extra)


def _tables_dir(work) -> Path:
    return _local_path(work) / "tables"


def _fresh_tables(work, name: str, ranks: Ranks) -> Path:
    """An empty folder of tables for one step (made by rank 0, then seen by all)."""
    tables = _tables_dir(work) / name
    if ranks.rank == 0:
        shutil.rmtree(tables, ignore_errors=True)
        tables.mkdir(parents=True)
    ranks.barrier()
    return tables


def _local_path(group) -> Path:
    root = getattr(group.store, "root", None)
    if root is None:
        raise ValueError(f"blockwise post-processing needs a local zarr store, not {group.store}")
    return Path(root) / group.path


# ---------------------------------------------------------------------------------------------
# The steps of one class, block by block
# ---------------------------------------------------------------------------------------------


def cleaned_mask(read_mask: MaskReader, name: str, blocks: Blocks, voxel_size,
                 pp: PostProcessing, ranks: Ranks, work) -> MaskReader:
    """Steps 1 and 2 (small objects, holes) of :func:`torchtitan.postprocess.clean_mask`, as a
    reader of the cleaned mask in any box."""
    least = min_object_voxels(pp.min_object_nm3, voxel_size)
    mask = read_mask
    if least > 1:
        objects = label_blockwise(mask, blocks, ranks, work, f"{name}.objects", "full",
                                  keep=lambda sizes, border: sizes >= least)
        mask = lambda lo, hi, c=objects: c.ids(lo, hi) > 0  # noqa: E731
    if pp.fills(name):
        planes = pp.fill_holes == "planes" and len(blocks.shape) == 3
        before = mask
        holes = label_blockwise(lambda lo, hi: ~before(lo, hi), blocks, ranks, work,
                                f"{name}.holes", "planes" if planes else "faces",
                                keep=lambda sizes, border: ~border)
        mask = lambda lo, hi, c=holes: before(lo, hi) | (c.ids(lo, hi) > 0)  # noqa: E731
    return mask


def components_ids(mask: MaskReader, name: str, blocks: Blocks, ranks: Ranks, work,
                   boxes: bool = False) -> Components:
    """Instance ids of a cleaned mask: its connected components (full connectivity)."""
    return label_blockwise(mask, blocks, ranks, work, f"{name}.instances", "full", boxes=boxes)


def _edt_exact(mask: MaskReader, lo, hi, shape, sampling, pad: int, need):
    """The distance map of ``mask`` (to its background) on the box (lo, hi) grown by ``pad``
    until the depth of the voxels where ``need(box_array)`` holds is exact (at most the
    padding); returns (outer box, mask, depth)."""
    sampling = np.asarray(sampling, float)
    while True:
        olo = tuple(max(0, l - pad) for l in lo)
        ohi = tuple(min(s, h + pad) for h, s in zip(hi, shape))
        m = mask(olo, ohi)
        depth = ndi.distance_transform_edt(m, sampling=sampling)
        region = need((olo, ohi), m)
        deepest = float(depth[region].max()) if region.any() else 0.0
        whole = olo == (0,) * len(lo) and ohi == tuple(shape)
        if whole or deepest <= pad * float(sampling.min()):
            return (olo, ohi), m, depth
        pad *= 2


def watershed_split(objects: Components, mask: MaskReader, blocks: Blocks, voxel_size,
                    pp: PostProcessing, ranks: Ranks, work, name: str) -> Callable:
    """:func:`torchtitan.postprocess.watershed_instances` object by object: returns
    ``ids(lo, hi)`` of the split instances, numbered as the whole-region function numbers them."""
    sampling = np.asarray(voxel_size, float)
    tables = _fresh_tables(work, f"{name}.split", ranks)
    full = np.ones((3,) * len(blocks.shape), bool)
    min_voxels = min_object_voxels(pp.min_object_nm3, sampling)
    for j in ranks.mine(objects.count):
        c = j + 1
        lo, hi = tuple(objects.lo[j]), tuple(objects.hi[j])
        ids_box = {}

        def own_in(box, m, c=c):
            ids_box["ids"] = objects.ids(*box)
            return ids_box["ids"] == c

        outer, m, depth = _edt_exact(mask, lo, hi, blocks.shape, sampling, 2, own_in)
        own = ids_box["ids"] == c
        peaks = own & (depth >= ndi.maximum_filter(depth, footprint=full))
        if ndi.label(peaks, structure=full)[1] < 2:
            continue
        inner = _inner(outer, (lo, hi))
        basins = flood_component(own[inner], depth[inner], sampling, pp.watershed_neck_ratio,
                                 min_voxels)
        if basins.max() > 1 or not (basins == 1).any():
            np.savez(tables / f"object{c}.npz", lo=np.asarray(lo), basins=basins.astype(np.int32))
    ranks.barrier()
    # The numbering of watershed_instances: components keep 1..n, the further basins of each
    # split object follow in object order, then every id present is renumbered 1..m in order.
    splits = sorted(int(p.stem[6:]) for p in tables.glob("object*.npz"))
    present = np.ones(objects.count + 1, bool)
    present[0] = False
    extra_base, extra_present, next_id = {}, [], objects.count + 1
    for c in splits:
        with np.load(tables / f"object{c}.npz") as t:
            basins = t["basins"]
        values = np.unique(basins)
        present[c] = bool((values == 1).any())
        top = int(basins.max())
        extra_base[c] = next_id - 2
        extra_present += [next_id - 2 + v for v in values if v > 1]
        next_id += top - 1
    every = np.zeros(next_id, bool)
    every[: objects.count + 1] = present
    every[np.asarray(extra_present, np.int64)] = True
    renumber = np.zeros(next_id, np.uint32)
    renumber[every] = np.arange(1, int(every.sum()) + 1, dtype=np.uint32)
    boxes = {c: (tuple(objects.lo[c - 1]), tuple(objects.hi[c - 1])) for c in splits}

    def ids(lo, hi):
        out = objects.ids(lo, hi).astype(np.int64)
        for c, (olo, ohi) in boxes.items():
            a = np.maximum(lo, olo)
            b = np.minimum(hi, ohi)
            if np.any(a >= b):
                continue
            with np.load(tables / f"object{c}.npz") as t:
                basins = t["basins"][_sl(a - np.asarray(olo), b - np.asarray(olo))]
            here = out[_sl(a - np.asarray(lo), b - np.asarray(lo))]
            own = here == c
            part = own & (basins > 1)
            here[part] = basins[part] + extra_base[c]
        return renumber[out]

    return ids


def boundary_ids(inside: MaskReader, boundary: MaskReader, name: str, blocks: Blocks,
                 voxel_size, pp: PostProcessing, ranks: Ranks, work,
                 halo_nm: float = DEFAULT_HALO_NM) -> Callable:
    """:func:`torchtitan.neurons.boundary_instances` block by block; returns ``ids(lo, hi)``
    for the blocks of ``blocks`` (whole blocks only).

    The whole-region flood grows the seeds down the distance map, deepest voxels first, so a
    face-connected part of the interior is flooded from the seeds inside it before the flood
    crosses any boundary voxel (distance 0, the last to go). Hence, exactly:

    * the seeds (interior farther than ``boundary_seed_nm`` from a boundary) are found per
      block with a halo of that distance and labelled across blocks;
    * a part of the interior with one seed is that seed's neuron, whole;
    * a part with several seeds is flooded from them alone, on its box (object by object,
      round-robin over the ranks), where the distance map is exact; a part whose box is over
      ``8 x`` a block's voxels is flooded from its seeds per block instead, with a halo of
      ``halo_nm`` (exact where each voxel's flooding path stays in the halo);
    * the boundary voxels and the parts without a seed, which the whole-region flood reaches
      across a boundary in an order set by the whole region, are flooded per block with a halo
      of ``halo_nm`` from the seeds: which of two neighbours a boundary voxel between them, or
      a part without a seed, goes to may differ from the whole-region result.

    With a region of one block, or a halo as large as the region, the result is the
    whole-region one; measured on real EM with shorter halos in BENCHMARKS.md ("Prediction at
    any size").
    """
    sampling = np.asarray(voxel_size, float)
    seed_halo = int(np.ceil(pp.boundary_seed_nm / sampling.min())) + 1
    min_voxels = int(np.ceil(pp.min_object_nm3 / float(np.prod(sampling))))

    def interior(lo, hi):
        return inside(lo, hi) & ~boundary(lo, hi)

    def seed_mask(lo, hi):
        olo = tuple(max(0, l - seed_halo) for l in lo)
        ohi = tuple(min(s, h + seed_halo) for h, s in zip(hi, blocks.shape))
        inner = interior(olo, ohi)
        distance = ndi.distance_transform_edt(inner, sampling=sampling)
        return (inner & (distance > pp.boundary_seed_nm))[_inner((olo, ohi), (lo, hi))]

    any_interior = 0
    for k in ranks.mine(len(blocks)):
        any_interior = max(any_interior, int(interior(*blocks.box(k)).any()))
    if not _max_over_ranks(any_interior, work, f"{name}.interior", ranks):
        return lambda lo, hi: np.zeros(tuple(h - l for l, h in zip(lo, hi)), np.uint32)
    seeds = label_blockwise(seed_mask, blocks, ranks, work, f"{name}.seeds", "faces",
                            keep=(lambda sizes, border: sizes >= min_voxels)
                            if min_voxels > 1 else None)
    if seeds.count == 0:  # no interior deep enough anywhere: the components of the mask
        return components_ids(inside, name, blocks, ranks, work).ids
    parts = label_blockwise(interior, blocks, ranks, work, f"{name}.parts", "faces", boxes=True)
    owner = _seed_of_part(parts, seeds, blocks, ranks, work, name)
    known = _flood_parts(parts, seeds, owner, interior, blocks, sampling, ranks, work, name)
    halo = int(np.ceil(halo_nm / sampling.min()))

    def ids(lo, hi):
        from skimage.segmentation import watershed

        olo = tuple(max(0, l - halo) for l in lo)
        ohi = tuple(min(s, h + halo) for h, s in zip(hi, blocks.shape))
        m = inside(olo, ohi)
        inner = m & ~boundary(olo, ohi)
        distance = ndi.distance_transform_edt(inner, sampling=sampling)
        markers = seeds.ids(olo, ohi).astype(np.int32)
        flooded = watershed(-distance, markers=markers, mask=m)  # boundaries, unseeded parts
        within = watershed(-distance, markers=markers, mask=inner)  # each part from its seeds
        exact = known(olo, ohi)
        left = inner & (exact == 0) & (within > 0)  # parts with seeds over the box budget
        flooded[left] = within[left]
        flooded[exact > 0] = exact[exact > 0]
        return flooded[_inner((olo, ohi), (lo, hi))].astype(np.uint32)

    return ids


def _seed_of_part(parts: Components, seeds: Components, blocks: Blocks, ranks: Ranks, work,
                  name: str) -> np.ndarray:
    """Entry ``p``: the seed id of interior part ``p`` when it holds one seed, 0 when it holds
    none and -1 when it holds several (entry 0: the background)."""
    tables = _fresh_tables(work, f"{name}.owners", ranks)
    for k in ranks.mine(len(blocks)):
        lo, hi = blocks.box(k)
        part, seed = parts.ids(lo, hi), seeds.ids(lo, hi)
        on = seed > 0
        np.save(tables / f"pairs{k}.npy",
                np.unique(np.stack([part[on], seed[on]], axis=1), axis=0).astype(np.int64))
    ranks.barrier()
    if ranks.rank == 0:
        pairs = np.unique(np.concatenate([np.load(tables / f"pairs{k}.npy")
                                          for k in range(len(blocks))]), axis=0)
        count = np.bincount(pairs[:, 0], minlength=parts.count + 1)
        owner = np.zeros(parts.count + 1, np.int64)
        owner[pairs[:, 0]] = pairs[:, 1]
        owner[count > 1] = -1
        np.save(tables / "owner.npy", owner)
    ranks.barrier()
    return np.load(tables / "owner.npy")


def _flood_parts(parts: Components, seeds: Components, owner: np.ndarray, interior: MaskReader,
                 blocks: Blocks, sampling, ranks: Ranks, work, name: str) -> Callable:
    """Flood each interior part that holds several seeds from them alone, on the part's box
    grown by two voxels (the distance of each of its voxels to the nearest boundary lies in
    it); returns ``known(lo, hi)``: the neuron of every voxel of a part with seeds (0
    elsewhere, and in a part whose box is over 8 blocks: it is left to the per-block flood)."""
    from skimage.segmentation import watershed

    tables = _fresh_tables(work, f"{name}.floods", ranks)
    most = 8 * int(np.prod(blocks.block))
    several = np.flatnonzero(owner < 0)
    for j in ranks.mine(len(several)):
        p = int(several[j])
        lo = tuple(max(0, int(v) - 2) for v in parts.lo[p - 1])
        hi = tuple(min(s, int(v) + 2) for v, s in zip(parts.hi[p - 1], blocks.shape))
        if np.prod([h - l for l, h in zip(lo, hi)]) > most:
            continue
        own = parts.ids(lo, hi) == p
        distance = ndi.distance_transform_edt(interior(lo, hi), sampling=sampling)
        markers = np.where(own, seeds.ids(lo, hi), 0).astype(np.int32)
        flooded = watershed(-distance, markers=markers, mask=own)
        np.savez(tables / f"part{p}.npz", lo=np.asarray(lo), ids=flooded.astype(np.uint32))
    ranks.barrier()
    flooded_parts = {int(f.stem[4:]): f for f in tables.glob("part*.npz")}
    single = np.where(owner > 0, owner, 0).astype(np.uint32)

    def known(lo, hi):
        part = parts.ids(lo, hi)
        out = single[part]
        for p, path in flooded_parts.items():
            plo, phi = parts.lo[p - 1], parts.hi[p - 1]
            a, b = np.maximum(lo, plo), np.minimum(hi, phi)
            if np.any(a >= b):
                continue
            with np.load(path) as t:
                box_lo, values = t["lo"], t["ids"]
            here = _sl(a - np.asarray(lo), b - np.asarray(lo))
            there = values[_sl(a - box_lo, b - box_lo)]
            mine = part[here] == p
            out[here][mine] = there[mine]
        return out

    return known


# ---------------------------------------------------------------------------------------------
# A region of a prediction store
# ---------------------------------------------------------------------------------------------


def _recover(group, cls: str) -> None:
    """Undo a killed run's half-done class group: ``s0`` back from ``_raw``, stale arrays
    removed (either ``s0`` is a valid input: every step is idempotent)."""
    path = _local_path(group) / cls
    if not (path / "s0").exists() and (path / RAW).exists():
        os.rename(path / RAW, path / "s0")
    for stale in (RAW, POST):
        shutil.rmtree(path / stale, ignore_errors=True)


def _replace_s0(group, cls: str) -> None:
    """``<cls>/_post`` becomes ``<cls>/s0`` (two renames; :func:`_recover` undoes a half)."""
    path = _local_path(group) / cls
    os.rename(path / "s0", path / RAW)
    os.rename(path / POST, path / "s0")
    shutil.rmtree(path / RAW)


def postprocess_region(group, classes, voxel_size, post: PostProcessing, instances: bool,
                       block, rank: int = 0, world: int = 1,
                       barrier: Callable[[], None] = lambda: None,
                       halo_nm: float = DEFAULT_HALO_NM) -> dict[str, int]:
    """Post-process a predicted region in place, block by block (module docstring).

    ``group``: the region's zarr group (read-write, on every rank); each ``<class>/s0`` holds
    masks (0/1). Every class is cleaned (``post``: small objects, holes); with ``instances``,
    the instance classes become instance ids (uint32): connected components, the watershed,
    or for a class whose membrane is predicted too (``post.membrane``) the neurons that membrane
    cuts. ``block``: the block shape (whole chunks of ``s0``). Collective over the ranks
    (``barrier`` waits for all). Scratch data stays in ``<region>/_work`` for the caller to
    delete. Returns ``{class: instances}`` for the classes given ids (on every rank).
    """
    ranks = Ranks(rank, world, barrier)
    if rank == 0:
        for cls in classes:
            _recover(group, cls)
    barrier()
    work = group.require_group(WORK) if rank == 0 else None
    barrier()
    work = work if work is not None else group[WORK]
    shape = group[f"{classes[0]}/s0"].shape
    blocks = Blocks(shape, block)
    sources = {cls: group[f"{cls}/s0"] for cls in classes}
    cleaned = {}
    for cls in classes:
        raw = lambda lo, hi, a=sources[cls]: np.asarray(a[_sl(lo, hi)]) > 0  # noqa: E731
        cleaned[cls] = cleaned_mask(raw, cls, blocks, voxel_size, post, ranks, work)
    counts = {}
    for cls in classes:
        membrane = post.membrane(cls, classes) if instances else None
        if instances and cls in INSTANCE_CLASSES:
            if membrane is not None:
                read = boundary_ids(cleaned[cls], cleaned[membrane], cls, blocks, voxel_size,
                                    post, ranks, work, halo_nm)
            elif post.instances == "watershed":
                objects = components_ids(cleaned[cls], cls, blocks, ranks, work, boxes=True)
                read = watershed_split(objects, cleaned[cls], blocks, voxel_size, post, ranks,
                                       work, cls)
            else:
                read = components_ids(cleaned[cls], cls, blocks, ranks, work).ids
            dtype = "uint32"
        else:
            read = lambda lo, hi, m=cleaned[cls]: m(lo, hi).astype(np.uint8)  # noqa: E731
            dtype = "uint8"
        out = group.create_array(f"{cls}/{POST}", shape=shape, chunks=sources[cls].chunks,
                                 dtype=dtype, fill_value=0, overwrite=True) if rank == 0 else None
        barrier()
        out = out if out is not None else group[f"{cls}/{POST}"]
        top = 0
        for k in ranks.mine(len(blocks)):
            lo, hi = blocks.box(k)
            values = read(lo, hi)
            out[_sl(lo, hi)] = values
            if dtype == "uint32" and values.size:
                top = max(top, int(values.max()))
        if dtype == "uint32":
            counts[cls] = _max_over_ranks(top, work, cls, ranks)
        barrier()
    if rank == 0:
        for cls in classes:
            _replace_s0(group, cls)
    barrier()
    return counts


def _max_over_ranks(value: int, work, name: str, ranks: Ranks) -> int:
    """The largest ``value`` of any rank (through small files: no process group is needed)."""
    path = _tables_dir(work) / f"{name}.max{ranks.rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(value))
    ranks.barrier()
    return max(int((_tables_dir(work) / f"{name}.max{r}").read_text()) for r in range(ranks.world))
