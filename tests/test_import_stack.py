"""helpers/import_stack.py: folders of 2D EM sections and label images become CellMap stores.

Synthetic stacks are written by the tests as real image files (8- and 16-bit TIFF, PNG,
multi-page TIFF), imported, and read back from disk: with zarr, and through the project's own
data code (dataset discovery, the training samples, the validation crop reader). Every bad
input is tried through the script's ``main`` and must give one ``error:`` line naming the
file or value and the fix. The last test imports the first sections of the real VNC stack
(``../shared/data/vnc``; skipped when absent).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr
from PIL import Image

from conftest import REPO, SHARED, script_module
from torchtitan.cellmap.labels import LabelEncoding, label_to_target
from torchtitan.cellmap.ome_ngff import pyramid_steps, read_multiscales, stored_intensity_range
from torchtitan.config.manager import ConfigManager
from torchtitan.data.crops import layout, reader
from torchtitan.data.crops.layout import EM_GROUP, EM_GROUP_UINT16, GT_GROUP
from torchtitan.imports.image_stack import natural_key
from torchtitan.data.sampling.samples import build_segmentation_samples
from torchtitan.data.crops.selection import DataSettings, load_em_sources, load_segmentation_data
from torchtitan.data.io.stores import StoreContext
from torchtitan.data.crops.reader import CropReader, crop_grid
from torchtitan.data.crops.reader import read_instance_ids
from torchtitan.errors import run_cli

import_main = script_module("helpers/import_stack.py").main

VNC = SHARED / "data" / "vnc" / "stack1"
VOXEL = "50,4,4"
# Label values of the synthetic stacks (those of the VNC stack): membrane, ecs, mito, synapse, cytoplasm.
PM, ECS, MITO, SYNAPSE, CYTO = 0, 159, 191, 223, 255
CLASS_FLAGS = ["--class", f"pm={PM},32-128", "--class", f"mito={MITO}", "--class", f"ecs={ECS}",
               "--background", f"{CYTO},{SYNAPSE}"]


def synthetic_labels(n: int, shape=(24, 32)) -> np.ndarray:
    """(n, y, x) uint8 labels: cytoplasm with a membrane line, an ecs patch, a synapse dot,
    one mitochondrion through every section and one only in section 0."""
    lab = np.full((n, *shape), CYTO, np.uint8)
    lab[:, 12, :] = PM
    lab[:, 13, :4] = 128
    lab[:, 18:22, 26:30] = ECS
    lab[:, 2, 2] = SYNAPSE
    lab[:, 3:7, 3:9] = MITO
    lab[0, 3:6, 20:24] = MITO
    return lab


def synthetic_em(n: int, shape=(24, 32), dtype=np.uint8) -> np.ndarray:
    rng = np.random.default_rng(0)
    top = 255 if dtype == np.uint8 else 60000
    return rng.integers(1, top, size=(n, *shape)).astype(dtype)


def write_images(folder: Path, arrays, suffix: str, names=None) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    names = names or [f"{i:02d}" for i in range(len(arrays))]
    paths = []
    for name, a in zip(names, arrays):
        paths.append(folder / f"{name}{suffix}")
        Image.fromarray(a).save(paths[-1])
    return paths


def write_multipage(path: Path, arrays) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pages = [Image.fromarray(a) for a in arrays]
    pages[0].save(path, save_all=True, append_images=pages[1:])
    return path


def run(argv, capsys) -> tuple[int, str, str]:
    rc = run_cli(import_main, [str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def imported(argv, capsys) -> str:
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    return out


def open_store(out: Path, name: str):
    return zarr.open_group(str(out / name / f"{name}.zarr"), mode="r")


# ---------------------------------------------------------------------------------------------
# What a good stack becomes
# ---------------------------------------------------------------------------------------------


def test_natural_order():
    names = ["s10.tif", "s2.tif", "s1.tif", "S3.tif"]
    assert [p.name for p in sorted(map(Path, names), key=natural_key)] == [
        "s1.tif", "s2.tif", "S3.tif", "s10.tif"]


def test_tiff_folder_with_png_labels_becomes_em_pyramid_and_label_crops(tmp_path, capsys):
    em, lab = synthetic_em(6, (40, 96)), synthetic_labels(6, (40, 96))
    # Names sort differently as text and as numbers: sections are taken by number.
    names = ["z1", "z2", "z3", "z9", "z10", "z11"]
    write_images(tmp_path / "raw", em, ".tif", names)
    write_images(tmp_path / "labels", lab, ".png", [f"label_{n}" for n in names])
    out = tmp_path / "data"
    log = imported(["--em", tmp_path / "raw", "--labels", tmp_path / "labels", "--out", out,
                    "--voxel_size", VOXEL, *CLASS_FLAGS, "--crop", "crop1=0-3",
                    "--crop", "crop7=4-5"], capsys)
    assert "--data.dataset_path" in log and "--data.classes pm,mito,ecs" in log
    root = open_store(out, "raw")  # the name defaults to the EM folder's
    np.testing.assert_array_equal(root[f"{EM_GROUP}/s0"][:], em)

    # Pyramid: in plane only until the pixels approach the 50 nm sections.
    levels = read_multiscales(out / "raw" / "raw.zarr" / EM_GROUP)
    assert [lv.scale for lv in levels] == [(50.0, 4.0, 4.0), (50.0, 8.0, 8.0)]
    assert [lv.shape for lv in levels] == [(6, 40, 96), (6, 20, 48)]
    assert levels[1].translation == (0.0, 2.0, 2.0)  # voxel centres: (8 - 4) / 2
    np.testing.assert_array_equal(
        root[f"{EM_GROUP}/s1"][:], np.rint(em.reshape(6, 20, 2, 48, 2).mean(axis=(2, 4))).astype(np.uint8))

    crop1 = layout.read_crop(StoreContext(), out / "raw" / "raw.zarr" / GT_GROUP / "crop1", "raw")
    crop7 = layout.read_crop(StoreContext(), out / "raw" / "raw.zarr" / GT_GROUP / "crop7", "raw")
    assert sorted(crop1.classes) == ["ecs", "mito", "pm"]
    assert crop1.classes["pm"][0].shape == (4, 40, 96)
    assert crop7.classes["pm"][0].translation == (200.0, 0.0, 0.0)  # section 4 at 50 nm
    pm = root[f"{GT_GROUP}/crop7/pm/s0"][:]
    np.testing.assert_array_equal(pm, (lab[4:] <= 128).astype(np.uint8))
    ecs = root[f"{GT_GROUP}/crop1/ecs/s0"]
    assert ecs.dtype == np.uint8
    np.testing.assert_array_equal(ecs[:], (lab[:4] == ECS).astype(np.uint8))

    # mito is an instance class: object ids, connected across sections (3D by default).
    mito = root[f"{GT_GROUP}/crop1/mito/s0"][:]
    assert len(np.unique(mito[mito > 0])) == 2
    assert np.array_equal(mito > 0, lab[:4] == MITO)
    attrs = dict(root[f"{GT_GROUP}/crop1/mito"].attrs)["cellmap"]["annotation"]
    assert attrs["annotation_type"]["type"] == "instance_segmentation"
    assert LabelEncoding.from_attrs(dict(root[f"{GT_GROUP}/crop1/mito"].attrs)).unknown == 65535
    assert attrs["class_name"] == "mito"
    assert attrs["complement_counts"]["absent"] == int(np.count_nonzero(lab[:4] != MITO))
    pm_attrs = dict(root[f"{GT_GROUP}/crop1/pm"].attrs)["cellmap"]["annotation"]
    assert pm_attrs["annotation_type"]["type"] == "semantic_segmentation"


def test_2d_instances_unknown_values_and_a_value_map_file(tmp_path, capsys):
    em, lab = synthetic_em(3), synthetic_labels(3)
    lab[2, 20:24, :8] = 7  # "not annotated" in the user's labels
    write_images(tmp_path / "raw", em, ".png")
    write_images(tmp_path / "lab", lab, ".tif")
    vm = tmp_path / "map.toml"
    vm.write_text(f'background = [{CYTO}, {SYNAPSE}, "{ECS}"]\nunknown = 7\n'
                  f'[classes]\npm = "{PM},32-128"\nmito = {MITO}\n')
    out = tmp_path / "data"
    imported(["--em", tmp_path / "raw", "--labels", tmp_path / "lab", "--out", out, "--name", "mine",
              "--voxel_size", VOXEL, "--value_map", vm, "--instances", "2d"], capsys)
    root = open_store(out, "mine")
    assert sorted(root[f"{GT_GROUP}/crop1"].group_keys()) == ["mito", "pm"]
    mito = root[f"{GT_GROUP}/crop1/mito/s0"][:]
    # Per section: the mitochondrion running through all three is three objects, + one in z=0.
    assert len(np.unique(mito[(mito > 0) & (mito < 65535)])) == 4
    pm = root[f"{GT_GROUP}/crop1/pm/s0"][:]
    assert np.all(pm[lab == 7] == 255) and np.all(mito[lab == 7] == 65535)
    target, valid = label_to_target(pm)
    assert not valid[lab == 7].any() and valid[lab != 7].all()
    assert np.array_equal(target, (lab <= 128) & (lab != 7))


def test_16bit_multipage_tiff_em_keeps_its_range_and_labels_from_a_glob(tmp_path, capsys):
    em, lab = synthetic_em(4, dtype=np.uint16), synthetic_labels(4)
    write_multipage(tmp_path / "em.tif", em)
    (tmp_path / "lab").mkdir()
    for z, plane in enumerate(lab):  # palette images, as annotation tools save them
        image = Image.frombytes("P", plane.shape[::-1], plane.tobytes())
        image.putpalette([v for g in range(256) for v in (g, 255 - g, g)])
        image.save(tmp_path / "lab" / f"{z}.png")
    (tmp_path / "lab" / "notes.txt").write_text("not an image")
    out = tmp_path / "data"
    imported(["--em", tmp_path / "em.tif", "--labels", str(tmp_path / "lab" / "*.png"), "--out", out,
              "--voxel_size", "8,8,8", *CLASS_FLAGS], capsys)
    root = open_store(out, "em")  # a file's name without its suffix
    assert EM_GROUP not in root
    np.testing.assert_array_equal(root[f"{GT_GROUP}/crop1/ecs/s0"][:], (lab == ECS).astype(np.uint8))
    np.testing.assert_array_equal(root[f"{EM_GROUP_UINT16}/s0"][:], em)
    assert stored_intensity_range(out / "em" / "em.zarr" / EM_GROUP_UINT16) == (em.min(), em.max())
    # Isotropic voxels: a plain 2x pyramid.
    levels = read_multiscales(out / "em" / "em.zarr" / EM_GROUP_UINT16)
    assert [lv.scale for lv in levels] == [(8.0, 8.0, 8.0)]  # 32 pixels: one level suffices
    # The loader maps the stored range onto the uint8 scale, as for CellMap's uint16 EM.
    cfg = ConfigManager().parse_args([
        "--job.config_file", "train_configs/debug_segmentation_2d.toml", "--data.dataset_path",
        str(out), "--data.voxel_size", "8,8,8", "--data.classes", "pm"])
    (source,) = load_em_sources(DataSettings.from_config(cfg))
    assert source.levels[0].path.endswith("fibsem-uint16/s0")
    (crop,) = source.crops
    origin, shape = crop_grid(crop, cfg.data.voxel_size)
    image = CropReader([source], ["pm"], cfg.data.voxel_size).read(crop, origin, shape, raw_em=True).image
    lo, hi = float(em.min()), float(em.max())
    np.testing.assert_allclose(image[0], np.rint((em - lo) * (255 / (hi - lo))), atol=1)


def test_an_unlabelled_stack_is_em_only_and_trains_mae(tmp_path, capsys):
    write_images(tmp_path / "raw", synthetic_em(3), ".tif")
    out = tmp_path / "data"
    imported(["--em", tmp_path / "raw", "--out", out, "--voxel_size", VOXEL], capsys)
    root = open_store(out, "raw")
    assert "recon-1/labels" not in root
    (source,) = layout.discover(StoreContext(), out)
    assert source.crops == []


def test_existing_dataset_is_kept_unless_overwrite_and_a_failed_import_leaves_nothing(tmp_path, capsys):
    write_images(tmp_path / "raw", synthetic_em(2), ".tif")
    out = tmp_path / "data"
    argv = ["--em", tmp_path / "raw", "--out", out, "--voxel_size", VOXEL]
    imported(argv, capsys)
    rc, _, err = run(argv, capsys)
    assert rc == 2 and f"{out / 'raw'} exists already" in err and "--overwrite" in err
    write_images(tmp_path / "raw", synthetic_em(3), ".tif")  # a third section
    imported([*argv, "--overwrite"], capsys)
    assert open_store(out, "raw")[f"{EM_GROUP}/s0"].shape[0] == 3
    # A section whose pixels cannot be read (its header can) stops the import while it
    # writes: the dataset there stays as it was, and no partial copy is left.
    bad = tmp_path / "raw" / "01.tif"
    bad.write_bytes(bad.read_bytes()[:300])
    rc, _, err = run([*argv, "--overwrite"], capsys)
    assert rc == 2 and "cannot read the pixels of" in err and "01.tif" in err
    assert sorted(p.name for p in out.iterdir()) == ["raw"]
    assert open_store(out, "raw")[f"{EM_GROUP}/s0"].shape[0] == 3


def test_crop_names_stay_unique_across_the_datasets_of_a_folder(tmp_path, capsys):
    write_images(tmp_path / "a", synthetic_em(2), ".tif")
    write_images(tmp_path / "lab", synthetic_labels(2), ".png")
    out = tmp_path / "data"
    argv = ["--labels", tmp_path / "lab", "--out", out, "--voxel_size", VOXEL, *CLASS_FLAGS]
    imported(["--em", tmp_path / "a", *argv], capsys)
    rc, _, err = run(["--em", tmp_path / "a", "--name", "b", *argv], capsys)
    assert rc == 2 and "--crop crop1: dataset a in" in err and "its crops: crop1" in err
    imported(["--em", tmp_path / "a", "--name", "b", *argv, "--crop", "crop2=0-1"], capsys)
    imported(["--em", tmp_path / "a", *argv, "--overwrite"], capsys)  # its own crops are no clash
    assert sorted(c.name for s in layout.discover(StoreContext(), out) for c in s.crops) == ["crop1", "crop2"]


def test_anisotropic_pyramid_steps():
    assert pyramid_steps((50, 4.6, 4.6), (20, 1024, 1024)) == [
        (1, 2, 2), (1, 2, 2), (1, 2, 2), (2, 2, 2)]
    assert pyramid_steps((8, 8, 8), (256, 256, 256)) == [(2, 2, 2), (2, 2, 2)]
    assert pyramid_steps((8, 8, 8), (1, 256, 256)) == [(1, 2, 2), (1, 2, 2)]  # one section


# ---------------------------------------------------------------------------------------------
# Bad input: one clear error each, nothing written
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def stack(tmp_path) -> Path:
    write_images(tmp_path / "raw", synthetic_em(4), ".tif")
    write_images(tmp_path / "lab", synthetic_labels(4), ".png")
    return tmp_path


def _bad(stack: Path, case: str) -> list:
    em, lab, out = stack / "raw", stack / "lab", stack / "data"
    base = ["--em", em, "--labels", lab, "--out", out, "--voxel_size", VOXEL]
    if case == "size":
        Image.fromarray(np.zeros((20, 32), np.uint8)).save(em / "02.tif")
    elif case == "dtype":
        Image.fromarray(np.zeros((24, 32), np.uint16)).save(em / "03.tif")
    elif case == "palette":
        Image.fromarray(np.zeros((24, 32), np.uint8)).convert("P").save(em / "02.tif")
    elif case == "rgb":
        Image.fromarray(np.zeros((24, 32, 3), np.uint8)).save(em / "01.tif")
    elif case == "empty":
        (stack / "nothing").mkdir()
        base[1] = stack / "nothing"
    elif case == "glob":
        base[1] = str(em / "*.jpg")
    elif case == "missing":
        base[1] = stack / "nope"
    elif case == "count":
        (lab / "03.png").unlink()
    elif case == "label_size":
        for p in lab.glob("*.png"):
            Image.fromarray(np.full((24, 30), CYTO, np.uint8)).save(p)
    elif case == "rgb_labels":
        Image.fromarray(np.zeros((24, 32, 3), np.uint8)).save(lab / "00.png")
    return base


BAD_INPUTS = {
    # case: (extra flags, what the message must say)
    "size": ([], ["02.tif is 32 x 20 pixels", "00.tif is 32 x 24", "same size"]),
    "dtype": ([], ["03.tif is uint16", "00.tif is uint8", "one pixel type"]),
    "rgb": ([], ["01.tif", "colour image (mode RGB)", "convert('L')"]),
    "palette": ([], ["02.tif", "palette image (mode P); EM must be greyscale"]),
    "rgb_labels": (CLASS_FLAGS, ["00.png", "colour image", "single channel"]),
    "empty": ([], ["--em", "nothing", "holds no .tif/.tiff/.png images"]),
    "glob": ([], ["*.jpg", "matches no file"]),
    "missing": ([], ["nope", "no such file or folder"]),
    "count": (CLASS_FLAGS, ["--labels has 3 images but --em has 4 sections", "one label image per EM section"]),
    "label_size": (CLASS_FLAGS, ["--labels", "30 x 24", "32 x 24", "pixel for pixel"]),
    "unclaimed": (["--class", "mito=191", "--background", "255,159"],
                  ["value 0 in sections 0-3", "value 128 in sections 0-3", "value 223 in sections 0-3",
                   "--class NAME=0", "--background 0", "--unknown 0"]),
    "no_value_map": ([], ["labels given without a value map", "--class NAME=VALUES"]),
    "unknown_class": (["--class", "mitto=191"], ["--class mitto: not a CellMap class", "did you mean 'mito'"]),
    "class_and_background": ([*CLASS_FLAGS[:-2], "--background", "255,223,191"],
                             ["label value 191 is in both --class mito and --background"]),
    "out_of_range": (["--class", "mito=191,300", "--background", "0-255"],
                     ["--class mito: value 300 is outside", "uint8 label images (0-255)"]),
    "bad_values": (["--class", "mito=19a"], ["--class mito: '19a' is not a label value"]),
    "crop_outside": ([*CLASS_FLAGS, "--crop", "crop1=0-1", "--crop", "crop2=2-4"],
                     ["--crop crop2=2-4", "sections 0-3 only"]),
    "crop_overlap": ([*CLASS_FLAGS, "--crop", "crop1=0-2", "--crop", "crop2=2-3"],
                     ["crop1=0-2 and --crop crop2=2-3 overlap (sections 2-2)"]),
    "crop_name": ([*CLASS_FLAGS, "--crop", "train=0-2"], ["--crop 'train=0-2': expected crop<N>=FIRST-LAST"]),
    "voxel_size": (["--voxel_size", "50,4"], ["--voxel_size '50,4'", "z,y,x"]),
    "name": (["--name", "../x"], ["--name '../x'"]),
    "out_file": (["--out", __file__], ["is a file; give the folder"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_clear_error_and_writes_nothing(stack, case, capsys):
    extra, expected = BAD_INPUTS[case]
    rc, out, err = run([*_bad(stack, case), *extra], capsys)
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    assert not (stack / "data").exists() or not any((stack / "data").iterdir())


def test_value_map_without_labels_and_bad_value_map_files(tmp_path, capsys):
    write_images(tmp_path / "raw", synthetic_em(2), ".tif")
    base = ["--em", tmp_path / "raw", "--out", tmp_path / "data", "--voxel_size", VOXEL]
    rc, _, err = run([*base, "--class", "mito=191"], capsys)
    assert rc == 2 and "need label images: give them with --labels" in err
    (tmp_path / "map.toml").write_text("backgrund = 255\n")
    rc, _, err = run([*base, "--value_map", tmp_path / "map.toml"], capsys)
    assert rc == 2 and "unknown key(s) ['backgrund']" in err


def test_the_script_exits_2_with_one_error_line(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "helpers" / "import_stack.py"), "--em",
                        str(tmp_path / "none"), "--out", str(tmp_path / "o"), "--voxel_size", VOXEL],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: --em {tmp_path / 'none'}: no such file or folder"


# ---------------------------------------------------------------------------------------------
# Real EM: the first sections of the VNC stack, read back by the training and validation code
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not VNC.is_dir(), reason="../shared/data/vnc is not here")
def test_vnc_sections_import_and_read_back_through_the_dataset_code(tmp_path, capsys):
    n = 3
    em = np.stack([np.asarray(Image.open(VNC / "raw" / f"{i:02d}.tif")) for i in range(n)])
    lab = np.stack([np.asarray(Image.open(VNC / "labels" / f"labels{i:08d}.png")) for i in range(n)])
    out = tmp_path / "vnc"
    imported(["--em", VNC / "raw" / "0[0-2].tif", "--labels", VNC / "labels" / "labels0000000[0-2].png",
              "--out", out, "--name", "vnc", "--voxel_size", "50,4.6,4.6",
              "--class", "pm=0,32,64,96,128", "--class", "mito=191", "--class", "ecs=159",
              "--background", "255,223", "--crop", "crop1=0-1", "--crop", "crop2=2"], capsys)

    classes = ["pm", "mito", "ecs"]
    cfg = ConfigManager().parse_args([
        "--job.config_file", "train_configs/debug_segmentation_2d.toml", "--data.dataset_path", str(out),
        "--data.voxel_size", "50,4.6,4.6", "--data.classes", ",".join(classes),
        "--data.val_crops", "crop2", "--model.crop_size", "128,128"])
    sources, train, val = load_segmentation_data(DataSettings.from_config(cfg))
    assert [c.name for c in train] == ["crop1"] and [c.name for c in val] == ["crop2"]

    # Training samples: planes of the stack, fully annotated, the classes' values disjoint.
    samples = build_segmentation_samples(DataSettings.from_config(cfg), sources, train)
    seen = np.zeros(3)
    for i in range(4):
        s = samples[i]
        assert s.target.shape == (3, 128, 128) and bool(s.valid.all())
        assert int(s.target.sum(0).max()) <= 1
        seen += s.target.float().mean((1, 2)).numpy()
    assert seen[0] > 0  # membranes are everywhere

    # The validation crop, read whole as validation reads it: the label PNG's class fractions.
    reader = CropReader(sources, classes, cfg.data.voxel_size)
    origin, shape = crop_grid(val[0], cfg.data.voxel_size)
    assert shape == (1, 1024, 1024)
    vol = reader.read(val[0], origin, shape, raw_em=True)
    np.testing.assert_array_equal(vol.image[0, 0], em[2])
    want = {"pm": np.isin(lab[2], [0, 32, 64, 96, 128]), "mito": lab[2] == 191, "ecs": lab[2] == 159}
    for k, cls in enumerate(classes):
        np.testing.assert_array_equal(vol.target[k, 0] > 0, want[cls])
    assert 0.1 < want["pm"].mean() < 0.25 and 0.02 < want["mito"].mean() < 0.1
    ids = read_instance_ids(val[0], "mito", origin, cfg.data.voxel_size, shape)
    assert ids.max() > 10 and np.array_equal(ids[0] > 0, want["mito"])
    summary = json.loads((out / "vnc" / "vnc.zarr" / GT_GROUP / "crop2" / "mito" / ".zattrs").read_text())
    assert summary["cellmap"]["annotation"]["complement_counts"]["absent"] == int((~want["mito"]).sum())
