"""The metrics neuron segmentation is judged by: variation of information (split and merge)
and the adapted Rand error, as the CREMI challenge defines them.

A dense segmentation of neurons is wrong in two ways the instance F1 weighs poorly: a false
merge of two large cells, or a cell split into pieces, costs one or two matches there but a
large part of the volume here. Both metrics read one contingency table, the voxel count
``n_ij`` of every (truth id i, predicted id j) pair, over the voxels that count: those the
validity mask keeps (not unknown) whose truth id is not 0. With ``n`` those voxels,
``a_i = sum_j n_ij`` (true segment sizes) and ``b_j = sum_i n_ij`` (predicted ones):

* VOI split = H(prediction | truth) = ``sum_ij (n_ij / n) log2(a_i / n_ij)`` (over-
  segmentation: how many bits tell the pieces of a true segment apart), VOI merge =
  H(truth | prediction) = ``sum_ij (n_ij / n) log2(b_j / n_ij)`` (under-segmentation), in bits;
* ARAND = 1 - F, F = ``(sum n_ij^2 - n) / ((sum a_i^2 - n + sum b_j^2 - n) / 2)``: the
  harmonic mean of the Rand precision and recall over pairs of distinct voxels (0 when there
  is no such pair in either segmentation, that is when both are the same partition).

Which voxels count, and the base, are CREMI's (``cremi_python``, ``evaluation/voi.py`` and
``rand.py``): truth id 0 is ignored, predicted id 0 is a segment like any other (the voxels of
true segments the prediction left as background are one predicted segment), log base 2.
scikit-image computes the same numbers: with the truth set to 0 outside the validity mask,
``(voi_split, voi_merge) == skimage.metrics.variation_of_information(truth, pred,
ignore_labels=(0,))`` and ``arand == skimage.metrics.adapted_rand_error(truth, pred,
ignore_labels=(0,))[0]`` (``tests/test_neuron_metrics.py`` holds them equal). The VOI is
CREMI's exactly; for ARAND, CREMI's ``rand.py`` counts every voxel paired with itself
(``sum n_ij^2``, not ``sum n_ij^2 - n``) and adds ``sum_i n_i0 / n`` for predicted 0, so its
value on the same arrays differs from this one by terms of order 1 / segment size; this one
is scikit-image's (pairs of distinct voxels, predicted 0 an ordinary id).

Crops are disjoint, so the metrics of several crops are those of their tables side by side
(:func:`pool_neuron_scores`): the VOI terms are voxel-weighted means of the crops' conditional
entropies (exact), and ARAND is F of the summed ``sum n_ij^2``, ``sum a_i^2``, ``sum b_j^2``
and ``n``; each crop's entry (:func:`neuron_scores`) keeps them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class ContingencyTable(NamedTuple):
    """One entry per (truth id, predicted id) pair that occurs, sorted by the pair."""

    truth: np.ndarray  # truth id of the pair
    pred: np.ndarray  # predicted id of the pair
    count: np.ndarray  # n_ij: voxels of the pair (int64)


def _codes(ids: np.ndarray) -> tuple[np.ndarray, int, np.ndarray | None]:
    """Non-negative int64 codes of ``ids``, the number of codes, and the id each code stands
    for (None: the codes are the ids themselves, for small non-negative integer ids; other
    ids, e.g. random uint64 or negative ones, are coded by their rank)."""
    if ids.dtype.kind in "biu" and ids.size and int(ids.min()) >= 0 and int(ids.max()) < 2**31:
        return ids.astype(np.int64), int(ids.max()) + 1, None
    values, inverse = np.unique(ids, return_inverse=True)
    return inverse.ravel().astype(np.int64), int(values.size), values


def contingency_table(truth_ids, pred_ids, valid=None) -> ContingencyTable:
    """The voxel count of every (truth id, predicted id) pair over the voxels that count:
    inside ``valid`` (None: all) and with a truth id other than 0 (predicted 0 counts).

    One pass over the voxels: each pair becomes one integer key, counted by a bincount when
    the dense table is small and by a sort otherwise.
    """
    t, p = np.asarray(truth_ids), np.asarray(pred_ids)
    if t.shape != p.shape:
        raise ValueError(f"prediction shape {p.shape} differs from ground truth {t.shape}")
    keep = t != 0
    if valid is not None:
        keep &= np.asarray(valid, dtype=bool)
    t, p = t[keep], p[keep]
    if t.size == 0:
        empty = np.zeros(0, np.int64)
        return ContingencyTable(empty, empty, empty)
    t_code, n_t, t_values = _codes(t)
    p_code, n_p, p_values = _codes(p)
    key = t_code * n_p + p_code
    if n_t * n_p <= 2**24:
        count = np.bincount(key, minlength=n_t * n_p)
        key = np.flatnonzero(count)
        count = count[key]
    else:
        key, count = np.unique(key, return_counts=True)
    rows, cols = np.divmod(key, n_p)
    truth = rows if t_values is None else t_values[rows]
    pred = cols if p_values is None else p_values[cols]
    return ContingencyTable(truth, pred, count.astype(np.int64))


def segment_sizes(ids: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The size of every segment in a table's column ``ids`` (sorted by id) and, for each
    pair, the index of its segment there: ``a_i`` or ``b_j`` and who has which."""
    _, which = np.unique(ids, return_inverse=True)
    which = which.ravel()
    return np.bincount(which, weights=count).astype(np.int64), which


def conditional_entropy(count: np.ndarray, given_size: np.ndarray) -> float:
    """H(X | Y) in bits from a table's counts ``n_xy`` and, per pair, the size ``n_y`` of the
    segment of Y it lies in: ``sum (n_xy / n) log2(n_y / n_xy)``; 0 for an empty table."""
    n = count.sum()
    if n == 0:
        return 0.0
    return float(np.sum(count * np.log2(given_size / count)) / n)


def voi_split(table: ContingencyTable) -> float:
    """H(prediction | truth): the over-segmentation (false splits) part of the VOI, in bits."""
    sizes, which = segment_sizes(table.truth, table.count)
    return conditional_entropy(table.count, sizes[which])


def voi_merge(table: ContingencyTable) -> float:
    """H(truth | prediction): the under-segmentation (false merges) part of the VOI, in bits."""
    sizes, which = segment_sizes(table.pred, table.count)
    return conditional_entropy(table.count, sizes[which])


def rand_sums(table: ContingencyTable) -> dict[str, int]:
    """What the adapted Rand error is made of, and what adds up over disjoint crops:
    ``pair_sq_sum`` = sum n_ij^2, ``truth_sq_sum`` = sum a_i^2, ``pred_sq_sum`` = sum b_j^2 and
    ``neuron_voxels`` = n (the voxels that count, which also weight the VOI in a pool)."""
    a, _ = segment_sizes(table.truth, table.count)
    b, _ = segment_sizes(table.pred, table.count)
    return {"pair_sq_sum": int(table.count @ table.count), "truth_sq_sum": int(a @ a),
            "pred_sq_sum": int(b @ b), "neuron_voxels": int(table.count.sum())}


def adapted_rand_error(sums: dict) -> float:
    """1 - the adapted Rand F-score of :func:`rand_sums` (one crop's or several crops'):
    ``F = (sum n_ij^2 - n) / ((sum a_i^2 - n + sum b_j^2 - n) / 2)``, over pairs of distinct
    voxels. With no such pair in either segmentation (no voxel, or every segment one voxel in
    both: the same partition) nothing is wrong and the error is 0."""
    n = sums["neuron_voxels"]
    joint = sums["pair_sq_sum"] - n
    either = (sums["truth_sq_sum"] - n + sums["pred_sq_sum"] - n) / 2
    return float(1.0 - joint / either) if either > 0 else 0.0


def neuron_scores(truth_ids, pred_ids, valid=None) -> dict:
    """VOI split and merge and ARAND of one crop (module docstring), and what pooling needs.

    ``truth_ids`` and ``pred_ids`` are id volumes of one shape (0 in the truth: not scored),
    ``valid`` the voxels that count (None: all). Keys: ``voi_split``, ``voi_merge``, ``arand``
    and the :func:`rand_sums`.
    """
    table = contingency_table(truth_ids, pred_ids, valid)
    sums = rand_sums(table)
    return {"voi_split": voi_split(table), "voi_merge": voi_merge(table),
            "arand": adapted_rand_error(sums), **sums}


def pool_neuron_scores(entries: list[dict]) -> dict:
    """The metrics of several disjoint crops' :func:`neuron_scores` entries as if their
    tables lay side by side in one volume: VOI split and merge are the crops' values weighted
    by their voxels (exact: a crop's share of the conditional entropy is its share of the
    voxels times its own), ARAND is :func:`adapted_rand_error` of the summed sums. Adds
    ``voi`` = split + merge."""
    sums = {k: sum(e[k] for e in entries) for k in ("pair_sq_sum", "truth_sq_sum", "pred_sq_sum",
                                                    "neuron_voxels")}
    n = sums["neuron_voxels"]
    split, merge = (sum(e[k] * e["neuron_voxels"] for e in entries) / n if n else 0.0
                    for k in ("voi_split", "voi_merge"))
    return {"voi_split": float(split), "voi_merge": float(merge), "voi": float(split + merge),
            "arand": adapted_rand_error(sums), **sums}
