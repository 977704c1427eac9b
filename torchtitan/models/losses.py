"""Segmentation losses, each returned as a ``(sum, count)`` pair.

The trainer turns a pair into a loss with the GLOBAL count, ``loss = sum * dp / all_reduce(count)``,
so that averaging gradients over data-parallel ranks gives the mean over the whole batch. That
only works if a loss is a sum of independent terms (one per voxel, per (sample, class) pair or
per sample) together with the number of terms: then the pair of a batch is the sum of the pairs
of any split of it, and the result does not depend on how the batch is spread over ranks.

Every loss takes:

* ``logits`` (B, K, *spatial): one channel per class (compute them in fp32);
* ``targets`` (B, K, *spatial): 1 where the class is present, 0 where it is absent; what it
  holds at invalid voxels (e.g. 255) is never read;
* ``valid`` broadcastable to the logits, e.g. (B, K, *spatial) or (B, K, 1, 1, 1) for a class a
  crop does not annotate: nonzero where the label is known. Invalid voxels contribute nothing
  and receive exactly zero gradient;
* ``class_weights`` (K,) or None: multiplies the terms of each class. Counts stay unweighted,
  so a weight of 2 doubles the pull of that class (and uniform weights w scale the loss by w).

Multi-label losses (a voxel may belong to several classes, each with its own validity mask):
``masked_bce_loss`` (per-voxel, per-class sigmoid cross-entropy), ``soft_dice_loss`` (per
sample and class) and ``bce_dice_loss`` (their per-sample sum). ``cross_entropy_loss``
treats the classes as mutually exclusive, with an implicit background class.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

LossTerms = tuple[Tensor, Tensor]  # (sum of the loss terms, their count)
LossFn = Callable[[Tensor, Tensor, Tensor], LossTerms]
ClassWeights = Tensor | Sequence[float] | None  # one weight per class, or none

DICE_EPS = 1.0  # smoothing: an empty class predicted empty scores a perfect 0 loss


# ----------------------------------------------------------------------------- helpers
def _valid_mask(valid: Tensor, logits: Tensor) -> Tensor:
    """Boolean mask of the logits' shape."""
    return (valid > 0).expand_as(logits)


def _safe_targets(targets: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor:
    """Targets as floats with every invalid entry replaced by 0 (so 255 & co. never leak in)."""
    targets = targets.to(dtype)
    return torch.where(valid, targets, torch.zeros_like(targets))


def _class_weights(class_weights: ClassWeights, logits: Tensor) -> Tensor | None:
    """(K,) weights -> (1, K, 1, ...) on the logits' device and dtype, or None."""
    if class_weights is None:
        return None
    w = torch.as_tensor(class_weights, device=logits.device, dtype=logits.dtype)
    if w.shape != (logits.shape[1],):
        raise ValueError(
            f"class_weights has shape {tuple(w.shape)}, expected ({logits.shape[1]},): one weight per class"
        )
    return w.view(1, -1, *([1] * (logits.dim() - 2)))


def _bce_per_sample(logits, targets, valid, class_weights) -> LossTerms:
    """Weighted BCE summed over the valid entries of each sample, and their number: (B,), (B,)."""
    v = _valid_mask(valid, logits)
    t = _safe_targets(targets, v, logits.dtype)
    bce = F.binary_cross_entropy_with_logits(logits, t, reduction="none")
    w = _class_weights(class_weights, logits)
    if w is not None:
        bce = bce * w
    bce = torch.where(v, bce, torch.zeros_like(bce))
    return bce.flatten(1).sum(1), v.flatten(1).sum(1).to(logits.dtype)


def _dice_per_pair(logits, targets, valid, eps: float) -> LossTerms:
    """Soft Dice loss of each (sample, class) pair over its valid voxels, and whether the pair
    has any valid voxel: (B, K) floats, (B, K) bools."""
    v = _valid_mask(valid, logits)
    t = _safe_targets(targets, v, logits.dtype)
    p = torch.sigmoid(logits)
    p = torch.where(v, p, torch.zeros_like(p))  # invalid voxels: no value, no gradient
    intersection = (p * t).flatten(2).sum(2)
    denominator = p.flatten(2).sum(2) + t.flatten(2).sum(2)
    loss = 1.0 - (2.0 * intersection + eps) / (denominator + eps)
    return loss, v.flatten(2).any(2)


# ----------------------------------------------------------------------------- losses
def masked_bce_loss(
    logits: Tensor, targets: Tensor, valid: Tensor, class_weights: ClassWeights = None
) -> LossTerms:
    """Binary cross-entropy with logits: (sum over valid entries, number of valid entries).

    One term per valid (voxel, class) entry, so ``sum / count`` is the mean BCE over them.
    """
    total, count = _bce_per_sample(logits, targets, valid, class_weights)
    return total.sum(), count.sum()


def soft_dice_loss(logits: Tensor, targets: Tensor, valid: Tensor,
                   class_weights: ClassWeights = None, eps: float = DICE_EPS) -> LossTerms:
    """Soft Dice on sigmoid probabilities, one term per (sample, class) pair.

    For each pair, over its valid voxels: ``1 - (2 sum(p t) + eps) / (sum(p) + sum(t) + eps)``.
    Pairs without a valid voxel (a class the crop does not annotate) are left out; the count is
    the number of pairs kept, so ``sum / count`` is the mean Dice loss over annotated pairs.
    """
    loss, has_valid = _dice_per_pair(logits, targets, valid, eps)
    w = _class_weights(class_weights, logits)
    if w is not None:
        loss = loss * w.view(1, -1)
    total = torch.where(has_valid, loss, torch.zeros_like(loss)).sum()
    return total, has_valid.sum().to(logits.dtype)


def bce_dice_loss(logits: Tensor, targets: Tensor, valid: Tensor,
                  class_weights: ClassWeights = None, eps: float = DICE_EPS) -> LossTerms:
    """BCE + soft Dice, one term per sample.

    The Dice term covers only the (sample, class) pairs whose valid voxels contain the class;
    pairs without it are left to BCE. Dice on an empty target is minimised only by predicting
    almost exactly nothing (``1 - eps / (sum(p) + eps)``: a probability of 0.01 over a 64^2 crop
    already costs 0.98), a pull towards missing large classes such as nuclei wherever a crop is
    ambiguous; BCE weighs such false positives per voxel, as they should be.

    BCE has one term per valid voxel and Dice one per (sample, class) pair, so their
    counts differ and no single (sum, count) pair gives "mean BCE + mean Dice" over a batch
    that is split across ranks. The per-sample level is common to both: each sample
    contributes ``mean BCE over its valid voxels + mean Dice over its annotated classes``;
    the sum runs over samples and the count is the number of samples with any valid voxel.
    ``sum / count`` is thus the batch mean of the per-sample loss (every sample weighs the
    same, however many of its voxels are annotated), and it adds up across any batch split.
    """
    bce_sum, bce_count = _bce_per_sample(logits, targets, valid, class_weights)
    dice, has_valid = _dice_per_pair(logits, targets, valid, eps)
    v = _valid_mask(valid, logits)
    has_class = has_valid & (_safe_targets(targets, v, logits.dtype) > 0).flatten(2).any(2)
    w = _class_weights(class_weights, logits)
    if w is not None:
        dice = dice * w.view(1, -1)
    dice_sum = torch.where(has_class, dice, torch.zeros_like(dice)).sum(1)
    dice_count = has_class.sum(1).to(logits.dtype)
    keep = bce_count > 0  # samples with any valid voxel (their Dice may have no pair)
    per_sample = bce_sum / bce_count.clamp_min(1) + dice_sum / dice_count.clamp_min(1)
    total = torch.where(keep, per_sample, torch.zeros_like(per_sample)).sum()
    return total, keep.sum().to(logits.dtype)


def _with_background(logits: Tensor) -> Tensor:
    """(B, K, ...) -> (B, 1 + K, ...) with a constant 0 background logit in front."""
    return torch.cat([torch.zeros_like(logits[:, :1]), logits], dim=1)


def cross_entropy_loss(
    logits: Tensor, targets: Tensor, valid: Tensor, class_weights: ClassWeights = None
) -> LossTerms:
    """Softmax cross-entropy for mutually exclusive classes with an implicit background.

    The model has one channel per class; the background gets a fixed logit of 0, so the
    softmax runs over ``[0, logits]`` and P(background) = 1 / (1 + sum_k exp(logit_k)). The
    target of a voxel is its present class (the first one, should several be marked), or
    background when none is. A voxel is ignored when any class is invalid there: without every
    label, "background" cannot be told apart from "unlabelled". Class weights scale the terms
    of voxels of that class (background weighs 1); the count is the number of kept voxels.
    """
    v = _valid_mask(valid, logits)
    t = _safe_targets(targets, v, logits.dtype)
    keep = v.all(dim=1)  # (B, *spatial)
    best_value, best_class = t.max(dim=1)
    index = torch.where(best_value > 0.5, best_class + 1, torch.zeros_like(best_class))
    nll = F.cross_entropy(_with_background(logits), index, reduction="none")  # (B, *spatial)
    w = _class_weights(class_weights, logits)
    if w is not None:
        w = torch.cat([w.new_ones(1), w.flatten()])  # background first
        nll = nll * w[index]
    total = torch.where(keep, nll, torch.zeros_like(nll)).sum()
    return total, keep.sum().to(logits.dtype)


# ----------------------------------------------------------------------------- registry
LOSSES: dict[str, LossFn] = {
    "bce": masked_bce_loss,
    "dice": soft_dice_loss,
    "bce_dice": bce_dice_loss,
    "ce": cross_entropy_loss,
}
MULTI_LABEL_LOSSES = ("bce", "dice", "bce_dice")  # sigmoid per class; "ce" is exclusive


def _check_loss_name(name: str) -> None:
    if name not in LOSSES:
        raise ValueError(f"Unknown loss {name!r}; available: {', '.join(LOSSES)}")


def build_loss(name: str, class_weights: ClassWeights = None) -> LossFn:
    """``loss(logits, targets, valid) -> (sum, count)`` for a loss name of ``LOSSES``.

    ``class_weights`` (K,) may be a tensor or a list; an empty list means no weights.
    """
    _check_loss_name(name)
    if class_weights is not None and len(class_weights) == 0:
        class_weights = None
    return functools.partial(LOSSES[name], class_weights=class_weights)


def predict_probabilities(logits: Tensor, loss_name: str) -> Tensor:
    """Per-class probabilities (B, K, ...) matching how a loss reads the logits: a sigmoid
    per class for the multi-label losses, the softmax over [background, classes] without its
    background channel for "ce"."""
    _check_loss_name(loss_name)
    if loss_name == "ce":
        return torch.softmax(_with_background(logits), dim=1)[:, 1:]
    return torch.sigmoid(logits)


__all__ = [
    "LOSSES",
    "MULTI_LABEL_LOSSES",
    "bce_dice_loss",
    "build_loss",
    "cross_entropy_loss",
    "masked_bce_loss",
    "predict_probabilities",
    "soft_dice_loss",
]
