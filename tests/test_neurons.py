"""Neurons from predicted boundaries (torchtitan/postprocess/neurons.py) and their place in post-processing."""

import numpy as np
import pytest

from torchtitan.postprocess.neurons import boundary_instances
from torchtitan.postprocess.masks import PostProcessing, PostProcessingError, postprocess


def _two_cells(gap: int = 0):
    """Two boxes side by side in one mask, a membrane plane between them (a hole of side
    ``gap`` in its middle)."""
    inside = np.ones((12, 20, 30), bool)
    membrane = np.zeros_like(inside)
    membrane[:, :, 14:16] = True
    if gap:
        membrane[6 - gap // 2: 6 + (gap + 1) // 2, 10 - gap // 2: 10 + (gap + 1) // 2, 14:16] = False
    return inside, membrane


def test_membrane_cuts_one_mask_into_its_cells():
    inside, membrane = _two_cells()
    ids, n = boundary_instances(membrane, (10, 10, 10), seed_nm=10)
    assert n == 2
    # every voxel gets an id, the cut runs through the membrane's middle
    assert (ids > 0).all()
    assert (ids[:, :, :15] == ids[0, 0, 0]).all() and (ids[:, :, 15:] == ids[0, 0, -1]).all()


def test_a_gap_narrower_than_twice_the_seed_distance_does_not_join_the_cells():
    inside, membrane = _two_cells(gap=2)  # a 20 nm hole
    assert boundary_instances(membrane, (10, 10, 10), seed_nm=0)[1] == 1  # leaks at seed 0
    assert boundary_instances(membrane, (10, 10, 10), seed_nm=20)[1] == 2


def test_small_seeds_are_dropped_and_outside_the_mask_stays_zero():
    inside, membrane = _two_cells()
    membrane[4:7, 8:11, 2:5] = True  # a 3 x 3 x 3 block of membrane...
    membrane[5, 9, 3] = False        # ...enclosing one voxel of interior
    inside[:, :, -3:] = False
    ids, n = boundary_instances(membrane, (10, 10, 10), seed_nm=0, inside=inside)
    assert n == 3  # the one-voxel speck is a seed of its own
    ids, n = boundary_instances(membrane, (10, 10, 10), seed_nm=0, inside=inside,
                                min_object_nm3=2000)  # two voxels
    assert n == 2 and (ids[:, :, -3:] == 0).all()


def test_anisotropic_distances_are_in_nm():
    inside, membrane = _two_cells(gap=2)
    # 40 nm voxels across the hole's axes: the hole is 80 nm wide, 20 nm seeds leak through
    assert boundary_instances(membrane, (40, 40, 10), seed_nm=20)[1] == 1


def test_postprocess_cuts_cell_by_pm_only_when_asked_and_both_are_predicted():
    inside, membrane = _two_cells()
    masks = {"cell": inside, "pm": membrane}
    on = PostProcessing(boundary_instances=True, boundary_seed_nm=10)
    assert on.enabled and on.membrane("cell", masks) == "pm" and on.membrane("mito", masks) is None
    out = postprocess(masks, (10, 10, 10), on)
    assert out["cell"].max() == 2 and out["pm"].dtype == bool
    assert postprocess(masks, (10, 10, 10), PostProcessing(instances="watershed"))["cell"].max() == 1
    assert postprocess({"cell": inside}, (10, 10, 10), on)["cell"].max() == 1  # no pm: components


def test_bad_seed_distance_names_the_option():
    with pytest.raises(PostProcessingError, match="inference.boundary_seed_nm"):
        PostProcessing(boundary_instances=True, boundary_seed_nm=-1)
