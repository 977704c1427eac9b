"""Limits on what a run sees: a fraction of the training labels (``data.train_label_fraction``,
for label-efficiency studies) and the EM that MAE pretraining holds out (``data.val_crops``).

Each test writes a small store whose EM value tells the section a voxel came from (section z
holds 10 * z + 5), so that a sample's image says where it was drawn.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_sampling_augment import make_store, write_labels

from torchtitan.config.manager import ConfigManager
from torchtitan.data.crops.layout import DatasetError
from torchtitan.data.crops.selection import DataSettings, load_segmentation_data
from torchtitan.data.volume_source import build_source
from torchtitan.errors import ConfigError

SECTIONS, SIDE = 20, 32


def sections_of(image) -> set[int]:
    """The sections whose EM a sample shows (raw uint8 or normalised)."""
    raw = np.asarray(image, dtype=np.float64)
    if raw.max() <= 1.0 + 1e-6:  # normalised to [-1, 1]
        raw = (raw + 1.0) * 127.5
    return {int(v) // 10 for v in np.unique(np.rint(raw))}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """EM of 20 sections of 32 x 32 at 8 nm; crop1 labels sections 0-15 (mito present on the
    left half), crop2 sections 16-19."""
    root = tmp_path_factory.mktemp("stack") / "data"
    em = np.broadcast_to((10 * np.arange(SECTIONS) + 5)[:, None, None], (SECTIONS, SIDE, SIDE))
    store = make_store(root, em)
    mito = np.zeros((SECTIONS, SIDE, SIDE), np.uint8)
    mito[:, :, : SIDE // 2] = 1
    write_labels(store, "crop1", {"mito": mito[:16]}, (8, 8, 8))
    write_labels(store, "crop2", {"mito": mito[16:]}, (8, 8, 8), corner_voxel=(16, 0, 0))
    return root


def cfg(data, *extra, crop="16,16", ndim=2):
    return ConfigManager().parse_args([
        "--data.dataset_path", str(data), "--data.classes", "mito", "--data.voxel_size", "8,8,8",
        "--data.val_crops", "crop2", "--model.ndim", str(ndim), "--model.crop_size", crop,
        "--model.patch_size", "8", "--no-augmentation.flips", *extra])


# ------------------------------------------------------------------ data.train_label_fraction
@pytest.mark.parametrize("fraction,kept", [(1.0, range(16)), (0.25, range(6, 10)),
                                           (1 / 16, [7]), (0.01, [7])])
def test_label_fraction_keeps_a_slab_of_sections_in_the_middle(stack, fraction, kept):
    """The fraction of the sections, at least one, centred in the crop; the validation crop
    keeps all of its labels."""
    source = build_source(cfg(stack, "--data.train_label_fraction", str(fraction)))
    (train,) = source.train_crops
    (val,) = source.val_crops
    assert val.bounds is None and (val.box_min[0], val.box_max[0]) == (128, 160)
    assert (train.box_min[0], train.box_max[0]) == (8 * kept[0], 8 * (kept[-1] + 1))
    whole = source.reader.read(train, np.zeros(3), (16, SIDE, SIDE))  # all 16 stored sections
    annotated = [z for z in range(16) if whole.valid[0, z].any()]
    assert annotated == list(kept)
    assert all(whole.valid[0, z].all() for z in kept)
    assert int(whole.target[0].sum()) == len(kept) * SIDE * SIDE // 2  # the labels themselves


def test_training_samples_see_labels_of_the_slab_only(stack):
    source = build_source(cfg(stack, "--data.train_label_fraction", "0.25"))
    data = source.segmentation_dataset()
    for g in range(40):
        sample = data[g]
        assert sections_of(sample.image) <= set(range(6, 10)), g  # 2D: placed in the slab
        assert sample.valid.all()


def test_label_fraction_in_3d_reads_em_context_around_a_thin_slab(stack):
    """A slab thinner than the crop: the sample is centred on it, the sections around it are
    real EM without labels."""
    source = build_source(cfg(stack, "--data.train_label_fraction", "0.125", crop="8,16,16",
                              ndim=3))
    sample = source.segmentation_dataset()[0]
    valid_sections = [z for z in range(8) if sample.valid[0, z].any()]
    assert valid_sections == [3, 4]  # 2 of 16 sections (7 and 8), in the middle of the crop
    assert sections_of(sample.image) == set(range(4, 12))


def test_label_fraction_out_of_range_and_with_slices_is_refused(stack):
    with pytest.raises(ConfigError, match=r"data.train_label_fraction.*\(0, 1\]"):
        cfg(stack, "--data.train_label_fraction", "0")
    with pytest.raises(ConfigError, match="train_label_fraction.*dataset_name"):
        cfg(stack, "--data.train_label_fraction", "0.5", "--data.dataset_name", "some/slices")


# ------------------------------------------------------------------ MAE: held-out EM
def test_mae_trains_outside_the_held_out_crops_and_validates_inside(stack):
    source = build_source(cfg(stack), labels=False)
    assert [c.full_name for c in source.val_crops] == ["jrc_t-1/crop2"]
    train, val = source.mae_dataset(), source.mae_dataset(7, augment=False, validation=True)
    assert set().union(*(sections_of(train[g].image) for g in range(200))) == set(range(16))
    assert set().union(*(sections_of(val[g].image) for g in range(40))) == set(range(16, 20))


def test_mae_3d_boxes_never_reach_into_the_held_out_crops(stack):
    source = build_source(cfg(stack, crop="8,16,16", ndim=3), labels=False)
    train = source.mae_dataset()
    seen = [sections_of(train[g].image) for g in range(60)]
    assert max(max(s) for s in seen) == 15 and min(min(s) for s in seen) == 0
    # crop2 (4 sections) is thinner than the sample: centred on it, padding past the volume.
    val = source.mae_dataset(7, augment=False, validation=True)
    assert all(sections_of(val[g].image) == set(range(14, 20)) | {0} for g in range(10))


def test_mae_without_held_out_crops_draws_from_all_the_em(stack):
    """Without data.val_crops nothing is held out (validation is a separate stream)."""
    source = build_source(cfg(stack, "--data.val_crops", ""), labels=False)
    assert source.val_crops == []
    train = source.mae_dataset()
    assert set().union(*(sections_of(train[g].image) for g in range(200))) == set(range(20))


def test_held_out_crops_leaving_no_room_for_training_stop_at_once(stack):
    with pytest.raises(DatasetError, match=r"overlapped the held-out crops.*data.val_crops"):
        build_source(cfg(stack, "--data.val_crops", "crop1,crop2"), labels=False).mae_dataset()
    with pytest.raises(DatasetError, match="unknown crops"):
        build_source(cfg(stack, "--data.val_crops", "crop9"), labels=False)


def test_mae_on_slices_holds_out_no_crops(stack):
    with pytest.raises(DatasetError, match="slices dataset.*leave data.val_crops empty"):
        build_source(cfg(stack, "--data.dataset_name", "some/slices"), labels=False)


def test_loader_logs_the_limited_labels(stack, caplog):
    with caplog.at_level("INFO"):
        _, train, _ = load_segmentation_data(
            DataSettings.from_config(cfg(stack, "--data.train_label_fraction", "0.5")))
    assert (train[0].box_min[0], train[0].box_max[0]) == (32, 96)
    assert "jrc_t-1/crop1 z 32-96 nm" in caplog.text
