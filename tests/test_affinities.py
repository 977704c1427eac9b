"""Affinities of instance classes: targets from hand-made id volumes, the loader's samples, the
two cuts (mutex watershed of voxels and of fragments), and bad input.

Targets (``torchtitan/cellmap/affinities.py``) are checked against a per-voxel loop over the
rule; samples are drawn from a real store imported from an HDF5 id volume
(``helpers/import_stack.py --ids``); the cuts run the real ``mwatershed`` and ``waterz`` on
affinities made from known objects.
"""

from __future__ import annotations

from itertools import product

import numpy as np
import pytest
import scipy.ndimage as ndi
import torch

from test_import_h5 import write_h5
from test_import_stack import imported
from torchtitan.cellmap.affinities import (AffinitySpec, affinities, channel_name,
                                           default_offsets, face_channels, output_channels,
                                           split_outputs)
from torchtitan.config.manager import ConfigManager
from torchtitan.data.sampling.augment import apply_axis_map, host_axis_map
from torchtitan.data.crops.layout import DatasetError
from torchtitan.data.volume_source import build_source
from torchtitan.errors import ConfigError
from torchtitan.choices import AFFINITY_CUTS
from torchtitan.postprocess.affinities import (absorb_small, affinity_instances,
                                               graph_instances, mutex_watershed)
from torchtitan.postprocess.masks import PostProcessing, postprocess
from torchtitan.scoring.metrics import label_instances

UNKNOWN = 255


def loop_affinities(ids, known, offset):
    """The rule voxel by voxel: (target, valid) of one offset."""
    target = np.zeros(ids.shape, np.uint8)
    valid = np.zeros(ids.shape, np.uint8)
    for v in product(*(range(n) for n in ids.shape)):
        u = tuple(a + o for a, o in zip(v, offset))
        if not all(0 <= a < n for a, n in zip(u, ids.shape)):
            continue
        if known[v] and known[u]:
            valid[v] = 1
            target[v] = int(ids[v] == ids[u] and ids[v] != 0)
    return target, valid


def three_objects(shape=(6, 10, 12)) -> np.ndarray:
    """Ids: two bodies split along x with a wavy face, a third in a corner, some background."""
    ids = np.full(shape, 2, np.int64)
    z, y, x = np.indices(shape)
    ids[x < 5 + (y + z) % 2] = 1
    ids[:3, :4, 8:] = 3
    ids[4:, 7:, :2] = 0
    return ids


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [(0, 0, 1), (1, 0, 0), (0, 3, 0), (0, 0, -2), (2, -1, 1)])
def test_targets_follow_the_rule_voxel_by_voxel(offset):
    ids = three_objects()
    known = np.ones(ids.shape, bool)
    known[2, 3:6, 4:7] = False  # an unknown patch
    target, valid = affinities(ids, known, [offset])
    want_t, want_v = loop_affinities(ids, known, offset)
    np.testing.assert_array_equal(target[0], want_t)
    np.testing.assert_array_equal(valid[0], want_v)


def test_background_pairs_are_known_and_not_affine_and_far_offsets_are_unknown():
    ids = np.zeros((4, 5, 6), np.int64)
    ids[:, :, 3:] = 7
    target, valid = affinities(ids, np.ones(ids.shape, bool), [(0, 0, 1), (0, 0, 6), (0, 0, 5)])
    assert target[0, :, :, :2].sum() == 0 and valid[0, :, :, :2].all()  # background: 0, known
    assert target[0, :, :, 3:5].all() and not target[0, :, :, 2].any()  # the face is cut
    assert not valid[1].any()  # an offset as long as the box: no partner anywhere
    assert valid[2, :, :, 0].all() and not valid[2, :, :, 1:].any()


def test_2d_targets():
    ids = three_objects()[0]
    t, v = affinities(ids, ids >= 0, [(0, 1), (3, 0)])
    for i, offset in enumerate([(0, 1), (3, 0)]):
        want_t, want_v = loop_affinities(ids, np.ones(ids.shape, bool), offset)
        np.testing.assert_array_equal(t[i], want_t)
        np.testing.assert_array_equal(v[i], want_v)


def test_default_offsets_follow_the_grid():
    iso = default_offsets((10, 10, 10), 3)
    assert iso[:3] == ((1, 0, 0), (0, 1, 0), (0, 0, 1))
    assert (9, 0, 0) in iso and (0, 0, 3) in iso and len(iso) == 9
    # Serial-section EM, 40 nm sections of 4 nm pixels: no long-range z offset that repeats
    # the nearest one, the long ones in-plane.
    aniso = default_offsets((40, 4, 4), 3)
    assert aniso[:3] == iso[:3] and all(o[0] == 0 for o in aniso[3:])
    # A small window drops offsets of half the window or more.
    assert (0, 0, 9) not in default_offsets((8, 8, 8), 3, crop_size=(16, 16, 16))
    assert default_offsets((8, 8, 8), 2) == ((1, 0), (0, 1), (3, 0), (0, 3), (9, 0), (0, 9))


def test_channel_layout_has_one_owner():
    spec = AffinitySpec(("cell",), ((1, 0, 0), (0, 0, 3)))
    names = output_channels(["pm", "cell"], spec)
    assert names == ["pm", "cell", channel_name("cell", (1, 0, 0)), "cell_aff_0_0_3"]
    out = np.arange(4)[:, None]
    classes, by_class = split_outputs(out, ["pm", "cell"], spec)
    assert classes.ravel().tolist() == [0, 1]
    assert by_class["cell"][0].ravel().tolist() == [2, 3] and by_class["cell"][1] == spec.offsets


@pytest.mark.parametrize("seed", range(6))
def test_host_axis_map_is_the_device_map(seed):
    rng = np.random.default_rng(seed)
    x = rng.random((2, 4, 4, 4))
    perm = rng.permutation(3)
    axes = np.array([perm, rng.integers(0, 2, 3)])
    device = apply_axis_map(torch.from_numpy(x)[None], torch.from_numpy(axes)[None])[0]
    np.testing.assert_array_equal(host_axis_map(x, axes, channels=True), device.numpy())
    np.testing.assert_array_equal(host_axis_map(x[0], axes), device.numpy()[0])


# ---------------------------------------------------------------------------------------------
# Samples from a real store
# ---------------------------------------------------------------------------------------------


def stripes(shape=(16, 16, 16), width: int = 4) -> np.ndarray:
    """Ids of slabs ``width`` voxels thick along x: a stripe pattern any flip or turn keeps."""
    return (np.indices(shape)[2] // width + 1).astype(np.uint64)


def imported_store(tmp_path, capsys, ids, *flags) -> str:
    raw = np.random.default_rng(0).integers(1, 255, ids.shape).astype(np.uint8)
    h5 = write_h5(tmp_path / "vol.h5", {"raw": raw, "ids": ids})
    out = tmp_path / "data"
    imported(["--em", f"{h5}:raw", "--labels", f"{h5}:ids", *flags, "--voxel_size", "8,8,8",
              "--crop", f"crop1=0-{ids.shape[0] - 1}", "--out", out], capsys)
    return str(out)


def config(data: str, *extra: str):
    return ConfigManager().parse_args([
        "--job.config_file", "train_configs/debug_segmentation_3d.toml",
        "--data.dataset_path", data, "--data.classes", "cell", "--data.voxel_size", "8,8,8",
        "--data.val_crops", "", "--data.val_fraction", "0", "--model.crop_size", "16,16,16",
        "--affinities.classes", "cell", *extra])


# The last case leaves EM's resampling and the labels' flips to the device: the label values
# are then moved on the host before the affinities are made, the device's map is the identity.
DEVICE_FLIPS = ["--augmentation.rot90", "true", "--augmentation.rotate_deg", "0.001",
                "--augmentation.resample_on", "device"]


@pytest.mark.parametrize("augment", [["--augmentation.flips", "true"],
                                     ["--augmentation.rot90", "true"], DEVICE_FLIPS])
def test_samples_carry_affinities_made_in_the_sample_frame(tmp_path, capsys, augment):
    data = imported_store(tmp_path, capsys, stripes(), "--ids", "cell")
    cfg = config(data, "--affinities.offsets", "1:0:0,0:1:0,0:0:1,0:0:3,0:2:0", *augment)
    ds = build_source(cfg).segmentation_dataset()
    offsets = AffinitySpec.from_config(cfg).offsets
    for index in range(6):
        sample = ds[index]
        if augment is DEVICE_FLIPS:
            assert sample.augmentation.label_axes.tolist() == [[0, 1, 2], [0, 0, 0]]
        assert sample.target.shape == (1 + len(offsets), 16, 16, 16)
        target = sample.target[1:].numpy()
        valid = sample.valid[1:].numpy()
        # The stripes run across exactly one axis of the sample, whatever the flips and turns.
        # (16 voxels of 4-voxel stripes: a flipped axis has its faces at the same places.)
        cut = [a for a in range(3) if not target[a][valid[a] > 0].all()]
        assert len(cut) == 1
        ids = np.indices((16, 16, 16))[cut[0]] // 4
        for k, offset in enumerate(offsets):
            want_t, want_v = loop_affinities(ids + 1, np.ones(ids.shape, bool), offset)
            np.testing.assert_array_equal(valid[k], want_v)
            np.testing.assert_array_equal(target[k], want_t)


def test_a_class_stored_without_ids_is_refused(tmp_path, capsys):
    data = imported_store(tmp_path, capsys, (stripes() > 2).astype(np.uint8), "--class", "cell=1",
                          "--instances", "none", "--background", "0")
    cfg = config(data)
    with pytest.raises(DatasetError, match=r"no training crop stores 'cell' with object ids"):
        build_source(cfg).segmentation_dataset()


@pytest.mark.parametrize("flags, message", [
    (["--affinities.offsets", "0:0:16"], "reaches past 'model.crop_size'"),
    (["--affinities.offsets", "1:0"], "has 2 entries but 'model.ndim' = 3"),
    (["--affinities.offsets", "1,0,0"], "whole numbers joined by ':'"),
    (["--affinities.offsets", "0:0:0"], "not all 0"),
    (["--affinities.classes", "mito"], "'data.classes' does not hold"),
    (["--model.loss", "ce"], "needs a multi-label loss"),
    (["--inference.affinity_cut", "agglomerate"], "no longer offered: .*use 'mutex_graph'"),
    (["--inference.agglomerate_threshold", "0.6"], "no longer an option"),
    (["--inference.affinity_cut", "mutex_graph", "--affinities.offsets", "1:0:0,0:1:0"],
     r"lacks \['0:0:1'\]"),
    (["--affinities.dice_on", "cuts"], "'affinities.dice_on' on the command line is no longer"),
    (["--affinities.boundary", "pm"], "'affinities.boundary' = 'pm' is not in 'data.classes'"),
    (["--affinities.boundary", "cell"], "is a class of 'affinities.classes'"),
    (["--data.classes", "pm,cell", "--affinities.boundary", "pm", "--affinities.offsets",
      "1:0:0,0:1:0,0:0:4"], r"needs the face-neighbour affinities.*lacks \['0:0:1'\]"),
    (["--data.classes", "pm,cell", "--affinities.boundary", "pm", "--model.head", "linear"],
     "needs full-resolution logits"),
    (["--model.ndim", "2", "--model.crop_size", "32,32", "--data.voxel_size", "8,8,8",
      "--inference.planes", "zyx", "--affinities.offsets", "1:0,0:1"],
     "affinity channels .* differ between those planes"),
])
def test_bad_affinity_settings_name_the_option(flags, message):
    with pytest.raises(ConfigError, match=message):
        config("data/none", *flags)


@pytest.mark.parametrize("ndim", [2, 3])
def test_boundary_from_face_affinities_is_the_imported_boundary(ndim):
    """``affinities.boundary``: where the affinities are the true ones (logits +-8 from the
    targets of known ids), the derived boundary channel is exactly the boundary class that
    ``import_stack.py --boundary`` stores for those ids; a trained model's pm loss reaches the
    face-affinity channels."""
    from torchtitan.imports.id_labels import boundary_mask
    from torchtitan.models.segmentation import boundary_from_affinities

    ids = three_objects() + 1  # every voxel in an object (no background pairs)
    if ndim == 2:
        ids = ids[2]
    offsets = [tuple(int(a == axis) for a in range(ndim)) for axis in range(ndim)]
    offsets.insert(1, (0,) * (ndim - 1) + (3,))  # a long-range offset between the faces
    known = np.ones(ids.shape, bool)
    target, _ = affinities(ids, known, offsets)
    logits = torch.from_numpy(target).float()[None] * 16 - 8
    spec = AffinitySpec(("cell",), tuple(offsets))
    faces = face_channels(["pm", "cell"], spec, "cell")
    assert faces == [(2, 0), *((4 + a, 1 + a) for a in range(ndim - 1))]
    derived = boundary_from_affinities(torch.cat([torch.zeros_like(logits[:, :2]), logits], 1),
                                       faces)
    expected = boundary_mask(ids[None] if ndim == 2 else ids, known[None] if ndim == 2 else known)
    assert torch.equal(derived[0, 0] > 0, torch.from_numpy(expected.reshape(ids.shape)))


def test_a_model_with_the_boundary_from_affinities_trains_them_through_it():
    from torchtitan.data.sampling.batch import Batch
    from torchtitan.tasks.segmentation import SegmentationTask

    cfg = config("data/none", "--data.classes", "pm,cell", "--affinities.boundary", "pm",
                 "--affinities.offsets", "1:0:0,0:1:0,0:0:1,0:0:3", "--model.head", "multiscale")
    task = SegmentationTask.__new__(SegmentationTask)  # no dataset: the model and loss only
    task.cfg, task._loss = cfg, None
    task.affinities = AffinitySpec.from_config(cfg)
    task.channels = output_channels(cfg.data.classes, task.affinities)
    torch.manual_seed(0)
    model = task.build_model()
    assert model.head.classifier.out_channels == len(task.channels) - 1 == 5
    x = torch.randn(1, 1, 16, 16, 16)
    out = model(x)
    assert out.shape == (1, 6, 16, 16, 16)
    faces = out[:, [2, 3, 4]]
    # The pm channel is minus the least face-affinity logit of each voxel's six neighbours.
    inner = out[0, 0, 1:-1, 1:-1, 1:-1]
    least = torch.stack([faces[0, 0, 1:-1, 1:-1, 1:-1], faces[0, 0, :-2, 1:-1, 1:-1],
                         faces[0, 1, 1:-1, 1:-1, 1:-1], faces[0, 1, 1:-1, :-2, 1:-1],
                         faces[0, 2, 1:-1, 1:-1, 1:-1], faces[0, 2, 1:-1, 1:-1, :-2]]).amin(0)
    torch.testing.assert_close(inner, -least)
    # A loss on pm alone moves the classifier rows of the face affinities, not the others.
    model.zero_grad()
    out[:, 0].sum().backward()
    rows = model.head.classifier.weight.grad.flatten(1).abs().sum(1)
    assert (rows[[1, 2, 3]] > 0).all() and (rows[[0, 4]] == 0).all()


def test_offsets_without_classes_are_refused():
    with pytest.raises(ConfigError, match="has no effect"):
        ConfigManager().parse_args(["--affinities.offsets", "1:0:0"])


# ---------------------------------------------------------------------------------------------
# From affinities to objects
# ---------------------------------------------------------------------------------------------


def predicted(ids, offsets, noise: float = 0.0, seed: int = 0) -> np.ndarray:
    """Affinity probabilities of ``ids``: 0.9 within an object, 0.1 across, plus noise."""
    t, _ = affinities(ids, np.ones(ids.shape, bool), offsets)
    p = 0.1 + 0.8 * t.astype(np.float64)
    p += np.random.default_rng(seed).normal(0, noise, p.shape)
    return np.clip(p, 0, 1)


def same_partition(a, b) -> bool:
    pairs = np.unique(np.stack([a.ravel(), b.ravel()]), axis=1)
    return len(np.unique(pairs[0])) == pairs.shape[1] == len(np.unique(pairs[1]))


NEIGHBOURS = ((1, 0, 0), (0, 1, 0), (0, 0, 1))
LONG = NEIGHBOURS + ((0, 0, 3), (0, 3, 0), (3, 0, 0))


@pytest.mark.parametrize("method", AFFINITY_CUTS)
def test_each_cut_recovers_known_objects(method):
    ids = three_objects()
    ids[ids == 0] = 4  # dense, like neuropil
    aff = predicted(ids, LONG, noise=0.05)
    out, n = affinity_instances(aff, LONG, method, (8, 8, 8))
    assert n == 4 and same_partition(out, ids)


def test_long_range_edges_keep_objects_apart_where_the_boundary_is_not_seen():
    """Two slabs whose face-neighbour affinities across their contact are slightly wrong (the
    model does not see the membrane there): the mutex watershed on face neighbours alone joins
    them; long-range repulsions, surer, keep them apart."""
    ids = np.ones((8, 12, 12), np.int64)
    ids[:, :, 6:] = 2
    aff = predicted(ids, LONG)
    aff[3:][aff[3:] < 0.5] = 0.02  # sure: these are two objects
    aff[LONG.index((0, 0, 1)), :, :, 5] = 0.55  # unsure, on the wrong side of 0.5
    assert len(np.unique(mutex_watershed(aff[:3], NEIGHBOURS))) == 1
    assert same_partition(mutex_watershed(aff, LONG), ids)


def test_long_range_edges_only_repel_so_objects_are_connected():
    """Two objects a membrane plane apart that the long-range channels wrongly call one (0.95
    across): only face neighbours join, so the pixel and graph mutex cuts keep them apart, and
    every object of a noisy prediction is one face-connected piece with an id (none left 0)."""
    ids = np.ones((6, 10, 12), np.int64)
    ids[:, :, 6:] = 2
    aff = predicted(ids, LONG)
    aff[3:] = 0.95  # long range: "the same object" everywhere, across the membrane too
    assert same_partition(mutex_watershed(aff, LONG, 0.5, 0.5), ids)
    assert same_partition(graph_instances(aff, LONG, "mutex_graph", threshold_nearest=0.5,
                                          threshold_long=0.5), ids)

    noisy = predicted(three_objects((8, 12, 12)), LONG, noise=0.3, seed=1)
    out = mutex_watershed(noisy, LONG, 0.5, 0.4)
    assert out.min() >= 1
    for obj in np.unique(out):
        assert ndi.label(out == obj)[1] == 1  # face connectivity is scipy's default
    graph = graph_instances(noisy, LONG, "mutex_graph", threshold_nearest=0.5,
                            threshold_long=0.4)
    for obj in np.unique(graph[graph > 0]):
        assert ndi.label(graph == obj)[1] == 1


def test_long_stride_thins_the_repulsions_on_the_volume_grid():
    """``long_stride``: long-range edges only from voxels on the volume's grid of that step.
    Two objects along a row of voxels, whose contact looks like no boundary to the face
    neighbours, kept apart by one sure long-range repulsion from x = 4 (to x = 7): at stride 2 the row is on the
    grid (two objects), and a box of the volume starting one voxel later along x takes the
    same edges when given its ``origin`` (not without); at stride 3 the edge is off the grid
    and the objects join."""
    ids = np.ones((1, 1, 12), np.int64)  # one row: every voxel on the grid along z and y
    ids[:, :, 6:] = 2
    long_x = ((0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 3))
    aff = predicted(ids, long_x)
    aff[0, :, :, 5] = 0.9  # the face neighbours see no boundary
    aff[3] = np.where(aff[3] < 0.5, 0.5, aff[3])  # long range: unsure everywhere ...
    aff[3, :, :, 4] = 0.0  # ... but the row from x = 4, sure that x = 4 and x = 7 differ

    def objects(*args, **kwargs):
        return len(np.unique(mutex_watershed(*args, **kwargs)))

    assert objects(aff, long_x, 0.5, 0.6) == 2
    assert objects(aff, long_x, 0.5, 0.6, long_stride=2) == 2
    assert objects(aff[..., 1:], long_x, 0.5, 0.6, long_stride=2, origin=(0, 0, 1)) == 2
    assert objects(aff[..., 1:], long_x, 0.5, 0.6, long_stride=2) == 1
    assert objects(aff, long_x, 0.5, 0.6, long_stride=3) == 1
    with pytest.raises(Exception, match="mutex_long_stride = 0"):
        PostProcessing(mutex_long_stride=0)


def test_graph_cuts_take_given_fragments():
    """Fragments handed in replace the watershed basins: the true objects as fragments are
    kept; one fragment across both (a merge in the over-segmentation) cannot be undone by the
    agglomeration; fragments of another shape are refused."""
    ids = np.ones((6, 8, 10), np.int64)
    ids[:, :, 5:] = 2
    aff = predicted(ids, LONG)
    assert same_partition(graph_instances(aff, LONG, "mutex_graph", fragments=ids), ids)
    one = graph_instances(aff, LONG, "mutex_graph", fragments=np.ones_like(ids))
    assert (one == 1).all()
    with pytest.raises(ValueError, match="fragments of shape"):
        graph_instances(aff, LONG, "mutex_graph", fragments=ids[1:])


def test_2d_cuts():
    ids = three_objects()[0]
    ids[ids == 0] = 4
    offsets = ((1, 0), (0, 1), (0, 3), (3, 0))
    for method in AFFINITY_CUTS:
        out, n = affinity_instances(predicted(ids, offsets), offsets, method, (8, 8))
        assert same_partition(out, ids), method


def test_small_objects_are_absorbed_and_outside_the_mask_is_zero():
    ids = np.ones((6, 8, 10), np.int64)
    ids[:, :, 5:] = 2
    ids[2, 3, 2] = 3  # a one-voxel speck inside object 1
    absorbed = absorb_small(ids, predicted(ids, LONG), LONG, 2)
    assert absorbed[2, 3, 2] == 1 and len(np.unique(absorbed)) == 2
    inside = np.ones(ids.shape, bool)
    inside[0] = False
    out, n = affinity_instances(predicted(ids, LONG), LONG, "mutex", (10, 10, 10), inside=inside,
                                min_object_nm3=2000)
    assert n == 2 and (out[0] == 0).all() and out[2, 3, 2] == out[2, 3, 1]


def test_a_small_object_joins_the_neighbour_it_is_most_affine_to_not_the_nearest():
    """A thin slab (object 3) between objects 1 and 2, touching both: its face affinities say
    it belongs to 2 (0.9) and not to 1 (0.2). It is absorbed whole into 2, where giving each
    voxel to the nearest large object would split it between both."""
    ids = np.ones((4, 6, 9), np.int64)
    ids[:, :, 4] = 3
    ids[:, :, 5:] = 2
    aff = predicted(np.where(ids == 3, 2, ids), NEIGHBOURS)  # 3 is part of 2 ...
    aff[2, :, :, 3] = 0.2  # ... and not of 1, across the face x = 3 | 4
    out = absorb_small(ids, aff, NEIGHBOURS, min_voxels=ids.size // 4)
    assert same_partition(out, np.where(ids == 3, 2, ids))


def test_postprocess_takes_the_affinities_of_their_class_unless_told_boundary():
    ids = np.ones((6, 8, 10), np.int64)
    ids[:, :, 5:] = 2
    masks = {"cell": np.ones(ids.shape, bool), "pm": np.zeros(ids.shape, bool)}
    affs = {"cell": (predicted(ids, LONG), LONG)}
    on = PostProcessing(affinity_cut="mutex")
    assert on.cuts_affinities(affs) and not on.enabled
    assert label_instances(postprocess(masks, (8, 8, 8), on, affinities=affs)["cell"])[1] == 2
    off = PostProcessing(affinity_cut="boundary")
    assert not off.cuts_affinities(affs)
    out = postprocess(masks, (8, 8, 8), off, affinities=affs)["cell"]
    assert label_instances(out)[1] == 1  # connected components of the mask
