"""Data discovery formats and bad data on disk.

Formats: CellMap-layout folders in zarr format 2 and 3 (OME-NGFF 0.4 / 0.5 metadata) and
split lists (cellmap-data's datasplit CSV, or a TOML list) that mark crops train or val.
Bad input: each problem is a DatasetError that names the store and the path and says how to
fix it. Everything here calls the data functions directly on small stores written by the
tests, except one end-to-end torchrun run that checks a bad input stops every rank.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from conftest import launch, read_jsonl
from torchtitan.config.manager import ConfigManager
from torchtitan.data.crops.reader import ChunkReadError, read_linear
from torchtitan.data.crops.layout import DatasetError, check_voxel_size, discover
from torchtitan.data.sampling.samples import build_segmentation_samples
from torchtitan.data.crops.selection import DataSettings, load_em_sources, load_segmentation_data
from torchtitan.data.io.stores import StoreContext, StoreSettings
from torchtitan.data.io.zarr_chunks import ChunkedArray

EM = "recon-1/em/fibsem-uint8"
GT = "recon-1/labels/groundtruth"
ENCODING = {"cellmap": {"annotation": {"annotation_type": {
    "encoding": {"absent": 0, "present": 1, "unknown": 255}, "type": "semantic_segmentation"}}}}


# ---------------------------------------------------------------------------------------------
# Writing small CellMap-layout stores
# ---------------------------------------------------------------------------------------------


def write_multiscale(group: Path, arrays, scales, translations, zarr_format: int = 2,
                     axes=("z", "y", "x"), unit: str | None = "nanometer", attrs=None,
                     metadata: bool = True) -> None:
    """One OME-NGFF multiscale group: 0.4 ``multiscales`` in format 2, 0.5 ``ome`` in 3."""
    g = zarr.open_group(str(group), mode="w", zarr_format=zarr_format)
    datasets = []
    for i, (a, s, t) in enumerate(zip(arrays, scales, translations)):
        g.create_array(f"s{i}", data=a, chunks=tuple(min(8, n) for n in a.shape))
        datasets.append({"path": f"s{i}", "coordinateTransformations": [
            {"type": "scale", "scale": list(s)}, {"type": "translation", "translation": list(t)}]})
    axis_meta = [{"name": n, "type": "space", **({"unit": unit} if unit else {})} for n in axes]
    ms = {"name": group.name, "axes": axis_meta, "datasets": datasets}
    if metadata and zarr_format == 2:
        g.attrs["multiscales"] = [{"version": "0.4", **ms}]
    elif metadata:
        g.attrs["ome"] = {"version": "0.5", "multiscales": [ms]}
    if attrs:
        g.attrs.update(attrs)


def write_store(root: Path, name: str = "jrc_t-1", zarr_format: int = 2,
                em_scales=((8.0, 8.0, 8.0),), crops=None, seed: int = 0, **em_kwargs) -> Path:
    """``root/<name>/<name>.zarr`` with a (24, 32, 32) EM volume at (8, 8, 8) nm and label
    crops ``{crop name: (offset in EM voxels, {class: present fraction})}``, each an
    (8, 16, 16) label array on the EM grid."""
    rng = np.random.default_rng(seed)
    store = root / name / f"{name}.zarr"
    em = rng.integers(0, 256, (24, 32, 32), dtype=np.uint8)
    levels = [em[::int(s[0] // em_scales[0][0]), ::int(s[1] // em_scales[0][1]),
                 ::int(s[2] // em_scales[0][2])] for s in em_scales]
    translations = [tuple(v / 2 for v in s) for s in em_scales]  # corner of voxel 0 at 0 nm
    write_multiscale(store / EM, levels, em_scales, translations, zarr_format, **em_kwargs)
    if crops is None:
        crops = {"crop1": ((4, 4, 4), {"mito": 0.3, "nuc": 0.5})}
    for crop, (offset, classes) in crops.items():
        t = tuple(8.0 * o + 4.0 for o in offset)
        for cls, frac in classes.items():
            lab = (rng.random((8, 16, 16)) < frac).astype(np.uint8)
            write_multiscale(store / GT / crop / cls, [lab], [(8.0, 8.0, 8.0)], [t],
                             zarr_format, attrs=ENCODING)
    return store


def seg_cfg(data, *extra):
    return ConfigManager().parse_args([
        "--job.config_file", "train_configs/debug_segmentation_2d.toml",
        "--data.dataset_path", str(data), "--data.classes", "mito,nuc",
        "--model.crop_size", "16,16", "--data.val_fraction", "0", *extra])


# ---------------------------------------------------------------------------------------------
# Bad metadata
# ---------------------------------------------------------------------------------------------


def test_missing_multiscales(tmp_path):
    store = write_store(tmp_path, metadata=False)
    with pytest.raises(DatasetError) as e:
        discover(StoreContext(), tmp_path)
    msg = str(e.value)
    assert str(store / EM) in msg and "multiscales" in msg and "add" in msg


def test_axes_not_zyx(tmp_path):
    store = write_store(tmp_path, axes=("x", "y", "z"))
    with pytest.raises(DatasetError) as e:
        discover(StoreContext(), tmp_path)
    msg = str(e.value)
    assert str(store / EM) in msg and "('x', 'y', 'z')" in msg and "(z, y, x)" in msg


def test_unit_other_than_nanometer(tmp_path):
    store = write_store(tmp_path, unit="micrometer")
    with pytest.raises(DatasetError) as e:
        discover(StoreContext(), tmp_path)
    msg = str(e.value)
    assert str(store / EM) in msg and "'micrometer'" in msg
    assert "convert" in msg and "'nanometer'" in msg


def test_crop_outside_its_em_volume(tmp_path):
    # EM spans 0..192 nm in z; a crop starting at voxel 20 of 8 voxels ends at 224 nm.
    store = write_store(tmp_path, crops={"crop1": ((4, 4, 4), {"mito": 0.3, "nuc": 0.3}),
                                         "crop2": ((20, 0, 0), {"mito": 0.3})})
    with pytest.raises(DatasetError) as e:
        load_segmentation_data(DataSettings.from_config(seg_cfg(tmp_path)))
    msg = str(e.value)
    assert str(store) in msg and "crop2" in msg and "outside its EM volume" in msg
    assert str(store / GT / "crop2" / "mito" / "s0") in msg and "translation" in msg


# ---------------------------------------------------------------------------------------------
# Voxel size a dataset cannot serve
# ---------------------------------------------------------------------------------------------


@pytest.fixture()
def anisotropic(tmp_path):
    """EM levels at (16, 8, 8) and (32, 16, 16) nm, like the demo's jrc_synth-2."""
    write_store(tmp_path, em_scales=((16.0, 8.0, 8.0), (32.0, 16.0, 16.0)))
    (source,) = discover(StoreContext(), tmp_path)
    return source


@pytest.mark.parametrize("voxel_size", [(8, 8, 8), (16, 8, 8), (8, 4, 4), (64, 32, 32)])
def test_voxel_size_within_2x_of_the_levels_is_served(anisotropic, voxel_size):
    check_voxel_size(anisotropic, voxel_size)


@pytest.mark.parametrize("voxel_size, what, axes", [
    ((4, 8, 8), "finer than half the finest", "axis z"),
    ((8, 2, 2), "finer than half the finest", "axis yx"),
    ((128, 16, 16), "coarser than twice the coarsest", "axis z"),
])
def test_voxel_size_no_level_can_serve(anisotropic, voxel_size, what, axes):
    with pytest.raises(DatasetError) as e:
        check_voxel_size(anisotropic, voxel_size)
    msg = str(e.value)
    assert anisotropic.store in msg and what in msg and axes in msg
    assert "s0=[16.0, 8.0, 8.0]" in msg and "choose a data.voxel_size" in msg


def test_voxel_size_is_checked_when_loading(tmp_path, demo_data):
    # The demo trains jrc_synth-2 (16 x 8 x 8 nm) at 8 nm isotropic: allowed.
    assert len(load_em_sources(
        DataSettings.from_config(seg_cfg(demo_data, "--data.voxel_size", "8,8,8")))) == 2
    with pytest.raises(DatasetError, match="jrc_synth-1.zarr: data.voxel_size"):
        load_segmentation_data(
            DataSettings.from_config(seg_cfg(demo_data, "--data.voxel_size", "2,2,2")))


# ---------------------------------------------------------------------------------------------
# Missing and corrupt chunks
# ---------------------------------------------------------------------------------------------


def _chunk_file(array_path: Path) -> Path:
    """The chunk file of chunk (0, 0, 0), format 2 or 3."""
    for rel in ("0.0.0", "0/0/0", "c/0/0/0"):
        p = array_path / rel
        if p.is_file():
            return p
    raise AssertionError(f"no chunk file under {array_path}")


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_missing_chunk_reads_as_the_fill_value(tmp_path, zarr_format):
    """zarr stores sparse arrays by leaving out chunks; reading one gives the fill value (0 for
    EM, i.e. background), not an error. (For labels 0 means 'absent', so a label array must
    store all chunks of its crop; the CellMap crops do.)"""
    write_store(tmp_path, zarr_format=zarr_format)
    (source,) = discover(StoreContext(), tmp_path)
    level = source.levels[0]
    _chunk_file(Path(level.path)).unlink()
    img, inside = read_linear(source.stores, level, (0.0, 0.0, 0.0), (8.0, 8.0, 8.0), (16, 16, 16))
    assert inside.all()
    assert (img[:8, :8, :8] == 0).all() and img[8:, 8:, 8:].any()


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_corrupt_chunk_raises_chunk_read_error(tmp_path, zarr_format):
    write_store(tmp_path, zarr_format=zarr_format)
    (source,) = discover(StoreContext(), tmp_path)
    level = source.levels[0]
    _chunk_file(Path(level.path)).write_bytes(b"not a compressed chunk at all")
    with pytest.raises(ChunkReadError) as e:
        read_linear(source.stores, level, (0.0, 0.0, 0.0), (8.0, 8.0, 8.0), (4, 4, 4))
    assert isinstance(e.value, DatasetError)
    assert e.value.array_path == level.path
    assert e.value.region == ((0, 0, 0), (4, 4, 4))  # grid-aligned: exactly the box
    msg = str(e.value)
    assert level.path in msg and "[0:4, 0:4, 0:4]" in msg and "re-copy" in msg
    # Another region of the same array, in intact chunks, still reads.
    read_linear(source.stores, level, (80.0, 80.0, 80.0), (8.0, 8.0, 8.0), (4, 4, 4))


def test_chunk_read_error_survives_pickling():
    """DataLoader workers send exceptions to the main process by message."""
    import pickle

    err = ChunkReadError("/x/s0", (0, 1, 2), (3, 4, 5), ValueError("bad"))
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, ChunkReadError) and str(again) == str(err)
    assert isinstance(ChunkReadError(str(err)), DatasetError)


def test_array_handle_cache_is_bounded(tmp_path):
    write_store(tmp_path)
    stores = StoreContext(StoreSettings(array_handles=2))
    (source,) = discover(stores, tmp_path)
    paths = [source.levels[0].path] + [lv[0].path for lv in source.crops[0].classes.values()]
    for p in paths:
        arr = stores.open_array(p)
        # Read chunk by chunk from the file system: no chunk data is kept between reads.
        assert isinstance(arr, ChunkedArray)
    assert stores.open_paths() == paths[-2:]
    stores.open_array(paths[-2])  # reused: now the most recently used
    assert stores.open_paths() == [paths[-1], paths[-2]]


# ---------------------------------------------------------------------------------------------
# Class names
# ---------------------------------------------------------------------------------------------


def test_class_name_neither_cellmap_nor_annotated(tmp_path):
    write_store(tmp_path)
    with pytest.raises(DatasetError, match="'mitochondrion'"):
        load_segmentation_data(
            DataSettings.from_config(seg_cfg(tmp_path, "--data.classes", "mito,mitochondrion")))


# ---------------------------------------------------------------------------------------------
# Split lists
# ---------------------------------------------------------------------------------------------

THREE_CROPS = {"crop1": ((0, 0, 0), {"mito": 0.3, "nuc": 0.5}),
               "crop2": ((8, 0, 0), {"mito": 0.3, "nuc": 0.5}),
               "crop3": ((16, 16, 16), {"mito": 0.3, "nuc": 0.5})}


def _csv_row(split, store, crop=None, classes=None):
    row = f'"{split}","{store}","{EM}"'
    if crop:
        row += f',"{store}","{GT}/{crop}' + (f'/[{",".join(classes)}]"' if classes else '"')
    return row + "\n"


def test_csv_split_list_in_the_cellmap_data_format(tmp_path):
    store = write_store(tmp_path / "data", crops=THREE_CROPS)
    other = write_store(tmp_path / "data", name="jrc_t-2", seed=1)
    rel = store.relative_to(tmp_path)  # relative paths are relative to the CSV's folder
    split = tmp_path / "datasplit.csv"
    split.write_text(_csv_row("train", store, "crop1", ["mito", "nuc"])
                     + _csv_row("train", rel, "crop2", ["mito"])
                     + _csv_row("validate", store, "crop3", ["mito", "nuc"])
                     + _csv_row("train", other))  # EM only: for MAE
    sources = discover(StoreContext(), split)
    assert [s.name for s in sources] == ["jrc_t-1", "jrc_t-2"]
    assert sources[0].store == str(store) and sources[1].crops == []
    _, train, val = load_segmentation_data(
        DataSettings.from_config(seg_cfg(split, "--data.val_crops", "crop1")))
    assert [c.full_name for c in train] == ["jrc_t-1/crop1", "jrc_t-1/crop2"]
    assert [c.full_name for c in val] == ["jrc_t-1/crop3"]  # val_crops is ignored
    assert list(train[1].classes) == ["mito"]  # only the listed classes, though nuc exists


def test_toml_split_list(tmp_path):
    write_store(tmp_path / "data", crops=THREE_CROPS)
    split = tmp_path / "lists" / "split.toml"
    split.parent.mkdir()
    split.write_text(f'''root = "{tmp_path / 'data'}"
[[train]]
em = "jrc_t-1/jrc_t-1.zarr/{EM}"
crops = ["jrc_t-1/jrc_t-1.zarr/{GT}/crop1", "jrc_t-1/jrc_t-1.zarr/{GT}/crop2"]
classes = ["mito", "nuc"]

[[val]]
em = "jrc_t-1/jrc_t-1.zarr/{EM}"
crop = "jrc_t-1/jrc_t-1.zarr/{GT}/crop3"
''')
    _, train, val = load_segmentation_data(DataSettings.from_config(seg_cfg(split)))
    assert [c.name for c in train] == ["crop1", "crop2"] and [c.name for c in val] == ["crop3"]
    assert all(c.split == "train" for c in train) and val[0].split == "val"


def test_split_list_without_val_entries_is_split_by_val_crops(tmp_path):
    store = write_store(tmp_path / "data", crops=THREE_CROPS)
    split = tmp_path / "split.csv"
    split.write_text("".join(_csv_row("train", store, c) for c in THREE_CROPS))
    _, train, val = load_segmentation_data(
        DataSettings.from_config(seg_cfg(split, "--data.val_crops", "crop2")))
    assert [c.name for c in train] == ["crop1", "crop3"] and [c.name for c in val] == ["crop2"]


@pytest.mark.parametrize("case, fragments", [
    ("split", ["line 1", "'test'", "'train'"]),
    ("columns", ["line 2", "expected 5 columns"]),
    ("no_crop", ["line 1", "crop9", "does not exist"]),
    ("no_class", ["line 1", "no class group ['er']", "remove those classes"]),
    ("twice", ["line 2", "jrc_t-1/crop1", "already listed at", "line 1"]),
    ("remote", ["line 1", "ftp://host/jrc_t-1.zarr", "unsupported URL", "s3://bucket/path"]),
    ("suffix", ["not a split list", ".csv"]),
    ("toml_key", ["[[train]] entry 1", "'crops'", "'emm'"]),
    ("toml_no_zarr", ["is not inside a .zarr store", "name ="]),
])
def test_split_list_errors(tmp_path, case, fragments):
    store = write_store(tmp_path / "data")
    split = tmp_path / ("split.toml" if case.startswith("toml") else "split.csv")
    good = _csv_row("train", store, "crop1", ["mito"])
    text = {
        "split": _csv_row("test", store, "crop1"),
        "columns": good + f'"train","{store}","{EM}","{store}"\n',
        "no_crop": _csv_row("train", store, "crop9"),
        "no_class": _csv_row("train", store, "crop1", ["mito", "er"]),
        "twice": good + _csv_row("validate", store, "crop1", ["nuc"]),
        "remote": _csv_row("train", "ftp://host/jrc_t-1.zarr", "crop1"),
        "toml_key": f'[[train]]\nemm = "{store / EM}"\n',
        "toml_no_zarr": f'[[train]]\nem = "{tmp_path}"\n',
    }.get(case, good)
    if case == "suffix":
        split = tmp_path / "split.txt"
    split.write_text(text)
    with pytest.raises(DatasetError) as e:
        discover(StoreContext(), split)
    for frag in fragments:
        assert frag in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------
# Zarr format 3 (OME-NGFF 0.5)
# ---------------------------------------------------------------------------------------------


def test_zarr_v3_store_reads_like_v2(tmp_path):
    write_store(tmp_path / "v2", zarr_format=2, crops=THREE_CROPS)
    v3 = write_store(tmp_path / "v3", zarr_format=3, crops=THREE_CROPS)
    assert (v3 / EM / "zarr.json").is_file() and not (v3 / EM / ".zattrs").exists()
    samples = []
    for root in (tmp_path / "v2", tmp_path / "v3"):
        cfg = seg_cfg(root)
        sources, train, _ = load_segmentation_data(DataSettings.from_config(cfg))
        assert [c.name for c in train] == list(THREE_CROPS)
        assert sources[0].levels[0].scale == (8.0, 8.0, 8.0)
        ds = build_segmentation_samples(DataSettings.from_config(cfg), sources, train)
        samples.append([ds[g] for g in range(6)])
    for a, b in zip(*samples):
        for key in ("image", "target", "valid"):
            assert torch.equal(getattr(a, key), getattr(b, key)), key


@pytest.mark.distributed
def test_zarr_v3_store_listed_in_a_csv_trains(tmp_path):
    """End to end on one process: a format-3 store, named by a datasplit CSV, trains and
    validates on the crop the CSV marks 'validate'."""
    store = write_store(tmp_path / "data", zarr_format=3, crops=THREE_CROPS)
    split = tmp_path / "datasplit.csv"
    split.write_text(_csv_row("train", store, "crop1", ["mito", "nuc"])
                     + _csv_row("train", store, "crop2", ["mito", "nuc"])
                     + _csv_row("validate", store, "crop3", ["mito", "nuc"]))
    dump = tmp_path / "run"
    r = launch("train_segmentation.py", [
        "--job.config_file", "train_configs/debug_segmentation_2d.toml",
        "--data.dataset_path", str(split), "--data.classes", "mito,nuc",
        "--model.crop_size", "16,16", "--job.dump_folder", str(dump), "--training.steps", "2",
        "--training.batch_size", "2", "--metrics.log_freq", "1",
        "--no-checkpoint.enable_checkpoint", "--no-metrics.progress_bar"], nproc=0, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "1 validation crops (jrc_t-1/crop3)" in r.stdout + r.stderr
    records = read_jsonl(dump / "logs" / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert any("val/mean_iou" in r for r in records)


# ---------------------------------------------------------------------------------------------
# End to end: a bad input stops every rank with one message
# ---------------------------------------------------------------------------------------------


@pytest.mark.distributed
def test_unservable_voxel_size_stops_torchrun_with_one_message(demo_data, tmp_path):
    r = launch("train_segmentation.py", [
        "--job.config_file", "train_configs/debug_segmentation_2d.toml",
        "--data.dataset_path", str(demo_data), "--job.dump_folder", str(tmp_path / "d"),
        "--data.voxel_size", "2,2,2", "--no-metrics.progress_bar"], timeout=300)
    assert r.returncode != 0
    err = r.stderr
    assert err.count("error:") == 1, err[-4000:]  # printed once, by rank 0
    for frag in ("jrc_synth-1.zarr", "data.voxel_size [2.0, 2.0, 2.0]", "finer than half",
                 "choose a data.voxel_size"):
        assert frag in err, err[-4000:]


@pytest.mark.distributed
def test_corrupt_chunk_during_training_is_logged_and_counted(tmp_path):
    """A corrupt label chunk in a training crop: the run goes on, warns with the array path,
    and logs how many samples were replaced as ``data/resampled``."""
    store = write_store(tmp_path / "data", crops=THREE_CROPS)
    chunk = store / GT / "crop1" / "mito" / "s0" / "0.0.0"
    assert chunk.is_file()
    chunk.write_bytes(b"\x00 not a compressed chunk \x00" * 4)
    dump = tmp_path / "run"
    r = launch("train_segmentation.py", [
        "--job.config_file", "train_configs/debug_segmentation_2d.toml",
        "--data.dataset_path", str(tmp_path / "data"), "--data.classes", "mito,nuc",
        "--data.val_crops", "crop3", "--model.crop_size", "16,16",
        "--job.dump_folder", str(dump), "--training.steps", "3", "--training.batch_size", "4",
        "--metrics.log_freq", "1", "--metrics.eval_freq", "0",
        "--no-checkpoint.enable_checkpoint", "--no-metrics.progress_bar"], nproc=0, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert str(chunk.parent.parent) in r.stderr
    counts = [rec["data/resampled"] for rec in read_jsonl(dump / "logs" / "metrics.jsonl")
              if "data/resampled" in rec]
    assert counts == sorted(counts) and counts[-1] > 0, counts
