"""The rules of context parallelism (CP), in one place.

Under CP the ranks of a group split every sample's patch-token sequence into equal contiguous
slabs along the first spatial axis of the patch grid (``models/context.py``). What that
needs of a run is decided here, and every place that enforces it asks this module:

* the config checks (:func:`config_problems`, from ``config.checks``): which models, losses
  and parallelisms combine with CP, and that the degree divides the patch grid's rows;
* the MAE task (:func:`mae_problems`): the kept tokens of the masked encoder split evenly;
* the models at run time (:func:`slab_size`): any tensor split into slabs splits evenly.

(That the degree divides the world size is a rule of the whole device mesh, with the other
degrees: ``parallelisms/parallel_dims.py``.)

Floor 1: the standard library and the ground floor only, so that the config checks can import it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchtitan.choices import num_kept_patches

_KEY = "'training.context_parallel_degree'"
# Losses that score each (sample, class) over the whole sample, which no CP rank holds.
WHOLE_SAMPLE_LOSSES = ("dice", "bce_dice")


def slab_size(n: int, size: int) -> int:
    """The length of each of ``size`` equal slabs of an axis of ``n``; raises ValueError
    when the axis does not split evenly."""
    if n % size:
        raise ValueError(f"context parallelism {size} cannot split a sequence axis of {n} evenly")
    return n // size


def config_problems(cp: int, *, tensor_parallel: int, ndim: int, crop_size: Sequence[int],
                    patch_size: int, loss: str) -> list[str]:
    """Where a context-parallel degree ``cp`` cannot split the token sequences of the
    configured model (each problem names the keys and the way out)."""
    if cp == 1:
        return []
    key = f"{_KEY} = {cp}"
    if tensor_parallel > 1:
        return [f"{key} and 'training.tensor_parallel_degree' = {tensor_parallel} do not "
                "combine; use one of them (CP for long 3D token sequences, TP for wide models) "
                "and data parallelism for the rest"]
    if ndim != 3:
        return [f"{key} splits the token sequences of 3D models; a 2D model's sequence "
                f"(crop {crop_size}, patch {patch_size}) fits one device: use data "
                "parallelism, or set it to 1"]
    problems = []
    rows = crop_size[0] // patch_size
    if rows % cp:
        problems.append(
            f"{key} must divide the patch grid's first axis, {rows} rows ('model.crop_size'[0] "
            f"= {crop_size[0]} / 'model.patch_size' = {patch_size}): each rank takes "
            f"an equal slab of rows; use a crop depth that is a multiple of "
            f"{patch_size * cp}, or a degree that divides {rows}")
    if loss in WHOLE_SAMPLE_LOSSES:
        problems.append(
            f"{key}: 'model.loss' = {loss!r} scores each (sample, class) over the whole "
            "sample, which no rank holds; use 'bce' or 'ce' (sums over voxels) with context "
            "parallelism")
    return problems


def mae_problems(cp: int, *, crop_size: Sequence[int], patch_size: int,
                 mask_ratio: float) -> list[str]:
    """Under CP each rank encodes an equal part of the patches the MAE keeps."""
    num_patches = 1
    for c in crop_size:
        num_patches *= c // patch_size
    kept = num_kept_patches(num_patches, mask_ratio)
    if cp == 1 or kept % cp == 0:
        return []
    return [f"{_KEY} = {cp} must divide the number of patches the MAE encoder keeps, {kept} "
            f"({num_patches} patches of crop {crop_size} at 'model.mask_ratio' = "
            f"{mask_ratio}); change the mask ratio or the crop size"]
