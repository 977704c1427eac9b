"""Prediction with instances on a volume larger than memory: peak memory per rank and
throughput against the block size (``predict.py --max_block_mb``), under a memory cap.

    sudo true  # the cap is a memory cgroup: run as root, or pass --cap_mb 0 for no cap
    python bench/predict_memory.py --out /tmp/predict_memory --shape 256,1024,1024 \\
        --cap_mb 1024 --block_mb 16,64,256 --nproc 1,2

What it does:

1. **Data**: the demo data (``helpers/make_demo_data.py``, scale 0.5) and, beside it, a dataset
   ``jrc_big`` whose EM (8 nm, ``--shape`` voxels) is the demo's ``jrc_synth-1`` EM mirrored
   and tiled: cells, nuclei and mitochondria everywhere, objects crossing every block face.
2. **Model**: a small 3D ViT (``vit_debug``, crop 32 x 64 x 64, patch 16, at 8 nm) trained for
   ``--steps`` steps on the demo data, so that its masks have objects to label.
3. **Runs**: for each number of ranks and block size, ``predict.py --dataset jrc_big
   --instances`` into a new store, the whole job inside a memory cgroup limited to
   ``--cap_mb`` per rank (plus :data:`AGENT_MB` for torchrun's agent with more than one rank).
   Each row gives the block, the wall time, the voxels per second, the peak resident memory of
   every rank (``predict.py`` logs it) and whether the job finished. A last run takes the whole
   region as one block (what holding the region in memory costs): the cap stops it.

The region's float32 probabilities of its 4 classes take 16 bytes a voxel, its instance ids 4
bytes a voxel per instance class: at 256 x 1024 x 1024 voxels, 4 GiB and 1 GiB, against a cap
of 1 GiB per rank. The cap is a cgroup v1 (``memory.limit_in_bytes``) or v2 (``memory.max``)
group made under ``/sys/fs/cgroup``; without the right to make one the runs are uncapped and
the table says so. The page cache is emptied before each run where allowed, so that the group
is charged for the libraries its processes map; the peak resident memory a rank reports counts
them too (about 350 MiB of it is the imported torch and its libraries).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
AGENT_MB = 512  # torchrun's agent process (it imports torch), with more than one rank
CLASSES = ("nuc", "mito", "er", "cell")
TRAIN_FLAGS = ["--job.config_file", "train_configs/debug_segmentation_3d.toml",
               "--model.backbone", "vit_debug", "--model.crop_size", "32,64,64",
               "--model.patch_size", "16", "--data.voxel_size", "8,8,8",
               "--checkpoint.interval", "1000", "--no-metrics.progress_bar"]


# ---------------------------------------------------------------------------------------------
# Data and model
# ---------------------------------------------------------------------------------------------


def mirror_index(n: int, size: int) -> np.ndarray:
    """Indices 0..n-1 of a source of ``size`` read forwards, backwards, forwards, ..."""
    k = np.arange(n) % (2 * size)
    return np.where(k < size, k, 2 * size - 1 - k)


def make_big_dataset(data: Path, shape: tuple[int, int, int]) -> None:
    """``data/jrc_big``: the EM of ``jrc_synth-1`` mirrored and tiled to ``shape`` (8 nm)."""
    import zarr

    from torchtitan.cellmap.ome_ngff import create_multiscale_group
    from torchtitan.data.crops.layout import EM_GROUP

    path = data / "jrc_big" / "jrc_big.zarr"
    if (path / EM_GROUP / "s0" / ".zarray").is_file():
        return
    source = zarr.open_group(str(data / "jrc_synth-1" / "jrc_synth-1.zarr"), mode="r")
    em = np.asarray(source[f"{EM_GROUP}/s0"][:])
    store = zarr.open_group(str(path), mode="w", zarr_format=2)
    group = create_multiscale_group(store, EM_GROUP, (8.0, 8.0, 8.0), (4.0, 4.0, 4.0), 1)
    s0 = group.create_array("s0", shape=shape, chunks=(64, 64, 64), dtype="uint8", fill_value=0)
    iy, ix = mirror_index(shape[1], em.shape[1]), mirror_index(shape[2], em.shape[2])
    iz = mirror_index(shape[0], em.shape[0])
    for z in range(0, shape[0], 64):
        slab = em[iz[z:z + 64]][:, iy][:, :, ix]
        s0[z:z + slab.shape[0]] = slab


def train_model(out: Path, data: Path, steps: int) -> Path:
    run = out / "model"
    if not (run / "checkpoint").is_dir():
        subprocess.run([sys.executable, str(REPO / "train_segmentation.py"), *TRAIN_FLAGS,
                        "--data.dataset_path", str(data), "--job.dump_folder", str(run),
                        "--training.steps", str(steps), "--metrics.eval_freq", "0"],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return run / "checkpoint"


# ---------------------------------------------------------------------------------------------
# The memory cap
# ---------------------------------------------------------------------------------------------


def make_cgroup(name: str, limit_bytes: int) -> Path | None:
    """A memory cgroup limited to ``limit_bytes`` (its ``cgroup.procs``), or None."""
    for root, limit_file in ((Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
                             (Path("/sys/fs/cgroup"), "memory.max")):
        if not (root / limit_file).exists() and not (root / "cgroup.controllers").exists():
            continue
        group = root / name
        try:
            group.mkdir(exist_ok=True)
            (group / limit_file).write_text(str(limit_bytes))
            return group / "cgroup.procs"
        except OSError:
            continue
    return None


def remove_cgroup(procs: Path | None) -> None:
    if procs is not None:
        try:
            procs.parent.rmdir()
        except OSError:
            pass


def drop_page_cache() -> None:
    """Empty the page cache where allowed, so that a capped run is charged for the libraries
    it maps (a memory cgroup charges a page to the group that first read it)."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError:
        pass


def run_capped(cmd: list[str], procs: Path | None, log: Path) -> tuple[int, float]:
    """Run ``cmd`` (inside the cgroup of ``procs``); returns (exit code, wall seconds)."""
    drop_page_cache()

    def enter():
        if procs is not None:
            procs.write_text(str(os.getpid()))

    t0 = time.perf_counter()
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, preexec_fn=enter,
                           env={**os.environ, "OMP_NUM_THREADS": os.environ.get(
                               "OMP_NUM_THREADS", "1")})
    return r.returncode, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# The runs
# ---------------------------------------------------------------------------------------------


def predict(out: Path, data: Path, checkpoint: Path, nproc: int, block_mb: float,
            cap_mb: float) -> dict:
    name = f"n{nproc}_b{block_mb:g}"
    store, log = out / f"{name}.zarr", out / f"{name}.log"
    shutil.rmtree(store, ignore_errors=True)
    launcher = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(nproc)]
    cmd = [*launcher, str(REPO / "predict.py"), "--checkpoint", str(checkpoint), "--data",
           str(data), "--dataset", "jrc_big", "--out", str(store), "--instances",
           "--max_block_mb", str(block_mb), "--no-progress"]
    limit = int((cap_mb * nproc + (AGENT_MB if nproc > 1 else 0)) * 2**20) if cap_mb else 0
    procs = make_cgroup(f"predict_memory_{os.getpid()}_{name}", limit) if limit else None
    try:
        code, wall = run_capped(cmd, procs, log)
    finally:
        remove_cgroup(procs)
    text = log.read_text()
    peaks = re.search(r"peak memory per rank \(MiB\): ([\d, ]+)", text)
    block = re.search(r"in blocks \[([\d, ]+)\]", text)
    counts = dict(re.findall(r"jrc_big/(\w+): (\d+) instances", text))
    shutil.rmtree(store, ignore_errors=True)
    return {"nproc": nproc, "block_mb": block_mb, "code": code, "wall": wall,
            "peaks": peaks.group(1) if peaks else "-", "capped": procs is not None,
            "block": block.group(1).replace(" ", "") if block else "?", "instances": counts,
            "limit_mb": limit / 2**20}


def table(rows: list[dict], voxels: int) -> str:
    lines = ["| ranks | --max_block_mb | block (voxels) | job cap (MiB) | wall s | Mvoxel/s | "
             "peak MiB per rank | result |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r["code"] == 0
        result = "finished" if ok else f"stopped (exit {r['code']})"
        speed = f"{voxels / r['wall'] / 1e6:.2f}" if ok else "-"
        cap = f"{r['limit_mb']:.0f}" if r["capped"] else "none"
        lines.append(f"| {r['nproc']} | {r['block_mb']:g} | {r['block']} | {cap} | "
                     f"{r['wall']:.0f} | {speed} | {r['peaks']} | {result} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/predict_memory"))
    p.add_argument("--shape", default="256,1024,1024", help="the region, voxels z,y,x")
    p.add_argument("--cap_mb", type=float, default=1024, help="memory per rank; 0: no cap")
    p.add_argument("--block_mb", default="16,64,256", help="--max_block_mb values")
    p.add_argument("--nproc", default="1,2", help="numbers of ranks")
    p.add_argument("--steps", type=int, default=60, help="training steps of the model")
    p.add_argument("--whole", action=argparse.BooleanOptionalAction, default=True,
                   help="also try the whole region as one block (under the cap)")
    args = p.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split(","))
    voxels = int(np.prod(shape))
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "data"
    if not (data / "jrc_synth-1").is_dir():
        from torchtitan.demo.data import generate_demo_data

        generate_demo_data(data, seed=0, scale=0.5)
    make_big_dataset(data, shape)
    checkpoint = train_model(args.out, data, args.steps)
    print(f"region {shape} = {voxels / 2**20:.0f} Mi voxels: probabilities of {len(CLASSES)} "
          f"classes {voxels * 4 * len(CLASSES) / 2**30:.1f} GiB, ids of one class "
          f"{voxels * 4 / 2**30:.1f} GiB; cap {args.cap_mb:g} MiB per rank", flush=True)
    rows = []
    runs = [(n, float(b)) for n in map(int, args.nproc.split(","))
            for b in args.block_mb.split(",")]
    if args.whole:
        runs.append((1, float(voxels * 4 * (len(CLASSES) + 1) / 2**20) + 1))
    for nproc, block_mb in runs:
        rows.append(predict(args.out, data, checkpoint, nproc, block_mb, args.cap_mb))
        r = rows[-1]
        print(f"ranks {nproc}, block {r['block']} ({block_mb:g} MB): exit {r['code']}, "
              f"{r['wall']:.0f} s, peak MiB per rank {r['peaks']}, instances {r['instances']}",
              flush=True)
    print()
    print(table(rows, voxels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
