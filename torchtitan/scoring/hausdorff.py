"""Hausdorff distances between instances, as the CellMap challenge's instance metric takes
them (nm, exact, from Euclidean distance transforms, anisotropic voxels), capped and
normalised. :mod:`torchtitan.scoring.metrics` scores with them; see its docstring, step 4.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.ndimage as ndi


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


def _union_box(boxes):
    return tuple(slice(min(b[d].start for b in boxes), max(b[d].stop for b in boxes))
                 for d in range(len(boxes[0])))


def pair_hausdorff(truth_ids, pred_ids, matched_t, matched_p, voxel_size) -> np.ndarray:
    """Hausdorff distance of every matched pair alone, on the pair's joint bounding box."""
    true_boxes = ndi.find_objects(truth_ids)
    pred_boxes = ndi.find_objects(pred_ids)
    out = np.zeros(len(matched_t))
    for k, (i, j) in enumerate(zip(matched_t, matched_p)):
        box = _union_box([true_boxes[i - 1], pred_boxes[j - 1]])
        out[k] = hausdorff_distance(truth_ids[box] == i, pred_ids[box] == j, voxel_size)
    return out


def truth_hausdorff(truth_ids, stored_ids, pred_ids, n_pred: int, matched_t, matched_p,
                    voxel_size, cap: float) -> np.ndarray:
    """One distance (nm, at most ``cap``) per true instance, as the challenge computes it.

    The challenge gives each matched prediction the id of its true instance and leaves every
    unmatched prediction its own component number; the distance of true instance k is then
    taken to every predicted voxel that carries k's stored id. So an unmatched component
    whose number equals a stored true id counts as part of that instance: added to its match,
    or standing in for a missed instance (which otherwise gets the cap).
    """
    n_true = len(stored_ids)
    match_of = np.zeros(n_true + 1, np.int64)
    match_of[matched_t] = matched_p
    pred_matched = np.zeros(n_pred + 1, bool)
    pred_matched[matched_p] = True
    true_boxes = ndi.find_objects(truth_ids, max_label=n_true)
    pred_boxes = ndi.find_objects(pred_ids, max_label=n_pred)
    out = np.full(n_true, float(cap))
    for k in range(1, n_true + 1):
        parts = [int(match_of[k])] if match_of[k] else []
        stored = int(stored_ids[k - 1])
        if stored <= n_pred and not pred_matched[stored]:
            parts.append(stored)  # an unmatched component numbered like this true id
        if not parts:
            continue
        box = _union_box([true_boxes[k - 1]] + [pred_boxes[p - 1] for p in parts])
        region = pred_ids[box]
        predicted = region == parts[0] if len(parts) == 1 else np.isin(region, parts)
        out[k - 1] = min(hausdorff_distance(truth_ids[box] == k, predicted, voxel_size), cap)
    return out
