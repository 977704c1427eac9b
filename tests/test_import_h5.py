"""helpers/import_stack.py on volumes as connectomics holds them: HDF5 datasets and id labels.

Small synthetic HDF5 files are written with h5py in tmp_path (EM, a volume of object ids of
64-bit values crossing the crops, a ``resolution`` attribute), imported through the script's
``main`` and read back with zarr and through the project's data code. The boundary class is
checked voxel for voxel against a direct per-voxel computation of its definition. Every bad
input must give one ``error:`` line naming the file, the dataset or the value and the fix, and
write nothing. The last tests import the real medulla cubes (``../shared/data/medulla``;
skipped when absent).
"""

from __future__ import annotations

import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import zarr
from PIL import Image

from conftest import SHARED
from torchtitan.cellmap.labels import LabelEncoding
from torchtitan.cellmap.ome_ngff import pyramid_steps, read_multiscales
from torchtitan.config.manager import ConfigManager
from torchtitan.data.crops import layout, reader
from torchtitan.data.crops.layout import EM_GROUP, EM_GROUP_UINT16, GT_GROUP
from torchtitan.imports.id_labels import boundary_mask
from torchtitan.data.io.stores import StoreContext
from torchtitan.imports.volume_files import HDF5Volume
from torchtitan.data.volume_source import build_source
from test_import_stack import imported, run

MEDULLA = SHARED / "data" / "medulla"
SHAPE = (8, 12, 16)  # z, y, x
BIG = 10**12  # an id far beyond uint32, as body ids of real ground truth are
FACES = [(-1, 0, 0), (1, 0, 0), (0, -1, 0), (0, 1, 0), (0, 0, -1), (0, 0, 1)]


def synthetic_ids() -> np.ndarray:
    """(8, 12, 16) uint64 ids: two large bodies split along a wavy line, a small one through
    sections 3-6 (across the crops 0-4 / 5-7), a corner of no object, id 7 in one patch."""
    ids = np.full(SHAPE, 5, np.uint64)
    z, y, x = np.indices(SHAPE)
    ids[x < 6 + (y + z) % 3] = BIG
    ids[3:7, 4:8, 9:13] = 3
    ids[:2, :3, 13:] = 0
    ids[6:, 9:, 12:] = 7
    return ids


def synthetic_raw(dtype=np.uint8) -> np.ndarray:
    top = 255 if dtype == np.uint8 else 60000
    return np.random.default_rng(0).integers(1, top, size=SHAPE).astype(dtype)


def write_h5(path: Path, datasets: dict) -> Path:
    """``{name: array or (array, attrs)}`` as gzip-chunked datasets, as CREMI files are."""
    with h5py.File(path, "w") as f:
        for name, value in datasets.items():
            array, attrs = value if isinstance(value, tuple) else (value, {})
            chunks = tuple(min(4, n) for n in array.shape) if array.ndim else None
            ds = f.create_dataset(name, data=array, chunks=chunks,
                                  compression="gzip" if chunks else None)
            ds.attrs.update(attrs)
    return path


@pytest.fixture
def h5(tmp_path) -> Path:
    res = {"resolution": np.array([8.0, 4.0, 4.0])}
    return write_h5(tmp_path / "sample.h5", {"volumes/raw": (synthetic_raw(), res),
                                             "volumes/labels/neuron_ids": (synthetic_ids(), res)})


def gt(out: Path, name: str, crop: str, cls: str):
    root = zarr.open_group(str(out / name / f"{name}.zarr"), mode="r")
    return root[f"{GT_GROUP}/{crop}/{cls}/s0"][:], dict(root[f"{GT_GROUP}/{crop}/{cls}"].attrs)


def direct_boundary(ids: np.ndarray, known: np.ndarray, width: int) -> np.ndarray:
    """The boundary definition computed voxel by voxel: a known voxel with a known face
    neighbour (inside the volume) of another id; at width N every voxel within city-block
    distance N - 1 of one."""
    edge = np.zeros(ids.shape, bool)
    for p in np.ndindex(ids.shape):
        for f in FACES:
            q = tuple(a + b for a, b in zip(p, f))
            if all(0 <= c < n for c, n in zip(q, ids.shape)) and known[p] and known[q] \
                    and ids[p] != ids[q]:
                edge[p] = True
    if width == 1:
        return edge
    seeds = np.argwhere(edge)
    out = np.zeros(ids.shape, bool)
    for p in np.ndindex(ids.shape):
        out[p] = len(seeds) > 0 and np.abs(seeds - np.array(p)).sum(1).min() <= width - 1
    return out


def same_partition(stored: np.ndarray, ids: np.ndarray) -> bool:
    """Whether two id volumes group the voxels alike (one-to-one ids, 0 where 0)."""
    pairs = np.unique(np.stack([stored.ravel(), ids.ravel().astype(np.uint64)]), axis=1)
    return (len(np.unique(pairs[0])) == pairs.shape[1] == len(np.unique(pairs[1]))
            and np.array_equal(stored == 0, ids == 0))


IDS = "volumes/labels/neuron_ids"
ID_FLAGS = ["--ids", "cell", "--boundary", "pm"]


# ---------------------------------------------------------------------------------------------
# What an HDF5 volume of ids becomes
# ---------------------------------------------------------------------------------------------


def test_hdf5_raw_and_ids_become_em_and_instance_and_boundary_crops(h5, tmp_path, capsys):
    out = tmp_path / "data"
    log = imported(["--em", f"{h5}:volumes/raw", "--labels", f"{h5}:{IDS}", *ID_FLAGS,
                    "--crop", "crop1=0-4", "--crop", "crop2=5-7", "--out", out], capsys)
    assert "from the resolution attribute" in log and "--data.voxel_size 8,4,4" in log
    assert "--data.classes cell,pm" in log
    root = zarr.open_group(str(out / "sample" / "sample.zarr"), mode="r")  # the file's stem
    np.testing.assert_array_equal(root[f"{EM_GROUP}/s0"][:], synthetic_raw())
    assert read_multiscales(out / "sample" / "sample.zarr" / EM_GROUP)[0].scale == (8.0, 4.0, 4.0)

    ids = synthetic_ids()
    for crop, (a, b), n in (("crop1", (0, 4), 3), ("crop2", (5, 7), 4)):
        part = ids[a: b + 1]
        cell, attrs = gt(out, "sample", crop, "cell")
        # Renumbered 1..n in the order of the ids' values; the small body is in both crops.
        assert cell.dtype == np.uint16 and sorted(np.unique(cell[cell > 0])) == list(range(1, n + 1))
        assert same_partition(cell, part)
        assert cell[part == 3].min() == 1 and cell[part == BIG].min() == n
        assert LabelEncoding.from_attrs(attrs).unknown == 65535
        ann = attrs["cellmap"]["annotation"]
        assert ann["annotation_type"]["type"] == "instance_segmentation" and ann["class_name"] == "cell"
        assert ann["complement_counts"]["absent"] == int(np.count_nonzero(part == 0))
        pm, pm_attrs = gt(out, "sample", crop, "pm")
        want = direct_boundary(part, np.ones(part.shape, bool), 1)
        np.testing.assert_array_equal(pm, want.astype(np.uint8))  # crop edges are not boundaries
        assert pm_attrs["cellmap"]["annotation"]["annotation_type"]["type"] == "semantic_segmentation"
        assert f"{crop}: sections {a}-{b}" in log and f"({n} objects), pm {want.mean():.3f}" in log

    # The project's reader finds both crops, their classes and the voxel size.
    (source,) = layout.discover(StoreContext(), out)
    assert sorted(c.name for c in source.crops) == ["crop1", "crop2"]
    assert all(sorted(c.classes) == ["cell", "pm"] for c in source.crops)
    assert source.crops[1].classes["pm"][0].translation == (40.0, 0.0, 0.0)  # section 5 at 8 nm


@pytest.mark.parametrize("width", [1, 2, 3])
def test_boundary_matches_its_definition_voxel_for_voxel(width):
    ids = synthetic_ids()
    known = ids != 7
    np.testing.assert_array_equal(boundary_mask(ids, known, width), direct_boundary(ids, known, width))


def test_boundary_width_and_unknown_ids_through_the_import(h5, tmp_path, capsys):
    out = tmp_path / "data"
    imported(["--em", f"{h5}:volumes/raw", "--labels", f"{h5}:{IDS}", *ID_FLAGS,
              "--boundary_width", "2", "--unknown", "7", "--out", out], capsys)
    ids = synthetic_ids()
    known = ids != 7
    pm, _ = gt(out, "sample", "crop1", "pm")
    want = direct_boundary(ids, known, 2).astype(np.uint8)
    want[~known] = 255
    np.testing.assert_array_equal(pm, want)
    cell, attrs = gt(out, "sample", "crop1", "cell")
    assert np.all(cell[~known] == 65535) and same_partition(cell[known], ids[known])
    assert attrs["cellmap"]["annotation"]["complement_counts"]["unknown"] == int((~known).sum())


def test_voxel_size_flag_overrides_the_resolution_attribute(h5, tmp_path, capsys):
    out = tmp_path / "data"
    log = imported(["--em", f"{h5}:volumes/raw", "--out", out, "--voxel_size", "6,6,6"], capsys)
    assert "from --voxel_size" in log and "says 8,4,4" in log
    assert read_multiscales(out / "sample" / "sample.zarr" / EM_GROUP)[0].scale == (6.0, 6.0, 6.0)


def test_png_em_with_hdf5_ids_and_16bit_png_ids_and_uint16_hdf5_em(tmp_path, capsys):
    """One path for images and HDF5: either may be the EM and either the ids."""
    raw, ids = synthetic_raw(), synthetic_ids()
    (tmp_path / "png").mkdir()
    (tmp_path / "idpng").mkdir()
    small = np.where(ids == BIG, 9, ids).astype(np.uint16)  # ids that fit 16-bit images
    for z in range(SHAPE[0]):
        Image.fromarray(raw[z]).save(tmp_path / "png" / f"{z}.png")
        Image.fromarray(small[z]).save(tmp_path / "idpng" / f"{z}.png")
    h5 = write_h5(tmp_path / "ids.hdf5", {"ids": ids, "em16": synthetic_raw(np.uint16)})
    out = tmp_path / "data"
    imported(["--em", tmp_path / "png", "--labels", f"{h5}:ids", "--ids", "cell", "--out", out,
              "--name", "a", "--voxel_size", "8,8,8"], capsys)
    imported(["--em", f"{h5}:em16", "--labels", tmp_path / "idpng", "--ids", "cell", "--out", out,
              "--name", "b", "--voxel_size", "8,8,8", "--crop", "crop2=0-7"], capsys)
    assert same_partition(gt(out, "a", "crop1", "cell")[0], ids)
    assert same_partition(gt(out, "b", "crop2", "cell")[0], small)
    root = zarr.open_group(str(out / "b" / "b.zarr"), mode="r")
    np.testing.assert_array_equal(root[f"{EM_GROUP_UINT16}/s0"][:], synthetic_raw(np.uint16))


def test_hdf5_value_map_labels(tmp_path, capsys):
    lab = np.where(synthetic_ids() == 3, 191, 255).astype(np.uint8)
    h5 = write_h5(tmp_path / "v.h5", {"raw": synthetic_raw(), "lab": lab})
    out = tmp_path / "data"
    imported(["--em", f"{h5}:raw", "--labels", f"{h5}:lab", "--class", "mito=191",
              "--background", "255", "--out", out, "--voxel_size", "8,8,8"], capsys)
    mito, _ = gt(out, "v", "crop1", "mito")
    assert np.array_equal(mito > 0, lab == 191) and mito.max() == 1


def test_em_is_read_slab_by_slab(tmp_path, capsys, monkeypatch):
    h5 = write_h5(tmp_path / "long.h5", {"raw": np.zeros((150, 8, 8), np.uint8)})
    reads = []
    original = HDF5Volume.read_range
    monkeypatch.setattr(HDF5Volume, "read_range",
                        lambda self, a, b: reads.append(b - a) or original(self, a, b))
    imported(["--em", f"{h5}:raw", "--out", tmp_path / "data", "--voxel_size", "8,8,8"], capsys)
    assert sum(reads) == 150 and max(reads) < 150


def test_isotropic_pyramids_halve_every_axis():
    # A 250^3 cube at 10 nm: 250, 125, 63 voxels a side (10, 20, 40 nm), down to <= 64.
    assert pyramid_steps((10, 10, 10), (250, 250, 250)) == [(2, 2, 2), (2, 2, 2)]
    assert pyramid_steps((10, 10, 10), (1000, 1000, 1000)) == [(2, 2, 2)] * 4


# ---------------------------------------------------------------------------------------------
# Bad input: one clear error each, nothing written
# ---------------------------------------------------------------------------------------------


def _bad_files(tmp: Path) -> dict[str, Path]:
    res = {"resolution": [8.0, 4.0, 4.0]}
    ids, raw = synthetic_ids(), synthetic_raw()
    empty2 = ids.copy()
    empty2[5:] = 0
    signed = ids.astype(np.int64)
    signed[2, 3, 4] = -3
    return {
        "h5": write_h5(tmp / "s.h5", {"volumes/raw": (raw, res), IDS: (ids, res),
                                      "flat": raw[0], "float": ids.astype(np.float32),
                                      "mask": ids > 5, "signed": signed, "empty2": empty2,
                                      "narrow": ids[:, :, :15], "fem": raw.astype(np.float32),
                                      "other_res": (ids, {"resolution": [10.0, 4.0, 4.0]})}),
        "plain": write_h5(tmp / "p.h5", {"raw": raw, "bad_res": (raw, {"resolution": [8.0, 4.0]})}),
    }


BAD = {
    # case: (arguments, what the one error line must say)
    "no_dataset_name": (["--em", "{h5}"], ["{h5}: name the dataset", "volumes/raw (8, 12, 16) uint8",
                                           "FILE.h5:DATASET"]),
    "missing_dataset": (["--em", "{h5}:volumes/rwa"], ["no dataset 'volumes/rwa'",
                                                       "did you mean 'volumes/raw'",
                                                       f"{IDS} (8, 12, 16) uint64"]),
    "group": (["--em", "{h5}:volumes"], ["{h5}:volumes is a group", "volumes/raw (8, 12, 16)"]),
    "missing_file": (["--em", "{tmp}/nope.h5:raw"], ["nope.h5", "no such file"]),
    "not_hdf5": (["--em", "{tmp}/text.h5:raw"], ["text.h5 is not an HDF5 file"]),
    "not_3d": (["--em", "{h5}:flat"], ["{h5}:flat has shape (12, 16) (2D)", "3D volume, (z, y, x)"]),
    "float_em": (["--em", "{h5}:fem"], ["--em {h5}:fem is float32", "uint8 or uint16", "rescale"]),
    "shapes_differ": (["--labels", "{h5}:narrow", *ID_FLAGS],
                      ["--labels {h5}:narrow is 8 x 12 x 15 (z, y, x)",
                       "--em {h5}:volumes/raw is 8 x 12 x 16", "voxel for voxel"]),
    "float_ids": (["--labels", "{h5}:float", *ID_FLAGS], ["{h5}:float is float32", "must be integers"]),
    "bool_ids": (["--labels", "{h5}:mask", *ID_FLAGS], ["{h5}:mask is bool", "not object ids"]),
    "negative_ids": (["--labels", "{h5}:signed", *ID_FLAGS],
                     ["{h5}:signed: value -3 at section 2 (y 3, x 4)", "must be >= 0"]),
    "crop_without_objects": (["--labels", "{h5}:empty2", *ID_FLAGS, "--crop", "crop1=0-4",
                              "--crop", "crop2=5-7"],
                             ["{h5}:empty2: crop2 (sections 5-7) holds no object",
                              "every voxel is 0 (no object)", "--crop crop2=FIRST-LAST"]),
    "crop_all_unknown": (["--labels", "{h5}:" + IDS, *ID_FLAGS, "--unknown", f"0-5,{BIG}",
                          "--crop", "crop1=0-1"],
                         ["crop1 (sections 0-1) holds no object",
                          f"or an --unknown id (0-5,{BIG})"]),
    "boundary_without_ids": (["--labels", "{h5}:" + IDS, "--boundary", "pm"],
                             ["--boundary pm derives a class", "--ids cell --boundary pm"]),
    "width_without_boundary": (["--labels", "{h5}:" + IDS, "--ids", "cell", "--boundary_width", "2"],
                               ["--boundary_width needs --boundary CLASS"]),
    "width_zero": (["--labels", "{h5}:" + IDS, *ID_FLAGS, "--boundary_width", "0"],
                   ["--boundary_width 0"]),
    "ids_misspelt": (["--labels", "{h5}:" + IDS, "--ids", "cel"],
                     ["--ids cel: not a CellMap class; did you mean 'cell'?"]),
    "ids_semantic": (["--labels", "{h5}:" + IDS, "--ids", "pm"],
                     ["--ids pm: a semantic class", "instance class", "cell"]),
    "boundary_misspelt": (["--labels", "{h5}:" + IDS, "--ids", "cell", "--boundary", "pmm"],
                          ["--boundary pmm: not a CellMap class; did you mean 'pm'?"]),
    "boundary_instance": (["--labels", "{h5}:" + IDS, "--ids", "cell", "--boundary", "mito"],
                          ["--boundary mito: an instance class", "semantic class"]),
    "ids_and_value_map": (["--labels", "{h5}:" + IDS, "--ids", "cell", "--class", "mito=3"],
                          ["--ids cell reads the labels as object ids, but --class", "not both"]),
    "ids_without_labels": (["--ids", "cell"], ["--ids cell needs the volume of object ids",
                                               "--labels"]),
    "value_map_on_ids": (["--labels", "{h5}:" + IDS, "--class", "mito=3"],
                         ["{h5}:volumes/labels/neuron_ids is uint64", "8- or 16-bit",
                          "--ids CLASS"]),
    "resolutions_differ": (["--labels", "{h5}:other_res", *ID_FLAGS],
                           ["has resolution 8,4,4 nm but --labels {h5}:other_res has 10,4,4",
                            "--voxel_size"]),
    "no_voxel_size": (["--em", "{plain}:raw"], ["--em {plain}:raw: no voxel size",
                                                "--voxel_size z,y,x"]),
    "bad_resolution": (["--em", "{plain}:bad_res"], ["{plain}:bad_res: its resolution attribute",
                                                     "--voxel_size z,y,x"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_clear_error_and_writes_nothing(tmp_path, case, capsys):
    files = _bad_files(tmp_path)
    (tmp_path / "text.h5").write_text("not HDF5")
    fill = {"h5": str(files["h5"]), "plain": str(files["plain"]), "tmp": str(tmp_path)}
    args, expected = BAD[case]
    args = [a.format(**fill) for a in args]
    if "--em" not in args:
        args = ["--em", f"{files['h5']}:volumes/raw", *args]
    rc, out, err = run([*args, "--out", tmp_path / "data"], capsys)
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for text in expected:
        assert text.format(**fill) in lines[0], lines[0]
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").iterdir())


# ---------------------------------------------------------------------------------------------
# Real EM: the medulla cubes, read back by the training and validation code
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not (MEDULLA / "labelled.h5").is_file(), reason="../shared/data/medulla is not here")
def test_medulla_imports_and_reads_back_through_the_volume_source(tmp_path, capsys):
    h5 = MEDULLA / "labelled.h5"
    out = tmp_path / "medulla"
    start = time.monotonic()
    log = imported(["--em", f"{h5}:volumes/raw", "--labels", f"{h5}:{IDS}", *ID_FLAGS,
                    "--crop", "crop1=0-189", "--crop", "crop2=190-249", "--out", out,
                    "--name", "medulla"], capsys)
    imported(["--em", MEDULLA / "unlabelled", "--voxel_size", "10,10,10", "--out", out,
              "--name", "medulla_more"], capsys)
    assert time.monotonic() - start < 30
    assert "--data.voxel_size 10,10,10" in log and "3 levels" in log

    with h5py.File(h5, "r") as f:
        ids = f[IDS][:]
    # The README's figure: 12.6 % of the cube's voxels have a face neighbour of another id.
    assert boundary_mask(ids, np.ones(ids.shape, bool)).mean() == pytest.approx(0.126, abs=0.0005)

    sources = {s.name: s for s in layout.discover(StoreContext(), out)}
    assert sorted(sources) == ["medulla", "medulla_more"] and sources["medulla_more"].crops == []
    for s in sources.values():
        assert [lv.shape for lv in s.levels] == [(250,) * 3, (125,) * 3, (63,) * 3]
        assert [lv.scale for lv in s.levels] == [(10.0,) * 3, (20.0,) * 3, (40.0,) * 3]

    cfg = ConfigManager().parse_args([
        "--job.config_file", "train_configs/debug_segmentation_3d.toml", "--data.dataset_path",
        str(out), "--data.voxel_size", "10,10,10", "--data.classes", "cell,pm",
        "--data.val_crops", "crop2"])
    source = build_source(cfg)
    assert [c.name for c in source.train_crops] == ["crop1"]
    for crop, (a, b) in ((source.train_crops[0], (0, 189)), (source.val_crops[0], (190, 249))):
        part = ids[a: b + 1]
        vol = source.read_volume(crop)
        assert vol.voxel_size == (10.0, 10.0, 10.0) and vol.annotated == ["cell", "pm"]
        assert tuple(vol.target.shape) == (2, b - a + 1, 250, 250) and bool(vol.valid.all())
        n = len(np.unique(part[part > 0]))
        assert int(vol.instance_ids["cell"].max()) == n == len(np.unique(vol.instance_ids["cell"])) - (
            1 if (part == 0).any() else 0)
        np.testing.assert_array_equal(vol.target[1].numpy(), boundary_mask(part, np.ones(part.shape, bool)))
        assert tuple(vol.image.shape) == (1, b - a + 1, 250, 250)
        assert f"({n} objects)" in log
