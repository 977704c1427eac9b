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

Instance metrics (``INSTANCE_CLASSES``): the CellMap challenge's 2025 definition
------------------------------------------------------------------------------------
Reproduces the challenge's own scoring code (``utils/eval_utils`` of
janelia-cellmap/cellmap-segmentation-challenge), leaderboard quirks included.

1. Instances. Voxels outside the validity mask are set to background in both arrays first.
   The prediction is split into connected components with full connectivity (26-connected in
   3D, 8 in 2D), each predicted id on its own, numbered 1..n in raster order of their first
   voxel. True instances keep their stored ids (a true mask is split into components).
2. Matching. A sparse contingency table of (true id, predicted id) voxel counts gives the IoU
   of every overlapping pair. True and predicted instances are matched one-to-one with the
   challenge's min-cost-flow objective (``match_instances``: maximal total IoU in the flow's
   integer costs); only pairs with IoU > 0 can match. The overlap graph falls apart into small
   connected components, and the assignment is solved per component.
3. F1 = 2TP / (2TP + FP + FN), TP = matched pairs, FP = unmatched predictions, FN =
   unmatched true instances.
4. Hausdorff distances (nm, exact, from Euclidean distance transforms, anisotropic voxels):
   one per true instance and the cap ``min(voxel_size * shape) / 2`` for every unmatched
   prediction. As in the challenge, a true instance's distance is taken to every predicted
   voxel carrying its stored id after matched predictions took their true ids: an unmatched
   component whose number equals a true id counts as part of that instance
   (``truth_hausdorff``). No distance exceeds the cap; each is normalised to
   ``1.01 ** (-d / |voxel_size|)``.
5. A crop with more than ``10 + 50 exp(-n / 5)`` predicted instances per true instance (n:
   the largest true id) is skipped: it adds nothing to its class.

Overall
-------
``combine_scores`` pools over crops, per class: semantic voxel counts (IoU, Dice), instance
counts (F1) and normalised distances (their mean); instance score = sqrt(F1 x mean). Overall:
the plain mean of the semantic IoUs, the plain mean of the instance scores and their geometric
mean (``overall_scores``). Validation logs exactly this (``val/score``), and the scoring command
prints it for the 2025 metric.

Neuron metrics (``NEURON_CLASSES``)
-----------------------------------
A class scored as a dense segmentation of neurons (``cell``) is also judged by the variation of
information (split, merge) and the adapted Rand error, CREMI's definitions, from the truth ids
and the predicted instances of step 1 (``torchtitan/scoring/neuron_metrics.py``); ``combine_scores``
pools them over crops as if the crops lay side by side in one volume.

Scoring a submission
--------------------
``python -m torchtitan.scoring --predictions PRED.zarr --groundtruth DATA`` scores a
prediction store with the challenge's metric (current or previous version,
``--metric-version``); reading the stores and the challenge's aggregation live in
``torchtitan/scoring/stores.py``, beside these metrics.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import scipy.ndimage as ndi
from scipy.optimize import linear_sum_assignment
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from torchtitan.choices import PROBABILITY_THRESHOLD
from torchtitan.cellmap.classes import INSTANCE_CLASSES, NEURON_CLASSES
from torchtitan.scoring.hausdorff import hausdorff_cap, normalize_distance, truth_hausdorff
from torchtitan.scoring.neuron_metrics import neuron_scores, pool_neuron_scores



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


def _relabel_consecutive(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Map the positive ids of ``ids`` to 1..n (int32) in increasing order, everything else
    to 0. Returns the relabelled array and the ids it replaced (sorted: entry k-1 is the id
    that became k)."""
    if ids.dtype.kind == "i" and ids.size and ids.min() < 0:
        ids = np.where(ids > 0, ids, 0)
    values = ids[ids > 0]  # the foreground only: usually a small part of the volume
    if values.size == 0:
        return np.zeros(ids.shape, np.int32), np.zeros(0, np.int64)
    top = int(values.max())
    if top < 2**26:
        # Which ids occur: one bincount over the foreground; then a lookup table, no sort.
        present = np.bincount(values.astype(np.intp, copy=False), minlength=top + 1) > 0
        present[0] = False
        originals = np.flatnonzero(present)
        if originals.size == top:  # already 1..n
            return ids.astype(np.int32, copy=False), originals
        lut = np.zeros(top + 1, np.int32)
        lut[originals] = np.arange(1, originals.size + 1, dtype=np.int32)
        return lut[ids], originals
    # Huge ids (e.g. random uint64): sort the foreground values instead.
    uniq, inverse = np.unique(values, return_inverse=True)
    out = np.zeros(ids.shape, np.int32)
    out[ids > 0] = inverse.ravel() + 1
    return out, uniq


def _as_mask_or_ids(x, valid) -> np.ndarray:
    """A boolean mask (from booleans, 0/1 integers or probabilities > 0.5) or integer ids,
    with the voxels outside ``valid`` set to background."""
    x = np.asarray(x)
    if x.dtype.kind == "f":
        x = x > PROBABILITY_THRESHOLD
    elif x.dtype != bool and (x.size == 0 or x.max() <= 1):
        x = x > 0  # a 0/1 mask
    if valid is not None:
        valid = np.asarray(valid, dtype=bool)
        x = x & valid if x.dtype == bool else np.where(valid, x, 0)
    return x


def _components(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """Connected components of a mask with full connectivity (26 in 3D, 8 in 2D), numbered
    in raster order of their first voxel."""
    structure = np.ones((3,) * mask.ndim, dtype=bool)
    labels, n = ndi.label(mask, structure=structure, output=np.int32)
    return labels, int(n)


def label_instances(x, valid=None) -> tuple[np.ndarray, int]:
    """Instance ids (int32, 1..n, 0 = background) and the number of instances ``n``.

    Boolean, 0/1 or probability (float, foreground > 0.5) inputs are split into connected
    components with full connectivity; other integer arrays are instance ids, kept as they
    are (renumbered 1..n). Voxels outside ``valid`` become background.
    """
    x = _as_mask_or_ids(x, valid)
    if x.dtype == bool:
        return _components(x)
    ids, originals = _relabel_consecutive(x)
    return ids, int(originals.size)


def truth_instances(truth, valid=None) -> tuple[np.ndarray, np.ndarray]:
    """The true instances of one class: ids 1..n (int32) and the id each had as stored
    (entry k-1: the stored id of instance k). Ids are kept as stored, as the challenge reads
    its ground truth; a mask is split into connected components (numbered as for a
    prediction). Voxels outside ``valid`` become background."""
    x = _as_mask_or_ids(truth, valid)
    if x.dtype == bool:
        ids, n = _components(x)
        return ids, np.arange(1, n + 1, dtype=np.int64)
    return _relabel_consecutive(x)


def predicted_instances(pred, valid=None) -> tuple[np.ndarray, int]:
    """The predicted instances of one class, as the challenge relabels a submission: the
    connected components (full connectivity) of every predicted id, the pieces of one id
    apart and touching ids apart, numbered 1..n in raster order of their first voxel (the
    numbering matters: an unmatched component keeps its number, see ``instance_scores``).
    Masks and probabilities (> 0.5) are one id. Voxels outside ``valid`` are background."""
    x = _as_mask_or_ids(pred, valid)
    if x.dtype == bool:
        return _components(x)
    ids, originals = _relabel_consecutive(x)
    pieces = np.zeros(ids.shape, np.int32)
    count = 0
    for i, box in enumerate(ndi.find_objects(ids), start=1):
        if box is None:
            continue
        labels, k = _components(ids[box] == i)
        inside = labels > 0
        pieces[box][inside] = labels[inside] + count
        count += k
    if count == 0:
        return pieces, 0
    # Renumber by first voxel in raster order (np.unique's first indices of the flat array).
    flat = pieces.ravel()
    nonzero = np.flatnonzero(flat)
    labels, first = np.unique(flat[nonzero], return_index=True)
    lut = np.zeros(count + 1, np.int32)
    lut[labels[np.argsort(first, kind="stable")]] = np.arange(1, count + 1, dtype=np.int32)
    return lut[pieces], count


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


# The challenge matches by a min-cost flow with integer costs: a matched pair costs
# int((1 - IoU) * scale) with IoU in float32, an unmatched true instance scale + 1.
MATCH_COST_SCALE = 1_000_000


def match_weights(iou) -> np.ndarray:
    """What matching a pair saves over leaving its true instance unmatched, in the
    challenge's integer costs: ``scale + 1 - int((1 - IoU) * scale)`` (always >= 1)."""
    iou32 = np.asarray(iou, dtype=np.float32).astype(np.float64)
    return MATCH_COST_SCALE + 1 - np.trunc((1.0 - iou32) * MATCH_COST_SCALE).astype(np.int64)


def match_instances(rows, cols, iou, n_true: int, n_pred: int):
    """One-to-one matching of the overlapping pairs (IoU > 0) with the challenge's objective:
    the largest total of :func:`match_weights` (its min-cost flow's optimum: the largest total
    IoU, in steps of 1e-6, and among equal totals the most matches).

    ``rows``/``cols``/``iou`` list the nonzero entries of the IoU matrix (ids from 1). The
    overlap graph is split into connected components; a component with a single pair is a
    match outright, larger ones are solved with the Hungarian algorithm. Where several
    matchings reach the same total (exact ties, e.g. two predictions of equal IoU with one
    true instance), which one is taken may differ from the challenge's solver (OR-Tools'
    min-cost flow), and with it the collisions of ``truth_hausdorff``. Returns the matched
    true ids, predicted ids and their IoU.
    """
    keep = np.asarray(iou, dtype=np.float32) > 0
    rows, cols, iou = rows[keep], cols[keep], iou[keep]
    if rows.size == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, np.zeros(0)
    weight = match_weights(iou)
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
        matrix = np.zeros((r_ids.size, c_ids.size), np.int64)
        matrix[r, c] = weight[edges]
        overlap = np.zeros(matrix.shape)
        overlap[r, c] = iou[edges]
        ri, ci = linear_sum_assignment(matrix, maximize=True)
        ok = matrix[ri, ci] > 0
        matched_t.append(r_ids[ri[ok]])
        matched_p.append(c_ids[ci[ok]])
        matched_iou.append(overlap[ri[ok], ci[ok]])
    return np.concatenate(matched_t), np.concatenate(matched_p), np.concatenate(matched_iou)


def ratio_cutoff(n_true: int) -> float:
    """Most predicted instances per true instance the 2025 metric scores in one crop."""
    return 10.0 + 50.0 * math.exp(-n_true / 5.0)


def instance_scores(pred, truth, voxel_size, valid=None) -> dict:
    """The CellMap challenge's (2025) instance scores of one class in one crop.

    ``pred``: a mask, probabilities (> 0.5) or instance ids, relabelled by
    :func:`predicted_instances`; ``truth``: instance ids (kept as stored) or a mask (split
    into connected components); ``voxel_size`` in nm per axis; ``valid``: voxels that count
    (None: all). Matching: :func:`match_instances`. Distances: one per true instance
    (:func:`truth_hausdorff`) and the cap for every unmatched prediction, taken in float32
    and normalised (:func:`normalize_distance`). A crop with more predicted instances than
    ``ratio_cutoff(largest true id)`` per true instance is skipped (``status``): it adds
    nothing to its class.

    Returned keys: ``tp``, ``fp``, ``fn`` (instances), ``n_true``, ``n_pred``, ``f1``,
    ``hausdorff_nm`` (per true instance, in id order), ``mean_hausdorff_nm`` (over matched
    true instances, None without any), ``matched_hausdorff_sum_nm``, ``hausdorff_cap_nm``,
    ``hausdorff_norm_sum`` and ``n_hausdorff`` (what the class pools),
    ``normalized_hausdorff`` (their mean in this crop), ``score`` = sqrt(f1 x that mean) and
    ``status``.
    """
    truth_ids, stored_ids = truth_instances(truth, valid)
    pred_ids, n_pred = predicted_instances(pred, valid)
    return scores_of_instances(truth_ids, stored_ids, pred_ids, n_pred, voxel_size)


def scores_of_instances(truth_ids, stored_ids, pred_ids, n_pred: int, voxel_size) -> dict:
    """:func:`instance_scores` of instances already labelled (by :func:`truth_instances` and
    :func:`predicted_instances`), for a caller that scores the same instances otherwise too."""
    if truth_ids.shape != pred_ids.shape:
        raise ValueError(f"prediction shape {pred_ids.shape} differs from ground truth {truth_ids.shape}")
    n_true = int(stored_ids.size)
    voxel_size = np.asarray(voxel_size, dtype=float)
    cap = hausdorff_cap(truth_ids.shape, voxel_size)
    out = {"n_true": n_true, "n_pred": n_pred, "hausdorff_cap_nm": cap, "status": "scored"}

    largest_id = int(stored_ids[-1]) if n_true else 0  # the challenge counts true ids by the largest
    if largest_id and n_pred and n_pred / largest_id > ratio_cutoff(largest_id):
        return {**out, "status": "skipped_too_many_instances", "tp": 0, "fp": 0, "fn": 0,
                "f1": 0.0, "hausdorff_nm": [], "mean_hausdorff_nm": None,
                "matched_hausdorff_sum_nm": 0.0, "hausdorff_norm_sum": 0.0, "n_hausdorff": 0,
                "normalized_hausdorff": 0.0, "score": 0.0}

    rows, cols, iou, _, _ = instance_overlaps(truth_ids, n_true, pred_ids, n_pred)
    matched_t, matched_p, _ = match_instances(rows, cols, iou, n_true, n_pred)
    tp = len(matched_t)
    fp, fn = n_pred - tp, n_true - tp
    f1 = 2 * tp / (2 * tp + fp + fn) if (tp + fp + fn) > 0 else 1.0

    per_true = truth_hausdorff(truth_ids, stored_ids, pred_ids, n_pred, matched_t, matched_p,
                               voxel_size, cap).astype(np.float32)
    distances = np.concatenate([per_true, np.full(fp, cap, np.float32)])
    normalized = normalize_distance(distances, voxel_size)
    mean_normalized = float(normalized.mean()) if normalized.size else 1.0
    matched = per_true[matched_t - 1].astype(float)
    return {
        **out,
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "f1": float(f1),
        "hausdorff_nm": per_true.astype(float).tolist(),
        "mean_hausdorff_nm": float(matched.mean()) if tp else None,
        "matched_hausdorff_sum_nm": float(matched.sum()),
        "hausdorff_norm_sum": float(normalized.sum()),
        "n_hausdorff": int(normalized.size),
        "normalized_hausdorff": mean_normalized,
        "score": float(math.sqrt(f1 * mean_normalized)),
    }


# ---------------------------------------------------------------------------------------------
# One crop, many crops
# ---------------------------------------------------------------------------------------------


def score_class(pred, truth, valid, voxel_size, instance: bool, neuron: bool = False) -> dict:
    """Scores of one class in one crop: semantic IoU/Dice and voxel counts, and for an
    instance class also :func:`instance_scores` (its instance counts named
    ``instance_tp``/``instance_fp``/``instance_fn``, since ``tp``/``fp``/``fn`` count voxels).
    An instance class that is also a ``neuron`` class gets the VOI and ARAND of the same
    instances (:func:`torchtitan.scoring.neuron_metrics.neuron_scores`), whatever the instance status.
    ``pred``: mask, probabilities (> 0.5) or ids; ``valid``: voxels that count (None: all)."""
    truth = np.asarray(truth)
    pred = np.asarray(pred)
    if pred.shape != truth.shape or (valid is not None and np.shape(valid) != truth.shape):
        raise ValueError(
            f"prediction {pred.shape}, ground truth {truth.shape} and validity mask "
            f"{np.shape(valid)} must have one shape (resample the prediction to the crop's grid)"
        )
    if pred.dtype.kind == "f":
        pred = pred > PROBABILITY_THRESHOLD
    scores = {"type": "semantic", **semantic_crop_scores(pred, truth, valid)}
    if instance:
        truth_ids, stored_ids = truth_instances(truth, valid)
        pred_ids, n_pred = predicted_instances(pred, valid)
        inst = scores_of_instances(truth_ids, stored_ids, pred_ids, n_pred, voxel_size)
        for key in ("tp", "fp", "fn"):
            inst[f"instance_{key}"] = inst.pop(key)
        scores.update(type="instance", **inst)
        if neuron:  # both are background outside ``valid`` already
            scores.update(neuron_scores(truth_ids, pred_ids))
    return scores


def score_crop(pred_by_class: dict, truth_by_class: dict, valid_by_class: dict, voxel_size,
               instance_classes=INSTANCE_CLASSES, neuron_classes=NEURON_CLASSES) -> dict:
    """Scores of every class a crop annotates (:func:`score_class`; the neuron metrics for
    the instance classes among ``neuron_classes``).

    ``truth_by_class`` names the annotated classes (a class missing there is not scored);
    a class missing from ``pred_by_class`` counts as an empty prediction, one missing from
    ``valid_by_class`` as valid everywhere. A class with no valid voxel is skipped.
    Returns ``{"voxel_size": [...], "classes": {name: scores}}``.
    """
    classes = {}
    for name, truth in truth_by_class.items():
        truth = np.asarray(truth)
        valid = valid_by_class.get(name)
        valid = np.ones(truth.shape, bool) if valid is None else np.asarray(valid, dtype=bool)
        if valid.shape == truth.shape and not valid.any():
            continue
        pred = pred_by_class.get(name)
        pred = np.zeros(truth.shape, bool) if pred is None else pred
        try:
            classes[name] = score_class(pred, truth, valid, voxel_size, name in instance_classes,
                                        name in neuron_classes)
        except ValueError as e:
            raise ValueError(f"class {name!r}: {e}") from None
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


def classes_and_overall(classes: dict[str, dict]) -> dict:
    """A combination's result: the per-class scores and the overall scores made from them
    (:func:`overall_scores`), whichever metric version pooled the classes."""
    return {"classes": classes, "overall": overall_scores(
        [c["iou"] for c in classes.values() if c["type"] == "semantic"],
        [c["score"] for c in classes.values() if c["type"] == "instance"])}


def overall_scores(semantic_ious, instance_scores_) -> dict:
    """The overall scores from the per-class ones: ``mean_semantic_iou`` (plain mean over
    semantic classes), ``mean_instance_score`` (plain mean over instance classes) and
    ``score``, their geometric mean. A half with no class is None ("not scored") and the
    score is then the other half alone (the challenge scores every class of its test set,
    so both halves always exist there); None when nothing was scored."""
    semantic, instance = _mean(semantic_ious), _mean(instance_scores_)
    if semantic is not None and instance is not None:
        overall = math.sqrt(semantic * instance)
    else:
        overall = semantic if instance is None else instance
    return {"mean_semantic_iou": semantic, "mean_instance_score": instance, "score": overall}


def pool_instance_scores(entries: list[dict]) -> dict:
    """One instance class over crops, the 2025 way: instance TP/FP/FN pooled into F1, the
    normalised distances pooled into their mean, score = sqrt(F1 x mean). A class with no
    instance and no distance anywhere scores 1 (F1, mean and score)."""
    tp, fp, fn = (sum(e[f"instance_{k}"] for e in entries) for k in ("tp", "fp", "fn"))
    norm_sum = sum(e["hausdorff_norm_sum"] for e in entries)
    count = sum(e["n_hausdorff"] for e in entries)
    skipped = sum(e.get("status") == "skipped_too_many_instances" for e in entries)
    if skipped:
        # The challenge leaves such crops out of the pool, which can leave a class with nothing
        # in it and a perfect score: say so, so that a broken prediction is not read as perfect.
        logging.getLogger("torchtitan").warning(
            "%d crop(s) not scored as instances: more predicted objects than the challenge's "
            "cutoff per true object (ratio_cutoff); they add nothing to the class's pooled "
            "instance score, as on the leaderboard", skipped)
    if 2 * tp + fp + fn == 0 and count == 0:
        f1 = normalized = 1.0
    else:
        f1 = 2 * tp / (2 * tp + fp + fn) if 2 * tp + fp + fn else 0.0
        normalized = norm_sum / count if count else 0.0
    matched_sum = sum(e.get("matched_hausdorff_sum_nm", 0.0) for e in entries)
    return {"instance_tp": tp, "instance_fp": fp, "instance_fn": fn, "f1": f1,
            "normalized_hausdorff": normalized, "score": math.sqrt(f1 * normalized),
            "mean_hausdorff_nm": matched_sum / tp if tp else None}


def combine_scores(crops: list[dict]) -> dict:
    """Per-class and overall scores over several crops' scores (:func:`score_crop`), by the
    CellMap challenge's 2025 rules; validation and the scoring command both use it.

    Semantic: voxel TP/FP/FN pooled over crops, IoU/Dice of the sums. Instance:
    :func:`pool_instance_scores`. Neuron metrics, where crops have them:
    :func:`torchtitan.scoring.neuron_metrics.pool_neuron_scores`. Overall: :func:`overall_scores`.
    """
    classes = {}
    for name, entries in scores_by_class(crops).items():
        tp, fp, fn = (sum(e[k] for e in entries) for k in ("tp", "fp", "fn"))
        iou, dice = _iou_dice(tp, fp, fn)
        kind = "instance" if any(e["type"] == "instance" for e in entries) else "semantic"
        out = {"type": kind, "crops": len(entries), "iou": iou, "dice": dice, "tp": tp, "fp": fp, "fn": fn}
        if kind == "instance":
            out.update(pool_instance_scores([e for e in entries if e["type"] == "instance"]))
        neuron = [e for e in entries if "voi_split" in e]
        if neuron:
            out.update(pool_neuron_scores(neuron))
        classes[name] = out
    return classes_and_overall(classes)


def validation_scores(combined: dict, classes: list[str]) -> dict[str, float]:
    """Flat ``val/...`` scalars of a :func:`combine_scores` result, for logging.

    ``val/iou/<class>`` and ``val/dice/<class>`` for every scored class,
    ``val/instance_score/<class>``, ``val/f1/<class>`` and ``val/hausdorff_nm/<class>`` for
    instance classes, ``val/voi_split/<class>``, ``val/voi_merge/<class>``, ``val/voi/<class>``
    (their sum) and ``val/arand/<class>`` for classes scored with the neuron metrics,
    ``val/mean_iou`` and ``val/mean_dice`` over every scored class, and the
    challenge's overall ``val/mean_semantic_iou``, ``val/mean_instance_score`` and
    ``val/score`` (a half that was not scored is left out).
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
        if "voi_split" in c:
            for key in ("voi_split", "voi_merge", "voi", "arand"):
                out[f"val/{key}/{name}"] = c[key]
    scored = [per_class[n] for n in classes if n in per_class]
    if scored:
        out["val/mean_iou"] = float(np.mean([c["iou"] for c in scored]))
        out["val/mean_dice"] = float(np.mean([c["dice"] for c in scored]))
    for key, value in combined["overall"].items():
        if value is not None:
            out[f"val/{key}"] = float(value)
    return out

