"""Names and facts that several floors share, written once (the ground floor: imports nothing).

The config offers a name that a model or the data implements (a head, a loss, an attention
kernel, the planes a 2D model sees); the config's choices are these tuples, and the
implementations' registries are checked against them by tests/test_choices.py. The facts below
them (the EM intensity scale, the probability threshold, isotropy, the MAE's kept patches) are
formulas that the config checks, the data, the models and the scoring all apply.
"""

from __future__ import annotations

from collections.abc import Sequence

# Segmentation heads (models/segmentation.py implements each) and the backbone blocks that
# feed them.
HEADS = ("linear", "upconv", "multiscale")
# The heads that encode the input image beside the backbone's features, and at how many
# resolutions by default (model.head_image_levels = 0).
HEAD_IMAGE_LEVELS = {"upconv": 1, "multiscale": 3}
OUT_LAYER_SETS = ("last", "four_last", "four_even_intervals")

# Segmentation losses (models/losses.py implements each). The multi-label ones score each
# class with its own sigmoid; "ce" is one softmax over exclusive classes.
LOSSES = ("bce", "dice", "bce_dice", "ce")
MULTI_LABEL_LOSSES = ("bce", "dice", "bce_dice")

# How post-processing cuts a class with predicted affinities into objects
# (postprocess/affinities.py implements each).
AFFINITY_CUTS = ("mutex", "mutex_graph")

# Attention kernels (models/attention.py): "auto" takes fa4 where it runs, sdpa otherwise.
ATTENTION_BACKENDS = ("sdpa", "fa4", "auto")

# The planes a 2D model is trained on or predicts: normal to z only, or to z, y and x.
PLANES = ("z", "zyx")

# uint8 EM intensities map to model inputs as x / EM_SCALE - 1 (roughly [-1, 1]).
EM_SCALE = 127.5

# Probabilities above this are foreground where no other threshold is configured (the
# default of inference.threshold, and the scoring of probability volumes as the CellMap
# challenge scores them).
PROBABILITY_THRESHOLD = 0.5

# Two voxel sizes are equal within this relative tolerance (float nanometres read from
# OME-NGFF metadata, TIFF tags and TOML are not bit-exact).
VOXEL_RTOL = 1e-6


def same_size(a: float, b: float) -> bool:
    """Whether two voxel sizes (nm, of one axis) are equal, within :data:`VOXEL_RTOL`."""
    return abs(float(a) - float(b)) <= VOXEL_RTOL * max(abs(float(a)), abs(float(b)))


def same_voxel_size(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two voxel sizes (nm, per axis) are equal on every axis."""
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def is_isotropic(voxel_size: Sequence[float]) -> bool:
    """Whether every axis of ``voxel_size`` (nm) has the same size, within :data:`VOXEL_RTOL`."""
    largest = max(voxel_size)
    return all(same_size(s, largest) for s in voxel_size)


def num_kept_patches(num_patches: int, mask_ratio: float) -> int:
    """How many of ``num_patches`` the MAE encoder sees at ``mask_ratio`` (at least one)."""
    return max(1, int(num_patches * (1 - mask_ratio)))


def parse_offset(text: str) -> tuple[int, ...]:
    """An offset of the config's ``affinities.offsets``, written ``'z:y:x'`` (``'y:x'`` in
    2D), as a tuple of ints; ValueError when it is not whole numbers joined by ':'."""
    return tuple(int(part) for part in str(text).split(":"))
