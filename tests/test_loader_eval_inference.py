"""Sampler, loader split, metrics and sliding-window inference (single process, fast)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchtitan.config.manager import ConfigManager
from torchtitan.data.crops.layout import DatasetError
from torchtitan.data.sampling.loader import GlobalBatchSampler, build_loader
from torchtitan.data.sampling.samples import build_segmentation_samples
from torchtitan.data.crops.selection import DataSettings, load_segmentation_data, split_crops
from torchtitan.scoring.metrics import combine_scores, score_crop, validation_scores
from torchtitan.inference.sliding_window import WindowPlan, predict_volume, sliding_window


def _take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_global_batch_is_independent_of_the_number_of_ranks():
    one = _take(GlobalBatchSampler(8, 0, 1), 3)
    for dp in (2, 4):
        per_rank = [_take(GlobalBatchSampler(8, r, dp), 3) for r in range(dp)]
        for step in range(3):
            assert sum((per_rank[r][step] for r in range(dp)), []) == one[step]


def test_sampler_restarts_at_a_step():
    assert _take(GlobalBatchSampler(4, 1, 2, start_step=5), 1) == [[22, 23]]
    with pytest.raises(ValueError, match="not divisible"):
        GlobalBatchSampler(6, 0, 4)


def _cfg(data, *extra):
    return ConfigManager().parse_args(["--job.config_file", "train_configs/debug_segmentation_2d.toml",
                                       "--data.dataset_path", str(data), *extra])


def test_loader_batches_equal_with_and_without_workers_and_after_restart(demo_data):
    cfg = _cfg(demo_data)
    sources, train, _ = load_segmentation_data(DataSettings.from_config(cfg))
    ds = build_segmentation_samples(DataSettings.from_config(cfg), sources, train)
    it0 = iter(build_loader(ds, 4, 0, 1, start_step=0, num_workers=0))
    batches = [next(it0) for _ in range(3)]
    it2 = iter(build_loader(ds, 4, 0, 1, start_step=2, num_workers=2))
    resumed = next(it2)
    for key in ("image", "target", "valid", "index"):
        assert torch.equal(getattr(batches[2], key), getattr(resumed, key)), key
    assert resumed.index.tolist() == [8, 9, 10, 11]


def test_validation_crops_are_disjoint_from_training(demo_data):
    cfg = _cfg(demo_data)
    sources, train, val = load_segmentation_data(DataSettings.from_config(cfg))
    assert val and train
    assert not {c.full_name for c in train} & {c.full_name for c in val}
    named = _cfg(demo_data, "--data.val_crops", "crop1,jrc_synth-2/crop5")
    _, train2, val2 = load_segmentation_data(DataSettings.from_config(named))
    assert [c.full_name for c in val2] == ["jrc_synth-1/crop1", "jrc_synth-2/crop5"]
    assert len(train2) + 2 == len(train) + len(val)
    with pytest.raises(DatasetError, match="crop99"):
        load_segmentation_data(
            DataSettings.from_config(_cfg(demo_data, "--data.val_crops", "crop99")))


def test_split_prefers_crops_with_every_class(demo_data):
    cfg = _cfg(demo_data)
    sources, train, val = load_segmentation_data(DataSettings.from_config(cfg))
    crops = train + val
    _, val = split_crops(crops, ["nuc", "mito"], [], 0.25, seed=3)
    assert all({"nuc", "mito"} <= set(c.classes) for c in val)


def _crop_scores(pred, target, valid, classes) -> dict:
    """``score_crop`` of one crop whose classes are the rows of (K, N) arrays."""
    return score_crop({n: pred[k] for k, n in enumerate(classes)},
                      {n: target[k] for k, n in enumerate(classes)},
                      {n: valid[k] for k, n in enumerate(classes)}, voxel_size=(1.0,))


def test_iou_and_dice_by_hand():
    """The metrics validation logs: score_crop per crop, pooled by combine_scores."""
    classes = ["a", "b", "c"]
    pred = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]], bool)
    target = np.array([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    valid = np.array([[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
    combined = combine_scores([_crop_scores(pred, target, valid, classes)])
    assert combined["classes"]["a"]["iou"] == pytest.approx(1 / 3)  # tp 1, fp 1, fn 1
    assert combined["classes"]["b"]["iou"] == 1.0  # empty prediction of an empty class
    assert "c" not in combined["classes"]  # not annotated anywhere: not scored
    scores = validation_scores(combined, classes)
    assert scores["val/dice/a"] == pytest.approx(0.5)
    assert "val/iou/c" not in scores
    assert scores["val/mean_iou"] == pytest.approx((1 / 3 + 1) / 2)


def test_iou_pools_counts_over_crops():
    ones = np.ones((1, 2), bool)
    crops = [_crop_scores(ones, ones, ones, ["a"]), _crop_scores(~ones, ones, ones, ["a"])]
    assert combine_scores(crops)["classes"]["a"]["iou"] == pytest.approx(0.5)


@pytest.mark.parametrize("blend", ["gaussian", "constant"])
def test_sliding_window_equals_whole_volume_for_a_local_model(blend):
    """A voxel-wise model has no border effects: tiling and blending must not change it."""
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(1, 2, kernel_size=1)
    volume = torch.randn(1, 10, 37, 29)
    whole = conv(volume[None])[0]
    tiled = sliding_window(lambda x: conv(x), volume, (8, 16, 16), 2, overlap=0.5, blend=blend)
    torch.testing.assert_close(tiled, whole, atol=1e-5, rtol=1e-5)


def test_2d_models_predict_plane_by_plane_and_call_counts_match():
    conv = torch.nn.Conv2d(1, 3, kernel_size=1)
    volume = torch.randn(1, 5, 20, 40)
    calls = []

    def predict(x):
        calls.append(x.shape[0])
        return conv(x)

    out = predict_volume(predict, volume, (16, 16), 3, overlap=0.25, batch_size=4)
    expected = torch.stack([conv(volume[:, z][None])[0] for z in range(5)], dim=1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert len(calls) == WindowPlan.build((5, 20, 40), (16, 16), 0.25, 4).num_calls


def test_inputs_smaller_than_the_window_are_padded():
    volume = torch.randn(1, 3, 5, 6)
    out = sliding_window(lambda x: x * 2, volume, (4, 8, 8), 1)
    torch.testing.assert_close(out, volume * 2)


def test_blockwise_prediction_equals_whole_volume_prediction():
    """A volume larger than the memory budget is predicted block by block, windows on one
    global grid, so the blended result is identical to predicting it at once."""
    from torchtitan.inference.sliding_window import block_shape_for_budget, predict_blockwise

    torch.manual_seed(0)
    conv = torch.nn.Conv3d(1, 2, kernel_size=1)
    volume = torch.randn(1, 20, 45, 37)

    def model(x):  # depends on the whole window: blending matters
        return conv(x) + x.mean(dim=(2, 3, 4), keepdim=True)

    whole = sliding_window(model, volume, (8, 16, 16), 2, overlap=0.25)

    def read(lo, hi):
        out = torch.zeros(1, *[h - l for l, h in zip(lo, hi)])
        src = volume[:, lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]]
        out[:, :src.shape[1], :src.shape[2], :src.shape[3]] = src
        return out

    result = torch.full((2, 20, 45, 37), float("nan"))

    def write(lo, hi, values):
        result[:, lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] = values

    budget = 20_000 * 12  # bytes: far less than the 20*45*37 volume's buffers
    block = block_shape_for_budget((20, 45, 37), (8, 16, 16), 2, budget)
    assert np.prod(block) < 20 * 45 * 37
    blocks = predict_blockwise(model, read, write, (20, 45, 37), (8, 16, 16), 2,
                               overlap=0.25, block_shape=block)
    assert blocks > 1
    torch.testing.assert_close(result, whole, atol=1e-6, rtol=1e-6)
    # Two ranks each write half of the blocks.
    assert predict_blockwise(model, read, write, (20, 45, 37), (8, 16, 16), 2,
                             block_shape=block, rank=1, world_size=2) == blocks // 2
