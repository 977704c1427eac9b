"""The slices dataset: helpers/create_slice_dataset.py writes every plane of the label crops as
a Hugging Face dataset that matches the zarr reading, and 2D segmentation trains (and
validates) from it with --data.dataset_name, without the zarr stores. Datasets of the original
torchtitan-segmentation's schema (e.g. eminorhan/cellmap-2d) train too, and MAE trains from
the EM images of either."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, debug_run, launch, read_jsonl, script_module

datasets = pytest.importorskip("datasets")

from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.data.crops.layout import DatasetError, discover
from torchtitan.data.sampling.samples import build_segmentation_samples
from torchtitan.data.crops.reader import crop_grid, em_to_model_input
from torchtitan.data.slices.samples import (  # noqa: E402
    build_slice_mae_samples,
    build_slice_samples,
    load_mae_slices,
    load_slice_data,
)
from torchtitan.data.slices.original import CellMapIdLabels  # noqa: E402
from torchtitan.data.io.stores import StoreContext  # noqa: E402
from torchtitan.data.crops.reader import annotates
from torchtitan.data.volume_source import CellMapSource, SliceSource, build_source
from torchtitan.data.crops.selection import DataSettings


def _same(a, b) -> bool:
    """Whether two samples are equal, field by field."""
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(vars(a).values(), vars(b).values()))

HELPER = str(REPO / "helpers" / "create_slice_dataset.py")
SEG2D = "train_configs/debug_segmentation_2d.toml"
MAE2D = "train_configs/debug_mae_2d.toml"
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
    (source,) = [s for s in discover(StoreContext(), demo_data) if s.name == dataset]
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
    crops = [c for s in discover(StoreContext(), demo_data) for c in s.crops]
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
    samples = build_segmentation_samples(
        DataSettings.from_config(_cfg("--data.classes", ",".join(CLASSES))), [source],
                                         [label_crop])
    zarr = samples.reader.read(label_crop, origin, shape)  # what validation reads: normalized EM

    image = np.asarray(item["image"])
    assert image.dtype == np.uint8
    expected = zarr.image[0].take(index, ax)
    # EM is stored in 8 bits: exact where the EM grid is the training grid, else rounded.
    atol = 1e-6 if em_on_grid else 0.5 / 127.5 + 1e-6
    np.testing.assert_allclose(em_to_model_input(image), expected, atol=atol, rtol=0)
    for k, cls in enumerate(CLASSES):
        label = np.asarray(item[f"label_{cls}"])
        valid = np.asarray(item[f"valid_{cls}"])
        assert label.dtype == bool and label.shape == image.shape
        np.testing.assert_array_equal(label, zarr.target[k].take(index, ax) > 0)
        np.testing.assert_array_equal(valid, zarr.valid[k].take(index, ax) > 0)
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
    main = script_module("helpers/create_slice_dataset.py").main

    assert main(["--zarr", str(demo_data), "--out", str(slices)]) == 2
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
    samples = build_slice_samples(DataSettings.from_config(cfg))
    if "zyx" in extra:
        assert set(samples.index.row_axis[samples.train_rows]) == {"z", "x"}
    for g in (0, 1, 17, 12345):
        item = samples[g]
        assert item.image.shape == (1, 64, 64) and item.image.dtype == torch.float32
        assert item.target.shape == item.valid.shape == (2, 64, 64)
        assert item.target.dtype == item.valid.dtype == torch.float32
        assert item.index == g
        assert torch.all(item.target <= item.valid)  # present only where annotated
        again = samples[g]
        assert _same(item, again)  # a sample depends on (seed, index) alone
    assert not torch.equal(samples[0].image, samples[1].image)


def test_a_slice_smaller_than_the_crop_is_centred_with_invalid_padding(slices):
    # jrc_synth-1/crop2 is 62 x 62 voxels in the plane at 8 nm: one voxel of padding a side.
    cfg = _cfg("--data.dataset_name", str(slices), "--data.val_fraction", "0",
               "--data.min_label_fraction", "0.5")
    index, train, _ = load_slice_data(DataSettings.from_config(cfg))
    only = [c for c in train if c.full_name == "jrc_synth-1/crop2"]
    samples = build_slice_samples(DataSettings.from_config(cfg), index, only)
    samples.augment = False
    item = samples[3]
    valid = item.valid
    assert valid[:, :1].sum() == 0 and valid[:, -1:].sum() == 0
    assert valid[:, :, :1].sum() == 0 and valid[:, :, -1:].sum() == 0
    assert valid[:, 1:-1, 1:-1].sum() > 0
    assert torch.all(item.image[:, 0] == -1.0)  # padding reads as EM 0, as outside the volume


def test_validation_volumes_from_slices_equal_the_zarr_ones(slices, demo_data):
    cfg = _cfg("--data.dataset_name", str(slices), "--data.dataset_path", str(demo_data))
    from_slices, from_zarr = build_source(cfg), CellMapSource(DataSettings.from_config(cfg))
    assert isinstance(from_slices, SliceSource)  # data.dataset_name names the source
    # The same split by crop name as from the zarr stores.
    assert [c.full_name for c in from_slices.train_crops] == \
        [c.full_name for c in from_zarr.train_crops]
    val, zarr_val = from_slices.val_crops, from_zarr.val_crops
    assert [c.full_name for c in val] == [c.full_name for c in zarr_val] and val
    for crop, zcrop in zip(val, zarr_val):
        a, b = from_slices.read_volume(crop), from_zarr.read_volume(zcrop)
        assert a.shape == b.shape and a.annotated == b.annotated and a.classes == b.classes
        np.testing.assert_allclose(a.image, b.image, atol=0.5 / 127.5 + 1e-6)
        np.testing.assert_array_equal(a.target, b.target)
        np.testing.assert_array_equal(a.valid, b.valid)


def test_config_mismatches_are_clear_errors(slices):
    name = str(slices)
    with pytest.raises(DatasetError, match="model.ndim = 3"):
        load_slice_data(DataSettings.from_config(ConfigManager().parse_args([
            "--job.config_file", "train_configs/debug_segmentation_3d.toml",
            "--data.dataset_name", name])))
    with pytest.raises(DatasetError, match=r"data.classes \['ves'\] are not in the slices"):
        load_slice_data(
            DataSettings.from_config(_cfg("--data.dataset_name", name,
                                          "--data.classes", "mito,ves")))
    with pytest.raises(DatasetError, match="data.voxel_size"):
        load_slice_data(
            DataSettings.from_config(_cfg("--data.dataset_name", name,
                                          "--data.voxel_size", "16,16,16")))
    with pytest.raises(DatasetError, match="no such folder"):
        load_slice_data(DataSettings.from_config(_cfg("--data.dataset_name", "./no/such/slices")))


# ---------------------------------------------------------------------------------------------
# Training end to end
# ---------------------------------------------------------------------------------------------


def _train_from_slices(script, config, slices, tmp_path, dump, steps: int) -> list[dict]:
    """Train ``steps`` steps on 2 processes from a slices dataset, with no zarr store at the
    data path; checks each step's loss is logged and finite, returns the metrics records."""
    debug_run(script, config, tmp_path / "no_zarr_here", dump, "--data.dataset_name", str(slices),
              "--training.steps", str(steps), "--metrics.log_freq", "1",
              "--checkpoint.interval", str(steps), nproc=2)
    records = read_jsonl(dump / "logs" / "metrics.jsonl")
    losses = [r for r in records if "loss" in r]
    assert [r["step"] for r in losses] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss"]) for r in losses)
    return records


@pytest.mark.distributed
def test_training_from_slices_without_the_zarr_stores(slices, tmp_path):
    dump = tmp_path / "run"
    records = _train_from_slices("train_segmentation.py", SEG2D, slices, tmp_path, dump, 3)
    val = [r for r in records if "val/mean_iou" in r]  # held-out crops, stacked from slices
    assert val and val[-1]["step"] == 3 and math.isfinite(val[-1]["val/mean_iou"])
    assert (dump / "checkpoint" / "step-3" / ".metadata").is_file()


# ---------------------------------------------------------------------------------------------
# The original torchtitan-segmentation's schema (helpers/create_slice_dataset_cellmap.py there)
# ---------------------------------------------------------------------------------------------

# (crop_name, axis, planes, (h, w), CellMap ids in vertical bands): three crops; crop2 lacks
# plane 1 (the original helper drops uniform slices); crop1's x slices are thinner than a
# model crop (padded); 255 is no CellMap id (unknown).
ORIGINAL_ROWS = [
    ("jrc_a-1/recon-1/crop1", "z", [0, 1, 2, 3], (72, 80), (0, 3, 4, 35)),
    ("jrc_a-1/recon-1/crop1", "x", [0, 1], (4, 72), (35, 0)),
    ("jrc_a-1/recon-1/crop2", "z", [0, 2, 3], (70, 70), (0, 20, 28, 35)),
    ("jrc_b-1/recon-1/crop7", "z", [0, 1, 2], (66, 90), (1, 60, 255, 0)),
]


def _bands(shape, ids) -> np.ndarray:
    label = np.zeros(shape, np.uint8)
    for i, part in enumerate(np.array_split(np.arange(shape[1]), len(ids))):
        label[:, part] = ids[i]
    return label


def _save(tmp_path_factory, name: str, columns: dict, features=None):
    out = tmp_path_factory.mktemp("hf") / name
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(out))
    return out


@pytest.fixture(scope="module")
def original_slices(tmp_path_factory):
    """A small dataset of the original schema: image, label (CellMap ids), crop_name, axis,
    slice."""
    from PIL import Image

    rng = np.random.default_rng(0)
    columns = {"image": [], "label": [], "crop_name": [], "axis": [], "slice": []}
    for crop, axis, planes, shape, ids in ORIGINAL_ROWS:
        for plane in planes:
            columns["image"].append(Image.fromarray(rng.integers(1, 256, shape, dtype=np.uint8)))
            columns["label"].append(Image.fromarray(_bands(shape, ids)))
            columns["crop_name"].append(crop)
            columns["axis"].append(axis)
            columns["slice"].append(plane)
    features = datasets.Features({
        "image": datasets.Image(), "label": datasets.Image(),
        "crop_name": datasets.Value("string"), "axis": datasets.Value("string"),
        "slice": datasets.Value("int32"),
    })
    return _save(tmp_path_factory, "cellmap_2d", columns, features)


def test_cellmap_ids_give_targets_and_validity():
    labels = CellMapIdLabels(["mito", "mito_mem", "cell", "nuc"])
    # background, mito_mem, mito_lum, cyto, mito (composite), no CellMap id
    target, valid = labels.targets(np.array([[0, 3, 4, 35, 50, 255]], np.uint8))
    np.testing.assert_array_equal(target[:, 0], [[0, 1, 1, 0, 1, 0],   # mito
                                                 [0, 1, 0, 0, 0, 0],   # mito_mem
                                                 [0, 1, 1, 1, 1, 0],   # cell
                                                 [0, 0, 0, 0, 0, 0]])  # nuc
    # mito: its own id is in the slice, so background is a negative; mito_mem: the composite
    # mito is only partly mito_mem (unknown); cell and nuc: not held whole, background invalid.
    np.testing.assert_array_equal(valid[:, 0], [[1, 1, 1, 1, 1, 0],
                                                [1, 1, 1, 1, 0, 0],
                                                [0, 1, 1, 1, 1, 0],
                                                [0, 1, 1, 1, 1, 0]])
    # Background is a negative only in slices that hold the class whole (all its parts).
    _, valid = labels.targets(np.array([[0, 3, 4]], np.uint8))
    assert valid[0].tolist() == [[False, True, True]]
    _, valid = labels.targets(np.array([[0, 3, 4, 5]], np.uint8))
    assert valid[0].tolist() == [[True, True, True, True]]


def test_original_schema_loads_and_validates_from_stacked_planes(original_slices):
    cfg = _cfg("--data.dataset_name", str(original_slices), "--data.classes", "mito,nuc,cell",
               "--data.val_crops", "crop2", "--data.planes", "zyx")
    source = build_source(cfg)
    train, val = source.train_crops, source.val_crops
    assert [c.full_name for c in train] == ["jrc_a-1/recon-1/crop1", "jrc_b-1/recon-1/crop7"]
    assert [c.full_name for c in val] == ["jrc_a-1/recon-1/crop2"]
    # The three planes present, stacked along z, taken at data.voxel_size.
    (crop,) = val
    assert source.grid(crop)[1] == (3, 70, 70) and crop.voxel_size == (8.0, 8.0, 8.0)

    samples = source.segmentation_dataset()
    assert set(samples.index.row_axis[samples.train_rows]) == {"z", "x"}
    vol = source.read_volume(crop)
    assert vol.image.shape == (1, 3, 70, 70) and vol.target.shape == (3, 3, 70, 70)
    bands = _bands((70, 70), (0, 20, 28, 35))  # background, ne_mem, nucpl, cyto
    target, valid = CellMapIdLabels(["mito", "nuc", "cell"]).targets(bands)
    np.testing.assert_array_equal(vol.target, np.repeat(target[:, None], 3, 1))
    np.testing.assert_array_equal(vol.valid, np.repeat(valid[:, None], 3, 1))
    assert not vol.target[1][:, :, :17].any() and vol.target[1][:, :, 18:52].all()
    assert vol.instance_ids == {}  # slices hold binary masks only

    for g in (0, 5, 77):
        item = samples[g]
        assert item.image.shape == (1, 64, 64) and item.target.shape == (3, 64, 64)
        assert torch.all(item.target <= item.valid)
        again = samples[g]
        assert _same(item, again)  # a sample depends on (seed, index) alone


def test_unknown_columns_are_a_clear_error(tmp_path_factory):
    name = str(_save(tmp_path_factory, "unknown", {"pixels": [1, 2], "mask": [0, 1]}))
    with pytest.raises(DatasetError) as err:
        load_slice_data(DataSettings.from_config(_cfg("--data.dataset_name", name)))
    assert str(err.value) == (
        f"data.dataset_name {name!r} has the columns ['pixels', 'mask'], which match no slices "
        "dataset schema; expected either this project's (helpers/create_slice_dataset.py): "
        "image, label_<class> and valid_<class> per class, annotated, dataset, crop, axis, index, "
        "voxel_size, origin, shape; or the original torchtitan-segmentation's "
        "(helpers/create_slice_dataset_cellmap.py, e.g. eminorhan/cellmap-2d): image, label, "
        "crop_name, axis, slice"
    )
    mae = ConfigManager().parse_args(["--job.config_file", MAE2D, "--data.dataset_name", name])
    with pytest.raises(DatasetError) as err:
        load_mae_slices(DataSettings.from_config(mae))
    assert str(err.value).startswith(
        f"data.dataset_name {name!r} has no 'image' column of images (it has the columns "
        "['pixels', 'mask']); MAE reads the EM images of a slices dataset: this project's")
    # The original's 3D crops are named as such.
    name3d = str(_save(tmp_path_factory, "cellmap_3d", {
        "volume": [b"\0" * 8], "label": [b"\0" * 8], "crop_name": ["a/recon-1/crop1"],
        "shape": [[2, 2, 2]]}))
    with pytest.raises(DatasetError, match="holds whole 3D crops"):
        load_slice_data(DataSettings.from_config(_cfg("--data.dataset_name", name3d)))


def test_original_schema_config_errors(original_slices):
    with pytest.raises(DatasetError, match=r"data.classes \['mitochondria'\] are not CellMap"):
        load_slice_data(DataSettings.from_config(_cfg("--data.dataset_name", str(original_slices),
                             "--data.classes", "mito,mitochondria")))
    with pytest.raises(DatasetError, match="model.ndim = 3; train 3D MAE"):
        load_mae_slices(DataSettings.from_config(ConfigManager().parse_args([
            "--job.config_file", "train_configs/debug_mae_3d.toml",
            "--data.dataset_name", str(original_slices)])))


@pytest.mark.parametrize("which", ["original_slices", "slices", "images_only"])
def test_mae_samples_from_slices(which, request, tmp_path_factory):
    if which == "images_only":  # like the original's EM-only sets (eminorhan/openorganelle-2d)
        from PIL import Image

        rng = np.random.default_rng(1)
        name = _save(tmp_path_factory, "oo_2d", {
            "image": [Image.fromarray(rng.integers(0, 256, (50 + 10 * i, 90), dtype=np.uint8))
                      for i in range(4)],
            "volume_name": ["jrc_x"] * 4, "part_id": ["0_0"] * 4},
            datasets.Features({"image": datasets.Image(), "volume_name": datasets.Value("string"),
                               "part_id": datasets.Value("string")}))
    else:
        name = request.getfixturevalue(which)
    cfg = ConfigManager().parse_args(["--job.config_file", MAE2D, "--data.dataset_name",
                                      str(name), "--augmentation.rotate_deg", "20",
                                      "--augmentation.contrast", "0.2"])
    data = load_mae_slices(DataSettings.from_config(cfg))
    if which != "images_only":
        assert set(data.row_axis[data.rows]) == {"z"}  # data.planes = "z"
    samples = build_slice_mae_samples(DataSettings.from_config(cfg), data, num_patches=64)
    for g in (0, 3, 999):
        item = samples[g]
        assert item.image.shape == item.valid.shape == (1, 64, 64)
        assert item.noise.shape == (64,) and item.index == g
        assert item.valid.sum() > 0
        again = samples[g]
        assert _same(item, again)  # a sample depends on (seed, index) alone
    assert not torch.equal(samples[0].noise, samples[1].noise)
    held_out = build_slice_mae_samples(
        DataSettings.from_config(cfg), data, seed_offset=1_000_003, num_patches=64,
                                       augment=False)
    assert not torch.equal(held_out[0].noise, samples[0].noise)


@pytest.mark.distributed
def test_training_from_original_schema_slices(original_slices, tmp_path):
    dump = tmp_path / "run"
    result = launch("train_segmentation.py", [
        "--job.config_file", SEG2D, "--data.dataset_name", str(original_slices),
        "--data.dataset_path", str(tmp_path / "no_zarr_here"), "--data.val_crops", "crop2",
        "--job.dump_folder", str(dump), "--training.steps", "2", "--metrics.log_freq", "1",
        "--checkpoint.interval", "2", "--no-metrics.progress_bar"], nproc=2)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert "original torchtitan-segmentation schema" in result.stdout + result.stderr
    records = read_jsonl(dump / "logs" / "metrics.jsonl")
    losses = [r for r in records if "loss" in r]
    assert [r["step"] for r in losses] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in losses)
    val = [r for r in records if "val/mean_iou" in r]  # crop2, stacked from its planes
    assert val and val[-1]["step"] == 2 and math.isfinite(val[-1]["val/mean_iou"])


@pytest.mark.distributed
def test_mae_training_from_slices(original_slices, tmp_path):
    dump = tmp_path / "run"
    records = _train_from_slices("train_mae.py", MAE2D, original_slices, tmp_path, dump, 2)
    val = [r for r in records if "val/reconstruction_loss" in r]
    assert val and math.isfinite(val[-1]["val/reconstruction_loss"])
