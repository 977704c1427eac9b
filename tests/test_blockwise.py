"""Blockwise post-processing equals the whole-region functions, on real zarr stores.

Masks are blobs of smoothed noise (objects of every shape, many crossing block faces, edges and
corners) plus a ball centred on a block corner; the blocks do not divide the region. The
whole-region reference is :func:`torchtitan.postprocess.masks.postprocess` on the same masks.
Two ranks run as two threads on the same store, with a real barrier between the passes.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import scipy.ndimage as ndi
import zarr

from torchtitan.postprocess.blockwise import postprocess_region
from torchtitan.postprocess.blockwise_labels import Blocks, Ranks, label_blockwise
from torchtitan.postprocess.masks import PostProcessing, postprocess

SHAPE = (37, 45, 51)
BLOCK = (16, 16, 16)
VOXEL = (8.0, 8.0, 8.0)


def blobs(seed: int, sigma: float = 2.0, fraction: float = 0.15, shape=SHAPE) -> np.ndarray:
    """About ``fraction`` of the voxels in blobs of about ``sigma`` voxels."""
    rng = np.random.default_rng(seed)
    smooth = ndi.gaussian_filter(rng.standard_normal(shape), sigma)
    mask = smooth > np.quantile(smooth, 1 - fraction)
    z, y, x = np.ogrid[tuple(slice(0, s) for s in shape)]
    mask |= (z - 16) ** 2 + (y - 16) ** 2 + (x - 16) ** 2 <= 16  # a ball on a block corner
    return mask


def region_store(tmp_path, masks: dict[str, np.ndarray], chunks=BLOCK):
    root = zarr.open_group(str(tmp_path / "pred.zarr"), mode="w", zarr_format=2)
    group = root.require_group("crop1")
    for cls, mask in masks.items():
        group.require_group(cls).attrs["keep"] = cls
        group[cls].create_array("s0", shape=mask.shape, chunks=chunks, dtype="uint8",
                                fill_value=0)[:] = mask.astype(np.uint8)
    return group


def run_ranks(world: int, fn):
    """``fn(rank, world, barrier)`` on ``world`` threads at once; the first error is raised."""
    if world == 1:
        return [fn(0, 1, lambda: None)]
    barrier = threading.Barrier(world, timeout=120)
    results, errors = [None] * world, []

    def target(rank):
        try:
            results[rank] = fn(rank, world, barrier.wait)
        except BaseException as e:  # noqa: BLE001: re-raised below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two id volumes hold the same objects (a bijection between their ids)."""
    if not np.array_equal(a > 0, b > 0):
        return False
    pairs = np.unique(np.stack([a[a > 0], b[b > 0]]), axis=1)
    return len(np.unique(pairs[0])) == len(np.unique(pairs[1])) == pairs.shape[1]


@pytest.mark.parametrize("connectivity,world", [("full", 1), ("faces", 1), ("planes", 1),
                                                ("full", 2), ("planes", 2)])
def test_components_equal_scipy_numbering(tmp_path, connectivity, world):
    mask = blobs(0)
    group = region_store(tmp_path, {"mito": mask})
    structure = {"full": np.ones((3, 3, 3), bool),
                 "faces": ndi.generate_binary_structure(3, 1),
                 "planes": np.pad(ndi.generate_binary_structure(2, 1)[None], ((1, 1), (0, 0),
                                                                               (0, 0)))}
    expected, n = ndi.label(mask, structure=structure[connectivity])
    blocks = Blocks(SHAPE, BLOCK)

    def job(rank, world, barrier):
        work = group.require_group("_work") if rank == 0 else None
        barrier()
        work = work if work is not None else group["_work"]
        c = label_blockwise(lambda lo, hi: mask[tuple(map(slice, lo, hi))], blocks,
                            Ranks(rank, world, barrier), work, "m", connectivity)
        return c.count, c.ids((0, 0, 0), SHAPE)

    for count, ids in run_ranks(world, job):
        assert count == n and n > 20
        np.testing.assert_array_equal(ids, expected)  # the same ids, not only the same objects


CASES = {
    "components": PostProcessing(),
    "min_object+volume_holes": PostProcessing(min_object_nm3=40 * 512.0, fill_holes="volume"),
    "planes_holes": PostProcessing(fill_holes="planes", fill_holes_classes=("mito",)),
    "watershed": PostProcessing(instances="watershed", min_object_nm3=20 * 512.0,
                                watershed_neck_ratio=0.7),
}


@pytest.mark.parametrize("case,world", [(c, 1) for c in CASES] + [("min_object+volume_holes", 2),
                                                                  ("watershed", 2)])
def test_region_equals_whole_region(tmp_path, case, world):
    post = CASES[case]
    masks = {"mito": blobs(1), "er": ~blobs(2, sigma=1.5, fraction=0.2)}  # er: holes
    group = region_store(tmp_path, masks)
    counts = run_ranks(world, lambda r, w, b: postprocess_region(
        group, list(masks), VOXEL, post, True, BLOCK, r, w, b))[0]
    expected = postprocess(masks, VOXEL, post)
    ids = group["mito/s0"][:]
    assert group["mito/s0"].dtype == np.uint32 and group["er/s0"].dtype == np.uint8
    np.testing.assert_array_equal(ids, expected["mito"])  # numbered as the whole-region run
    np.testing.assert_array_equal(group["er/s0"][:] > 0, expected["er"])
    assert counts["mito"] == expected["mito"].max()
    assert group["mito"].attrs["keep"] == "mito"  # the class group's attributes stay
    assert sorted(os.listdir(tmp_path / "pred.zarr/crop1/mito")) == [".zattrs", ".zgroup", "s0"]
    if case == "watershed":  # the case splits objects, or it tests nothing
        assert expected["mito"].max() > ndi.label(masks["mito"], np.ones((3, 3, 3)))[1] - 5


def neuropil(seed: int, shape=(40, 48, 48), cells: int = 25):
    """Voronoi cells with 1-voxel membranes between them: (membrane mask, cell mask)."""
    rng = np.random.default_rng(seed)
    points = rng.uniform(0, 1, (cells, 3)) * shape
    grid = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"), -1)
    owner = np.argmin(((grid[..., None, :] - points) ** 2).sum(-1), axis=-1)
    membrane = np.zeros(shape, bool)
    for axis in range(3):
        a = np.diff(owner, axis=axis) != 0
        membrane[tuple(slice(0, -1) if i == axis else slice(None) for i in range(3))] |= a
    membrane |= rng.random(shape) < 0.002  # specks
    cell = np.ones(shape, bool)
    cell[:, :2] = False  # a strip outside every cell
    return membrane, cell


@pytest.mark.parametrize("world", [1, 2])
def test_neurons_equal_whole_region(tmp_path, world):
    membrane, cell = neuropil(3)
    masks = {"pm": membrane, "cell": cell}
    post = PostProcessing(boundary_instances=True, boundary_seed_nm=16.0,
                          min_object_nm3=8 * 512.0)
    group = region_store(tmp_path, masks)
    run_ranks(world, lambda r, w, b: postprocess_region(
        group, ["pm", "cell"], VOXEL, post, True, BLOCK, r, w, b, halo_nm=8 * 48))
    expected = postprocess(masks, VOXEL, post)
    assert expected["cell"].max() >= 15
    np.testing.assert_array_equal(group["cell/s0"][:], expected["cell"])
    np.testing.assert_array_equal(group["pm/s0"][:] > 0, expected["pm"])


def test_neurons_with_a_short_halo_nearly_equal(tmp_path):
    """A halo shorter than the region: the seeds are exact (the same ids), the flood nearly so;
    what differs is which of two neighbours gets a voxel of the membrane between them (the
    flood's order on that flat floor depends on where it starts)."""
    membrane, cell = neuropil(4, shape=(48, 64, 64), cells=40)
    masks = {"pm": membrane, "cell": cell}
    post = PostProcessing(boundary_instances=True, boundary_seed_nm=16.0)
    group = region_store(tmp_path, masks)
    postprocess_region(group, ["pm", "cell"], VOXEL, post, True, BLOCK, halo_nm=8 * 8)
    got, expected = group["cell/s0"][:], postprocess(masks, VOXEL, post)["cell"]
    assert got.max() == expected.max()  # the same seeds, the same ids
    differ = got != expected
    assert differ.mean() < 0.01
    assert (differ & membrane).sum() >= 0.9 * differ.sum()


def test_a_part_with_several_seeds_is_flooded_on_its_box(tmp_path):
    """Two balls joined by a neck too thin for a seed, inside a membrane: one part of the
    interior with two seeds, across many blocks. With a halo of one voxel, far shorter than
    the way from the neck to either ball, the part is still split as the whole region splits
    it (flooded on its box), and so is every part with one seed."""
    shape = (24, 40, 64)
    z, y, x = np.ogrid[:shape[0], :shape[1], :shape[2]]
    balls = ((z - 12) ** 2 + (y - 20) ** 2 + (x - 14) ** 2 <= 81) | \
            ((z - 12) ** 2 + (y - 20) ** 2 + (x - 50) ** 2 <= 81)
    neck = ((z - 12) ** 2 + (y - 20) ** 2 <= 1) & (x > 14) & (x < 50)
    dumbbell = balls | neck
    membrane = ndi.binary_dilation(dumbbell) & ~dumbbell
    masks = {"pm": membrane, "cell": np.ones(shape, bool)}
    post = PostProcessing(boundary_instances=True, boundary_seed_nm=16.0)
    group = region_store(tmp_path, masks)
    postprocess_region(group, ["pm", "cell"], VOXEL, post, True, BLOCK, halo_nm=8.0)
    got, expected = group["cell/s0"][:], postprocess(masks, VOXEL, post)["cell"]
    assert len(np.unique(expected[dumbbell])) == 2  # the neck is shared out between the balls
    interior = ~membrane
    np.testing.assert_array_equal(got[interior], expected[interior])


def test_killed_run_is_run_again(tmp_path):
    """A run killed while replacing s0 (renamed away) or before: running again gives the same."""
    masks = {"mito": blobs(5), "er": blobs(6)}
    post = CASES["min_object+volume_holes"]
    expected = postprocess(masks, VOXEL, post)
    group = region_store(tmp_path, masks)
    mito = tmp_path / "pred.zarr/crop1/mito"
    postprocess_region(group, list(masks), VOXEL, post, True, BLOCK)
    # Killed between the two renames of a second run: s0 is gone, _raw holds it.
    os.rename(mito / "s0", mito / "_raw")
    zarr.open_group(str(tmp_path / "pred.zarr/crop1"), mode="r+")["mito"].create_array(
        "_post", shape=SHAPE, chunks=BLOCK, dtype="uint32", fill_value=7)  # half written
    postprocess_region(group, list(masks), VOXEL, post, True, BLOCK)
    np.testing.assert_array_equal(group["mito/s0"][:], expected["mito"])
    np.testing.assert_array_equal(group["er/s0"][:] > 0, expected["er"])
    assert sorted(os.listdir(mito)) == [".zattrs", ".zgroup", "s0"]
