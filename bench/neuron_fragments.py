"""The graph cut's fragments against the size of its region graph: what larger fragments cost.

    python bench/neuron_fragments.py --run vit_aff_s0=outputs/neurons/vit_aff_s0 \\
        --run vit_aff_s1=outputs/neurons/vit_aff_s1

The blockwise graph cuts (``mutex_graph``, ``agglomerate``) agglomerate one region graph in one
process, so their memory grows with the region's fragments and edges. This benchmark asks
whether larger fragments could shrink that graph without losing the neurons. Each run's last
checkpoint predicts its validation crops once (``bench/neuron_cuts.py``'s prediction); then the
affinities are cut into fragments by each rule below, the same graph mutex watershed
(``mutex_graph``, the run's config with ``--flags`` over it) agglomerates them, and the neurons
are scored by validation's own code, as in ``bench/neuron_cuts.py``:

* ``basins``: waterz's watershed basins of the face-neighbour affinities, nothing merged (what
  ``mutex_graph`` uses);
* ``basins>H``: the same, with every pair of voxels whose affinity is above ``H`` joined first
  (waterz's ``aff_threshold_high``);
* ``seeded>F``: a seeded watershed (scikit-image) of ``1 - mean face affinity``, seeded at the
  local maxima (3 voxels across) of the distance to the voxels whose mean face affinity is at
  most ``F`` (the rule of lsd's fragments);
* ``basins<N``: the basins, each under ``N`` voxels joined to the neighbour it shares the
  highest mean face affinity with (decided once per basin, so no two basins of ``N`` voxels or
  more are joined): the small basins that make most of the graph, gone.

Each row: fragments, region-graph edges and the graph's tables in MiB (``int64`` u, v, sum,
count per edge), the seconds of the fragments and the cut, VOI split / merge, ARAND and the
instance score of ``cell``.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import scipy.ndimage as ndi

from neuron_cuts import predict_run, run_config, run_task
from torchtitan.cellmap.affinities import is_nearest
from torchtitan.postprocess.affinities import (_check, _quiet_stdout, affinity_instances,
                                               region_graph, waterz_affinities)
from torchtitan.postprocess.masks import PostProcessing, clean_mask, postprocess
from torchtitan.scoring.metrics import combine_scores, score_crop, validation_scores

RULES = ("basins", "basins>0.99", "basins>0.95", "seeded>0.5", "seeded>0.9", "basins<64",
         "basins<512")


def absorb_small_basins(frag: np.ndarray, affinities: np.ndarray, offsets, min_voxels: int
                        ) -> np.ndarray:
    """``frag`` with every fragment under ``min_voxels`` joined to the neighbour it shares
    the highest mean face affinity with (each decided once, on the fragments as given, so a
    chain of small fragments ends at one large fragment or a pair of small ones: no two large
    fragments are joined)."""
    import scipy.sparse
    import scipy.sparse.csgraph

    graph, named = region_graph(affinities, offsets, frag)
    u, v, s, c = graph.near
    mean = s / np.maximum(c, 1)
    ui, vi = np.searchsorted(graph.names, u), np.searchsorted(graph.names, v)
    n = len(graph.names)
    # each node's best neighbour: edges in both directions, sorted by (node, -mean, partner)
    node = np.concatenate([ui, vi])
    other = np.concatenate([vi, ui])
    score = np.concatenate([mean, mean])
    order = np.lexsort((other, -score, node))
    node, other = node[order], other[order]
    first = np.flatnonzero(np.concatenate([[True], node[1:] != node[:-1]]))
    best = np.full(n, -1)
    best[node[first]] = other[first]
    small = (graph.sizes < min_voxels) & (best >= 0)
    rows = np.flatnonzero(small)
    link = scipy.sparse.coo_matrix((np.ones(len(rows)), (rows, best[rows])), shape=(n, n))
    _, label = scipy.sparse.csgraph.connected_components(link, directed=False)
    lookup = np.zeros(int(named.max()) + 1, np.uint64)
    lookup[graph.names] = label + 1
    return lookup[named]


def fragments(rule: str, affinities: np.ndarray, offsets) -> np.ndarray:
    """Fragment ids (0 = none) of ``affinities`` (C, *spatial) by ``rule`` (module docstring)."""
    affinities = _check(affinities, offsets)
    kind, _, value = rule.partition(">")
    if kind == "basins":
        import waterz

        with _quiet_stdout():
            ids = next(iter(waterz.agglomerate(
                waterz_affinities(affinities, offsets), thresholds=[0.0],
                aff_threshold_high=float(value) if value else 0.9999)))
        return ids[0] if affinities.ndim == 3 else ids
    if rule.startswith("basins<"):
        return absorb_small_basins(fragments("basins", affinities, offsets), affinities,
                                   offsets, int(rule.partition("<")[2]))
    if kind == "seeded":
        import skimage.segmentation

        near = [i for i, o in enumerate(offsets) if is_nearest(o)]
        mean = affinities[near].astype(np.float32).mean(0)
        inside = mean > float(value)
        distance = ndi.distance_transform_edt(inside)
        peaks = (ndi.maximum_filter(distance, size=3) == distance) & inside
        seeds, _ = ndi.label(peaks)
        return skimage.segmentation.watershed(1 - mean, seeds).astype(np.uint64)
    raise ValueError(f"fragment rule {rule!r}: must be one of {', '.join(RULES)}")


def score_rule(rule: str, predicted: list, cfg, post: PostProcessing) -> dict:
    """Scores of ``mutex_graph`` on ``rule``'s fragments over every crop, with the graph's
    size and the seconds of fragments + graph + agglomeration."""
    per_crop, size, seconds = [], {"fragments": 0, "edges": 0, "graph_mib": 0.0}, 0.0
    for vol, prob, affinities in predicted:
        pred = prob > cfg.inference.threshold
        channel = {n: k for k, n in enumerate(vol.classes) if n in vol.annotated}
        target, valid = vol.target.numpy(), vol.valid.numpy()
        truth = {n: vol.instance_ids.get(n, target[k]) for n, k in channel.items()}
        masks = {n: pred[k] for n, k in channel.items()}
        processed = postprocess(masks, vol.voxel_size, post)  # cell: replaced below
        probabilities, offsets = affinities["cell"]
        offsets = [tuple(int(v) for v in o) for o in offsets]
        start = time.perf_counter()
        frag = fragments(rule, probabilities, offsets)
        processed["cell"], _ = affinity_instances(
            probabilities, offsets, "mutex_graph", vol.voxel_size,
            inside=clean_mask(masks["cell"], "cell", vol.voxel_size, post),
            min_object_nm3=post.min_object_nm3, threshold_nearest=post.mutex_threshold_nearest,
            threshold_long=post.mutex_threshold_long, fragments=frag)
        seconds += time.perf_counter() - start
        graph, _ = region_graph(probabilities, offsets, frag)  # its size, outside the timing
        size["fragments"] += len(graph.names)
        size["edges"] += len(graph.near[0]) + len(graph.far[0])
        size["graph_mib"] += sum(a.nbytes for t in (graph.near, graph.far) for a in t) / 2**20
        per_crop.append(score_crop(processed, truth, {n: valid[k] for n, k in channel.items()},
                                   vol.voxel_size))
    scores = validation_scores(combine_scores(per_crop), list(cfg.data.classes))
    return {**{k.removeprefix("val/"): v for k, v in scores.items()}, **size,
            "time_s": seconds}


COLUMNS = (("fragments", "fragments", "{:.0f}"), ("graph edges", "edges", "{:.0f}"),
           ("graph MiB", "graph_mib", "{:.0f}"), ("seconds", "time_s", "{:.0f}"),
           ("VOI split", "voi_split/cell", "{:.3f}"), ("VOI merge", "voi_merge/cell", "{:.3f}"),
           ("VOI", "voi/cell", "{:.3f}"), ("ARAND", "arand/cell", "{:.3f}"),
           ("cell instance score", "instance_score/cell", "{:.3f}"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="NAME=DUMP_FOLDER")
    p.add_argument("--rules", default=",".join(RULES), help="comma-separated fragment rules")
    p.add_argument("--flags", default="--inference.mutex_threshold_nearest 0.4 "
                   "--inference.mutex_threshold_long 0.7 --inference.min_object_nm3 1e5",
                   help="flags over every run's config (the cut's thresholds)")
    args = p.parse_args(argv)
    rules = args.rules.split(",")
    results: dict[str, dict[str, dict]] = {}
    for spec in args.run:
        name, dump = spec.split("=", 1)
        flags = shlex.split(args.flags)
        cfg, predicted = predict_run(Path(dump), flags, run_task(name))
        post = PostProcessing.from_config(run_config(Path(dump), flags).inference)
        results[name] = {}
        for rule in rules:
            results[name][rule] = r = score_rule(rule, predicted, cfg, post)
            print(f"{name} {rule}: {r['fragments']} fragments, {r['edges']} edges, VOI "
                  f"{r['voi/cell']:.3f}, ARAND {r['arand/cell']:.3f}", file=sys.stderr,
                  flush=True)
    runs = list(results)
    print("| fragments | " + " | ".join(c for c, _, _ in COLUMNS) + " |")
    print("|---" * (1 + len(COLUMNS)) + "|")
    for rule in rules:
        cells = []
        for _, key, fmt in COLUMNS:
            values = [results[r][rule][key] for r in runs]
            text = " / ".join(fmt.format(v) for v in values)
            if len(values) > 1:
                text += " (" + fmt.format(statistics.fmean(values)) + ")"
            cells.append(text)
        print(f"| {rule} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
