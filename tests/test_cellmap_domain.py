"""The CellMap domain layer (``torchtitan.cellmap``): one rule for label values, one owner
for each fact.

A crop stored with instance ids (values above 1, plus absent and unknown voxels) must give
the same truth to training (the dataset's read path), validation, scoring (the scoring
tool's read) and the plotting helper. And each fact of the domain (the class table, the
instance classes, the label rule, the grid type, the OME-NGFF writer) is defined once in the
source tree.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from torchtitan.cellmap.labels import LabelEncoding, label_to_ids, label_to_target
from torchtitan.cellmap.ome_ngff import read_multiscales, write_multiscale_array_group
from torchtitan.data.crops.layout import EM_GROUP, GT_GROUP, discover
from torchtitan.data.sampling.samples import SegmentationSamples
from torchtitan.data.io.stores import StoreContext
from torchtitan.data.crops.reader import (compose_targets, groups_to_read, read_instance_ids,
                                          read_raw)
from torchtitan.scripts.label_crops import read_crop_volume
from torchtitan.scoring.stores import read_truth

REPO = Path(__file__).resolve().parents[1]
VOXEL = (8.0, 8.0, 8.0)
CROP_SHAPE = (8, 16, 16)
CROP_CORNER = (4, 4, 4)  # EM voxel of the crop's voxel 0
# How an instance group of the challenge declares its values: no "present", ids instead.
INSTANCE_ENCODING = {"cellmap": {"annotation": {"annotation_type": {
    "encoding": {"absent": 0, "unknown": 255}, "type": "instance_segmentation"}}}}


def _instance_labels() -> np.ndarray:
    """Absent background, objects with ids 1, 2, 3 and 7, and an unknown slab (z rows 0-1)."""
    labels = np.zeros(CROP_SHAPE, np.uint8)
    labels[2:6, 1:5, 1:5] = 1
    labels[2:6, 1:5, 8:12] = 2
    labels[3:7, 9:14, 2:6] = 3
    labels[1:8, 10:15, 9:15] = 7  # reaches into the unknown slab (z row 1)
    labels[:2] = 255
    return labels


@pytest.fixture(scope="module")
def instance_crop(tmp_path_factory):
    """A dataset whose one crop stores the instance class ``mito`` as object ids."""
    root = tmp_path_factory.mktemp("domain")
    store = zarr.open_group(str(root / "jrc_t-1" / "jrc_t-1.zarr"), mode="w", zarr_format=2)
    em = np.random.default_rng(0).integers(0, 256, (16, 24, 24), dtype=np.uint8)
    write_multiscale_array_group(store, EM_GROUP, [em], VOXEL, [v / 2 for v in VOXEL], chunks=(8, 8, 8))
    translation = [(c + 0.5) * v for c, v in zip(CROP_CORNER, VOXEL)]
    write_multiscale_array_group(store, f"{GT_GROUP}/crop1/mito", [_instance_labels()], VOXEL,
                                 translation, chunks=(8, 8, 8), extra_attrs=INSTANCE_ENCODING)
    (source,) = discover(StoreContext(), root)
    return source, source.crops[0]


def test_the_label_rule():
    raw = np.array([0, 1, 2, 7, 255], np.uint8)
    target, valid = label_to_target(raw)
    assert target.tolist() == [False, True, True, True, False]  # every id is present
    assert valid.tolist() == [True, True, True, True, False]
    assert label_to_ids(raw).tolist() == [0, 1, 2, 7, 0]
    other = LabelEncoding(absent=3, present=4, unknown=9)
    assert label_to_target(np.array([3, 4, 5, 9]), other)[0].tolist() == [False, True, True, False]
    assert LabelEncoding.from_attrs(INSTANCE_ENCODING) == LabelEncoding(0, 1, 255)


def test_training_validation_scoring_and_plots_agree_on_instance_ids(instance_crop):
    source, crop = instance_crop
    labels = _instance_labels()
    present, annotated = (labels != 0) & (labels != 255), labels != 255

    # Scoring: the scoring tool's read of the crop's s0 grid (instance ids kept).
    ids, valid, level = read_truth(crop, "mito")
    origin, shape = level.box_min, level.shape
    assert shape == CROP_SHAPE
    np.testing.assert_array_equal(valid, annotated)
    np.testing.assert_array_equal(ids, np.where(present, labels, 0))

    # Training: the dataset's read path (stored values -> composed targets).
    raw = {g: read_raw(crop, g, origin, VOXEL, shape) for g in groups_to_read(crop, ["mito"])}
    target, train_valid = compose_targets(crop, ["mito"], raw, shape)
    np.testing.assert_array_equal(target[0].astype(bool), present)
    np.testing.assert_array_equal(train_valid[0].astype(bool), annotated)

    # Validation: what the segmentation task reads of a whole validation crop.
    samples = SegmentationSamples([source], [crop], ["mito"], VOXEL, (8, 8, 8), seed=0)
    vol = samples.reader.read(crop, origin, shape)
    np.testing.assert_array_equal(vol.target[0] > 0, present)
    np.testing.assert_array_equal(vol.valid[0] > 0, annotated)
    np.testing.assert_array_equal(read_instance_ids(crop, "mito", origin, VOXEL, shape), ids)

    # Plots: what the helper draws as ground truth.
    plotted = read_crop_volume(source, crop, ["mito"], VOXEL)
    np.testing.assert_array_equal(plotted["origin"], origin)
    np.testing.assert_array_equal(plotted["truth"][0], present)
    np.testing.assert_array_equal(plotted["valid"][0], annotated)


def test_written_metadata_reads_back(tmp_path):
    """The one writer's OME-NGFF metadata follows the voxel-centre convention of a 2x pyramid."""
    group = zarr.open_group(str(tmp_path / "g.zarr"), mode="w", zarr_format=2)
    levels = [np.zeros((8, 8, 8), np.uint8), np.zeros((4, 4, 4), np.uint8)]
    write_multiscale_array_group(group, "a/b", levels, (4.0, 8.0, 8.0), (2.0, 4.0, 104.0))
    s0, s1 = read_multiscales(tmp_path / "g.zarr" / "a" / "b")
    assert s0.scale == (4.0, 8.0, 8.0) and s1.scale == (8.0, 16.0, 16.0)
    assert s1.translation == (4.0, 8.0, 108.0)
    np.testing.assert_allclose(s0.box_min, s1.box_min)  # both levels cover the same box
    np.testing.assert_allclose(s0.box_max, s1.box_max)
