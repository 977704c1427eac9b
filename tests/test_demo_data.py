"""Tests of the synthetic demo data generator.

Everything is read back with plain ``zarr`` and checked against the CellMap challenge layout
and conventions, without using the generator's own helpers, so that these tests also pin
down what data-loading code may rely on.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zarr

from torchtitan.demo.data import DEMO_CLASSES, generate_demo_data

REPO_ROOT = Path(__file__).resolve().parents[1]
SCALE = 0.25  # small volumes: a whole set takes a couple of seconds
EM_PATH = "recon-1/em/fibsem-uint8"
GT_PATH = "recon-1/labels/groundtruth"
ENCODING = {"absent": 0, "present": 1, "unknown": 255}

# child -> classes that must contain it
PARENTS = {
    "pm": ["cell"],
    "nuc": ["cell"],
    "mito": ["cell"],
    "mito_mem": ["mito", "cell"],
    "mito_lum": ["mito", "cell"],
    "er": ["cell"],
    "ves": ["cell"],
    "ld": ["cell"],
}


# ---------------------------------------------------------------------------------------
# Fixtures and plain-zarr readers
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    names = generate_demo_data(root, seed=0, scale=SCALE)
    return root, names


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Run the CLI twice on the same folder: it should generate, then skip."""
    out = tmp_path_factory.mktemp("cli") / "demo"
    cmd = [sys.executable, "helpers/make_demo_data.py", "--out", str(out), "--seed", "0", "--scale", str(SCALE)]
    env = {**os.environ, "PYTHONPATH": ""}  # the script finds the package as installed
    first = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    second = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    return out, first, second


def open_store(root, name) -> zarr.Group:
    return zarr.open_group(str(Path(root) / name / f"{name}.zarr"), mode="r")


def transforms(group: zarr.Group, level: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, translation) of multiscale level ``level``."""
    entry = group.attrs["multiscales"][0]["datasets"][level]
    assert entry["path"] == f"s{level}"
    by_type = {t["type"]: t for t in entry["coordinateTransformations"]}
    assert [t["type"] for t in entry["coordinateTransformations"]] == ["scale", "translation"]
    return np.array(by_type["scale"]["scale"], float), np.array(by_type["translation"]["translation"], float)


def crops(store: zarr.Group) -> dict[str, zarr.Group]:
    return dict(store[GT_PATH].groups())


def all_crops(root, names):
    """(dataset name, crop name, crop group) for every crop of the set."""
    return [(name, crop_name, crop) for name in names for crop_name, crop in crops(open_store(root, name)).items()]


def box(shape, scale, translation):
    """World box (lo, hi) in nm covered by a grid's voxels (not just their centres)."""
    lo = translation - scale / 2
    return lo, lo + scale * np.asarray(shape)


def em_at(store, shape, scale, translation) -> np.ndarray:
    """EM s0 values at the voxel centres of another grid (nearest EM voxel)."""
    em_scale, em_translation = transforms(store[EM_PATH], 0)
    em = store[EM_PATH]["s0"][:]
    idx = []
    for d in range(3):
        centres = translation[d] + scale[d] * np.arange(shape[d])
        idx.append(np.floor((centres - (em_translation[d] - em_scale[d] / 2)) / em_scale[d]).astype(int))
    return em[np.ix_(*idx)]


def check_multiscales(group: zarr.Group, n_levels: int):
    (ms,) = group.attrs["multiscales"]
    assert ms["version"] == "0.4"
    assert ms["axes"] == [{"name": a, "type": "space", "unit": "nanometer"} for a in ("z", "y", "x")]
    assert [d["path"] for d in ms["datasets"]] == [f"s{k}" for k in range(n_levels)]
    scale0, translation0 = transforms(group, 0)
    for k in range(1, n_levels):
        scale, translation = transforms(group, k)
        np.testing.assert_allclose(scale, scale0 * 2**k)
        # voxel-centre convention: voxel 0 of level k is centred on its 2^k s0 voxels
        np.testing.assert_allclose(translation, translation0 + (scale - scale0) / 2)
        assert group[f"s{k}"].shape == tuple(n // 2 for n in group[f"s{k - 1}"].shape)


# ---------------------------------------------------------------------------------------
# Layout and metadata
# ---------------------------------------------------------------------------------------


def test_layout_and_zarr_format(demo):
    root, names = demo
    assert len(names) >= 2 and all(n.startswith("jrc_") for n in names)
    for name in names:
        zpath = root / name / f"{name}.zarr"
        store = open_store(root, name)
        assert store.metadata.zarr_format == 2
        # every level of the hierarchy is a real zarr v2 group
        for sub in ["", "recon-1", "recon-1/em", EM_PATH, "recon-1/labels", GT_PATH]:
            assert (zpath / sub / ".zgroup").is_file(), sub
        for level in ("s0", "s1", "s2"):
            assert (zpath / EM_PATH / level / ".zarray").is_file()
            array = store[f"{EM_PATH}/{level}"]
            assert array.metadata.zarr_format == 2 and array.dtype == np.uint8
        assert 3 <= len(crops(store)) <= 5
        for crop_name, crop in crops(store).items():
            assert (zpath / GT_PATH / crop_name / ".zgroup").is_file()
            for class_name in crop.group_keys():
                assert class_name in DEMO_CLASSES
                for level in ("s0", "s1"):
                    assert (zpath / GT_PATH / crop_name / class_name / level / ".zarray").is_file()
    assert (root / ".demo_complete").is_file()


def test_em_multiscales(demo):
    root, names = demo
    translations, scales = [], []
    for name in names:
        group = open_store(root, name)[EM_PATH]
        check_multiscales(group, 3)
        scale, translation = transforms(group, 0)
        scales.append(scale)
        translations.append(translation)
        # each level is the 2x mean of the previous one
        for k in (1, 2):
            prev = group[f"s{k - 1}"][:].astype(np.float32)
            n = group[f"s{k}"].shape
            blocks = prev[: 2 * n[0], : 2 * n[1], : 2 * n[2]].reshape(n[0], 2, n[1], 2, n[2], 2)
            mean = blocks.mean(axis=(1, 3, 5))
            assert np.abs(group[f"s{k}"][:] - mean).max() <= 0.5 + 1e-3
    assert any(np.any(t != 0) for t in translations), "one dataset should sit away from the origin"
    assert any(s[0] > s[1] for s in scales), "one dataset should be anisotropic (z coarser)"
    assert any(np.all(s == s[0]) for s in scales), "one dataset should be isotropic"


def test_label_metadata_and_values(demo):
    root, names = demo
    for _, crop_name, crop in all_crops(root, names):
        for class_name, group in crop.groups():
            check_multiscales(group, 2)
            annotation = group.attrs["cellmap"]["annotation"]
            assert annotation["class_name"] == class_name
            assert annotation["annotation_type"] == {"encoding": ENCODING, "type": "semantic_segmentation"}
            s0 = group["s0"][:]
            assert s0.dtype == np.uint8 and group["s1"].dtype == np.uint8
            assert annotation["complement_counts"] == {
                "absent": int((s0 == 0).sum()),
                "unknown": int((s0 == 255).sum()),
            }
            for level in ("s0", "s1"):
                assert set(np.unique(group[level][:])) <= {0, 1, 255}, (crop_name, class_name, level)


def test_crop_numbers_unique(demo):
    root, names = demo
    crop_names = [crop_name for _, crop_name, _ in all_crops(root, names)]
    assert len(crop_names) == len(set(crop_names))
    assert all(c.startswith("crop") and c[4:].isdigit() for c in crop_names)


# ---------------------------------------------------------------------------------------
# Label content
# ---------------------------------------------------------------------------------------


def test_nested_classes_consistent(demo):
    root, names = demo
    for _, crop_name, crop in all_crops(root, names):
        for level in ("s0", "s1"):
            labels = {name: group[level][:] for name, group in crop.groups()}
            unknown = next(iter(labels.values())) == 255
            for name, values in labels.items():
                # the annotator skipped the same voxels for every class
                np.testing.assert_array_equal(values == 255, unknown)
            known = ~unknown
            present = {name: (values == 1) & known for name, values in labels.items()}
            for child, parents in PARENTS.items():
                for parent in parents:
                    if child in present and parent in present:
                        assert not np.any(present[child] & ~present[parent]), (crop_name, level, child, parent)
            if {"mito", "mito_mem", "mito_lum"} <= present.keys():
                np.testing.assert_array_equal(present["mito"], present["mito_mem"] | present["mito_lum"])
                assert not np.any(present["mito_mem"] & present["mito_lum"])
            if {"ecs", "cell"} <= present.keys():
                np.testing.assert_array_equal(present["ecs"], known & ~present["cell"])


def test_subsets_and_unknown(demo):
    root, names = demo
    class_sets = [set(crop.group_keys()) for _, _, crop in all_crops(root, names)]
    assert sum(s == set(DEMO_CLASSES) for s in class_sets) >= 2, "several crops annotate all classes"
    assert any(s < set(DEMO_CLASSES) for s in class_sets), "some crop annotates only a subset"
    with_unknown = 0
    for _, _, crop in all_crops(root, names):
        has_unknown = [bool((group["s0"][:] == 255).any()) for _, group in crop.groups()]
        if any(has_unknown):
            assert all(has_unknown), "unknown voxels are unknown in every class of the crop"
            with_unknown += 1
    assert with_unknown >= 1


def test_membranes_and_organelles_present(demo):
    root, names = demo
    totals = {}
    for _, _, crop in all_crops(root, names):
        for name, group in crop.groups():
            totals[name] = totals.get(name, 0) + int((group["s0"][:] == 1).sum())
    for name in ("ecs", "pm", "cell", "mito", "mito_mem", "mito_lum"):
        assert totals.get(name, 0) > 0, name


# ---------------------------------------------------------------------------------------
# Geometry: crops in world coordinates
# ---------------------------------------------------------------------------------------


def test_crops_inside_em_volume(demo):
    root, names = demo
    for name in names:
        store = open_store(root, name)
        em_scale, em_translation = transforms(store[EM_PATH], 0)
        em_lo, em_hi = box(store[EM_PATH]["s0"].shape, em_scale, em_translation)
        for crop_name, crop in crops(store).items():
            for _, group in crop.groups():
                scale, translation = transforms(group, 0)
                lo, hi = box(group["s0"].shape, scale, translation)
                assert np.all(lo >= em_lo - 1e-6) and np.all(hi <= em_hi + 1e-6), (name, crop_name)
            # all classes of a crop share one grid
            grids = {(*map(tuple, transforms(g, 0)), g["s0"].shape) for _, g in crop.groups()}
            assert len(grids) == 1


def test_label_grids_differ_from_em(demo):
    root, names = demo
    finer = coarser = half_off = not_at_origin = 0
    for name in names:
        store = open_store(root, name)
        em_scale, em_translation = transforms(store[EM_PATH], 0)
        for crop in crops(store).values():
            scale, translation = transforms(next(iter(crop.groups()))[1], 0)
            finer += bool(np.all(scale < em_scale))
            coarser += bool(np.all(scale >= em_scale) and np.any(scale > em_scale))
            offset = ((translation - em_translation) / em_scale) % 1.0
            half_off += bool(np.allclose(offset[1:], 0.5))
            not_at_origin += bool(np.all(np.abs(translation - em_translation) > em_scale))
    assert finer >= 1 and coarser >= 1 and half_off >= 1
    assert not_at_origin >= 1


def test_em_agrees_with_labels(demo):
    """Membranes are dark, the extracellular space is light, in every crop that shows both,
    whatever the crop's resolution and offset."""
    root, names = demo
    checked = 0
    for name in names:
        store = open_store(root, name)
        em = store[EM_PATH]["s0"][:]
        assert 100 < np.median(em) < 200 and em.std() > 15
        for crop in crops(store).values():
            if not {"pm", "ecs"} <= set(crop.group_keys()):
                continue
            pm, ecs = crop["pm"]["s0"][:] == 1, crop["ecs"]["s0"][:] == 1
            if pm.sum() < 20 or ecs.sum() < 20:
                continue
            scale, translation = transforms(crop["pm"], 0)
            values = em_at(store, pm.shape, scale, translation).astype(float)
            assert values[pm].mean() + 40 < values[ecs].mean()
            checked += 1
    assert checked >= 1


# ---------------------------------------------------------------------------------------
# Determinism and the command line
# ---------------------------------------------------------------------------------------


def read_all_arrays(root) -> dict[str, np.ndarray]:
    out = {}
    for zarray in sorted(Path(root).rglob(".zarray")):
        path = zarray.parent
        out[str(path.relative_to(root))] = zarr.open_array(str(path), mode="r")[:]
    return out


def test_cli_generates_then_skips(cli_runs):
    out, first, second = cli_runs
    assert first.returncode == 0, first.stderr
    assert "Wrote 2 demo datasets" in first.stdout and "crop1" in first.stdout
    assert (out / ".demo_complete").is_file()
    assert second.returncode == 0, second.stderr
    assert "already complete" in second.stdout


def test_deterministic(demo, cli_runs, tmp_path):
    root, _ = demo
    cli_out = cli_runs[0]
    reference = read_all_arrays(root)
    same = read_all_arrays(cli_out)  # same seed and scale, made by another process
    assert reference.keys() == same.keys()
    for key, values in reference.items():
        np.testing.assert_array_equal(values, same[key], err_msg=key)

    generate_demo_data(tmp_path, seed=1, scale=SCALE)
    other = read_all_arrays(tmp_path)
    em_key = next(k for k in reference if k.endswith("fibsem-uint8/s0"))
    assert not np.array_equal(reference[em_key], other[em_key])
    shared = [k for k in reference if "labels" in k and k in other and reference[k].shape == other[k].shape]
    assert any(not np.array_equal(reference[k], other[k]) for k in shared)


def test_crash_leaves_set_incomplete(demo, tmp_path, monkeypatch):
    """The marker is removed first and written last: a crash mid-way is detected."""
    from torchtitan.demo import data as demo_data

    root, _ = demo
    (tmp_path / ".demo_complete").write_text((root / ".demo_complete").read_text())
    assert demo_data.demo_data_complete(tmp_path, seed=0, scale=SCALE)
    assert not demo_data.demo_data_complete(tmp_path, seed=1, scale=SCALE)  # other settings: redo

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(demo_data, "_write_dataset", crash)
    with pytest.raises(RuntimeError):
        demo_data.generate_demo_data(tmp_path, seed=0, scale=SCALE)
    assert not demo_data.demo_data_complete(tmp_path, seed=0, scale=SCALE)


def test_preview_png(demo, tmp_path):
    from PIL import Image

    from torchtitan.demo.data import preview_png

    root, names = demo
    out = tmp_path / "preview.png"
    preview_png(root, out)
    image = Image.open(out)
    assert image.mode == "RGB" and image.height > 2 * 20
