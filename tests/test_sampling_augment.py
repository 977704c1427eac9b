"""Targets of nested classes, class-balanced sampling, augmentations and robust reading.

Every test writes its own small zarr store (CellMap layout, OME-NGFF 0.4 metadata).
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
import scipy.ndimage as ndi
import torch
import zarr

from torchtitan.config.job_config import Augmentation
from torchtitan.data.crops.layout import DatasetError, discover
from torchtitan.cellmap.classes import (
    CLASS_PARTS,
    INSTANCE_CLASSES,
    atoms,
    check_class_names,
)
from torchtitan.data.sampling.augment import Augmenter
from torchtitan.data.sampling.batch import Batch, Sample, collate
from torchtitan.data.sampling.mae_samples import MAESamples
from torchtitan.data.sampling.samples import SegmentationSamples, samples_kwargs
from torchtitan.data.io.stores import StoreContext
from torchtitan.data.crops.reader import annotates, read_instance_ids, read_target, target_groups
from torchtitan.data.crops.selection import DataSettings

EM_GROUP = "recon-1/em/fibsem-uint8"
GT = "recon-1/labels/groundtruth"


def write_group(path: Path, data: np.ndarray, scale, translation=None, chunks=16, attrs=None):
    """One OME-NGFF multiscale group with a single level ``s0`` (zarr format 2)."""
    scale = [float(s) for s in scale]
    translation = [s / 2 for s in scale] if translation is None else [float(t) for t in translation]
    g = zarr.open_group(str(path), mode="w", zarr_format=2)
    g.create_array("s0", data=data, chunks=tuple(min(chunks, n) for n in data.shape))
    g.attrs["multiscales"] = [{
        "version": "0.4", "name": path.name,
        "axes": [{"name": n, "type": "space", "unit": "nanometer"} for n in "zyx"],
        "datasets": [{"path": "s0", "coordinateTransformations": [
            {"type": "scale", "scale": scale},
            {"type": "translation", "translation": translation}]}],
    }]
    if attrs:
        g.attrs.update(attrs)


def write_labels(store: Path, crop: str, labels: dict[str, np.ndarray], scale,
                 corner_voxel=(0, 0, 0), chunks=16):
    """Label groups of one crop on a grid of ``scale`` whose voxel 0 is at ``corner_voxel``."""
    translation = [(c + 0.5) * s for c, s in zip(corner_voxel, scale)]
    enc = {"cellmap": {"annotation": {"annotation_type": {
        "encoding": {"absent": 0, "present": 1, "unknown": 255}, "type": "semantic_segmentation"}}}}
    for name, data in labels.items():
        write_group(store / GT / crop / name, data.astype(np.uint8), scale, translation, chunks,
                    attrs=enc)


def make_store(root: Path, em: np.ndarray, scale=(8, 8, 8), name="jrc_t-1", chunks=16) -> Path:
    store = root / name / f"{name}.zarr"
    write_group(store / EM_GROUP, em.astype(np.uint8), scale, chunks=chunks)
    return store


def ball(shape, centre, radius) -> np.ndarray:
    grid = np.indices(shape)
    return sum((g - c) ** 2 for g, c in zip(grid, centre)) <= radius**2


def smooth_em(shape, seed=0, sigma=3.0) -> np.ndarray:
    """A smooth random uint8 image: blobs a few voxels across, about half above 127.5."""
    noise = ndi.gaussian_filter(np.random.default_rng(seed).standard_normal(shape), sigma)
    return np.clip(128 + noise / noise.std() * 60, 0, 255).astype(np.uint8)


def blocky_em(shape, block=6, seed=1) -> np.ndarray:
    """Random blocks of two grey levels (60, 190): linear interpolation crosses their midpoint
    (125) where nearest-neighbour sampling switches, except near block corners."""
    bits = np.random.default_rng(seed).random([-(-n // block) for n in shape]) < 0.5
    full = np.kron(bits, np.ones((block,) * 3, bool))[: shape[0], : shape[1], : shape[2]]
    return np.where(full, 190, 60).astype(np.uint8)


def present(item) -> np.ndarray:
    """Per class: does the sample hold any valid foreground voxel?"""
    return ((item.target * item.valid).flatten(1).amax(1) > 0).numpy()


def inputs(sample: Sample) -> Batch:
    """One sample as training sees it: a batch of one, moved (to the CPU here), then
    augmented on the "device"."""
    return Augmenter.device(collate([sample]).to("cpu"))


def same_sample(a: Sample, b: Sample) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
               for x, y in zip(vars(a).values(), vars(b).values()))


# ---------------------------------------------------------------------------------------------
# Classes and targets
# ---------------------------------------------------------------------------------------------


def test_class_table_and_name_check():
    assert CLASS_PARTS["mito"] == ("mito_mem", "mito_lum", "mito_ribo")
    assert {"ne_mem", "nucpl", "hchrom", "nucleo"} <= set(CLASS_PARTS["nuc"])
    assert "pm" in atoms("cell") and "ecs" not in atoms("cell") and "mito_lum" in atoms("cell")
    assert atoms("mito_mem") == {"mito_mem"}
    assert "mito" in INSTANCE_CLASSES and "er" not in INSTANCE_CLASSES
    check_class_names(["mito", "er", "cell"])
    check_class_names(["my_class"], extra=["my_class"])
    with pytest.raises(DatasetError, match="'mitto'.*did you mean 'mito'"):
        check_class_names(["nuc", "mitto"])


@pytest.fixture()
def nested(tmp_path):
    """Crop 1 annotates mito only through its parts (with an unknown slab in mito_lum) and er
    through er_mem, er_lum, eres and ne; crop 2 lacks mito_ribo; crop 3 stores mito as ids."""
    shape = (8, 16, 16)
    store = make_store(tmp_path, np.full(shape, 100))
    mem = np.zeros(shape, np.uint8)
    mem[:, 2:4] = 1
    lum = np.zeros(shape, np.uint8)
    lum[:, 4:8] = 1
    lum[:, :, 12:] = 255  # unknown slab
    ribo = np.zeros(shape, np.uint8)
    ribo[:, 8] = 1
    er_parts = {n: np.zeros(shape, np.uint8) for n in ("er_mem", "er_lum", "eres", "ne")}
    er_parts["ne"][:, 14:] = 1
    er_parts["eres"][2, 2, 2] = 1
    write_labels(store, "crop1", {"mito_mem": mem, "mito_lum": lum, "mito_ribo": ribo, **er_parts},
                 (8, 8, 8))
    write_labels(store, "crop2", {"mito_mem": mem, "mito_lum": lum}, (8, 8, 8))
    ids = np.zeros(shape, np.uint8)
    ids[:, 1:3, 1:3] = 5
    ids[:, 10:12, 10:12] = 7
    ids[0] = 255
    write_labels(store, "crop3", {"mito": ids}, (8, 8, 8))
    (src,) = discover(StoreContext(), tmp_path)
    return src, {"mem": mem, "lum": lum, "ribo": ribo, "ids": ids}


def test_nested_classes_are_composed_from_their_parts(nested):
    src, lab = nested
    crop1, crop2, _ = src.crops
    origin, shape, vox = np.zeros(3), (8, 16, 16), (8.0, 8.0, 8.0)
    assert target_groups(crop1, "mito") == ("mito_lum", "mito_mem", "mito_ribo")
    t, v = read_target(crop1, "mito", origin, vox, shape)
    union = (lab["mem"] == 1) | (lab["lum"] == 1) | (lab["ribo"] == 1)
    np.testing.assert_array_equal(t, union)
    # Valid where every part is known, and wherever some part is present.
    np.testing.assert_array_equal(v, (lab["lum"] != 255) | union)
    assert not v[:, 0, 12:].any() and v[:, 2, 12:].all()
    # er = er_mem + er_lum + eres + ne (composite groups count when made only of er's parts).
    assert set(target_groups(crop1, "er")) == {"ne", "eres", "er_mem", "er_lum"}
    t, v = read_target(crop1, "er", origin, vox, shape)
    assert v.all() and t[:, 14:].all() and t[2, 2, 2] and t.sum() == 8 * 2 * 16 + 1
    # crop2 lacks mito_ribo: mito is not annotated there (invalid everywhere).
    assert not annotates(crop2, "mito") and annotates(crop2, "mito_mem")
    t, v = read_target(crop2, "mito", origin, vox, shape)
    assert not t.any() and not v.any()


def test_unannotated_classes_and_unknown_voxels_are_masked(nested):
    src, lab = nested
    ds = SegmentationSamples([src], src.crops[:2], ["mito_lum", "nuc", "mito"], (8, 8, 8), (8, 8),
                             seed=0, augment=False)
    arrays = ds.reader.read(src.crops[0], np.zeros(3), (8, 16, 16))
    assert not arrays.valid[1].any()  # nuc: no group, no parts
    np.testing.assert_array_equal(arrays.valid[0], lab["lum"] != 255)
    np.testing.assert_array_equal(arrays.target[0], lab["lum"] == 1)
    # Outside the crop (box half outside): invalid.
    arrays = ds.reader.read(src.crops[0], np.array([0.0, 64.0, 0.0]), (8, 16, 16))
    assert arrays.valid[0, :, :8].any() and not arrays.valid[0, :, 8:].any()


def test_instance_ids_give_binary_targets_and_ids(nested):
    src, lab = nested
    crop3 = src.crops[2]
    origin, shape, vox = np.zeros(3), (8, 16, 16), (8.0, 8.0, 8.0)
    t, v = read_target(crop3, "mito", origin, vox, shape)
    np.testing.assert_array_equal(v, lab["ids"] != 255)
    np.testing.assert_array_equal(t, (lab["ids"] != 0) & (lab["ids"] != 255))
    ids = read_instance_ids(crop3, "mito", origin, vox, shape)
    assert ids.dtype == np.int64 and set(np.unique(ids)) == {0, 5, 7}
    assert not ids[0].any()  # unknown reads as 0
    assert read_instance_ids(src.crops[0], "mito", origin, vox, shape) is None  # parts only
    from torchtitan.scoring.metrics import label_instances

    assert label_instances(ids)[1] == 2


# ---------------------------------------------------------------------------------------------
# Class-balanced sampling
# ---------------------------------------------------------------------------------------------


@pytest.fixture()
def rare(tmp_path):
    """A big nucleus, two mitochondria and one small lipid droplet, far apart; a second crop
    annotates mitochondria only through their parts."""
    shape = (24, 96, 96)
    store = make_store(tmp_path, smooth_em(shape), chunks=64)
    nuc = ball(shape, (12, 30, 30), 26)
    mito = np.zeros(shape, bool)
    for y in (20, 44):
        mito[:, y - 4:y + 4, 74:82] = True
    ld = ball(shape, (12, 80, 20), 4)
    write_labels(store, "crop1", {"nuc": nuc, "mito": mito, "ld": ld}, (8, 8, 8), chunks=64)
    parts = {"mito_mem": mito & ~ndi.binary_erosion(mito), "mito_lum": ndi.binary_erosion(mito),
             "mito_ribo": np.zeros(shape, bool)}
    write_labels(store, "crop2", parts, (8, 8, 8), chunks=64)
    return discover(StoreContext(), tmp_path)


def _presence(ds, n: int) -> np.ndarray:
    """How often each class is present in samples 0..n-1, relative to the mean over classes."""
    counts = sum(present(ds[g]) for g in range(n))
    return counts / counts.mean()


def test_class_balanced_sampling_is_near_uniform(rare):
    (src,) = rare
    classes = ["nuc", "mito", "ld"]

    def samples(crop_size, balanced):
        return SegmentationSamples([src], src.crops, classes, (8, 8, 8), crop_size, seed=0,
                                   class_balanced=balanced)

    balanced = _presence(samples((16, 16), True), 400)
    assert np.all(np.abs(balanced - 1) < 0.2), balanced
    unbalanced = _presence(samples((16, 16), False), 200)
    assert unbalanced[2] < 0.2, unbalanced  # without balancing ld is rare
    balanced_3d = _presence(samples((4, 16, 16), True), 120)
    assert np.all(np.abs(balanced_3d - 1) < 0.3), balanced_3d


def test_foreground_index_is_small_and_picklable(rare):
    (src,) = rare
    ds = SegmentationSamples([src], src.crops, ["mito", "ld"], (8, 8, 8), (16, 16), seed=0,
                             class_balanced=True)
    points = ds.foreground_points(1, 0)  # crop2: mito from its parts
    assert 0 < len(points) <= 2048 and points.dtype == np.float32
    assert len(ds.foreground_points(1, 1)) == 0  # crop2 does not annotate ld
    first = [ds[g] for g in range(5)]
    clone = pickle.loads(pickle.dumps(ds))
    assert not clone._fg_cache  # the cache does not travel to workers
    for a, g in zip(first, range(5)):
        assert same_sample(a, clone[g])


# ---------------------------------------------------------------------------------------------
# Augmentations
# ---------------------------------------------------------------------------------------------


@pytest.fixture()
def em_labels(tmp_path):
    """Label ``mito`` = EM > 125 on the EM grid, in a crop inside the volume."""
    shape = (40, 72, 72)
    em = blocky_em(shape)
    store = make_store(tmp_path, em)
    lo, hi = (4, 8, 8), (36, 64, 64)
    fg = em[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] > 125
    write_labels(store, "crop1", {"mito": fg}, (8, 8, 8), corner_voxel=lo)
    return discover(StoreContext(), tmp_path)


EM_MIDPOINT = 125 / 127.5 - 1  # normalised grey level between the two block values


def _mismatch(item) -> float:
    """Fraction of valid voxels where the label disagrees with the EM's block value. Linear
    (EM) and nearest (labels) resampling disagree only near block corners, well below 1%;
    labels one voxel off the EM would disagree on several percent."""
    if isinstance(item, Sample):
        item = inputs(item)  # raw uint8 EM -> normalised, as training sees it
    valid = item.valid[0, 0] > 0
    assert valid.float().mean() > 0.3
    disagree = (item.image[0, 0] > EM_MIDPOINT) != (item.target[0, 0] > 0)
    return float(disagree[valid].float().mean())


GEOMETRIC = {  # augmentation, tolerated mean mismatch
    "flips": (Augmentation(), 0.0),
    "rot90": (Augmentation(rot90=True), 0.0),
    "rotate": (Augmentation(flips=False, rotate_deg=45), 0.01),
    "zoom": (Augmentation(flips=False, scale=0.3), 0.01),
    "all": (Augmentation(rot90=True, rotate_deg=180, scale=0.3, resample_on="workers"), 0.01),
    "all_on_device": (Augmentation(rot90=True, rotate_deg=180, scale=0.3, resample_on="device"),
                      0.01),
}


@pytest.mark.parametrize("name", list(GEOMETRIC))
@pytest.mark.parametrize("crop_size,planes",
                         [((24, 24), "z"), ((24, 24), "zyx"), ((12, 12, 12), "z")])
def test_geometric_augmentations_move_em_and_labels_alike(em_labels, name, crop_size, planes):
    (src,) = em_labels
    params, tolerance = GEOMETRIC[name]
    ds = SegmentationSamples([src], src.crops, ["mito"], (8, 8, 8), crop_size, seed=2,
                             augmentation=params, planes=planes)
    plain = SegmentationSamples([src], src.crops, ["mito"], (8, 8, 8), crop_size, seed=2,
                                augment=False, planes=planes)
    changed, mismatch = 0, []
    for g in range(12):
        item = inputs(ds[g])  # rotation and zoom of EM happen here
        assert item.image.shape == (1, 1, *crop_size) == item.target.shape
        mismatch.append(_mismatch(item))
        changed += not torch.equal(item.image, inputs(plain[g]).image)
    assert np.mean(mismatch) <= tolerance and max(mismatch) <= 3 * tolerance + 0.01, mismatch
    assert changed >= 6  # the augmentation did something


@pytest.mark.parametrize("where", ["workers", "device"])
def test_anisotropic_rotation_about_z_keeps_alignment(tmp_path, where):
    shape = (20, 72, 72)
    em = blocky_em(shape, seed=3)
    store = make_store(tmp_path, em, scale=(16, 8, 8))
    write_labels(store, "crop1", {"mito": em > 125}, (16, 8, 8))
    (src,) = discover(StoreContext(), tmp_path)
    ds = SegmentationSamples([src], src.crops, ["mito"], (16, 8, 8), (6, 24, 24), seed=0,
                             augmentation=Augmentation(rot90=True, rotate_deg=90, scale=0.2,
                                                        resample_on=where))
    assert np.mean([_mismatch(ds[g]) for g in range(8)]) <= 0.01


@pytest.mark.parametrize("crop_size,planes,vox", [((16, 16), "zyx", (16, 8, 8)),
                                                  ((8, 16, 16), "z", (16, 8, 8)),
                                                  ((12, 12, 12), "z", (8, 8, 8))])
def test_rotation_on_the_device_or_in_the_workers_gives_the_same_inputs(tmp_path, crop_size,
                                                                        planes, vox):
    """The same sample, rotated and zoomed in the loader worker or on the device (labels:
    flipped and turned there, 90 degree turns through z included with isotropic voxels): the
    same model inputs (to float32 rounding), the same targets and validity."""
    em = smooth_em((32, 64, 64))
    store = make_store(tmp_path, em, scale=vox)
    write_labels(store, "crop1", {"mito": smooth_em((32, 64, 64), seed=1) > 128}, vox)
    (src,) = discover(StoreContext(), tmp_path)
    made = {}
    for where in ("workers", "device"):
        aug = Augmentation(rot90=True, rotate_deg=180, scale=0.2, gamma=0.2, blur_sigma=1.0,
                            resample_on=where)
        ds = SegmentationSamples([src], src.crops, ["mito"], vox, crop_size, seed=5,
                                 augmentation=aug, planes=planes)
        assert ds.augmenter.resamples_on_device == (where == "device")
        assert ds.em_uint8 == (where == "device")
        made[where] = [inputs(ds[g]) for g in range(8)]
    for a, b in zip(made["workers"], made["device"]):
        assert torch.equal(a.target, b.target) and torch.equal(a.valid, b.valid)
        torch.testing.assert_close(a.image, b.image, atol=1e-4, rtol=0)


def test_intensity_augmentations_touch_em_only(em_labels):
    (src,) = em_labels
    geometric = Augmentation(rot90=True, rotate_deg=30)
    both = Augmentation(rot90=True, rotate_deg=30, contrast=0.3, gamma=0.3, noise_std=0.1,
                         blur_sigma=1.5)
    a = SegmentationSamples([src], src.crops, ["mito"], (8, 8, 8), (24, 24), 0,
                            augmentation=geometric)
    b = SegmentationSamples([src], src.crops, ["mito"], (8, 8, 8), (24, 24), 0,
                            augmentation=both)
    for g in range(6):
        x, y = a[g], b[g]
        assert torch.equal(x.target, y.target) and torch.equal(x.valid, y.valid)
        # The changes are drawn with the sample and made on the device.
        assert torch.equal(x.image, y.image) and x.augmentation is None
        assert y.augmentation.intensity is not None and y.augmentation.noise_seed is not None
        x, y = inputs(x), inputs(y)
        assert y.augmentation is None
        assert torch.equal(x.target, y.target) and torch.equal(x.valid, y.valid)
        assert not torch.allclose(x.image, y.image, atol=1e-3)


@pytest.mark.parametrize("spatial", [(5, 12, 10), (12, 10)])
def test_device_intensity_changes(spatial):
    """The batched torch intensity changes equal the same formulas in numpy and scipy (blur:
    scipy's gaussian_filter, mode nearest), and each sample comes out the same whether it is
    changed alone or in a batch; the noise follows the sample's seed."""
    from torchtitan.data.sampling.augment import BLUR_TRUNCATE, apply_intensity

    rng = np.random.default_rng(0)
    image = torch.from_numpy(rng.uniform(-1, 1, (3, 1, *spatial)).astype(np.float32))
    sig = [0.0, 0.8, 1.3] if len(spatial) == 3 else [0.0, 0.0, 0.9]
    rows = torch.tensor([[1.2, 0.8, 0.0, *sig],
                         [1.0, 1.0, 0.1, 0.0, 0.0, 0.0],
                         [0.9, 1.1, 0.1, *sig]], dtype=torch.float32)
    seeds = torch.tensor([0, 7, 8])
    out = apply_intensity(image, rows, seeds)
    # Sample 0: gamma, contrast and blur, no noise, against numpy / scipy.
    x = image[0].numpy().astype(np.float64)
    x = 2 * np.clip((x + 1) / 2, 0, 1) ** 1.2 - 1
    x = (x - x.mean()) * 0.8 + x.mean()
    x[0] = ndi.gaussian_filter(x[0], sig[3 - len(spatial):], mode="nearest", truncate=BLUR_TRUNCATE)
    np.testing.assert_allclose(out[0].numpy(), x, atol=1e-5)
    # Alone or batched, the same; another seed, other noise.
    for b in range(3):
        alone = apply_intensity(image[b:b + 1], rows[b:b + 1], seeds[b:b + 1])[0]
        assert torch.equal(alone, out[b])
    noise1 = out[1] - image[1]
    assert 0.08 < float(noise1.std()) < 0.12
    again = apply_intensity(image[1:2], rows[1:2], torch.tensor([8]))[0]
    assert not torch.allclose(again, out[1])


def test_zyx_planes_cut_every_orientation(tmp_path):
    z = np.arange(32)[:, None, None]
    store = make_store(tmp_path, np.broadcast_to(z * 7, (32, 40, 40)))  # EM varies along z only
    write_labels(store, "crop1", {"mito": np.ones((32, 40, 40))}, (8, 8, 8))
    (src,) = discover(StoreContext(), tmp_path)
    ds = SegmentationSamples([src], src.crops, ["mito"], (8, 8, 8), (16, 16), seed=0,
                             augmentation=Augmentation(flips=False), planes="zyx")
    flat = 0
    for g in range(60):
        img = ds[g].image[0]
        if torch.all(img == img[0, 0]):
            flat += 1  # a y-x plane
        else:  # a z-x or z-y plane: varies along its first axis only
            assert torch.all(img == img[:, :1])
    assert 10 <= flat <= 30


# ---------------------------------------------------------------------------------------------
# Determinism, min_label_fraction, MAE foreground, corrupt chunks
# ---------------------------------------------------------------------------------------------


def test_samples_depend_only_on_seed_and_index(rare):
    (src,) = rare
    kwargs = dict(augmentation=Augmentation(rot90=True, rotate_deg=20, scale=0.1, contrast=0.2,
                                             noise_std=0.05, blur_sigma=1.0),
                  class_balanced=True, min_label_fraction=0.5, planes="zyx")
    a = SegmentationSamples([src], src.crops, ["nuc", "ld"], (8, 8, 8), (16, 16), 4, **kwargs)
    b = SegmentationSamples([src], src.crops, ["nuc", "ld"], (8, 8, 8), (16, 16), 4, **kwargs)
    order = [7, 3, 11, 3, 0]
    first = {g: a[g] for g in order}
    for g in reversed(order):  # another instance, another order: same samples
        assert same_sample(first[g], b[g])
    assert not torch.equal(first[7].image, first[11].image)
    c = SegmentationSamples([src], src.crops, ["nuc", "ld"], (8, 8, 8), (16, 16), 5, **kwargs)
    assert not torch.equal(first[7].image, c[7].image)


def test_min_label_fraction_lets_samples_leave_the_crop(tmp_path):
    store = make_store(tmp_path, np.full((16, 96, 96), 120))
    write_labels(store, "crop1", {"mito": np.zeros((8, 32, 32))}, (8, 8, 8),
                 corner_voxel=(4, 32, 32))
    write_labels(store, "crop2", {"mito": np.zeros((8, 16, 32))}, (8, 8, 8),
                 corner_voxel=(4, 8, 60))
    src, = discover(StoreContext(), tmp_path)
    crop1, crop2 = src.crops
    fractions = []
    ds = SegmentationSamples([src], [crop1], ["mito"], (8, 8, 8), (24, 24), 0,
                             min_label_fraction=0.5)
    for g in range(40):
        item = inputs(ds[g])
        fractions.append(float(item.valid.mean()))
        assert torch.all(item.image > -0.1)  # EM context is real, not padding
    assert min(fractions) >= 0.5 - 1e-6 and sum(f < 1 for f in fractions) > 20
    full = SegmentationSamples([src], [crop1], ["mito"], (8, 8, 8), (24, 24), 0)
    assert all(bool(full[g].valid.all()) for g in range(10))
    # A crop narrower than the sample (16 < 24 rows): centred, as before.
    small = SegmentationSamples([src], [crop2], ["mito"], (8, 8, 8), (24, 24), 0, augment=False)
    valid = small[0].valid[0]
    assert valid[4:20].all() and not valid[:4].any() and not valid[20:].any()


@pytest.mark.parametrize("rotate", [False, True])
def test_mae_foreground_threshold(tmp_path, rotate):
    em = np.zeros((16, 64, 64), np.uint8)
    em[:, :, 28 if rotate else 40:] = 150  # 9/16 or 3/8 of the volume is non-zero
    make_store(tmp_path, em)
    sources = discover(StoreContext(), tmp_path)
    aug = Augmentation(rotate_deg=180 if rotate else 0, scale=0.2 if rotate else 0,
                        resample_on="device")
    plain = MAESamples(sources, (8, 8, 8), (16, 16), seed=0, augmentation=aug)
    fg = MAESamples(sources, (8, 8, 8), (16, 16), seed=0, foreground_threshold=0.9, num_patches=4,
                    augmentation=aug)

    def fraction(item):
        return float((inputs(item).image > -0.99).float().mean())

    assert sum(fraction(plain[g]) < 0.9 for g in range(20)) > 8
    for g in range(20):
        item = fg[g]
        assert fraction(item) >= 0.9 and item.noise.shape == (4,)
        assert torch.equal(item.image, fg[g].image)


def _corrupt(path: Path) -> None:
    path.write_bytes(b"\x00 not a compressed chunk \x00" * 4)


@pytest.mark.parametrize("what", ["em", "labels"])
def test_corrupt_chunk_is_replaced_and_counted(tmp_path, caplog, what):
    store = make_store(tmp_path, smooth_em((16, 64, 64)))
    write_labels(store, "crop1", {"mito": np.ones((16, 64, 64))}, (8, 8, 8))
    bad = store / (EM_GROUP if what == "em" else f"{GT}/crop1/mito") / "s0" / "0.0.0"
    assert bad.is_file()
    _corrupt(bad)
    (src,) = discover(StoreContext(), tmp_path)
    ds = SegmentationSamples([src], src.crops, ["mito"], (8, 8, 8), (16, 16), seed=0)
    caplog.set_level(logging.WARNING)
    resampled = [ds[g].resampled for g in range(40)]
    assert sum(r > 0 for r in resampled) >= 3
    assert str(bad.parent) in caplog.text and "replacement" in caplog.text
    hit = resampled.index(max(resampled))
    assert torch.equal(ds[hit].image, ds[hit].image)  # still deterministic
    strict = SegmentationSamples([src], src.crops, ["mito"], (8, 8, 8), (16, 16), seed=0,
                                 max_resample=0)
    with pytest.raises(DatasetError, match="failed to read"):
        strict[hit]
    mae = MAESamples([src], (8, 8, 8), (16, 16), seed=0, max_resample=3)
    if what == "em":
        assert any(mae[g].resampled for g in range(40))


def test_samples_kwargs_from_config():
    from torchtitan.config.manager import ConfigManager

    cfg = ConfigManager().parse_args([
        "--job.config_file", "train_configs/debug_segmentation_2d.toml",
        "--data.class_balanced", "true", "--data.min_label_fraction", "0.6",
        "--augmentation.rotate_deg", "15", "--data.max_resample", "3"])
    seg = samples_kwargs(DataSettings.from_config(cfg), "segmentation")
    assert seg["class_balanced"] is True and seg["min_label_fraction"] == 0.6
    assert seg["augmentation"].rotate_deg == 15 and seg["max_resample"] == 3
    mae = samples_kwargs(DataSettings.from_config(cfg), "mae")
    assert set(mae) == {"augmentation", "planes", "max_resample", "foreground_threshold"}


def test_validation_scores_stored_instance_ids(tmp_path):
    """Two touching nuclei stored with ids 1 and 2: validation keeps them apart (2 true
    instances), as the scoring command does, where connected components would merge them."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.scoring.metrics import score_crop
    from torchtitan.tasks.segmentation import SegmentationTask

    store = make_store(tmp_path, smooth_em((16, 64, 64)))
    ids = np.zeros((16, 32, 32), np.uint16)
    ids[4:12, 4:16, 4:28] = 1
    ids[4:12, 16:28, 4:28] = 2  # touches instance 1 along y = 16
    write_labels(store, "crop1", {"nuc": ids, "mito": np.zeros_like(ids)}, (8, 8, 8))
    write_labels(store, "crop2", {"nuc": ids, "mito": np.zeros_like(ids)}, (8, 8, 8),
                 corner_voxel=(0, 32, 32))
    cfg = ConfigManager().parse_args([
        "--job.config_file", "train_configs/debug_segmentation_2d.toml",
        "--data.dataset_path", str(tmp_path), "--data.classes", "nuc,mito",
        "--data.val_crops", "crop2", "--model.crop_size", "16,16"])
    task = SegmentationTask(cfg)
    task.prepare()
    vol = task.source.read_volume(task.source.val_crops[0])
    assert set(vol.instance_ids) == {"nuc"}  # mito is semantic; a 0/1 group keeps the binary mask
    stored = vol.instance_ids["nuc"]
    assert set(np.unique(stored)) == {0, 1, 2}
    assert np.array_equal(stored > 0, vol.target[0].numpy())
    binary = vol.target[0].numpy()
    by_ids = score_crop({"nuc": binary}, {"nuc": stored}, {}, (8, 8, 8))["classes"]["nuc"]
    by_cc = score_crop({"nuc": binary}, {"nuc": binary}, {}, (8, 8, 8))["classes"]["nuc"]
    assert by_ids["n_true"] == 2 and by_cc["n_true"] == 1


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("ndim", [2, 3])
def test_uint8_samples_become_the_same_float_inputs(tmp_path, ndim, rotate):
    """Grid-aligned EM ships as raw uint8 and masks as uint8; on the device they become
    exactly the float32 inputs of the float path (EM normalised on the host), rotated and
    zoomed or not."""
    store = make_store(tmp_path, smooth_em((32, 64, 64)))
    write_labels(store, "crop1", {"mito": smooth_em((32, 64, 64), seed=1) > 128}, (8, 8, 8))
    (src,) = discover(StoreContext(), tmp_path)
    crop_size = (16, 16) if ndim == 2 else (8, 16, 16)
    aug = Augmentation(rot90=True, contrast=0.2, gamma=0.2, noise_std=0.05, blur_sigma=1.0,
                        rotate_deg=30 if rotate else 0, scale=0.2 if rotate else 0,
                        resample_on="device")
    fast = SegmentationSamples([src], src.crops, ["mito"], (8, 8, 8), crop_size, seed=3,
                               augmentation=aug)
    slow = SegmentationSamples([src], src.crops, ["mito"], (8, 8, 8), crop_size, seed=3,
                               augmentation=aug)
    slow.em_uint8 = False
    assert fast.em_uint8
    for g in range(6):
        a, b = fast[g], slow[g]
        assert a.image.dtype == torch.uint8 and b.image.dtype == torch.float32
        assert a.target.dtype == a.valid.dtype == torch.uint8
        a, b = inputs(a), inputs(b)
        for key in ("image", "target", "valid"):
            x, y = getattr(a, key), getattr(b, key)
            assert x.dtype == torch.float32 and torch.equal(x, y), key
    # An EM level off the grid: float EM.
    assert not SegmentationSamples([src], src.crops, ["mito"], (8, 8, 4), crop_size, seed=3).em_uint8
    mae = MAESamples([src], (8, 8, 8), crop_size, seed=3)
    assert mae.em_uint8 and mae[0].image.dtype == torch.uint8 and mae[0].valid.dtype == torch.uint8


@pytest.mark.parametrize("ndim", [2, 3])
def test_separable_resampling_equals_scipy(ndim):
    """Rotation about z and zoom are resampled by per-axis gathers; the result equals scipy's
    affine transform: nearest neighbour exactly, linear to float32 rounding, and positions
    outside the input read cval."""
    from torchtitan.data.sampling.augment import Plan, read_shape, resample, resample_matrix

    rng = np.random.default_rng(ndim)
    vox = (16.0, 8.0, 8.0)[-ndim:] if ndim == 3 else (8.0, 8.0)
    shape = (6, 24, 20)[-ndim:]
    for angle, zoom, extra in [(0.7, 1.1, 0), (-2.5, 0.9, 0), (0.2, 1.0, 6)]:
        matrix = resample_matrix(Plan(angle=angle, zoom=zoom), vox)
        big = read_shape(shape, matrix)
        shift = rng.uniform(-0.5, 0.5, ndim) + extra  # extra: part of the output reads outside
        centre_out = (np.asarray(shape) - 1) / 2
        offset = (np.asarray(big) - 1) / 2 + shift - matrix @ centre_out
        img = rng.integers(0, 256, size=(2, *big)).astype(np.uint8)
        lin = resample(img, matrix, shape, shift, order=1, cval=-1.0)
        near = resample(img, matrix, shape, shift, order=0, cval=7)
        for c in range(2):
            ref_lin = ndi.affine_transform(img[c].astype(np.float64), matrix, offset=offset,
                                           output_shape=shape, order=1, mode="constant",
                                           cval=-1.0, prefilter=False)
            ref_near = ndi.affine_transform(img[c], matrix, offset=offset, output_shape=shape,
                                            order=0, mode="constant", cval=7)
            assert lin.dtype == np.float32 and np.abs(lin[c] - ref_lin).max() < 1e-3
            assert near.dtype == np.uint8 and np.array_equal(near[c], ref_near)
        if extra:
            assert (near == 7).mean() > 0.05 and (lin == -1.0).mean() > 0.05


@pytest.mark.parametrize("ndim,vox", [(2, (8.0, 8.0)), (2, (16.0, 8.0)), (3, (8.0, 8.0, 8.0)),
                                      (3, (16.0, 8.0, 8.0))])
def test_device_geometry_equals_host_resampling(ndim, vox):
    """EM rotated and zoomed on the device (from the read box in a fixed-shape buffer, with
    flips, 90 degree rotations and transposes folded into one affine map) equals linear
    resampling then flipping on the host; every box read fits the buffer; a batch gives
    what its samples give alone; nearest neighbour on the host agrees, and the labels' flips
    made on the device from ``axis_map`` equal ``apply_flips``."""
    from torchtitan.data.sampling.augment import (
        Augmenter, apply_axis_map, apply_flips, apply_geometry, axis_map, device_geometry,
        max_read_shape, nearest_from_geometry, read_shape, resample, resample_matrix)

    rng = np.random.default_rng(ndim)
    shape = (10, 12, 12)[-ndim:] if ndim == 3 else (12, 12)
    params = Augmentation(rot90=True, rotate_deg=180, scale=0.3)
    draw = Augmenter(params).draw
    buffer_shape = max_read_shape(shape, vox, params)
    buffers, geometries, expected = [], [], []
    for _ in range(12):
        plan = draw(rng, shape, vox)
        matrix = resample_matrix(plan, vox)
        box = read_shape(shape, matrix)
        assert all(b <= m for b, m in zip(box, buffer_shape)), (box, buffer_shape)
        arr = rng.uniform(-1, 1, (1, *box)).astype(np.float32)
        shift = rng.uniform(-0.5, 0.5, ndim)
        buffer = np.full((1, *buffer_shape), 5.0, np.float32)  # never read
        buffer[(slice(None), *(slice(0, b) for b in box))] = arr
        geometry = device_geometry(matrix, plan, shape, box, shift)
        buffers.append(buffer)
        geometries.append(geometry)
        expected.append(np.ascontiguousarray(apply_flips(resample(arr, matrix, shape, shift, 1, -1.0),
                                                         plan)))
        nearest = nearest_from_geometry(buffer, geometry, shape)
        unflipped = resample(arr, matrix, shape, shift, 0, 0)
        host = apply_flips(unflipped, plan)
        assert (nearest == host).mean() > 0.995
        # Labels: the same flips made on the device from axis_map.
        flipped = apply_axis_map(torch.from_numpy(unflipped)[None],
                                 torch.from_numpy(axis_map(plan, shape))[None])[0]
        assert torch.equal(flipped, torch.from_numpy(np.ascontiguousarray(host)))
    out = apply_geometry(torch.from_numpy(np.stack(buffers)),
                         torch.from_numpy(np.stack(geometries)).float(), shape)
    np.testing.assert_allclose(out.numpy(), np.stack(expected), atol=1e-4)
    alone = apply_geometry(torch.from_numpy(buffers[3])[None],
                           torch.from_numpy(geometries[3])[None].float(), shape)
    assert torch.equal(alone[0], out[3])
    assert max(np.prod(read_shape(shape, resample_matrix(draw(rng, shape, vox), vox)))
               for _ in range(200)) > 0.8 * np.prod(buffer_shape)  # the bound is not loose
