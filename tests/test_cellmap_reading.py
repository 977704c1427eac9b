"""Reading EM and label crops in world coordinates: grids of different resolution and offset."""

from pathlib import Path

import numpy as np
import pytest
import zarr

from torchtitan.data.crops.layout import DatasetError, discover
from torchtitan.data.crops.reader import read_linear
from torchtitan.data.sampling.samples import SegmentationSamples
from torchtitan.data.crops.reader import crop_grid
from torchtitan.data.io.stores import StoreContext
from torchtitan.data.crops.reader import read_target


def _write_level_group(group_path: Path, arrays: list[np.ndarray], scales, translations, attrs=None):
    g = zarr.open_group(str(group_path), mode="w", zarr_format=2)
    datasets = []
    for i, (a, s, t) in enumerate(zip(arrays, scales, translations)):
        g.create_array(f"s{i}", data=a, chunks=tuple(min(16, n) for n in a.shape))
        datasets.append({"path": f"s{i}", "coordinateTransformations": [
            {"type": "scale", "scale": list(s)}, {"type": "translation", "translation": list(t)}]})
    g.attrs["multiscales"] = [{
        "version": "0.4", "name": group_path.name,
        "axes": [{"name": n, "type": "space", "unit": "nanometer"} for n in "zyx"],
        "datasets": datasets}]
    if attrs:
        g.attrs.update(attrs)


EM_SCALE = (8.0, 8.0, 8.0)
EM_T = (4.0 + 80, 4.0, 4.0 + 40)  # voxel 0 centred at these nm (volume shifted in z and x)
BOUNDARY_X = 203.0  # nm: labels are "present" left of this plane


def _em_value(world_x):
    """EM encodes the x index of the EM voxel whose centre is at world_x."""
    return (world_x - EM_T[2]) / EM_SCALE[2]


@pytest.fixture()
def store(tmp_path):
    ds = tmp_path / "jrc_test-1"
    root = ds / "jrc_test-1.zarr"
    em = np.broadcast_to(np.arange(48, dtype=np.uint8)[None, None, :], (24, 40, 48)).copy()
    _write_level_group(root / "recon-1/em/fibsem-uint8", [em], [EM_SCALE], [EM_T])
    # A label crop on a 4 nm grid whose voxel centres sit half an EM voxel off the EM grid,
    # not at the origin; present where the voxel centre is left of BOUNDARY_X; a slab of
    # unknown voxels.
    lab_scale = (4.0, 4.0, 4.0)
    lab_t = (EM_T[0] + 24 + 2, EM_T[1] + 40 + 2, EM_T[2] + 16 + 2)  # 4 nm voxel centres
    shape = (20, 40, 60)
    xc = lab_t[2] + np.arange(shape[2]) * lab_scale[2]
    lab = np.broadcast_to((xc < BOUNDARY_X).astype(np.uint8)[None, None], shape).copy()
    lab[:, :4] = 255
    enc = {"cellmap": {"annotation": {"annotation_type": {
        "encoding": {"absent": 0, "present": 1, "unknown": 255},
        "type": "semantic_segmentation"}, "class_name": "mito"}}}
    _write_level_group(root / "recon-1/labels/groundtruth/crop7/mito", [lab], [lab_scale], [lab_t],
                       enc)
    # A coarser (16 nm) crop of another class at another offset.
    coarse = np.ones((4, 4, 4), dtype=np.uint8)
    _write_level_group(root / "recon-1/labels/groundtruth/crop8/nuc", [coarse], [(16.0,) * 3],
                       [(EM_T[0] + 4, EM_T[1] + 4, EM_T[2] + 4)], enc)
    return tmp_path


def test_discovery_reads_levels_and_crops(store):
    (src,) = discover(StoreContext(), store)
    assert src.name == "jrc_test-1"
    assert src.levels[0].scale == EM_SCALE and src.levels[0].translation == EM_T
    assert [c.name for c in src.crops] == ["crop7", "crop8"]
    crop = src.crops[0]
    assert list(crop.classes) == ["mito"]
    np.testing.assert_allclose(crop.box_min, [EM_T[0] + 24, EM_T[1] + 40, EM_T[2] + 16])
    np.testing.assert_allclose(crop.box_max - crop.box_min, [80, 160, 240])


def test_em_and_labels_align_in_world_coordinates(store):
    (src,) = discover(StoreContext(), store)
    crop = src.crops[0]
    origin, shape = crop_grid(crop, (8.0, 8.0, 8.0))
    assert shape == (10, 20, 30)
    img, inside = read_linear(src.stores, src.levels[0], origin, (8.0, 8.0, 8.0), shape)
    assert inside.all()
    centres_x = origin[2] + (np.arange(shape[2]) + 0.5) * 8.0
    # The training grid (corner at the crop's corner) sits half an EM voxel off the EM grid,
    # so EM is linearly interpolated: its value encodes the exact world position.
    np.testing.assert_allclose(img[0, 0], _em_value(centres_x), atol=1e-4)
    target, valid = read_target(crop, "mito", origin, (8.0, 8.0, 8.0), shape)
    # Unknown slab: label rows 0..3 at 4 nm = the first 16 nm = the first 2 training rows.
    assert not valid[:, :2].any() and valid[:, 2:].all()
    expected = centres_x < BOUNDARY_X
    np.testing.assert_array_equal(target[0, 5], expected)


def test_coarser_label_grid_and_padding_outside_crop(store):
    (src,) = discover(StoreContext(), store)
    crop = src.crops[1]
    # A box larger than the crop: voxels outside the crop are invalid, inside present.
    origin = crop.box_min - 16.0
    shape = (12, 12, 12)
    target, valid = read_target(crop, "nuc", origin, (8.0, 8.0, 8.0), shape)
    assert valid[2:10, 2:10, 2:10].all()
    assert not valid[:2].any() and not valid[:, :, 10:].any()
    assert target[valid].all()


def test_segmentation_samples_mask_unannotated_classes(store):
    (src,) = discover(StoreContext(), store)
    data = SegmentationSamples([src], src.crops, ["mito", "nuc"], (8.0, 8.0, 8.0), (8, 8), seed=0)
    seen_mito = seen_nuc = False
    for g in range(20):
        item = data[g]
        assert item.image.shape == (1, 8, 8) and item.target.shape == (2, 8, 8)
        mito_valid, nuc_valid = item.valid[0].any(), item.valid[1].any()
        assert not (mito_valid and nuc_valid)  # no crop annotates both
        seen_mito |= bool(mito_valid)
        seen_nuc |= bool(nuc_valid)
        again = data[g]
        for k, value in vars(item).items():
            same = value == getattr(again, k)
            assert bool(same.all() if hasattr(same, "all") else same), \
                "a sample must depend only on its index"
    assert seen_mito and seen_nuc


def test_missing_path_and_missing_groups(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        discover(StoreContext(), tmp_path / "nope")
    (tmp_path / "ds" / "ds.zarr").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no EM group"):
        discover(StoreContext(), tmp_path)
