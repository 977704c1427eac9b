"""Segmentation metrics, counted only where a class is annotated.

Per class we accumulate true positives, false positives and false negatives over every
valid voxel of every crop (pooled), so that counts from different crops and ranks simply add.
IoU = TP / (TP + FP + FN), Dice = 2TP / (2TP + FP + FN). A class whose valid voxels hold
neither a true nor a predicted positive scores 1 (an empty prediction of an empty class is
perfect), as in the CellMap challenge.
"""

from __future__ import annotations

import numpy as np
import torch


class ConfusionCounts:
    """Pooled per-class TP / FP / FN / valid-voxel counts."""

    def __init__(self, num_classes: int):
        self.counts = torch.zeros(4, num_classes, dtype=torch.float64)  # tp, fp, fn, valid

    def update(self, pred: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> None:
        """``pred``, ``target``, ``valid``: boolean/0-1 tensors shaped (K, *spatial)."""
        k = pred.shape[0]
        p = pred.reshape(k, -1).bool()
        t = target.reshape(k, -1).bool()
        v = valid.reshape(k, -1).bool()
        self.counts[0] += (p & t & v).sum(1).double().cpu()
        self.counts[1] += (p & ~t & v).sum(1).double().cpu()
        self.counts[2] += (~p & t & v).sum(1).double().cpu()
        self.counts[3] += v.sum(1).double().cpu()

    def iou(self) -> np.ndarray:
        """Per-class IoU; NaN for a class with no valid voxel at all."""
        tp, fp, fn, valid = self.counts.numpy()
        union = tp + fp + fn
        iou = np.where(union > 0, tp / np.maximum(union, 1), 1.0)
        return np.where(valid > 0, iou, np.nan)

    def dice(self) -> np.ndarray:
        tp, fp, fn, valid = self.counts.numpy()
        denom = 2 * tp + fp + fn
        dice = np.where(denom > 0, 2 * tp / np.maximum(denom, 1), 1.0)
        return np.where(valid > 0, dice, np.nan)


def semantic_scores(counts: ConfusionCounts, classes: list[str]) -> dict[str, float]:
    """``val/iou/<class>``, ``val/dice/<class>`` and ``val/mean_iou`` (over scored classes)."""
    iou, dice = counts.iou(), counts.dice()
    out = {}
    for name, i, d in zip(classes, iou, dice):
        if not np.isnan(i):
            out[f"val/iou/{name}"] = float(i)
            out[f"val/dice/{name}"] = float(d)
    scored = iou[~np.isnan(iou)]
    if scored.size:
        out["val/mean_iou"] = float(scored.mean())
        out["val/mean_dice"] = float(dice[~np.isnan(dice)].mean())
    return out
