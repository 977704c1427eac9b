"""The slices dataset: helpers/create_slice_dataset.py writes every plane of the label crops as
a Hugging Face dataset that matches the zarr reading, and 2D segmentation trains (and
validates) from it with --data.dataset_name, without the zarr stores."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, launch, read_jsonl

datasets = pytest.importorskip("datasets")

from torchtitan.config_manager import ConfigManager  # noqa: E402
from torchtitan.datasets.cellmap import DatasetError, discover  # noqa: E402
from torchtitan.datasets.loader import build_segmentation_samples, load_segmentation_data  # noqa: E402
from torchtitan.datasets.samples import crop_grid, normalize_em  # noqa: E402
from torchtitan.datasets.slices import build_slice_samples, load_slice_data  # noqa: E402
from torchtitan.datasets.targets import annotates  # noqa: E402

HELPER = str(REPO / "helpers" / "create_slice_dataset.py")
SEG2D = "train_configs/debug_segmentation_2d.toml"
CLASSES = ["nuc", "mito", "er", "cell"]


def _helper(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, HELPER, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def slices(demo_data, tmp_path_factory):
    """z and x slices of every demo crop at 8 nm."""
    out = tmp_path_factory.mktemp("slices") / "demo_slices"
    result = _helper("--zarr", str(demo_data), "--out", str(out), "--axes", "z,x",
                     "--classes", ",".join(CLASSES), "--voxel_size", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "wrote" in result.stdout and "--data.dataset_name" in result.stdout
    return out


def _cfg(*overrides):
    return ConfigManager().parse_args(["--job.config_file", SEG2D, *overrides])


def _zarr_crop(demo_data, dataset: str, crop: str):
    (source,) = [s for s in discover(demo_data) if s.name == dataset]
    (label_crop,) = [c for c in source.crops if c.name == crop]
    return source, label_crop


# ---------------------------------------------------------------------------------------------
# The helper
# ---------------------------------------------------------------------------------------------


def test_dataset_has_one_row_per_plane_with_its_metadata(slices, demo_data):
    ds = datasets.load_from_disk(str(slices))
    assert ds.column_names[:3] == ["image", "label_nuc", "valid_nuc"]
    assert {f"label_{c}" for c in CLASSES} | {f"valid_{c}" for c in CLASSES} <= set(ds.column_names)
    meta = ds.select_columns(["dataset", "crop", "axis", "index", "shape", "voxel_size"]).to_dict()
    crops = [c for s in discover(demo_data) for c in s.crops]
    expected = 0
    for c in crops:
        _, shape = crop_grid(c, [8.0, 8.0, 8.0])
        for axis, ax in (("z", 0), ("x", 2)):
            rows = [i for i in range(len(ds)) if meta["dataset"][i] == c.dataset
                    and meta["crop"][i] == c.name and meta["axis"][i] == axis]
            assert sorted(meta["index"][i] for i in rows) == list(range(shape[ax]))
            assert all(tuple(meta["shape"][i]) == shape for i in rows)
            expected += shape[ax]
    assert len(ds) == expected
    assert set(map(tuple, meta["voxel_size"])) == {(8.0, 8.0, 8.0)}


@pytest.mark.parametrize("dataset,crop,axis,index,em_on_grid", [
    ("jrc_synth-1", "crop1", "z", 7, True),    # EM and labels at 8 nm: plain slices
    ("jrc_synth-1", "crop3", "x", 20, True),   # labels at 16 nm, annotates only cell and nuc
    ("jrc_synth-2", "crop5", "x", 30, False),  # EM at 16 nm in z (interpolated), unknown voxels
    ("jrc_synth-2", "crop7", "z", 3, False),   # labels at 4 nm
])
def test_slices_equal_the_zarr_reading(slices, demo_data, dataset, crop, axis, index, em_on_grid):
    ds = datasets.load_from_disk(str(slices))
    meta = ds.select_columns(["dataset", "crop", "axis", "index"]).to_dict()
    (row,) = [i for i in range(len(ds)) if (meta["dataset"][i], meta["crop"][i], meta["axis"][i],
                                           meta["index"][i]) == (dataset, crop, axis, index)]
    item = ds[row]
    ax = "zyx".index(axis)

    source, label_crop = _zarr_crop(demo_data, dataset, crop)
    voxel = [8.0, 8.0, 8.0]
    origin, shape = crop_grid(label_crop, voxel)
    assert item["origin"] == pytest.approx(origin.tolist()) and tuple(item["shape"]) == shape
    samples = build_segmentation_samples(_cfg("--data.classes", ",".join(CLASSES)), [source],
                                         [label_crop])
    zarr = samples.read(label_crop, origin, shape)  # what validation reads: normalized EM

    image = np.asarray(item["image"])
    assert image.dtype == np.uint8
    expected = zarr["image"][0].take(index, ax)
    # EM is stored in 8 bits: exact where the EM grid is the training grid, else rounded.
    atol = 1e-6 if em_on_grid else 0.5 / 127.5 + 1e-6
    np.testing.assert_allclose(normalize_em(image), expected, atol=atol, rtol=0)
    for k, cls in enumerate(CLASSES):
        label = np.asarray(item[f"label_{cls}"])
        valid = np.asarray(item[f"valid_{cls}"])
        assert label.dtype == bool and label.shape == image.shape
        np.testing.assert_array_equal(label, zarr["target"][k].take(index, ax) > 0)
        np.testing.assert_array_equal(valid, zarr["valid"][k].take(index, ax) > 0)
        assert (cls in item["annotated"]) == annotates(label_crop, cls)
        if not annotates(label_crop, cls):
            assert not valid.any()


def test_push_to_hub_without_a_token_stops_with_a_clear_message(demo_data, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH")}
    env["HF_HOME"] = str(tmp_path / "hf_home")  # no stored login there
    out = tmp_path / "never_written"
    result = _helper("--zarr", str(demo_data), "--out", str(out), "--push_to_hub", "me/em-slices",
                     env=env, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no Hugging Face token" in result.stderr
    assert "HF_TOKEN" in result.stderr and "hf auth login" in result.stderr
    assert not out.exists()


def test_existing_output_needs_force(slices, demo_data, capsys):
    from helpers.create_slice_dataset import main

    assert main(["--zarr", str(demo_data), "--out", str(slices)]) == 1
    assert "--force" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Training samples and validation volumes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [
    [],
    # every augmentation, and z- and x-normal planes (x slices are 40-88 x 76-88: padded)
    ["--data.planes", "zyx", "--data.min_label_fraction", "0.5", "--augmentation.rot90",
     "--augmentation.rotate_deg", "30", "--augmentation.scale", "0.2",
     "--augmentation.contrast", "0.2", "--augmentation.gamma", "0.2",
     "--augmentation.noise_std", "0.05", "--augmentation.blur_sigma", "1"],
], ids=["flips", "all_augmentations_zyx"])
def test_slice_samples_follow_the_sample_contract(slices, extra):
    cfg = _cfg("--data.dataset_name", str(slices), "--data.classes", "mito,nuc", *extra)
    samples = build_slice_samples(cfg)
    if "zyx" in extra:
        assert set(samples.index.row_axis[samples.train_rows]) == {"z", "x"}
    for g in (0, 1, 17, 12345):
        item = samples[g]
        assert item["image"].shape == (1, 64, 64) and item["image"].dtype == torch.float32
        assert item["target"].shape == item["valid"].shape == (2, 64, 64)
        assert item["target"].dtype == item["valid"].dtype == torch.float32
        assert item["index"].dtype == torch.int64 and int(item["index"]) == g
        assert torch.all(item["target"] <= item["valid"])  # present only where annotated
        again = samples[g]
        for key in item:  # a sample depends on (seed, index) alone
            assert torch.equal(item[key], again[key]), key
    assert not torch.equal(samples[0]["image"], samples[1]["image"])


def test_a_slice_smaller_than_the_crop_is_centred_with_invalid_padding(slices):
    # jrc_synth-1/crop2 is 62 x 62 voxels in the plane at 8 nm: one voxel of padding a side.
    cfg = _cfg("--data.dataset_name", str(slices), "--data.val_fraction", "0",
               "--data.min_label_fraction", "0.5")
    index, train, _ = load_slice_data(cfg)
    only = [c for c in train if c.full_name == "jrc_synth-1/crop2"]
    samples = build_slice_samples(cfg, index, only)
    samples.augment = False
    item = samples[3]
    valid = item["valid"]
    assert valid[:, :1].sum() == 0 and valid[:, -1:].sum() == 0
    assert valid[:, :, :1].sum() == 0 and valid[:, :, -1:].sum() == 0
    assert valid[:, 1:-1, 1:-1].sum() > 0
    assert torch.all(item["image"][:, 0] == -1.0)  # padding reads as EM 0, as outside the volume


def test_validation_volumes_from_slices_equal_the_zarr_ones(slices, demo_data):
    cfg = _cfg("--data.dataset_name", str(slices), "--data.dataset_path", str(demo_data))
    index, train, val = load_slice_data(cfg)
    sources, zarr_train, zarr_val = load_segmentation_data(cfg)
    # The same split by crop name as from the zarr stores.
    assert [c.full_name for c in train] == [c.full_name for c in zarr_train]
    assert [c.full_name for c in val] == [c.full_name for c in zarr_val] and val
    from_slices = build_slice_samples(cfg, index, train)
    from_zarr = build_segmentation_samples(cfg, sources, zarr_train)
    for crop, zcrop in zip(val, zarr_val):
        origin, shape = crop_grid(crop, cfg.data.voxel_size)
        assert shape == crop_grid(zcrop, cfg.data.voxel_size)[1]
        a = from_slices.read(crop, origin, shape)
        b = from_zarr.read(zcrop, *crop_grid(zcrop, cfg.data.voxel_size))
        np.testing.assert_allclose(a["image"], b["image"], atol=0.5 / 127.5 + 1e-6)
        np.testing.assert_array_equal(a["target"], b["target"])
        np.testing.assert_array_equal(a["valid"], b["valid"])


def test_config_mismatches_are_clear_errors(slices):
    name = str(slices)
    with pytest.raises(DatasetError, match="model.ndim = 3"):
        load_slice_data(ConfigManager().parse_args([
            "--job.config_file", "train_configs/debug_segmentation_3d.toml",
            "--data.dataset_name", name]))
    with pytest.raises(DatasetError, match=r"data.classes \['ves'\] are not in the slices"):
        load_slice_data(_cfg("--data.dataset_name", name, "--data.classes", "mito,ves"))
    with pytest.raises(DatasetError, match="data.voxel_size"):
        load_slice_data(_cfg("--data.dataset_name", name, "--data.voxel_size", "16,16,16"))
    with pytest.raises(DatasetError, match="no such folder"):
        load_slice_data(_cfg("--data.dataset_name", "./no/such/slices"))


# ---------------------------------------------------------------------------------------------
# Training end to end
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_training_from_slices_without_the_zarr_stores(slices, tmp_path):
    dump = tmp_path / "run"
    result = launch("train_segmentation.py", [
        "--job.config_file", SEG2D, "--data.dataset_name", str(slices),
        "--data.dataset_path", str(tmp_path / "no_zarr_here"), "--job.dump_folder", str(dump),
        "--training.steps", "3", "--metrics.log_freq", "1", "--checkpoint.interval", "3",
        "--no-metrics.progress_bar"], nproc=2)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    records = read_jsonl(dump / "logs" / "metrics.jsonl")
    losses = [r for r in records if "loss" in r]
    assert [r["step"] for r in losses] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in losses)
    val = [r for r in records if "val/mean_iou" in r]  # held-out crops, stacked from slices
    assert val and val[-1]["step"] == 3 and math.isfinite(val[-1]["val/mean_iou"])
    assert (dump / "checkpoint" / "step-3" / ".metadata").is_file()
