"""Objects cut from affinities block by block (torchtitan/postprocess/blockwise_affinities.py)
against the whole-volume cuts, on noisy affinities of known objects in a real zarr store, with
one and two ranks, and the region graph's edge tables on their own."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage as ndi
import zarr

from test_affinities import predicted, same_partition
from torchtitan.choices import AFFINITY_CUTS
from torchtitan.postprocess.affinities import affinity_instances, region_graph
from torchtitan.postprocess.blockwise_affinities import affinity_ids_blockwise
from torchtitan.postprocess.blockwise_labels import Blocks, Ranks, box_slices
from torchtitan.postprocess.masks import PostProcessing
from torchtitan.postprocess.region_graph import reduce_edges

OFFSETS = ((1, 0, 0), (0, 1, 0), (0, 0, 1), (3, 0, 0), (0, 3, 0), (0, 0, 3), (0, 0, 9))
SHAPE = (24, 40, 44)


def matching_agreement(a, b) -> float:
    """The share of voxels on which two id volumes agree once their ids are matched one to one,
    greedily by overlap (largest first): 1.0 for the same partition under other numbers. How
    block-by-block results are compared with whole-volume ones here (0 counts as an id)."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    if a.shape != b.shape:
        raise ValueError(f"id volumes of {a.size} and {b.size} voxels")
    if not a.size:
        return 1.0
    _, ia = np.unique(a, return_inverse=True)
    _, ib = np.unique(b, return_inverse=True)
    pairs, counts = np.unique(np.stack([ia.ravel(), ib.ravel()]), axis=1, return_counts=True)
    used_a, used_b, agreed = set(), set(), 0
    for i in np.argsort(-counts, kind="stable"):
        x, y = int(pairs[0, i]), int(pairs[1, i])
        if x not in used_a and y not in used_b:
            used_a.add(x)
            used_b.add(y)
            agreed += int(counts[i])
    return agreed / a.size



def voronoi(shape, n: int, seed: int = 0) -> np.ndarray:
    """Dense ids of ``n`` cells grown from random points (neuropil-like: no background)."""
    rng = np.random.default_rng(seed)
    points = rng.integers(0, shape, size=(n, len(shape)))
    seeds = np.zeros(shape, np.int64)
    seeds[tuple(points.T)] = np.arange(1, n + 1)
    _, nearest = ndi.distance_transform_edt(seeds == 0, return_indices=True)
    return seeds[tuple(nearest)]


@pytest.fixture(scope="module")
def region():
    ids = voronoi(SHAPE, 25)
    return ids, predicted(ids, OFFSETS, noise=0.2)


def blockwise(aff, block, pp, path, ranks=None, inside=None) -> np.ndarray:
    """The ids of every block, gathered into one volume."""
    work = zarr.open_group(str(path), mode="a").require_group("_work")
    blocks = Blocks(aff.shape[1:], block)
    read = affinity_ids_blockwise(lambda lo, hi: aff[(slice(None), *box_slices(lo, hi))],
                                  OFFSETS, inside, blocks, (10, 10, 10), pp,
                                  ranks or Ranks(), work, "cell")
    out = np.zeros(aff.shape[1:], np.uint32)
    for k in range(len(blocks)):
        lo, hi = blocks.box(k)
        out[box_slices(lo, hi)] = read(lo, hi)
    return out


@pytest.mark.parametrize("cut", AFFINITY_CUTS)
def test_blocks_match_the_whole_volume(region, tmp_path, cut):
    """The graph cuts give the whole volume's ids exactly (their basins, each cut by the
    block faces and stitched again, are the whole volume's here: every block's halo reaches
    across the region); the pixel mutex watershed nearly."""
    ids, aff = region
    pp = PostProcessing(affinity_cut=cut, min_object_nm3=2e5)  # 200 voxels
    whole, n = affinity_instances(aff, OFFSETS, cut, (10, 10, 10), min_object_nm3=2e5)
    assert matching_agreement(whole, ids) > 0.98  # the cut itself finds the cells
    one = blockwise(aff, SHAPE, pp, tmp_path / "one")
    many = blockwise(aff, (10, 16, 16), pp, tmp_path / "many")  # 3 x 3 x 3 blocks
    assert many.max() == len(np.unique(many)) and many.min() >= 1  # numbered 1..n
    if cut == "mutex":
        assert matching_agreement(one, whole) >= 0.99
        assert matching_agreement(many, whole) >= 0.99
    else:
        np.testing.assert_array_equal(one, whole)
        np.testing.assert_array_equal(many, whole)
        # the graph itself is the whole volume's, bit for bit: the stitched basins, their
        # names (first voxels), sizes and integer affinity sums
        graph, _ = region_graph(aff, OFFSETS)
        kept = np.load(tmp_path / "many" / "_work" / "tables" / "cell.graph" / "graph.npz")
        np.testing.assert_array_equal(kept["names"], graph.names)
        np.testing.assert_array_equal(kept["sizes"], graph.sizes)
        for kind in ("near", "far"):
            for i, column in enumerate(getattr(graph, kind)):
                np.testing.assert_array_equal(kept[f"{kind}_{i}"], column)


@pytest.mark.parametrize("join", ["overlap", "graph"])
def test_the_pixel_cuts_joins_with_little_context(region, tmp_path, monkeypatch, join):
    """The pixel cut's two joins of its blocks (``MUTEX_JOIN``), each block cut with less
    context than the region (``MUTEX_HALO``): stitched where their objects overlap on the
    faces, or joined by the graph's mutex watershed."""
    from torchtitan.postprocess import blockwise_affinities

    ids, aff = region
    monkeypatch.setattr(blockwise_affinities, "MUTEX_JOIN", join)
    monkeypatch.setattr(blockwise_affinities, "MUTEX_HALO", 12 if join == "overlap" else 0)
    pp = PostProcessing(affinity_cut="mutex", min_object_nm3=2e5)
    whole, _ = affinity_instances(aff, OFFSETS, "mutex", (10, 10, 10), min_object_nm3=2e5)
    many = blockwise(aff, (10, 16, 16), pp, tmp_path / "many")
    assert many.max() == len(np.unique(many)) and many.min() >= 1
    assert matching_agreement(many, whole) >= 0.99
    assert matching_agreement(many, ids) > 0.98


def test_ranks_share_the_work_and_agree(region, tmp_path):
    """Two ranks on one store (run one after the other, the barrier a no-op between them)
    give what one rank gives: each step is written by its owner and read back by all."""
    ids, aff = region
    pp = PostProcessing(affinity_cut="mutex")
    single = blockwise(aff, (12, 20, 22), pp, tmp_path / "single")
    path = tmp_path / "two"
    work = zarr.open_group(str(path), mode="a").require_group("_work")
    blocks = Blocks(SHAPE, (12, 20, 22))
    import threading

    barrier = threading.Barrier(2)
    results = {}

    def rank(r):
        read = affinity_ids_blockwise(lambda lo, hi: aff[(slice(None), *box_slices(lo, hi))],
                                      OFFSETS, None, blocks, (10, 10, 10), pp,
                                      Ranks(r, 2, barrier.wait), work, "cell")
        out = np.zeros(SHAPE, np.uint32)
        for k in range(len(blocks)):
            lo, hi = blocks.box(k)
            out[box_slices(lo, hi)] = read(lo, hi)
        results[r] = out

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], single)


def test_mask_and_small_objects(region, tmp_path):
    ids, aff = region
    inside = np.ones(SHAPE, bool)
    inside[:, :, :3] = False
    out = blockwise(aff, (12, 20, 22), PostProcessing(affinity_cut="mutex"), tmp_path / "m",
                    inside=lambda lo, hi: inside[box_slices(lo, hi)])
    assert (out[:, :, :3] == 0).all() and (out[:, :, 3:] > 0).all()
    # 5e6 nm^3 = 5000 voxels of 10 nm: every object is at least that large
    out = blockwise(aff, (12, 20, 22), PostProcessing(affinity_cut="mutex", min_object_nm3=5e6),
                    tmp_path / "s")
    sizes = np.bincount(out.ravel())[1:]
    assert sizes.min() >= 5000 and len(sizes) < len(np.unique(ids))


def test_edge_tables_add_each_pair_once_with_small_or_huge_ids():
    """reduce_edges against a dictionary, with ids as they are and with ids too large for a
    pair key (made dense first): the same table."""
    rng = np.random.default_rng(0)
    u, v = rng.integers(1, 50, 1000), rng.integers(1, 50, 1000)
    sums, counts = rng.integers(0, 1 << 24, 1000), np.ones(1000, np.int64)
    expected: dict[tuple[int, int], int] = {}
    for a, b, s in zip(u.tolist(), v.tolist(), sums.tolist()):
        if a != b:
            key = (min(a, b), max(a, b))
            expected[key] = expected.get(key, 0) + s
    small = reduce_edges(u, v, sums, counts)
    assert list(zip(small[0].tolist(), small[1].tolist())) == sorted(expected)
    assert small[2].tolist() == [expected[k] for k in sorted(expected)]
    huge = reduce_edges(u * 10**10, v * 10**10, sums, counts)
    np.testing.assert_array_equal(huge[0], small[0] * 10**10)
    np.testing.assert_array_equal(huge[1], small[1] * 10**10)
    np.testing.assert_array_equal(huge[2], small[2])
    np.testing.assert_array_equal(huge[3], small[3])
