"""Connected components of a mask too large for memory, block by block over the ranks.

The grid (:class:`Blocks`), each process's share of it (:class:`Ranks`) and the labelling of a
mask that is read one box at a time (:func:`label_blockwise`): each block is labelled (``cc3d``:
4x faster than ``scipy.ndimage.label`` on a 256^3 mask, the same numbering; scipy for in-plane
connectivity) into block-unique ids; the ids touching across each block's lower faces (a
two-voxel slab, one voxel wider for edge and corner neighbours) are joined by
``scipy.sparse.csgraph.connected_components``, and the objects, their sizes and border contacts
summed, are numbered in raster order of their first voxel: ``ndimage.label``'s, whatever the
blocks. A ``keep`` rule on the summed sizes and border contacts drops objects exactly (small
objects, holes that touch no border). :mod:`torchtitan.postprocess.blockwise` builds the post-processing of
a predicted region on it.

Scratch data lives in a zarr group ``work`` (arrays of block-unique ids, one chunk per block)
and small tables in ``work/tables/`` (files: the ranks need no process group, only a barrier).

Floor 3: numpy, scipy, cc3d and zarr.
"""

from __future__ import annotations

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

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (lo, hi) voxel corners


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


def box_slices(lo, hi) -> tuple[slice, ...]:
    """Slices of the box from corner ``lo`` to ``hi``."""
    return tuple(slice(int(l), int(h)) for l, h in zip(lo, hi))


def inner_slices(outer: Box, inner: Box) -> tuple[slice, ...]:
    """Slices of the box ``inner`` in an array that holds the box ``outer``."""
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
        raw = np.asarray(self.scratch[box_slices(lo, hi)])
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
    tables = fresh_tables(work, name, ranks)
    flat_stride = np.cumprod((1, *blocks.shape[::-1]))[:-1][::-1]  # raster index of a voxel
    border_axes = range(1, ndim) if connectivity == "planes" else range(ndim)
    # Pass 1: label each block; its labels' sizes, first voxels, border contacts, boxes.
    for k in ranks.mine(len(blocks)):
        lo, hi = blocks.box(k)
        labels, n = _label_block(np.asarray(read_mask(lo, hi), dtype=bool), connectivity)
        base = np.uint64(k * blocks.capacity)
        scratch[box_slices(lo, hi)] = np.where(labels > 0, labels.astype(np.uint64) + base, 0)
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
            slab = np.asarray(scratch[box_slices(slab_lo, slab_hi)])
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


def tables_dir(work) -> Path:
    return local_path(work) / "tables"


def fresh_tables(work, name: str, ranks: Ranks) -> Path:
    """An empty folder of tables for one step (made by rank 0, then seen by all)."""
    tables = tables_dir(work) / name
    if ranks.rank == 0:
        shutil.rmtree(tables, ignore_errors=True)
        tables.mkdir(parents=True)
    ranks.barrier()
    return tables


def local_path(group) -> Path:
    root = getattr(group.store, "root", None)
    if root is None:
        raise ValueError(f"blockwise post-processing needs a local zarr store, not {group.store}")
    return Path(root) / group.path


def max_over_ranks(value: int, work, name: str, ranks: Ranks) -> int:
    """The largest ``value`` of any rank (through small files: no process group is needed)."""
    path = tables_dir(work) / f"{name}.max{ranks.rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(value))
    ranks.barrier()
    return max(int((tables_dir(work) / f"{name}.max{r}").read_text()) for r in range(ranks.world))
