"""Neurons cut by their membranes block by block against the whole region, on real EM ids.

    python bench/blockwise_neurons.py --h5 ../shared/data/medulla/labelled.h5 \\
        --block 64 --halo_nm 100,200,400,800

The membranes are the true ones (every voxel with a face neighbour of another body id, as
``helpers/import_stack.py --boundary pm`` derives them) and ``cell`` is every voxel of a body,
so what is measured is the blockwise flood alone: :func:`torchtitan.blockwise.postprocess_region`
with the ``[inference]`` settings of ``--config`` (the 3D recipe's: seeds 50 nm from a
membrane, seeds under 1e5 nm^3 dropped) in blocks of ``--block`` voxels, for each flood halo,
against
:func:`torchtitan.postprocess.postprocess` on the whole region. Each row gives the voxels whose
neuron differs, how many of them lie on a membrane, VOI and ARAND of both against the true
bodies, and the time. The seeds are exact at any halo (the same ids); the flood from them
equals the whole region's where each voxel's path stays inside its block's halo.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import zarr

from torchtitan.blockwise import postprocess_region
from torchtitan.config_manager import ConfigManager
from torchtitan.datasets.id_labels import boundary_mask
from torchtitan.neuron_metrics import neuron_scores
from torchtitan.postprocess import PostProcessing, postprocess

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--h5", default=str(REPO.parent / "shared" / "data" / "medulla" /
                                       "labelled.h5"))
    p.add_argument("--config", default=str(REPO / "train_configs" /
                                           "own_em_segmentation_3d.toml"))
    p.add_argument("--dataset", default="volumes/labels/neuron_ids")
    p.add_argument("--block", type=int, default=64, help="block side, voxels")
    p.add_argument("--halo_nm", default="100,200,400,800")
    args = p.parse_args(argv)
    ids, voxel = read_ids(args.h5, args.dataset)
    known = np.ones(ids.shape, bool)
    masks = {"pm": boundary_mask(ids, known), "cell": ids > 0}
    cfg = ConfigManager().parse_args(["--job.config_file", args.config])
    post = PostProcessing.from_config(cfg.inference)
    t0 = time.perf_counter()
    whole = postprocess(masks, voxel, post)["cell"]
    whole_s = time.perf_counter() - t0
    truth = neuron_scores(ids, whole)
    truth["voi"] = truth["voi_split"] + truth["voi_merge"]
    print(f"{args.h5}: {ids.shape} voxels of {voxel} nm, {len(np.unique(ids)) - 1} bodies; "
          f"blocks of {args.block}^3; {post}\n")
    print("| flood halo (nm) | voxels differing | of them on a membrane | neurons | VOI | ARAND "
          "| time s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| whole region | - | - | {whole.max()} | {truth['voi']:.3f} | {truth['arand']:.3f} "
          f"| {whole_s:.0f} |")
    for halo in (float(h) for h in args.halo_nm.split(",")):
        t0 = time.perf_counter()
        got = blockwise(masks, voxel, post, args.block, halo)
        seconds = time.perf_counter() - t0
        differ = got != whole
        scores = neuron_scores(ids, got)
        scores["voi"] = scores["voi_split"] + scores["voi_merge"]
        on_membrane = (differ & masks["pm"]).sum() / max(1, differ.sum())
        print(f"| {halo:g} | {differ.mean():.3%} | {on_membrane:.0%} | {got.max()} | "
              f"{scores['voi']:.3f} | {scores['arand']:.3f} | {seconds:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
