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
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from torchtitan.choices import MULTI_LABEL_LOSSES

from .resize import resize_linear, slab_statistics

LossTerms = tuple[Tensor, Tensor]  # (sum of the loss terms, their count)
ClassWeights = Tensor | Sequence[float] | None  # one weight per class, or none

DICE_EPS = 1.0  # smoothing: an empty class predicted empty scores a perfect 0 loss


# ----------------------------------------------------------------------------- helpers
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


# ----------------------------------------------------------------------------- statistics
# Each loss is a function of sums over voxels (its statistics: each the sum of its values
# over any split of the voxels) followed by a small ``finish`` on those sums. The statistics
# of the resized logits can thus be taken slab by slab (``resize.slab_statistics``: what
# training does on the linear head's logits) and give the loss of the whole.
def _prepared(logits, targets, valid, class_weights):
    """(valid as 0/1 floats, and times the class weights; targets as floats with 0 at every
    invalid entry, so that 255 & co. never leak in). The masks keep ``valid``'s shape
    (broadcastable to the logits); the targets have the logits' shape. Integer masks and
    targets (what the loader gives) take the quick conversions (clamp, multiply); float targets
    are selected (a NaN where invalid stays out)."""
    if valid.is_floating_point():
        m = (valid > 0).to(logits.dtype)  # known where positive
    else:
        m = valid.to(logits.dtype).clamp_(0, 1)  # 1 where positive
    w = _class_weights(class_weights, logits)
    if targets.is_floating_point():
        t = torch.where(m > 0, targets, 0).to(logits.dtype)
    else:
        t = targets.to(logits.dtype).mul_(m)
    return m, (m if w is None else m * w), t


def _count(m: Tensor, like: Tensor, first: int) -> Tensor:
    """The number of valid entries of ``like`` (0/1 mask ``m``, broadcastable) summed over
    every axis from ``first`` on, exactly (in float64), as integers."""
    return m.expand_as(like).sum(dim=tuple(range(first, like.dim())), dtype=torch.float64).long()


def _over(x: Tensor, first: int) -> Tensor:
    """Sum over every axis from ``first`` on (an expanded ``x`` is not materialised)."""
    return x.sum(dim=tuple(range(first, x.dim())))


def _multilabel_statistics(logits, targets, valid, class_weights, bce=True, dice=True,
                           derivatives=False):
    """Sums of the sigmoid losses: with ``bce``, the weighted BCE over each sample's valid
    entries and their number, (B,) each; with ``dice``, per (sample, class) pair over its valid
    voxels, sum(p t), sum(p), sum(t) of the probabilities p and the number of valid voxels, (B,
    K) each. BCE as softplus(z) - t z (exact for the 0/1 targets; its derivative is
    sigmoid(z) - t).

    With ``derivatives``: (sums, derivatives), where each sum's derivative is that of its own
    entry at each voxel with respect to the voxel's logit (None for the counts and sum(t)):
    the slab pass (``resize.slab_statistics``) sends them to the patch grid as it goes."""
    m, mw, t = _prepared(logits, targets, valid, class_weights)
    out: tuple[Tensor, ...] = ()
    d: tuple[Tensor | None, ...] = ()
    s = torch.sigmoid(logits) if dice or derivatives else None
    # In-place steps where autograd allows: fewer fresh buffers of the logits' size (each a
    # round of page faults on the CPU).
    if bce:
        bce_terms = F.softplus(logits).addcmul_(t, logits, value=-1).mul_(mw)
        out += (_over(bce_terms, 1), _count(m, logits, 1))
        if derivatives:  # d/dz of (softplus(z) - t z) m w
            d += ((s - t).mul_(mw), None)
    if dice:
        p = s * m  # invalid voxels: no value, no gradient
        out += (_over(p * t, 2), _over(p, 2), _over(t, 2), _count(m, logits, 2))
        if derivatives:  # p = s m: dp/dz = s (1 - s) m, and sum(p t) pulls with t
            dp = torch.addcmul(s, s, s, value=-1).mul_(m)
            d += (dp * t, dp, None, None)
    return (out, d) if derivatives else out


def _dice_per_pair(pt: Tensor, p: Tensor, t: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
    """Soft Dice loss of each (sample, class) pair, and whether the pair has a valid voxel."""
    loss = 1.0 - (2.0 * pt + DICE_EPS) / (p + t + DICE_EPS)
    return loss, n > 0


def _weighted_pairs(loss: Tensor, class_weights) -> Tensor:
    w = _class_weights(class_weights, loss)
    return loss if w is None else loss * w.view(1, -1)


def _ce_targets(logits, targets, valid, class_weights) -> tuple[Tensor, Tensor, Tensor]:
    """Per voxel (B, *spatial): whether it is kept (every class valid there), its class index
    in [background, classes], and its weight (background 1)."""
    m, _, t = _prepared(logits, targets, valid, None)
    keep = m.expand_as(logits).amin(dim=1) > 0
    best_value, best_class = t.max(dim=1)
    index = torch.where(best_value > 0.5, best_class + 1, torch.zeros_like(best_class))
    w = _class_weights(class_weights, logits)
    weight = None if w is None else torch.cat([w.new_ones(1), w.flatten()])[index]
    return keep, index, weight


def _ce_statistics(logits, targets, valid, class_weights) -> tuple[Tensor, Tensor]:
    """Weighted negative log-likelihood summed over the kept voxels, and their number."""
    keep, index, weight = _ce_targets(logits, targets, valid, class_weights)
    nll = F.cross_entropy(_with_background(logits), index, reduction="none")  # (B, *spatial)
    if weight is not None:
        nll = nll * weight
    return torch.where(keep, nll, torch.zeros_like(nll)).sum(), keep.sum()


def _bce_finish(stats, class_weights) -> LossTerms:
    bce_sum, count = stats
    return bce_sum.sum(), count.sum().to(bce_sum.dtype)


def _dice_finish(stats, class_weights) -> LossTerms:
    loss, has_valid = _dice_per_pair(*stats)
    loss = _weighted_pairs(loss, class_weights)
    total = torch.where(has_valid, loss, torch.zeros_like(loss)).sum()
    return total, has_valid.sum().to(loss.dtype)


def _bce_dice_finish(stats, class_weights) -> LossTerms:
    bce_sum, bce_count = stats[0], stats[1].to(stats[0].dtype)
    dice, has_valid = _dice_per_pair(*stats[2:])
    has_class = has_valid & (stats[4] > 0)  # targets are 0 or 1 where valid
    dice = _weighted_pairs(dice, class_weights)
    dice_sum = torch.where(has_class, dice, torch.zeros_like(dice)).sum(1)
    dice_count = has_class.sum(1).to(dice.dtype)
    keep = bce_count > 0  # samples with any valid voxel (their Dice may have no pair)
    per_sample = bce_sum / bce_count.clamp_min(1) + dice_sum / dice_count.clamp_min(1)
    total = torch.where(keep, per_sample, torch.zeros_like(per_sample)).sum()
    return total, keep.sum().to(bce_sum.dtype)


def _ce_finish(stats, class_weights) -> LossTerms:
    total, count = stats
    return total, count.to(total.dtype)


def _with_background(logits: Tensor) -> Tensor:
    """(B, K, ...) -> (B, 1 + K, ...) with a constant 0 background logit in front."""
    return torch.cat([torch.zeros_like(logits[:, :1]), logits], dim=1)


class Loss:
    """One segmentation loss with its class weights: ``loss(logits, targets, valid)`` and
    ``loss.resized(logits, size, targets, valid)`` both give ``(sum, count)``; the second
    takes logits below the targets' resolution and equals ``loss(resize_linear(logits,
    size), targets, valid)``, computed slab by slab (``resize.slab_statistics``) for the
    sigmoid losses, whose derivative is written out; "ce" resizes the whole logits."""

    def __init__(self, name: str, class_weights: ClassWeights = None, compiled: bool = False):
        _check_loss_name(name)
        if class_weights is not None and len(class_weights) == 0:
            class_weights = None
        self.name, self.class_weights = name, class_weights
        self._statistics, self._finish = LOSSES[name]
        self.slabs = name in MULTI_LABEL_LOSSES  # sums with derivatives written out
        self.compiled = compiled and self.slabs
        if self.compiled:
            # The sigmoid losses' element-wise passes (masks, softplus, sigmoid, products,
            # sums) fused into a loop or two per slab: a quarter to two fifths less of the
            # loss's time on a CPU (docs/benchmarks/model_step.md), fewer kernels on a GPU.
            # "ce" resizes whole and is left eager.
            self.statistics = torch.compile(self.statistics)
            self.derivatives = torch.compile(self.derivatives)

    def statistics(self, logits: Tensor, targets: Tensor, valid: Tensor) -> tuple[Tensor, ...]:
        return self._statistics(logits, targets, valid, self.class_weights)

    def derivatives(self, logits: Tensor, targets: Tensor, valid: Tensor
                    ) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]:
        return self._statistics(logits, targets, valid, self.class_weights, derivatives=True)

    def __call__(self, logits: Tensor, targets: Tensor, valid: Tensor) -> LossTerms:
        return self._finish(self.statistics(logits, targets, valid), self.class_weights)

    def resized(self, logits: Tensor, size: Sequence[int], targets: Tensor,
                valid: Tensor) -> LossTerms:
        if not self.slabs:  # "ce": slab by slab it took 1.4x the time of this
            return self(resize_linear(logits.float(), size), targets, valid)
        stats = slab_statistics(self.statistics, logits, size, targets, valid, self.derivatives)
        return self._finish(stats, self.class_weights)


# ----------------------------------------------------------------------------- losses
def masked_bce_loss(
    logits: Tensor, targets: Tensor, valid: Tensor, class_weights: ClassWeights = None
) -> LossTerms:
    """Binary cross-entropy with logits: (sum over valid entries, number of valid entries).

    One term per valid (voxel, class) entry, so ``sum / count`` is the mean BCE over them.
    """
    return Loss("bce", class_weights)(logits, targets, valid)


def soft_dice_loss(logits: Tensor, targets: Tensor, valid: Tensor,
                   class_weights: ClassWeights = None) -> LossTerms:
    """Soft Dice on sigmoid probabilities, one term per (sample, class) pair.

    For each pair, over its valid voxels: ``1 - (2 sum(p t) + eps) / (sum(p) + sum(t) + eps)``.
    Pairs without a valid voxel (a class the crop does not annotate) are left out; the count is
    the number of pairs kept, so ``sum / count`` is the mean Dice loss over annotated pairs.
    """
    return Loss("dice", class_weights)(logits, targets, valid)


def bce_dice_loss(logits: Tensor, targets: Tensor, valid: Tensor,
                  class_weights: ClassWeights = None) -> LossTerms:
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
    return Loss("bce_dice", class_weights)(logits, targets, valid)


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
    return Loss("ce", class_weights)(logits, targets, valid)


# ----------------------------------------------------------------------------- registry
# Each loss name of ``torchtitan.choices.LOSSES`` (the config's choices; tests/test_choices.py
# keeps the two equal) -> (statistics, finish). The statistics of the multi-label losses
# (``MULTI_LABEL_LOSSES``) also give their derivatives (``derivatives=True``) for the slab pass.
LOSSES = {
    "bce": (functools.partial(_multilabel_statistics, dice=False), _bce_finish),
    "dice": (functools.partial(_multilabel_statistics, bce=False), _dice_finish),
    "bce_dice": (_multilabel_statistics, _bce_dice_finish),
    "ce": (_ce_statistics, _ce_finish),
}


def _check_loss_name(name: str) -> None:
    if name not in LOSSES:
        raise ValueError(f"Unknown loss {name!r}; available: {', '.join(LOSSES)}")


def build_loss(name: str, class_weights: ClassWeights = None, compiled: bool = False) -> Loss:
    """The :class:`Loss` of a name of ``LOSSES``: ``loss(logits, targets, valid) -> (sum,
    count)``. ``class_weights`` (K,) may be a tensor or a list; an empty list means no weights.
    ``compiled``: its statistics and their gradient through ``torch.compile`` (what
    ``training.compile`` does), computing the same sums.
    """
    return Loss(name, class_weights, compiled)


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
    "Loss",
    "MULTI_LABEL_LOSSES",
    "bce_dice_loss",
    "build_loss",
    "cross_entropy_loss",
    "masked_bce_loss",
    "predict_probabilities",
    "soft_dice_loss",
]
