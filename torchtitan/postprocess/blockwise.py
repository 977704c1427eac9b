"""Post-processing of a predicted region block by block: memory set by the block, not the volume.

:mod:`torchtitan.postprocess.masks` cleans masks and labels instances of one volume held in memory.
Here the same steps run on a region stored in zarr (a prediction's ``<region>/<class>/s0``),
block by block, spread over the ranks, and give the same result as the whole-region functions
on a region that fits in memory (``tests/test_blockwise.py``):

* **Connected components across blocks**
  (:func:`torchtitan.postprocess.blockwise_labels.label_blockwise`): each block labelled, the ids touching
  across block faces joined, the objects numbered in raster order of their first voxel:
  ``ndimage.label``'s.
* **Small objects** (``min_object_nm3``): objects whose summed size is below the limit are
  dropped from the table: exact.
* **Holes** (``fill_holes``): background components (face connectivity; within each yx plane
  for ``"planes"``) that touch no border of the region (for ``"planes"``: no y or x border) are
  the holes: exact.
* **Instances, components**: the components of the cleaned mask, numbered as above: the same
  ids as :func:`torchtitan.scoring.metrics.label_instances`, not only the same objects.
* **Instances, watershed** (``instances = "watershed"``): object by object (round-robin over
  the ranks), on the object's box padded until its distance map is exact (the computed depth of
  every voxel is at most the padding), so the split is that of
  :func:`torchtitan.postprocess.masks.watershed_instances`, with the same numbering. Memory: the
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
  docs/benchmarks/prediction_memory.md).

Scratch data lives in ``<region>/_work`` (zarr arrays of ids, one chunk per block, and small
tables in ``_work/tables/``); the results go to ``<class>/_post`` and replace ``s0`` by renaming
at the end. Every step is idempotent on its own output (cleaning a cleaned mask changes nothing,
and instances are labelled from ``s0 > 0``), so a run killed at any point is simply run again.

Floor 3: numpy, scipy, scikit-image and zarr; uses :mod:`torchtitan.postprocess.masks` and
:mod:`torchtitan.postprocess.blockwise_labels`.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable

import numpy as np
import scipy.ndimage as ndi

from torchtitan.postprocess.blockwise_affinities import affinity_ids_blockwise
from torchtitan.postprocess.blockwise_labels import (
    Blocks,
    Components,
    Ranks,
    box_slices,
    fresh_tables,
    inner_slices,
    label_blockwise,
    local_path,
    max_over_ranks,
)
from torchtitan.cellmap.classes import INSTANCE_CLASSES
from torchtitan.postprocess.masks import (
    PostProcessing,
    flood_component,
    min_object_voxels,
)

WORK = "_work"  # scratch group of a region
POST = "_post"  # a class's post-processed array, before it replaces s0
RAW = "_raw"  # s0 while it is being replaced

# How far the flood of the neuron watershed may reach outside a block (see the docstring).
DEFAULT_HALO_NM = 400.0

MaskReader = Callable[[tuple, tuple], np.ndarray]  # (lo, hi) -> the mask of that box


# ---------------------------------------------------------------------------------------------
# The steps of one class, block by block
# ---------------------------------------------------------------------------------------------


def cleaned_mask(read_mask: MaskReader, name: str, blocks: Blocks, voxel_size,
                 pp: PostProcessing, ranks: Ranks, work) -> MaskReader:
    """Steps 1 and 2 (small objects, holes) of :func:`torchtitan.postprocess.masks.clean_mask`, as a
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
    """:func:`torchtitan.postprocess.masks.watershed_instances` object by object: returns
    ``ids(lo, hi)`` of the split instances, numbered as the whole-region function numbers them."""
    sampling = np.asarray(voxel_size, float)
    tables = fresh_tables(work, f"{name}.split", ranks)
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
        inner = inner_slices(outer, (lo, hi))
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
                basins = t["basins"][box_slices(a - np.asarray(olo), b - np.asarray(olo))]
            here = out[box_slices(a - np.asarray(lo), b - np.asarray(lo))]
            own = here == c
            part = own & (basins > 1)
            here[part] = basins[part] + extra_base[c]
        return renumber[out]

    return ids


def boundary_ids(inside: MaskReader, boundary: MaskReader, name: str, blocks: Blocks,
                 voxel_size, pp: PostProcessing, ranks: Ranks, work,
                 halo_nm: float = DEFAULT_HALO_NM) -> Callable:
    """:func:`torchtitan.postprocess.neurons.boundary_instances` block by block; returns ``ids(lo, hi)``
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
    whole-region one; measured on real EM with shorter halos in
    docs/benchmarks/prediction_memory.md.
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
        return (inner & (distance > pp.boundary_seed_nm))[inner_slices((olo, ohi), (lo, hi))]

    any_interior = 0
    for k in ranks.mine(len(blocks)):
        any_interior = max(any_interior, int(interior(*blocks.box(k)).any()))
    if not max_over_ranks(any_interior, work, f"{name}.interior", ranks):
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
        return flooded[inner_slices((olo, ohi), (lo, hi))].astype(np.uint32)

    return ids


def _seed_of_part(parts: Components, seeds: Components, blocks: Blocks, ranks: Ranks, work,
                  name: str) -> np.ndarray:
    """Entry ``p``: the seed id of interior part ``p`` when it holds one seed, 0 when it holds
    none and -1 when it holds several (entry 0: the background)."""
    tables = fresh_tables(work, f"{name}.owners", ranks)
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

    tables = fresh_tables(work, f"{name}.floods", ranks)
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
            here = box_slices(a - np.asarray(lo), b - np.asarray(lo))
            there = values[box_slices(a - box_lo, b - box_lo)]
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
    path = local_path(group) / cls
    if not (path / "s0").exists() and (path / RAW).exists():
        os.rename(path / RAW, path / "s0")
    for stale in (RAW, POST):
        shutil.rmtree(path / stale, ignore_errors=True)


def _replace_s0(group, cls: str) -> None:
    """``<cls>/_post`` becomes ``<cls>/s0`` (two renames; :func:`_recover` undoes a half)."""
    path = local_path(group) / cls
    os.rename(path / "s0", path / RAW)
    os.rename(path / POST, path / "s0")
    shutil.rmtree(path / RAW)


def postprocess_region(group, classes, voxel_size, post: PostProcessing, instances: bool,
                       block, rank: int = 0, world: int = 1,
                       barrier: Callable[[], None] = lambda: None,
                       halo_nm: float = DEFAULT_HALO_NM,
                       affinities: dict | None = None) -> dict[str, int]:
    """Post-process a predicted region in place, block by block (module docstring).

    ``group``: the region's zarr group (read-write, on every rank); each ``<class>/s0`` holds
    masks (0/1). Every class is cleaned (``post``: small objects, holes); with ``instances``,
    the instance classes become instance ids (uint32): connected components, the watershed,
    or for a class whose membrane is predicted too (``post.membrane``) the neurons that membrane
    cuts, or for a class of ``affinities`` (``{class: (reader of (C, *box) probabilities,
    offsets)}``, unless ``post.affinity_cut`` is "boundary") the objects cut from them
    (:mod:`torchtitan.postprocess.blockwise_affinities`). ``block``: the block shape (whole chunks of ``s0``). Collective over the ranks
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
        raw = lambda lo, hi, a=sources[cls]: np.asarray(a[box_slices(lo, hi)]) > 0  # noqa: E731
        cleaned[cls] = cleaned_mask(raw, cls, blocks, voxel_size, post, ranks, work)
    counts = {}
    for cls in classes:
        membrane = post.membrane(cls, classes) if instances else None
        if instances and post.cuts_affinities(affinities) and cls in affinities:
            read_affinities, offsets = affinities[cls]
            read = affinity_ids_blockwise(read_affinities, offsets, cleaned[cls], blocks,
                                          voxel_size, post, ranks, work, cls)
            dtype = "uint32"
        elif instances and cls in INSTANCE_CLASSES:
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
            out[box_slices(lo, hi)] = values
            if dtype == "uint32" and values.size:
                top = max(top, int(values.max()))
        if dtype == "uint32":
            counts[cls] = max_over_ranks(top, work, cls, ranks)
        barrier()
    if rank == 0:
        for cls in classes:
            _replace_s0(group, cls)
    barrier()
    return counts
