"""The region graph of fragments and its agglomeration: one computation for a whole volume and
for a region cut into blocks.

The graph cut of :mod:`torchtitan.postprocess.affinities` (``mutex_graph``) turns fragments (watershed basins of the affinities) into objects in two steps
that see only a graph:

1. **the region graph**: for every offset, each pair of fragments with voxels joined by that
   offset gets the sum and the count of the predicted affinities of those voxel pairs (face
   neighbours and long range kept apart), and each fragment its voxel count;
2. **an agglomeration** of the graph: the graph's mutex watershed (Wolf et al. 2018,
   ``mwatershed``), then objects under the size floor absorbed by their best-joined
   neighbour.

The graph is made independent of how the volume is cut into blocks, bit for bit, so that a
blockwise run whose fragments agree with the whole volume's gives the same objects:

* affinities are summed as integers (units of ``1 / QUANTUM``): no order of addition changes a
  sum;
* a fragment is named by the raster index (+ 1) of its first voxel in the volume, which no
  blocking changes, and every table is sorted by these names, so the agglomerations meet
  their ties in the same order.

Floor 3: numpy and mwatershed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchtitan.cellmap.affinities import is_nearest
from torchtitan.errors import optional_import

QUANTUM = 1 << 24  # affinities summed in units of 2^-24: float32's resolution near 1

FragmentReader = Callable[[tuple, tuple], np.ndarray]  # (lo, hi) -> fragment ids of the box


# ---------------------------------------------------------------------------------------------
# Tables: (u, v, sum, count) arrays, u < v, sorted by (u, v)
# ---------------------------------------------------------------------------------------------


def _empty() -> tuple[np.ndarray, ...]:
    return (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64),
            np.zeros(0, np.int64))


def reduce_edges(u, v, sums, counts) -> tuple[np.ndarray, ...]:
    """The table of the edges ``(u, v)`` (either order), their ``sums`` and ``counts`` added
    where a pair repeats; pairs with ``u == v`` are dropped."""
    u, v = np.asarray(u, np.int64), np.asarray(v, np.int64)
    sums, counts = np.asarray(sums, np.int64), np.asarray(counts, np.int64)
    keep = u != v
    u, v, sums, counts = u[keep], v[keep], sums[keep], counts[keep]
    if not len(u):
        return _empty()
    top = int(max(u.max(), v.max())) + 1
    if top < 3_000_000_000:  # ids as they are: the pair's key fits in int64
        nodes, a, b = None, u, v
    else:  # ids made dense first
        nodes, dense = np.unique(np.concatenate([u, v]), return_inverse=True)
        top, dense = len(nodes), dense.ravel()
        a, b = dense[:len(u)], dense[len(u):]
    key = np.minimum(a, b) * top + np.maximum(a, b)
    order = np.argsort(key)  # sums are integers: the order within a pair changes nothing
    key, sums, counts = key[order], sums[order], counts[order]
    first = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
    key = key[first]
    u, v = key // top, key % top
    if nodes is not None:
        u, v = nodes[u], nodes[v]
    return u, v, np.add.reduceat(sums, first), np.add.reduceat(counts, first)


def concat_tables(tables) -> tuple[np.ndarray, ...]:
    tables = list(tables)
    if not tables:
        return _empty()
    return reduce_edges(*(np.concatenate([t[i] for t in tables]) for i in range(4)))


def quantized(affinities: np.ndarray) -> np.ndarray:
    """Affinities in [0, 1] as integers of ``1 / QUANTUM``."""
    return np.rint(np.asarray(affinities, np.float64) * QUANTUM).astype(np.int64)


def block_edges(here: np.ndarray, lo, hi, read_fragments: FragmentReader, affinities: np.ndarray,
                offsets, shape) -> dict[str, tuple[np.ndarray, ...]]:
    """The edges whose first voxel lies in the box ``[lo, hi)`` of a volume of ``shape``:
    ``{"near": table, "far": table}`` (face neighbours, long range). ``here``: the box's
    fragment ids (0: none); ``affinities`` (C, *box): the box's affinities along ``offsets``;
    ``read_fragments(lo, hi)``: fragment ids of any box of the volume (the partners)."""
    parts: dict[str, list] = {"near": [], "far": []}
    for i, o in enumerate(offsets):
        plo = tuple(max(0, l + d) for l, d in zip(lo, o))
        phi = tuple(min(s, h + d) for h, d, s in zip(hi, o, shape))
        if any(a >= b for a, b in zip(plo, phi)):
            continue
        partner = np.asarray(read_fragments(plo, phi))
        src = tuple(slice(p - d - l, q - d - l) for p, q, d, l in zip(plo, phi, o, lo))
        a = here[src]
        on = (a != partner) & (a > 0) & (partner > 0)
        if on.any():
            w = quantized(affinities[i][src][on])
            parts["near" if is_nearest(o) else "far"].append(
                (a[on].astype(np.int64), partner[on].astype(np.int64), w,
                 np.ones(len(w), np.int64)))
    return {kind: concat_tables(p) for kind, p in parts.items()}


def rename_table(table, lookup: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, ...]:
    """``table`` with its nodes renamed by ``lookup`` (edges inside one new node dropped)."""
    u, v, s, c = table
    return reduce_edges(lookup(u), lookup(v), s, c)


def first_voxels(frag: np.ndarray, lo, shape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each fragment id > 0 of the box ``frag`` at corner ``lo`` of a volume of ``shape``:
    (ids, names, voxel counts); a name is the volume's raster index of the fragment's first
    voxel in the box, + 1."""
    ids, first, sizes = np.unique(frag.ravel(), return_index=True, return_counts=True)
    keep = ids > 0
    ids, first, sizes = ids[keep], first[keep], sizes[keep]
    local = np.unravel_index(first, frag.shape)
    names = np.ravel_multi_index(tuple(x + o for x, o in zip(local, lo)), shape)
    return ids.astype(np.int64), names.astype(np.int64) + 1, sizes.astype(np.int64)


# ---------------------------------------------------------------------------------------------
# The graph and its agglomerations
# ---------------------------------------------------------------------------------------------


@dataclass
class RegionGraph:
    """Fragments (``names`` sorted, ``sizes`` in voxels) and their edges (tables)."""

    names: np.ndarray
    sizes: np.ndarray
    near: tuple[np.ndarray, ...]
    far: tuple[np.ndarray, ...]


def _union_find():
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:
            parent[x], x = root, parent[x]
        return root

    return parent, find


def _edges(table) -> list[tuple[int, int, int, int]]:
    return list(zip(*(a.tolist() for a in table)))


def mutex_graph(graph: RegionGraph, threshold_nearest: float, threshold_long: float,
                apart: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None
                ) -> dict[int, int]:
    """The mutex watershed of the graph: each edge weighted by its mean affinity minus
    ``threshold_nearest`` (face neighbours) or ``threshold_long`` (long range; these only
    repel, as in the pixel cut, so that objects join only where they touch); ``apart(u,
    v)``: the edges forced apart (a mutex taken before any other). Returns {node: root}."""
    mwatershed = optional_import("mwatershed", "neurons", "The mutex cut of a region graph")
    weights, us, vs = [], [], []
    forced = 2.0  # above any |mean - threshold|: taken first
    for table, threshold in ((graph.near, threshold_nearest), (graph.far, threshold_long)):
        u, v, s, c = table
        w = s / np.maximum(c, 1) / QUANTUM - threshold
        if apart is not None:
            w = np.where(apart(u, v), -forced, w)
        if table is graph.far:
            keep = w < 0  # a long-range edge only repels: one that would join is left out
            u, v, w = u[keep], v[keep], w[keep]
        weights.append(w)
        us.append(u)
        vs.append(v)
    w, u, v = np.concatenate(weights), np.concatenate(us), np.concatenate(vs)
    # mwatershed.cluster_edges's order (decreasing |weight|, ties in the order given), sorted
    # here by numpy rather than by Python
    order = np.argsort(-np.abs(w), kind="stable")
    root = {int(n): int(n) for n in graph.names.tolist()}
    for fragment, segment in mwatershed.cluster(
            list(zip((w[order] > 0).tolist(), u[order].tolist(), v[order].tolist()))):
        root[int(fragment)] = int(segment)
    return root


def _touch(contact: dict, a: int, b: int, s: int, c: int) -> None:
    """Add a contact of affinity sum ``s`` over ``c`` voxel pairs between objects a and b."""
    for x, y in ((a, b), (b, a)):
        e = contact.setdefault(x, {}).setdefault(y, [0, 0])
        e[0] += s
        e[1] += c


def absorb_small(root: dict[int, int], graph: RegionGraph, min_voxels: int) -> dict[int, int]:
    """Objects under ``min_voxels`` join the neighbour they share the highest mean face
    affinity with, smallest (then lowest named) first; an object with no neighbour stays."""
    if min_voxels <= 1:
        return root
    size: dict[int, int] = {}
    for f, s in zip(graph.names.tolist(), graph.sizes.tolist()):
        size[root[f]] = size.get(root[f], 0) + s
    contact: dict[int, dict[int, list]] = {}
    for u, v, s, c in _edges(graph.near):
        if root[u] != root[v]:
            _touch(contact, root[u], root[v], s, c)
    parent, find = _union_find()
    for obj in sorted(size, key=lambda x: (size[x], x)):
        here = find(obj)
        if size[here] >= min_voxels:
            continue
        best, best_mean = None, -1.0
        for n, (s, c) in sorted(contact.get(here, {}).items()):
            other = find(n)
            if other != here and s / c > best_mean:
                best, best_mean = other, s / c
        if best is None:
            continue
        parent[here] = best
        size[best] += size[here]
        for n, (s, c) in sorted(contact.pop(here, {}).items()):
            if find(n) != best:
                _touch(contact, best, find(n), s, c)
    return {f: find(s) for f, s in root.items()}


def agglomerate_graph(graph: RegionGraph, method: str, *, threshold_nearest: float,
                      threshold_long: float, min_voxels: int, apart=None) -> np.ndarray:
    """Object ids (uint32, 1..n, numbered in the order of their first fragment's name: the
    raster order of their first voxel) of ``graph.names`` by ``method``: a mutex watershed
    (``mutex`` / ``mutex_graph``, ``apart``: :func:`mutex_graph`) or ``keep`` (each fragment
    an object); then small objects absorbed."""
    if method == "keep":
        root = {int(n): int(n) for n in graph.names.tolist()}
    else:
        root = mutex_graph(graph, threshold_nearest, threshold_long, apart)
    root = absorb_small(root, graph, min_voxels)
    number: dict[int, int] = {}
    for f in graph.names.tolist():  # sorted: objects numbered by their first fragment
        number.setdefault(root[f], len(number) + 1)
    return np.array([number[root[f]] for f in graph.names.tolist()], np.uint32)
