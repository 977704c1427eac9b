"""Segmentation metrics (CellMap challenge definitions), counted only where a class is annotated.

Semantic metrics
----------------
Per class we count true positives, false positives and false negatives over the valid
(annotated, not "unknown") voxels. IoU = TP / (TP + FP + FN), Dice = 2TP / (2TP + FP + FN).
A class whose valid voxels hold neither a true nor a predicted positive scores 1: an empty
prediction of an empty class is perfect, as in the CellMap challenge.
``semantic_crop_scores`` scores one crop; ``combine_scores`` pools the counts over every crop
(gathered from every rank), so they simply add. One function (``_iou_dice``) turns counts into
IoU and Dice for both, and validation and the scoring command share all of it.

Instance metrics (``INSTANCE_CLASSES``)
---------------------------------------
1. Instances. A binary prediction (or ground truth) is split into connected components with
   full connectivity (26-connected in 3D, 8 in 2D: voxels touching at a corner belong to one
   object). An integer array with values other than 0/1 is taken as instance ids as it is.
   Voxels outside the validity mask are set to background in both arrays first, so an
   object predicted only where the truth is unknown is neither a false positive nor a hit.
2. Matching. A sparse contingency table of (true id, predicted id) voxel counts gives the IoU
   of every overlapping pair. True and predicted instances are matched one-to-one so that the
   total IoU is maximal (Hungarian algorithm, ``scipy.optimize.linear_sum_assignment``); only
   pairs with IoU > 0 count as matches. The bipartite overlap graph falls apart into small
   connected components (one true object and the few predictions touching it), and the
   assignment is solved per component, which gives the same optimum as one assignment over
   the whole matrix at a fraction of the cost.
3. F1 = 2TP / (2TP + FP + FN), TP = matched pairs, FP = unmatched predictions, FN =
   unmatched true instances; 1 when both are empty.
4. Hausdorff distance (nm) of each matched pair: the symmetric maximum distance between the
   two voxel sets (voxel centres, anisotropic voxel size), from exact Euclidean distance
   transforms on the bounding box of the pair. Unmatched instances get the cap
   ``min(voxel_size * shape) / 2`` (the CellMap maximum distance), and no matched pair counts
   more than the cap. Each distance is normalised to ``1.01 ** (-hd / |voxel_size|)``
   (1 for a perfect outline, decaying with the distance in units of the voxel diagonal).
5. Instance score = sqrt(F1 * mean normalised Hausdorff over matched and unmatched instances).

Overall
-------
``combine_scores`` pools semantic counts of every class over crops, averages instance scores
over crops, and reports the mean semantic IoU (over non-instance classes), the mean instance
score (over instance classes) and the challenge score, their geometric mean.

Scoring a submission
--------------------
``python -m torchtitan.evaluation --predictions PRED.zarr --groundtruth DATA`` scores a
prediction store with the challenge's metric (current or previous version,
``--metric-version``); reading the stores and the challenge's aggregation live in
``torchtitan/scoring.py`` (floor 3, beside these metrics), which this entry point runs.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.ndimage as ndi
from scipy.optimize import linear_sum_assignment
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from torchtitan.cellmap.classes import INSTANCE_CLASSES

# Probabilities (and linearly resampled binary masks) above this count as foreground.
THRESHOLD = 0.5


# ---------------------------------------------------------------------------------------------
# Semantic scores of one crop
# ---------------------------------------------------------------------------------------------


def _iou_dice(tp: float, fp: float, fn: float) -> tuple[float, float]:
    """IoU and Dice from counts; 1 for an empty prediction of an empty class."""
    union = tp + fp + fn
    iou = tp / union if union > 0 else 1.0
    dice = 2 * tp / (2 * tp + fp + fn) if union > 0 else 1.0
    return float(iou), float(dice)


def _foreground(x) -> np.ndarray:
    x = np.asarray(x)
    return x if x.dtype == bool else x > 0


def semantic_crop_scores(pred, truth, valid=None) -> dict:
    """IoU, Dice and the voxel counts of one class in one crop.

    ``pred`` and ``truth`` are masks (nonzero = foreground; instance ids work too), ``valid``
    marks the voxels that count (None: all).
    """
    p, t = _foreground(pred), _foreground(truth)
    if valid is not None:
        v = np.asarray(valid, dtype=bool)
        p, t = p & v, t & v
        n_valid = int(np.count_nonzero(v))
    else:
        n_valid = int(t.size)
    tp = int(np.count_nonzero(p & t))
    fp = int(np.count_nonzero(p)) - tp
    fn = int(np.count_nonzero(t)) - tp
    iou, dice = _iou_dice(tp, fp, fn)
    return {"iou": iou, "dice": dice, "tp": tp, "fp": fp, "fn": fn, "valid_voxels": n_valid}


# ---------------------------------------------------------------------------------------------
# Instances: labelling, matching, Hausdorff distance
# ---------------------------------------------------------------------------------------------


def _relabel_consecutive(ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Map the positive ids of ``ids`` to 1..n (int32), everything else to 0."""
    if ids.dtype.kind == "i" and ids.size and ids.min() < 0:
        ids = np.where(ids > 0, ids, 0)
    values = ids[ids > 0]  # the foreground only: usually a small part of the volume
    if values.size == 0:
        return np.zeros(ids.shape, np.int32), 0
    top = int(values.max())
    if top < 2**26:
        # Which ids occur: one bincount over the foreground; then a lookup table, no sort.
        present = np.bincount(values.astype(np.intp, copy=False), minlength=top + 1) > 0
        n = int(present.sum())
        if n == top:  # already 1..n
            return ids.astype(np.int32, copy=False), n
        lut = np.zeros(top + 1, np.int32)
        lut[present] = np.arange(1, n + 1, dtype=np.int32)
        return lut[ids], n
    # Huge ids (e.g. random uint64): sort the foreground values instead.
    uniq, inverse = np.unique(values, return_inverse=True)
    out = np.zeros(ids.shape, np.int32)
    out[ids > 0] = inverse.ravel() + 1
    return out, int(uniq.size)


def label_instances(x, valid=None) -> tuple[np.ndarray, int]:
    """Instance ids (int32, 1..n, 0 = background) and the number of instances ``n``.

    Boolean, 0/1 or probability (float, foreground > 0.5) inputs are split into connected
    components with full connectivity; other integer arrays are instance ids, kept as they
    are (renumbered 1..n). Voxels outside ``valid`` become background.
    """
    x = np.asarray(x)
    if x.dtype.kind == "f":
        x = x > THRESHOLD
    elif x.dtype != bool and (x.size == 0 or x.max() <= 1):
        x = x > 0  # a 0/1 mask
    if valid is not None:
        valid = np.asarray(valid, dtype=bool)
        x = x & valid if x.dtype == bool else np.where(valid, x, 0)
    if x.dtype == bool:
        structure = np.ones((3,) * x.ndim, dtype=bool)  # full (26 / 8) connectivity
        labels, n = ndi.label(x, structure=structure, output=np.int32)
        return labels, int(n)
    return _relabel_consecutive(x)


def instance_overlaps(truth_ids: np.ndarray, n_true: int, pred_ids: np.ndarray, n_pred: int):
    """Sparse IoU table of every overlapping (true, predicted) pair.

    Returns ``rows`` (true ids), ``cols`` (predicted ids), ``iou``, and the voxel counts of
    the true and predicted instances (index = id; index 0 is not meaningful). Everything
    comes from one contingency table of the voxels where either array is foreground: their
    (true id, predicted id) pair keys are counted with a bincount (or a sort, when the
    dense table would be huge); instance sizes are its row and column sums.
    """
    t, p = truth_ids.ravel(), pred_ids.ravel()
    foreground = (t > 0) | (p > 0)
    key = t[foreground].astype(np.int64) * (n_pred + 1) + p[foreground]
    if (n_true + 1) * (n_pred + 1) <= 2**24:
        counts = np.bincount(key, minlength=(n_true + 1) * (n_pred + 1))
        key = np.flatnonzero(counts)
        counts = counts[key]
    else:
        key, counts = np.unique(key, return_counts=True)
    rows, cols = np.divmod(key, n_pred + 1)
    true_sizes = np.bincount(rows, weights=counts, minlength=n_true + 1).astype(np.int64)
    pred_sizes = np.bincount(cols, weights=counts, minlength=n_pred + 1).astype(np.int64)
    true_sizes[0] = pred_sizes[0] = 0
    pairs = (rows > 0) & (cols > 0)
    rows, cols, inter = rows[pairs], cols[pairs], counts[pairs]
    iou = inter / (true_sizes[rows] + pred_sizes[cols] - inter)
    return rows, cols, iou, true_sizes, pred_sizes


def match_instances(rows, cols, iou, n_true: int, n_pred: int):
    """One-to-one matching of maximal total IoU over the overlapping pairs (IoU > 0).

    ``rows``/``cols``/``iou`` list the nonzero entries of the IoU matrix (ids from 1). The
    overlap graph is split into connected components; a component with a single pair is a
    match outright, larger ones are solved with the Hungarian algorithm. Returns the matched
    true ids, predicted ids and their IoU.
    """
    keep = iou > 0
    rows, cols, iou = rows[keep], cols[keep], iou[keep]
    if rows.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, np.zeros(0)
    # Bipartite graph: node r-1 for true instance r, node n_true + c-1 for prediction c.
    n_nodes = n_true + n_pred
    graph = coo_matrix((np.ones(rows.size), (rows - 1, n_true + cols - 1)), shape=(n_nodes, n_nodes))
    _, component = connected_components(graph, directed=False)
    edge_component = component[rows - 1]
    edges_per_component = np.bincount(edge_component)

    single = edges_per_component[edge_component] == 1
    matched_t, matched_p, matched_iou = [rows[single]], [cols[single]], [iou[single]]

    # Components with several overlapping pairs: one small assignment problem each.
    multi = np.flatnonzero(~single)
    order = multi[np.argsort(edge_component[multi], kind="stable")]
    groups = np.split(order, np.flatnonzero(np.diff(edge_component[order])) + 1) if order.size else []
    for edges in groups:
        r_ids, r = np.unique(rows[edges], return_inverse=True)
        c_ids, c = np.unique(cols[edges], return_inverse=True)
        matrix = np.zeros((r_ids.size, c_ids.size))
        matrix[r, c] = iou[edges]
        ri, ci = linear_sum_assignment(matrix, maximize=True)
        ok = matrix[ri, ci] > 0
        matched_t.append(r_ids[ri[ok]])
        matched_p.append(c_ids[ci[ok]])
        matched_iou.append(matrix[ri[ok], ci[ok]])
    return np.concatenate(matched_t), np.concatenate(matched_p), np.concatenate(matched_iou)


def hausdorff_distance(a, b, voxel_size) -> float:
    """Symmetric Hausdorff distance (nm) between two non-empty voxel sets of one grid.

    ``max(max_{x in a} d(x, b), max_{y in b} d(y, a))`` with distances between voxel centres
    scaled by ``voxel_size``; exact, from Euclidean distance transforms. Infinite if either
    set is empty.
    """
    a, b = np.asarray(a, dtype=bool), np.asarray(b, dtype=bool)
    if not a.any() or not b.any():
        return math.inf
    sampling = [float(s) for s in voxel_size]
    to_b = ndi.distance_transform_edt(~b, sampling=sampling)  # distance of every voxel to b
    to_a = ndi.distance_transform_edt(~a, sampling=sampling)
    return float(max(to_b[a].max(), to_a[b].max()))


def hausdorff_cap(shape, voxel_size) -> float:
    """The largest distance that counts (nm): half the shortest side of the volume."""
    return float(np.min(np.asarray(voxel_size, dtype=float) * np.asarray(shape)) / 2)


def normalize_distance(distance, voxel_size):
    """``1.01 ** (-distance / |voxel_size|)``: 1 at distance 0, decaying per voxel diagonal."""
    return 1.01 ** (-np.asarray(distance, dtype=float) / np.linalg.norm(voxel_size))


def _pair_hausdorff(truth_ids, pred_ids, matched_t, matched_p, voxel_size) -> np.ndarray:
    """Hausdorff distance of every matched pair, on the pair's joint bounding box."""
    true_boxes = ndi.find_objects(truth_ids)
    pred_boxes = ndi.find_objects(pred_ids)
    out = np.zeros(len(matched_t))
    for k, (i, j) in enumerate(zip(matched_t, matched_p)):
        tb, pb = true_boxes[i - 1], pred_boxes[j - 1]
        box = tuple(slice(min(s.start, q.start), max(s.stop, q.stop)) for s, q in zip(tb, pb))
        out[k] = hausdorff_distance(truth_ids[box] == i, pred_ids[box] == j, voxel_size)
    return out


def instance_scores(pred, truth, voxel_size, valid=None) -> dict:
    """Instance F1, Hausdorff distances and the combined CellMap instance score of one crop.

    ``pred``/``truth``: binary masks (split into connected components), probabilities
    (thresholded at 0.5) or instance-id arrays; ``voxel_size`` in nm per axis; ``valid``:
    voxels that count (None: all). Returned keys: ``tp``, ``fp``, ``fn`` (instances),
    ``n_true``, ``n_pred``, ``f1``, ``hausdorff_nm`` (per matched pair, capped),
    ``mean_hausdorff_nm`` (over matched pairs, None without any), ``hausdorff_cap_nm``,
    ``normalized_hausdorff`` (mean over matched and unmatched instances) and ``score``.
    """
    truth_ids, n_true = label_instances(truth, valid)
    pred_ids, n_pred = label_instances(pred, valid)
    if truth_ids.shape != pred_ids.shape:
        raise ValueError(f"prediction shape {pred_ids.shape} differs from ground truth {truth_ids.shape}")
    voxel_size = np.asarray(voxel_size, dtype=float)
    cap = hausdorff_cap(truth_ids.shape, voxel_size)

    rows, cols, iou, _, _ = instance_overlaps(truth_ids, n_true, pred_ids, n_pred)
    matched_t, matched_p, _ = match_instances(rows, cols, iou, n_true, n_pred)
    tp = len(matched_t)
    fp, fn = n_pred - tp, n_true - tp
    f1 = 2 * tp / (2 * tp + fp + fn) if (tp + fp + fn) > 0 else 1.0

    hd = np.minimum(_pair_hausdorff(truth_ids, pred_ids, matched_t, matched_p, voxel_size), cap)
    normalized = np.concatenate([normalize_distance(hd, voxel_size),
                                 np.full(fp + fn, normalize_distance(cap, voxel_size))])
    mean_normalized = float(normalized.mean()) if normalized.size else 1.0
    return {
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "n_true": n_true,
        "n_pred": n_pred,
        "f1": float(f1),
        "hausdorff_nm": hd.tolist(),
        "mean_hausdorff_nm": float(hd.mean()) if tp else None,
        "hausdorff_cap_nm": cap,
        "normalized_hausdorff": mean_normalized,
        "score": float(math.sqrt(f1 * mean_normalized)),
    }


# ---------------------------------------------------------------------------------------------
# One crop, many crops
# ---------------------------------------------------------------------------------------------


def score_crop(pred_by_class: dict, truth_by_class: dict, valid_by_class: dict, voxel_size,
               instance_classes=INSTANCE_CLASSES) -> dict:
    """Scores of every class a crop annotates.

    ``truth_by_class`` names the annotated classes (a class missing there is not scored);
    a class missing from ``pred_by_class`` counts as an empty prediction, one missing from
    ``valid_by_class`` as valid everywhere. A class with no valid voxel is skipped. Every
    class gets semantic IoU/Dice and counts; classes in ``instance_classes`` also get the
    instance metrics of ``instance_scores`` (without the per-pair list; its instance counts
    renamed ``instance_tp``/``instance_fp``/``instance_fn``, since ``tp``/``fp``/``fn`` count
    voxels).
    Returns ``{"voxel_size": [...], "classes": {name: scores}}``.
    """
    classes = {}
    for name, truth in truth_by_class.items():
        truth = np.asarray(truth)
        valid = valid_by_class.get(name)
        valid = np.ones(truth.shape, bool) if valid is None else np.asarray(valid, dtype=bool)
        if not valid.any():
            continue
        pred = pred_by_class.get(name)
        pred = np.zeros(truth.shape, bool) if pred is None else np.asarray(pred)
        if pred.shape != truth.shape or valid.shape != truth.shape:
            raise ValueError(
                f"class {name!r}: prediction {pred.shape}, ground truth {truth.shape} and validity "
                f"mask {valid.shape} must have one shape (resample the prediction to the crop's grid)"
            )
        if pred.dtype.kind == "f":
            pred = pred > THRESHOLD
        scores = {"type": "semantic", **semantic_crop_scores(pred, truth, valid)}
        if name in instance_classes:
            inst = instance_scores(pred, truth, voxel_size, valid)
            inst.pop("hausdorff_nm")
            # tp/fp/fn above count voxels; the instance counts get their own names.
            for key in ("tp", "fp", "fn"):
                inst[f"instance_{key}"] = inst.pop(key)
            scores.update(type="instance", **inst)
        classes[name] = scores
    return {"voxel_size": [float(v) for v in voxel_size], "classes": classes}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def scores_by_class(crops: list[dict]) -> dict[str, list[dict]]:
    """The per-class score entries of many crops (``[{"classes": {name: scores}}]``), grouped
    by class name, in crop order."""
    by_class: dict[str, list[dict]] = {}
    for crop in crops:
        for name, scores in crop["classes"].items():
            by_class.setdefault(name, []).append(scores)
    return by_class


def combine_scores(crops: list[dict]) -> dict:
    """Per-class and overall scores over several ``score_crop`` results.

    Semantic counts are pooled over crops (IoU/Dice of the summed TP/FP/FN); instance
    metrics are averaged over the crops that annotate the class. Overall:
    ``mean_semantic_iou`` (over semantic classes), ``mean_instance_score`` (over instance
    classes) and ``score`` = sqrt(mean_semantic_iou * mean_instance_score), or whichever of
    the two exists when a set of classes is empty (None when nothing was scored).
    """
    classes = {}
    for name, entries in scores_by_class(crops).items():
        tp, fp, fn = (sum(e[k] for e in entries) for k in ("tp", "fp", "fn"))
        iou, dice = _iou_dice(tp, fp, fn)
        kind = "instance" if any(e["type"] == "instance" for e in entries) else "semantic"
        out = {"type": kind, "crops": len(entries), "iou": iou, "dice": dice, "tp": tp, "fp": fp, "fn": fn}
        if kind == "instance":
            inst = [e for e in entries if e["type"] == "instance"]
            out.update(
                score=_mean(e["score"] for e in inst),
                f1=_mean(e["f1"] for e in inst),
                normalized_hausdorff=_mean(e["normalized_hausdorff"] for e in inst),
                mean_hausdorff_nm=_mean(e["mean_hausdorff_nm"] for e in inst),
                **{f"instance_{k}": sum(e[f"instance_{k}"] for e in inst) for k in ("tp", "fp", "fn")},
            )
        classes[name] = out
    semantic = _mean(c["iou"] for c in classes.values() if c["type"] == "semantic")
    instance = _mean(c["score"] for c in classes.values() if c["type"] == "instance")
    if semantic is not None and instance is not None:
        overall = math.sqrt(semantic * instance)
    else:
        overall = semantic if instance is None else instance
    return {
        "classes": classes,
        "overall": {"mean_semantic_iou": semantic, "mean_instance_score": instance, "score": overall},
    }


def validation_scores(combined: dict, classes: list[str]) -> dict[str, float]:
    """Flat ``val/...`` scalars of a :func:`combine_scores` result, for logging.

    ``val/iou/<class>`` and ``val/dice/<class>`` for every scored class,
    ``val/instance_score/<class>``, ``val/f1/<class>`` and ``val/hausdorff_nm/<class>`` for
    instance classes, ``val/mean_iou`` and ``val/mean_dice`` over every scored class, and the
    challenge's overall ``val/mean_semantic_iou``, ``val/mean_instance_score`` and
    ``val/score``.
    """
    out: dict[str, float] = {}
    per_class = combined["classes"]
    for name in classes:
        c = per_class.get(name)
        if c is None:
            continue
        out[f"val/iou/{name}"] = c["iou"]
        out[f"val/dice/{name}"] = c["dice"]
        if c["type"] == "instance":
            out[f"val/instance_score/{name}"] = c["score"]
            out[f"val/f1/{name}"] = c["f1"]
            if c["mean_hausdorff_nm"] is not None:
                out[f"val/hausdorff_nm/{name}"] = c["mean_hausdorff_nm"]
    scored = [per_class[n] for n in classes if n in per_class]
    if scored:
        out["val/mean_iou"] = float(np.mean([c["iou"] for c in scored]))
        out["val/mean_dice"] = float(np.mean([c["dice"] for c in scored]))
    for key, value in combined["overall"].items():
        if value is not None:
            out[f"val/{key}"] = float(value)
    return out


def main(argv=None) -> int:
    """``python -m torchtitan.evaluation``: score a prediction store (see ``torchtitan.scoring``)."""
    from torchtitan.scoring import main as score_main

    return score_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
