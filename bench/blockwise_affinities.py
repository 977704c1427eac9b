"""Neurons cut from predicted affinities block by block against the whole region: ids, time and
peak memory.

    python predict.py --checkpoint RUN/checkpoint --dataset medulla --out PRED.zarr
    python bench/blockwise_affinities.py --region PRED.zarr/medulla --class cell \\
        --block 64,128 --cut mutex,mutex_graph,agglomerate [--config RUN/config.toml] \\
        [--flags "--inference.agglomerate_threshold 0.875"] [--truth IDS.h5:DATASET]

Trains nothing. The region's affinity channels (what ``predict.py`` writes for a model with
``[affinities]``: ``<class>_aff_<z>_<y>_<x>/s0``) are cut into objects two ways, each in a
process of its own whose peak resident memory is read back (``ru_maxrss``):

* **whole**: every channel read into memory and cut at once
  (:func:`torchtitan.postprocess.affinities.affinity_instances`), as validation does;
* **blocks of B**: :func:`torchtitan.postprocess.blockwise_affinities.affinity_ids_blockwise`,
  the path of ``predict.py --instances``, reading and writing B^3 blocks from zarr.

``--bytes`` rounds the affinities to 1/255 before cutting (what a store of bytes held);
``--basin-halo H`` gives the graph cuts' blocks H voxels of context for their basins;
``--mutex-halo H`` and ``--mutex-join graph|overlap`` set the pixel cut's context and join.

Each row gives the share of voxels on which the blockwise ids agree with the whole region's
once matched one to one (:func:`torchtitan.scoring.neuron_metrics.matching_agreement`), both
results' VOI and ARAND against ``--truth`` when given, the seconds and the peak memory. The
cut's settings are the run's ``[inference]`` (``--config``, with ``--flags`` over it) or the
defaults.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()


def channels(region: Path, cls: str) -> tuple[list[str], list[tuple[int, ...]]]:
    """The affinity channel names of ``cls`` in the region's plan, and their offsets."""
    import zarr

    from torchtitan.cellmap.affinities import channel_name

    plan = dict(zarr.open_group(str(region), mode="r").attrs).get("prediction_plan") or {}
    offsets = [tuple(o) for o in plan.get("offsets", [])]
    names = [channel_name(cls, o) for o in offsets]
    if not names or not set(names) <= set(plan.get("affinities", [])):
        raise SystemExit(f"{region}: no affinity channels of {cls!r} (predict.py with a model "
                         "that has [affinities], without --instances)")
    return names, offsets


def settings(config: str | None, flags: str = ""):
    import shlex

    from torchtitan.config.manager import ConfigManager
    from torchtitan.postprocess.masks import PostProcessing

    argv = (["--job.config_file", config] if config else []) + shlex.split(flags)
    return PostProcessing.from_config(ConfigManager().parse_args(argv).inference)


def worker(args) -> None:
    """One cut in this process; writes the ids to ``--ids-out`` and prints a JSON line."""
    import dataclasses

    import zarr

    from torchtitan.cellmap.affinities import from_stored as stored
    from torchtitan.postprocess import blockwise_affinities
    from torchtitan.postprocess.affinities import affinity_instances
    from torchtitan.postprocess.blockwise_affinities import affinity_ids_blockwise
    from torchtitan.postprocess.blockwise_labels import Blocks, Ranks, box_slices

    def from_stored(values):
        a = stored(values)
        return np.rint(a * 255) / np.float32(255) if args.bytes else a

    if args.basin_halo is not None:
        blockwise_affinities.BASIN_HALO = args.basin_halo
    if args.mutex_halo is not None:
        blockwise_affinities.MUTEX_HALO = args.mutex_halo
    if args.mutex_join:
        blockwise_affinities.MUTEX_JOIN = args.mutex_join
    region = zarr.open_group(args.region, mode="r")
    names, offsets = channels(Path(args.region), args.cls)
    arrays = [region[f"{n}/s0"] for n in names]
    shape = arrays[0].shape
    voxel = tuple(dict(region[names[0]].attrs)["voxel_size"])
    pp = dataclasses.replace(settings(args.config, args.flags), affinity_cut=args.cut)
    t0 = time.perf_counter()
    if args.worker == "whole":
        aff = np.stack([from_stored(a[:]) for a in arrays])
        ids = affinity_instances(aff, offsets, args.cut, voxel, min_object_nm3=pp.min_object_nm3,
                                 threshold_nearest=pp.mutex_threshold_nearest,
                                 threshold_long=pp.mutex_threshold_long,
                                 agglomerate_threshold=pp.agglomerate_threshold)[0]
        np.save(args.ids_out, ids)
    else:
        block = (int(args.worker),) * 3
        work = zarr.open_group(tempfile.mkdtemp(dir=Path(args.ids_out).parent), mode="w")
        blocks = Blocks(shape, block)

        def read(lo, hi):
            box = box_slices(lo, hi)
            return np.stack([from_stored(a[box]) for a in arrays])

        ids_of = affinity_ids_blockwise(read, offsets, None, blocks, voxel, pp, Ranks(), work,
                                        args.cls)
        out = zarr.open_array(args.ids_out + ".zarr", mode="w", shape=shape, chunks=block,
                              dtype="uint32")
        for k in range(len(blocks)):
            lo, hi = blocks.box(k)
            out[box_slices(lo, hi)] = ids_of(lo, hi)
    seconds = time.perf_counter() - t0
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "peak_mib": peak_mib}))


def run_worker(args, what: str, cut: str, ids_out: Path) -> dict:
    cmd = [sys.executable, str(HERE), "--region", args.region, "--class", args.cls,
           "--worker", what, "--cut", cut, "--ids-out", str(ids_out)]
    if args.config:
        cmd += ["--config", args.config]
    if args.flags:
        cmd += ["--flags", args.flags]
    if args.bytes:
        cmd += ["--bytes"]
    if args.basin_halo is not None:
        cmd += ["--basin-halo", str(args.basin_halo)]
    if args.mutex_halo is not None:
        cmd += ["--mutex-halo", str(args.mutex_halo)]
    if args.mutex_join:
        cmd += ["--mutex-join", args.mutex_join]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def read_ids(path: Path) -> np.ndarray:
    import zarr

    return np.load(path) if path.suffix == ".npy" else zarr.open_array(str(path), mode="r")[:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--region", required=True, help="PRED.zarr/<region> of predict.py")
    p.add_argument("--class", dest="cls", default="cell")
    p.add_argument("--block", default="64", help="block sides, comma-separated")
    p.add_argument("--cut", default="mutex,mutex_graph,agglomerate",
                   help="cuts, comma-separated")
    p.add_argument("--config", help="a run's config.toml: its [inference] cut settings")
    p.add_argument("--flags", default="", help="config flags over --config, e.g. "
                   "\"--inference.agglomerate_threshold 0.875\"")
    p.add_argument("--truth", help="true ids on the region's grid: FILE.h5:DATASET or a zarr "
                   "array (e.g. an imported crop's cell/s0)")
    p.add_argument("--bytes", action="store_true",
                   help="round the affinities to 1/255 first (as stores of bytes held them)")
    p.add_argument("--basin-halo", type=int, help="voxels of context for a block's basins "
                   "(default: blockwise_affinities.BASIN_HALO)")
    p.add_argument("--mutex-halo", type=int, help="voxels of context for a block's pixel mutex "
                   "watershed, at least the offsets' reach (default: "
                   "blockwise_affinities.MUTEX_HALO)")
    p.add_argument("--mutex-join", choices=["graph", "overlap"], help="how the pixel cut's "
                   "blocks are joined (default: blockwise_affinities.MUTEX_JOIN)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--ids-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    truth = None
    if args.truth and ":" in args.truth:
        import h5py

        path, dataset = args.truth.rsplit(":", 1)
        with h5py.File(path, "r") as f:
            truth = np.asarray(f[dataset][:])
    elif args.truth:
        import zarr

        truth = zarr.open_array(args.truth, mode="r")[:]
    from torchtitan.scoring.neuron_metrics import matching_agreement, neuron_scores

    print("| cut | run | seconds | peak MiB | agreement with whole | VOI split / merge | ARAND |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for cut in args.cut.split(","):
            whole_path = Path(tmp) / f"{cut}_whole.npy"
            rows = [("whole", run_worker(args, "whole", cut, whole_path), whole_path)]
            for b in args.block.split(","):
                path = Path(tmp) / f"{cut}_{b}"
                rows.append((f"blocks of {b}^3", run_worker(args, b, cut, path),
                             Path(str(path) + ".zarr")))
            whole = read_ids(whole_path)
            for name, stats, path in rows:
                ids = read_ids(path)
                quality = "-", "-"
                if truth is not None:
                    s = neuron_scores(truth, ids)
                    quality = f"{s['voi_split']:.3f} / {s['voi_merge']:.3f}", f"{s['arand']:.3f}"
                print(f"| {cut} | {name} | {stats['seconds']:.1f} | {stats['peak_mib']:.0f} | "
                      f"{matching_agreement(ids, whole):.4f} | {quality[0]} | {quality[1]} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
