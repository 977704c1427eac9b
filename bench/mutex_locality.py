"""How far the pixel mutex watershed's decisions reach: why its blockwise run is not exact in
bounded memory, measured on a stored prediction.

    python bench/mutex_locality.py --region PRED.zarr/<region> --config RUN/config.toml \\
        [--class cell] [--levels 0.55,0.4,0.2] [--ladder 0.599,...] [--block 64] \\
        [--halo 16,32] [--stability]

Trains nothing; reads the affinity channels ``predict.py`` wrote. The edge weights are the
cut's own (:func:`torchtitan.postprocess.affinities.mutex_weights` with the config's
thresholds). Ties are broken by a fixed order that depends only on an edge's voxel and offset
(weights rounded to 2^-20, a hashed fraction below that added), so that a block and the whole
region take their common edges in the same order. Four measures, each printed as a table:

1. **decomposition**: the mutex watershed over only the edges with ``|weight| > c`` (the
   state the whole cut reaches after its strongest edges: "prefix clusters"), then the graph
   of those clusters (each pair of clusters keeps its edge of largest ``|weight|``) cut by the
   same rule (``mwatershed.cluster``), against the whole cut. Agreement 1 means that the cut's
   later decisions need only this graph; its edges per voxel say how small it is.
2. **self-decided parts**: for each level ``L`` of ``--ladder``, the face-connected components
   of the attractive edges above ``L`` are closed: the cut's decisions above ``L`` inside one
   depend on its own edges only. Two ways a block could use one: a component narrower than the
   halo lies inside the box of every block that holds a voxel of it (the share of voxels in
   wider ones is printed), and a component without a repulsive edge above ``L`` between two of
   its voxels is one object of the cut's state at ``L`` whatever its size (the share of voxels in
   such components; blockwise connected components would find them exactly). Each voxel taken
   at the coarsest level where its component has no such repulsion, the exact graph stage over
   these parts gives the whole cut (agreement 1, printed) with the graph's edges per voxel.
3. **blocks**: the prefix clusters at level ``c`` computed block by block (each block's own
   voxels, cut with ``--halo`` voxels of context), then the same exact graph stage over all of
   them: the share of voxels whose object agrees with the whole cut's
   (:func:`torchtitan.scoring.neuron_metrics.matching_agreement`).
4. **stability** (``--stability``): the whole cut against itself under another order of ties
   and under noise of half a step of a 16-bit store.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import scipy.ndimage as ndi
import scipy.sparse
import scipy.sparse.csgraph

from blockwise_affinities import channels, settings
from torchtitan.cellmap.affinities import from_stored, is_nearest
from torchtitan.postprocess.affinities import mutex_objects, mutex_weights
from torchtitan.postprocess.blockwise_labels import Blocks, box_slices, inner_slices
from torchtitan.scoring.neuron_metrics import matching_agreement

RESOLUTION = 2 ** 20  # weights rounded to 2^-20; the tie order lies below it


def tie_broken(weights: np.ndarray, origin, seed: int = 0) -> np.ndarray:
    """``weights`` (C, *box) of a box at ``origin`` with ties broken by a hash of each edge's
    voxel (in the region) and channel: the same order in any box that holds the edge."""
    grids = np.meshgrid(*[np.arange(o, o + n, dtype=np.uint64)
                          for o, n in zip(origin, weights.shape[1:])], indexing="ij")
    mix = np.uint64(0x9E3779B97F4A7C15)
    out = np.empty_like(weights)
    with np.errstate(over="ignore"):  # the hash multiplies modulo 2^64
        base = np.uint64(seed + 1) * np.uint64(0xD1B54A32D192ED03)
        for g, k in zip(grids, (0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)):
            base = base ^ (g * np.uint64(k))
        for c in range(len(weights)):
            h = ((base ^ (np.uint64(c + 1) * mix)) * mix) >> np.uint64(32)
            q = np.rint(np.abs(weights[c]) * RESOLUTION)
            out[c] = np.sign(weights[c]) * (q + h.astype(np.float64) / 2 ** 32) / RESOLUTION
            out[c][q == 0] = 0.0
    return out


def graph_cut(clusters: np.ndarray, weights: np.ndarray, offsets) -> tuple[np.ndarray, int]:
    """The mutex watershed of the graph of ``clusters``: each pair of touching clusters keeps
    its edge of largest ``|weight|``; returns the objects and the graph's edge count."""
    import mwatershed

    clusters = np.unique(clusters, return_inverse=True)[1].reshape(clusters.shape).astype(np.int64)
    us, vs, ws = [], [], []
    for c, o in enumerate(offsets):
        src, dst = _pairs(o, clusters.shape)
        a, b, w = clusters[src], clusters[dst], weights[c][src]
        on = (a != b) & (w != 0)
        us.append(a[on])
        vs.append(b[on])
        ws.append(w[on])
    u, v, w = np.concatenate(us), np.concatenate(vs), np.concatenate(ws)
    top = int(clusters.max()) + 1
    key = np.minimum(u, v) * top + np.maximum(u, v)
    order = np.lexsort((-np.abs(w), key))
    key, w = key[order], w[order]
    first = np.concatenate([[True], key[1:] != key[:-1]])
    key, w = key[first], w[first]
    order = np.argsort(-np.abs(w), kind="stable")
    root = np.arange(top)
    for fragment, segment in mwatershed.cluster(list(zip(
            (w[order] > 0).tolist(), (key[order] // top).tolist(), (key[order] % top).tolist()))):
        root[fragment] = segment
    return root[clusters], len(w)


def prefix(weights: np.ndarray, offsets, level: float) -> np.ndarray:
    """The mutex watershed of the edges with ``|weight| > level`` only."""
    return mutex_objects(np.where(np.abs(weights) > level, weights, 0.0), offsets)


def components(weights: np.ndarray, offsets, level: float) -> np.ndarray:
    """Labels (0..n-1) of the face-connected components of the attractive edges above
    ``level``."""
    shape = weights.shape[1:]
    index = np.arange(int(np.prod(shape))).reshape(shape)
    us, vs = [], []
    for c, o in enumerate(offsets):
        if is_nearest(o):
            src, dst = _pairs(o, shape)
            on = weights[c][src] > level
            us.append(index[src][on])
            vs.append(index[dst][on])
    u, v = np.concatenate(us), np.concatenate(vs)
    links = scipy.sparse.coo_matrix((np.ones(len(u), bool), (u, v)), shape=(index.size,) * 2)
    return scipy.sparse.csgraph.connected_components(links, directed=False)[1].reshape(shape)


def _pairs(offset, shape) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """The slices of an edge's first voxels and of their partners at ``offset``."""
    return (tuple(slice(max(0, -d), s - max(0, d)) for d, s in zip(offset, shape)),
            tuple(slice(max(0, d), s - max(0, -d)) for d, s in zip(offset, shape)))


def wider_than(label: np.ndarray, width: int) -> np.ndarray:
    """Whether each voxel's component spans more than ``width`` voxels along some axis."""
    spans = np.array([max(s.stop - s.start for s in box)
                      for box in ndi.find_objects(label.astype(np.int64) + 1)])
    return spans[label] > width


def unrepelled(weights: np.ndarray, offsets, label: np.ndarray, level: float) -> np.ndarray:
    """Whether each voxel's component has no repulsive edge stronger than ``level`` between
    two of its voxels."""
    repelled = np.zeros(int(label.max()) + 1, bool)
    for c, o in enumerate(offsets):
        src, dst = _pairs(o, label.shape)
        on = weights[c][src] < -level
        a, b = label[src][on], label[dst][on]
        repelled[a[a == b]] = True
    return ~repelled[label]


def blockwise_prefix(read, shape, offsets, level: float, block: int, halo: int) -> np.ndarray:
    """Prefix clusters at ``level`` computed block by block with ``halo`` voxels of context:
    each block's own voxels keep their block's clusters, numbered block-unique."""
    out = np.zeros(shape, np.int64)
    blocks, base = Blocks(shape, (block,) * len(shape)), 0
    for k in range(len(blocks)):
        lo, hi = blocks.box(k)
        olo = tuple(max(0, a - halo) for a in lo)
        ohi = tuple(min(s, b + halo) for b, s in zip(hi, shape))
        core = prefix(read(olo, ohi), offsets, level)[inner_slices((olo, ohi), (lo, hi))]
        dense = np.unique(core, return_inverse=True)[1].reshape(core.shape)
        out[box_slices(lo, hi)] = dense + base + 1
        base += int(dense.max()) + 1
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--region", required=True, help="PRED.zarr/<region> of predict.py")
    p.add_argument("--class", dest="cls", default="cell")
    p.add_argument("--config", help="a run's config.toml: its [inference] thresholds")
    p.add_argument("--flags", default="", help="config flags over --config")
    p.add_argument("--levels", default="0.55,0.4,0.2", help="prefix levels c, comma-separated")
    p.add_argument("--ladder", default="0.599,0.59,0.55,0.5,0.4,0.2",
                   help="levels L of the self-decided parts, comma-separated")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--halo", default="16,32", help="voxels of context, comma-separated")
    p.add_argument("--stability", action="store_true")
    args = p.parse_args(argv)

    import zarr

    pp = settings(args.config, args.flags)
    region = zarr.open_group(args.region, mode="r")
    names, offsets = channels(Path(args.region), args.cls)
    arrays = [region[f"{n}/s0"] for n in names]
    shape = arrays[0].shape

    def read(lo, hi, seed=0):
        box = tuple(slice(a, b) for a, b in zip(lo, hi))
        w = mutex_weights(np.stack([from_stored(a[box]) for a in arrays]), offsets,
                          pp.mutex_threshold_nearest, pp.mutex_threshold_long,
                          pp.mutex_long_stride, lo)
        return tie_broken(w, lo, seed)

    levels = [float(x) for x in args.levels.split(",")]
    halos = [int(x) for x in args.halo.split(",")]
    weights = read((0,) * len(shape), shape)
    t0 = time.perf_counter()
    whole = mutex_objects(weights, offsets)
    print(f"{args.region}: {shape} voxels, mutex {pp.mutex_threshold_nearest} / "
          f"{pp.mutex_threshold_long}; the whole cut: {len(np.unique(whole))} objects, "
          f"{time.perf_counter() - t0:.0f} s\n")

    print("| level c | prefix clusters | graph edges per voxel | agreement with the whole cut |")
    print("|---|---|---|---|")
    for c in levels:
        clusters = prefix(weights, offsets, c)
        ids, edges = graph_cut(clusters, weights, offsets)
        print(f"| {c} | {len(np.unique(clusters))} | {edges / clusters.size:.3f} | "
              f"{matching_agreement(ids, whole):.6f} |", flush=True)

    ladder = sorted((float(x) for x in args.ladder.split(",")), reverse=True)
    print("\n| level L | " + " | ".join(f"voxels in components wider than {h}" for h in halos)
          + " | voxels in components without a repulsion above L |")
    print("|---|" + "---|" * (len(halos) + 1))
    parts = np.arange(1, weights[0].size + 1).reshape(shape)  # each voxel alone at first
    for level in ladder:
        label = components(weights, offsets, level)
        free = unrepelled(weights, offsets, label, level)
        parts = np.where(free, label.astype(np.int64) + parts.size + 1, parts)
        parts = np.unique(parts, return_inverse=True)[1].reshape(shape) + 1
        print(f"| {level} | " + " | ".join(f"{wider_than(label, h).mean():.3f}" for h in halos)
              + f" | {free.mean():.3f} |", flush=True)
    ids, edges = graph_cut(parts, weights, offsets)
    print(f"\nEach voxel in its coarsest component without a repulsion: {len(np.unique(parts))} "
          f"parts ({parts.size / len(np.unique(parts)):.1f} voxels each), graph "
          f"{edges / parts.size:.3f} edges per voxel, agreement with the whole cut "
          f"{matching_agreement(ids, whole):.6f}", flush=True)

    print(f"\n| level c | halo | blocks of {args.block}^3: graph edges per voxel | "
          "agreement with the whole cut | seconds |")
    print("|---|---|---|---|---|")
    for c in levels:
        for h in halos:
            t0 = time.perf_counter()
            clusters = blockwise_prefix(read, shape, offsets, c, args.block, h)
            ids, edges = graph_cut(clusters, weights, offsets)
            print(f"| {c} | {h} | {edges / clusters.size:.3f} | "
                  f"{matching_agreement(ids, whole):.4f} | {time.perf_counter() - t0:.0f} |",
                  flush=True)

    if args.stability:
        other = mutex_objects(read((0,) * len(shape), shape, seed=1), offsets)
        step = np.float32(0.5 / 65535)
        rng = np.random.default_rng(0)
        box = tuple(slice(0, s) for s in shape)
        noisy = np.stack([np.clip(from_stored(a[box]) + rng.uniform(-step, step, shape)
                                  .astype(np.float32), 0, 1) for a in arrays])
        noisy = tie_broken(mutex_weights(noisy, offsets, pp.mutex_threshold_nearest,
                                         pp.mutex_threshold_long, pp.mutex_long_stride),
                           (0,) * len(shape))
        print("\n| the whole cut against | agreement |\n|---|---|")
        print(f"| another order of ties | {matching_agreement(other, whole):.4f} |")
        print(f"| noise of half a 16-bit step | "
              f"{matching_agreement(mutex_objects(noisy, offsets), whole):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
