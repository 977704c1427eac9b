"""Neurons cut by their membranes block by block against the whole region, on real EM ids.

    python bench/blockwise_neurons.py --h5 ../shared/data/medulla/labelled.h5 \\
        --block 64 --halo_nm 100,200,400

The membranes are the true ones (every voxel with a face neighbour of another body id, as
``helpers/import_stack.py --boundary pm`` derives them) and ``cell`` is every voxel of a body,
so what is measured is the blockwise flood alone: :func:`torchtitan.postprocess.blockwise.postprocess_region`
with the ``[inference]`` settings of ``--config`` (the 3D recipe's: seeds 50 nm from a
membrane, seeds under 1e5 nm^3 dropped) in blocks of ``--block`` voxels, for each flood halo,
against
:func:`torchtitan.postprocess.masks.postprocess` on the whole region. Each row gives the voxels whose
neuron differs and where they lie (boundaries, interior parts without a seed, parts too large
to be flooded on their box; elsewhere nothing may differ), VOI and ARAND of both against the
true bodies, and the time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import scipy.ndimage as ndi
import zarr

from torchtitan.postprocess.blockwise import postprocess_region
from torchtitan.config.manager import ConfigManager
from torchtitan.data.imports.id_labels import boundary_mask
from torchtitan.scoring.neuron_metrics import neuron_scores
from torchtitan.postprocess.masks import PostProcessing, postprocess

REPO = Path(__file__).resolve().parents[1]


def read_ids(path: str, dataset: str) -> tuple[np.ndarray, tuple[float, ...]]:
    with h5py.File(path, "r") as f:
        data = f[dataset]
        voxel = tuple(float(v) for v in data.attrs.get("resolution", (10.0, 10.0, 10.0)))
        return np.asarray(data[:]), voxel


def blockwise(masks: dict, voxel, post, block: int, halo_nm: float) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        group = zarr.open_group(f"{tmp}/pred.zarr", mode="w", zarr_format=2).require_group("r")
        for cls, mask in masks.items():
            group.require_group(cls).create_array(
                "s0", shape=mask.shape, chunks=(block,) * 3, dtype="uint8",
                fill_value=0)[:] = mask.astype(np.uint8)
        postprocess_region(group, list(masks), voxel, post, True, (block,) * 3, halo_nm=halo_nm)
        return np.asarray(group["cell/s0"][:])


def kinds(masks: dict, voxel, post, block: int) -> np.ndarray:
    """Per voxel: 0 boundary (or outside), 1 interior part without a seed, 2 part with one
    seed, 3 part with several seeds flooded on its box, 4 one too large for a box (over 8
    blocks), as :func:`torchtitan.postprocess.blockwise.boundary_ids` treats them."""
    interior = masks["cell"] & ~masks["pm"]
    parts, n = ndi.label(interior)
    distance = ndi.distance_transform_edt(interior, sampling=voxel)
    seeds, _ = ndi.label(interior & (distance > post.boundary_seed_nm))
    least = int(np.ceil(post.min_object_nm3 / float(np.prod(voxel))))
    seeds[np.bincount(seeds.ravel())[seeds] < least] = 0
    pairs = np.unique(np.stack([parts[seeds > 0], seeds[seeds > 0]]), axis=1)
    count = np.bincount(pairs[0], minlength=n + 1)
    large = np.zeros(n + 1, bool)
    for p, box in enumerate(ndi.find_objects(parts), 1):
        large[p] = np.prod([min(size, s.stop + 2) - max(0, s.start - 2)
                            for s, size in zip(box, parts.shape)]) > 8 * block**3
    kind = np.select([count == 0, count == 1, ~large], [1, 2, 3], 4)[parts]
    return np.where(interior, kind, 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--h5", default=str(REPO.parent / "shared" / "data" / "medulla" /
                                       "labelled.h5"))
    p.add_argument("--config", default=str(REPO / "train_configs" /
                                           "own_em_segmentation_3d.toml"))
    p.add_argument("--dataset", default="volumes/labels/neuron_ids")
    p.add_argument("--block", type=int, default=64, help="block side, voxels")
    p.add_argument("--halo_nm", default="100,200,400")
    args = p.parse_args(argv)
    ids, voxel = read_ids(args.h5, args.dataset)
    masks = {"pm": boundary_mask(ids, np.ones(ids.shape, bool)), "cell": ids > 0}
    cfg = ConfigManager().parse_args(["--job.config_file", args.config])
    post = PostProcessing.from_config(cfg.inference)
    t0 = time.perf_counter()
    whole = postprocess(masks, voxel, post)["cell"]
    whole_s = time.perf_counter() - t0
    kind = kinds(masks, voxel, post, args.block)
    shares = [np.mean(kind == k) for k in range(5)]
    print(f"{args.h5}: {ids.shape} voxels of {voxel} nm, {len(np.unique(ids)) - 1} bodies; "
          f"blocks of {args.block}^3; seeds {post.boundary_seed_nm:g} nm from a membrane, "
          f"seeds under {post.min_object_nm3:g} nm^3 dropped. Voxels: boundary {shares[0]:.1%}, "
          f"parts without a seed {shares[1]:.1%}, with one {shares[2]:.1%}, with several "
          f"{shares[3]:.1%}, with several and too large for a box {shares[4]:.1%}\n")
    print("| flood halo (nm) | voxels differing | on boundaries | in parts without a seed | "
          "in parts too large for a box | elsewhere | neurons | VOI | ARAND | time s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    scores = neuron_scores(ids, whole)
    print(f"| whole region | - | - | - | - | - | {whole.max()} | "
          f"{scores['voi_split'] + scores['voi_merge']:.3f} | {scores['arand']:.3f} | "
          f"{whole_s:.0f} |")
    for halo in (float(h) for h in args.halo_nm.split(",")):
        t0 = time.perf_counter()
        got = blockwise(masks, voxel, post, args.block, halo)
        seconds = time.perf_counter() - t0
        differ = got != whole
        where = [np.mean(differ & (kind == k)) for k in range(5)]
        scores = neuron_scores(ids, got)
        print(f"| {halo:g} | {differ.mean():.2%} | {where[0]:.2%} | {where[1]:.2%} | "
              f"{where[4]:.2%} | {where[2] + where[3]:.2%} | {got.max()} | "
              f"{scores['voi_split'] + scores['voi_merge']:.3f} | {scores['arand']:.3f} | "
              f"{seconds:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
