"""3D training data loader: throughput vs raw zarr reads and vs cellmap-data, and memory.

    python bench/data_loader.py [--quick] [--repeats 3] [--batches 16]
                                [--cellmap-python /tmp/cellmap_env/bin/python]
    python bench/data_loader.py --duration 1200          # memory of a 20-minute run
    python bench/data_loader.py --profile 8              # cProfile of one process, 8 samples

Data: a CellMap-layout store written once to --data (default /tmp/bench_data_loader): one
dataset, EM 256x512x512 voxels of 8 nm (levels s0, s1) and four label crops of 192x256x256
voxels of 8 nm, each annotating every demo class; zarr format 2, 64^3 chunks, Blosc-zstd
(level 5, byte shuffle). The content is the demo generator's synthetic cells (membranes,
nuclei, mitochondria, ER, ...), so chunks compress like real EM and labels do. Every 128^3
sample lies wholly inside one crop, so nothing is padded or resampled.

Readers, each with --workers processes (default 2), measured side by side in one run,
alternating their order over --repeats and reporting the median:
  ours     the training loader, built as training builds it: ConfigManager ->
           load_segmentation_data -> build_segmentation_samples -> build_loader (batches of
           --batch-size, --workers loader workers), model.ndim 3, crop 128^3 at 8 nm. Measured
           once per --augment setting: 'flips' (the config's default augmentation: flips and
           y/x transposes), 'all' (every augmentation option the config has, switched on:
           see AUGMENT_ALL; rotated and zoomed EM interpolated in the workers, as CPU-only runs
           do), 'all@device' (the same with augmentation.resample_on=device, as GPU runs do:
           the workers ship the read box, the GPU interpolates) and/or 'none'. What is left
           to the device is timed on this CPU by --profile.
  raw      the floor: the same crops straight from zarr, ``arr[z0:z1, y0:y1, x0:x1]`` of the
           EM and of every class, in a pool of --workers processes that only read (nothing
           is converted, augmented or sent back). Origins are drawn like the training
           sampler draws them: a crop uniformly, then a voxel-aligned origin uniformly inside it.
  raw[chunks]  the same reads through torchtitan.data.io.zarr_chunks, the chunk reader
           ours uses instead of zarr-python (it decodes the chunk files with the same
           numcodecs codecs); ours / raw[chunks] is what everything but reading costs.
  raw[ts]  the same reads through TensorStore (torchtitan.data.io.stores.TensorStoreArray,
           what the loader uses for remote, sharded and N5 arrays), from the local files,
           with its chunk cache off (--ts-cache-mb, default 0: a real dataset is far larger
           than any cache, so samples seldom share chunks; the store here would fit).
  raw[ts-http]  the same through TensorStore from a local HTTP server (python -m http.server
           serving --data, a separate process whose CPU time is not counted; its wall time
           is). Skipped with --no-http.
  cellmap  cellmap-data (the official loader) on the same crops, classes, crop size, voxel
           size, batch size and workers, with its mirror + transpose augmentation, run by
           bench/cellmap_data_loader.py under --cellmap-python (a separate environment,
           since it pins zarr<3). Skipped when --cellmap-python is not given.

Throughput is sample voxels per second (batches x batch size x 128^3), from the arrival of
batch --skip (workers started and their prefetch queues drained) to the last one, and the
same voxels per CPU-second of the main process plus its workers (/proc/<pid>/stat): on a
machine shared with other jobs the wall-clock rates swing, the CPU cost per voxel does not.

--duration S runs our loader for S seconds, sampling the resident memory (RSS, and PSS,
which counts shared pages once) of the main process plus its workers every --interval
seconds, and reports the mean of the first minute after the first batch against the mean of
the last minute, the per-minute means and the least-squares trend.

--profile N runs N samples of our dataset under cProfile in this process (no workers) and
prints the CPU time per sample next to that of the raw reads, and the hot spots.

--breakdown N times, in this process, N samples per repeat with each augmentation option
alone and with all of them (BREAKDOWN): CPU ms per sample of the worker's part and of what is
left to the device, next to the chunk reads of the same boxes.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import json
import multiprocessing as mp
import os
import pstats
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

import numpy as np

# Process-tree CPU accounting, shared with the cellmap-data side (standard library only there):
# a sibling script, importable as `python bench/<script>.py` puts bench/ first on the import path.
from cellmap_data_loader import _children, tree_cpu_seconds

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# The benchmark store
# ---------------------------------------------------------------------------------------------

STORE_VERSION = 1
DATASET = "jrc_bench-1"
VOXEL_NM = (8.0, 8.0, 8.0)
EM_SHAPE = (256, 512, 512)
CROP_SHAPE = (192, 256, 256)
CROP_CORNERS = [(32, 0, 0), (32, 0, 256), (32, 256, 0), (32, 256, 256)]  # EM voxels
CHUNKS = (64, 64, 64)


def _compressor():
    from numcodecs import Blosc

    return Blosc(cname="zstd", clevel=5, shuffle=Blosc.SHUFFLE)


def _write_multiscale(parent, path: str, levels, translation0, attrs: dict | None = None) -> None:
    from torchtitan.cellmap.ome_ngff import multiscales_attrs

    group_attrs = {"multiscales": multiscales_attrs(path.rsplit("/", 1)[-1], VOXEL_NM,
                                                    translation0, len(levels))}
    group_attrs.update(attrs or {})
    head, _, name = path.rpartition("/")
    if head:
        parent = parent.require_group(head)  # every level a real zarr v2 group
    group = parent.create_group(name, attributes=group_attrs)
    for k, data in enumerate(levels):
        group.create_array(f"s{k}", data=data, chunks=tuple(min(c, n) for c, n in
                                                            zip(CHUNKS, data.shape)),
                           compressors=_compressor(), fill_value=0)


def make_store(root: Path, seed: int = 0) -> None:
    """Write the benchmark store under ``root`` unless a complete one with this seed is there."""
    import zarr

    from torchtitan.cellmap.grids import Grid
    from torchtitan.cellmap.labels import annotation_attrs
    from torchtitan.demo.data import (
        DEMO_CLASSES, EM_PATH, GROUNDTRUTH_PATH, atoms_to_class, downsample_mean, make_scene,
        render_atoms, render_em)

    marker = root / ".bench_complete"
    want = {"version": STORE_VERSION, "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return
    print(f"writing the benchmark store to {root} (once; about a minute) ...", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    grid = Grid(EM_SHAPE, VOXEL_NM, (0.0, 0.0, 0.0))
    scene = make_scene(np.random.default_rng([seed, 0]), grid.box_min, grid.box_max)
    atoms = render_atoms(scene, grid)
    em = render_em(atoms, grid.scale, np.random.default_rng([seed, 1]))
    store = zarr.open_group(str(root / DATASET / f"{DATASET}.zarr"), mode="w", zarr_format=2)
    _write_multiscale(store, EM_PATH, [em, downsample_mean(em)], grid.translation)
    for k, corner in enumerate(CROP_CORNERS, start=1):
        box = tuple(slice(c, c + n) for c, n in zip(corner, CROP_SHAPE))
        translation = tuple(t + c * v for t, c, v in zip(grid.translation, corner, VOXEL_NM))
        for cls in DEMO_CLASSES:
            labels = atoms_to_class(atoms[box], cls)
            _write_multiscale(store, f"{GROUNDTRUTH_PATH}/crop{k}/{cls}", [labels], translation,
                              annotation_attrs(cls, labels))
    marker.write_text(json.dumps(want))


# ---------------------------------------------------------------------------------------------
# Our loader, built as training builds it
# ---------------------------------------------------------------------------------------------

# Values for every augmentation option when --augment all; options the config does not
# (yet) have are skipped, so the benchmark follows what the loader offers.
AUGMENT_ALL = {"flips": True, "rot90": True, "rotate_deg": 15.0, "scale": 0.1, "contrast": 0.1,
               "gamma": 0.1, "noise_std": 0.03, "blur_sigma": 1.0}
# 'all' interpolates rotated and zoomed EM in the workers (what a CPU-only run does by
# default), 'all@device' leaves it to the device (what a GPU run does by default).
AUGMENT_SETTINGS = ("flips", "all", "all@device", "none")


def job_config(args, augment: str):
    if augment not in AUGMENT_SETTINGS:
        raise SystemExit(f"--augment: {augment!r} is not one of {', '.join(AUGMENT_SETTINGS)}")
    if augment.startswith("all"):
        chosen = {**AUGMENT_ALL, "resample_on": "device" if augment == "all@device" else "workers"}
    else:
        chosen = {"flips": augment == "flips"}
    return job_config_with(args, chosen)


def job_config_with(args, chosen: dict):
    """The benchmark's training config with the augmentation options ``chosen`` (every other
    option at its default; options the config does not have are skipped)."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.config.job_config import JobConfig

    argv = ["--data.dataset_path", str(args.data), "--data.classes", ",".join(args.classes),
            "--data.voxel_size", ",".join(str(v) for v in VOXEL_NM),
            "--data.num_workers", str(args.workers), "--data.val_fraction", "0",
            "--model.ndim", "3", "--model.crop_size", ",".join([str(args.crop)] * 3),
            "--training.batch_size", str(args.batch_size), "--training.seed", str(args.seed)]
    fields = {f.name for f in dataclasses.fields(JobConfig().augmentation)}
    for name, value in chosen.items():
        if name in fields:
            if isinstance(value, bool):
                argv.append(f"--augmentation.{name}" if value else f"--no-augmentation.{name}")
            else:
                argv += [f"--augmentation.{name}", str(value)]
    return ConfigManager().parse_args(argv)


def _switched_on(params) -> str:
    on = []
    for f in dataclasses.fields(params):
        v = getattr(params, f.name)
        if v is True:
            on.append(f.name)
        elif v not in (False, 0, 0.0, None):
            on.append(f"{f.name}={v}")
    return ", ".join(on) or "none"


def augment_summary(cfg, samples=None) -> str:
    """The augmentation the config asks for and, where it differs, what the dataset applies."""
    asked = _switched_on(cfg.augmentation)
    applied = getattr(getattr(samples, "augmenter", None), "params", None)
    if applied is not None and dataclasses.is_dataclass(applied):
        applied = _switched_on(applied)
        if applied != asked:
            return f"{asked} (configured; the dataset applies only: {applied})"
    return asked


def build_ours(cfg):
    """The training samples, exactly as the segmentation task makes them."""
    from torchtitan.data.crops.selection import DataSettings, load_segmentation_data
    from torchtitan.data.sampling.samples import build_segmentation_samples

    settings = DataSettings.from_config(cfg)
    sources, train, _ = load_segmentation_data(settings)
    return build_segmentation_samples(settings, sources, train)


def our_loader(cfg, samples, start_step: int = 0):
    from torchtitan.data.sampling.loader import build_loader

    return build_loader(samples, cfg.training.batch_size, dp_rank=0, dp_degree=1,
                        start_step=start_step, num_workers=cfg.data.num_workers)


def time_batches(batches, skip: int, n: int) -> tuple[float, float]:
    """Wall and CPU seconds (this process and its workers) from the arrival of batch ``skip``
    to that of batch ``skip + n``."""
    it = iter(batches)
    for _ in range(skip):
        next(it)
    server = _HTTP["pid"]  # a child too, but serving is not the reader's cost
    start, cpu, cpu_server = time.perf_counter(), tree_cpu_seconds(), _proc_cpu(server)
    for _ in range(n):
        next(it)
    served = _proc_cpu(server) - cpu_server if server else 0.0
    return time.perf_counter() - start, tree_cpu_seconds() - cpu - served


def _rates(args, seconds: float, cpu: float) -> tuple[float, float]:
    """(voxels per second, voxels per CPU-second)."""
    voxels = args.batches * args.batch_size * args.crop**3
    return voxels / seconds, voxels / max(cpu, 1e-9)


def run_ours(cfg, samples, args, repeat: int) -> tuple[float, float]:
    # A fresh loader per repeat (new workers, samples not seen before), like the others.
    loader = our_loader(cfg, samples, start_step=repeat * 10_000)
    it = iter(loader)
    try:
        return _rates(args, *time_batches(it, args.skip, args.batches))
    finally:
        if hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


# ---------------------------------------------------------------------------------------------
# Raw zarr reads of the same crops
# ---------------------------------------------------------------------------------------------

_ARRAYS: dict[tuple[str, str], object] = {}
RAW_KINDS = {"raw": "zarr", "raw[chunks]": "chunks", "raw[ts]": "ts", "raw[ts-http]": "ts-http"}
_HTTP = {"url": "", "root": "", "pid": 0}  # the local HTTP server of raw[ts-http]
# The store context of raw[ts] and raw[ts-http] (chunk cache of --ts-cache-mb), made by main;
# each forked reader opens its own handles under it.
_TS = {"stores": None}


def _array(path: str, kind: str = "zarr"):
    """The handle of one reader: zarr-python (``zarr``), the chunk reader our loader uses
    (``chunks``), TensorStore on the file (``ts``) or over the local HTTP server (``ts-http``)."""
    arr = _ARRAYS.get((path, kind))
    if arr is None:
        if kind == "chunks":
            from torchtitan.data.io.zarr_chunks import open_fast

            arr = open_fast(path)
            assert arr is not None, f"{path}: not readable by zarr_chunks"
        elif kind in ("ts", "ts-http"):
            where = path
            if kind == "ts-http":
                where = _HTTP["url"] + "/" + Path(path).relative_to(_HTTP["root"]).as_posix()
            arr = _TS["stores"].open_tensorstore(where)
        else:
            import zarr

            arr = zarr.open_array(path, mode="r")
        _ARRAYS[(path, kind)] = arr
    return arr


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of one process, 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_http_server(root: Path) -> subprocess.Popen:
    """``python -m http.server`` serving ``root`` on a free local port (for raw[ts-http])."""
    import socket
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1",
                             str(port), "--directory", str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.1)
    _HTTP.update(url=f"http://127.0.0.1:{port}", root=str(root), pid=proc.pid)
    return proc


def _index_box(level, origin_nm, shape) -> tuple[slice, ...]:
    corner = np.asarray(level.translation) - np.asarray(level.scale) / 2
    start = np.round((np.asarray(origin_nm) - corner) / np.asarray(level.scale)).astype(int)
    return tuple(slice(int(s), int(s) + n) for s, n in zip(start, shape))


def raw_draws(samples, crops, classes, n: int, seed: int, crop: int) -> list[list]:
    """Per sample: [(array path, index box), ...] for the EM and every class, at origins
    drawn like the training sampler: a crop uniformly, then a voxel origin inside it."""
    from torchtitan.cellmap.grids import closest_level

    rng = np.random.default_rng(seed)
    shape = (crop,) * 3
    size = np.asarray(shape) * np.asarray(VOXEL_NM)
    by_name = {s.name: s for s in samples.sources}
    draws = []
    for _ in range(n):
        c = crops[int(rng.integers(len(crops)))]
        free = np.floor((c.box_max - c.box_min - size) / np.asarray(VOXEL_NM) + 1e-6)
        origin = c.box_min + np.floor(rng.random(3) * (free + 1)) * np.asarray(VOXEL_NM)
        source = by_name[c.dataset]
        em = source.levels[closest_level(source.levels, VOXEL_NM)]
        reads = [(em.path, _index_box(em, origin, shape))]
        for cls in classes:
            level = c.classes[cls][closest_level(c.classes[cls], VOXEL_NM)]
            reads.append((level.path, _index_box(level, origin, shape)))
        draws.append(reads)
    return draws


def _read_sample(reads, kind: str = "zarr") -> int:
    nbytes = 0
    for path, box in reads:
        data = _array(path, kind)[box]
        assert data.shape == tuple(s.stop - s.start for s in box), (path, box, data.shape)
        nbytes += data.nbytes
    return nbytes


def run_raw(draws, args, kind: str = "zarr") -> tuple[float, float]:
    per_batch = [draws[i:i + args.batch_size] for i in range(0, len(draws), args.batch_size)]
    # TensorStore's threads do not survive fork(): the parent never reads with it, each
    # forked worker starts its own.
    ctx = mp.get_context("fork")
    read = functools.partial(_read_sample, kind=kind)
    if args.workers == 0:
        results = (sum(read(r) for r in b) for b in per_batch)
        timed = time_batches(results, args.skip, args.batches)
    else:
        with ctx.Pool(args.workers) as pool:
            # One task per sample, in order, like loader workers taking batches in turn.
            flat = pool.imap(read, [r for b in per_batch for r in b], chunksize=1)

            def batches():
                while True:
                    yield [next(flat) for _ in range(args.batch_size)]

            timed = time_batches(batches(), args.skip, args.batches)
    return _rates(args, *timed)


# ---------------------------------------------------------------------------------------------
# cellmap-data, in its own environment
# ---------------------------------------------------------------------------------------------


def run_cellmap(samples, crops, args, repeat: int) -> tuple[tuple[float, float] | None, str]:
    """(voxels/s, voxels per CPU-second) of bench/cellmap_data_loader.py, or (None, why it
    failed)."""
    if len({c.dataset for c in crops}) != 1:
        raise SystemExit("run_cellmap expects the crops of one dataset (the benchmark store)")
    sources = {s.name: s for s in samples.sources}
    em_group = str(Path(sources[crops[0].dataset].levels[0].path).parent)
    gts = [str(Path(c.classes[args.classes[0]][0].path).parents[1]) for c in crops]
    cmd = [args.cellmap_python, str(REPO / "bench" / "cellmap_data_loader.py"),
           "--raw", em_group, "--crops", *gts, "--classes", ",".join(args.classes),
           "--crop", str(args.crop), "--voxel-size", *[str(v) for v in VOXEL_NM],
           "--workers", str(args.workers), "--batch-size", str(args.batch_size),
           "--skip", str(args.skip), "--batches", str(args.batches),
           "--seed", str(args.seed + repeat)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            out = json.loads(line)
            return (out["voxels_per_s"], out["voxels_per_cpu_s"]), ""
    return None, (proc.stderr.strip().splitlines() or ["(no output)"])[-1]


# ---------------------------------------------------------------------------------------------
# Memory over a long run
# ---------------------------------------------------------------------------------------------


def _kib(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def memory_now() -> tuple[float, float, int]:
    """(RSS MiB, PSS MiB, number of processes) of this process and its descendants."""
    pids = [os.getpid(), *_children(os.getpid())]
    rss = sum(_kib(f"/proc/{p}/status", "VmRSS:") for p in pids)
    pss = sum(_kib(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids)
    return rss / 1024, pss / 1024, len(pids)


def run_memory(cfg, samples, args) -> None:
    loader = our_loader(cfg, samples)
    log = []  # (seconds, rss, pss, nproc, samples so far)
    done = [0]
    stop = threading.Event()
    start = time.perf_counter()

    def sample_memory():
        while not stop.is_set():
            rss, pss, nproc = memory_now()
            log.append((time.perf_counter() - start, rss, pss, nproc, done[0]))
            stop.wait(args.interval)

    sampler = threading.Thread(target=sample_memory, daemon=True)
    sampler.start()
    for batch in loader:
        done[0] += len(batch)
        del batch
        if time.perf_counter() - start >= args.duration:
            break
    stop.set()
    sampler.join()
    if args.memory_log:
        with open(args.memory_log, "w") as f:
            f.write("seconds,rss_mib,pss_mib,processes,samples\n")
            for row in log:
                f.write(",".join(f"{v:.1f}" if isinstance(v, float) else str(v)
                                 for v in row) + "\n")
    elapsed = time.perf_counter() - start
    print(f"our loader, {args.workers} workers, batch {args.batch_size}, {args.crop}^3, "
          f"augmentation: {augment_summary(cfg, samples)}; {elapsed:.0f} s, {done[0]} samples "
          f"({done[0] * args.crop**3 / elapsed / 1e6:.1f} Mvoxel/s), {len(log)} memory samples "
          f"every {args.interval:g} s, {log[-1][3]} processes")
    print_memory_summary(log)


def print_memory_summary(log: list[tuple]) -> None:
    """First minute vs last minute of a memory log, from the first batch on (before it the
    workers are still starting, and memory only climbs)."""
    t0 = next((r[0] for r in log if r[4] > 0), log[0][0])
    steady = [r for r in log if r[0] >= t0]
    end = steady[-1][0]
    window = min(60.0, (end - t0) / 3)
    first = [r for r in steady if r[0] < t0 + window]
    last = [r for r in steady if r[0] >= end - window]
    minutes = [[r for r in steady if m * 60 <= r[0] - t0 < (m + 1) * 60]
               for m in range(int((end - t0) // 60) + 1)]
    minutes = [m for m in minutes if m]
    print(f"from the first batch ({t0:.0f} s) on; windows of {window:.0f} s")
    print(f"{'MiB':32s} {'RSS':>8s} {'PSS':>8s}")
    for name, rows in (("first window, mean", first), ("last window, mean", last)):
        print(f"{name:32s} {statistics.mean(r[1] for r in rows):8.1f} "
              f"{statistics.mean(r[2] for r in rows):8.1f}")
    for name, fn in (("per-minute means, lowest", min), ("per-minute means, highest", max)):
        print(f"{name:32s} {fn(statistics.mean(r[1] for r in m) for m in minutes):8.1f} "
              f"{fn(statistics.mean(r[2] for r in m) for m in minutes):8.1f}")
    print(f"{'max':32s} {max(r[1] for r in steady):8.1f} {max(r[2] for r in steady):8.1f}")
    xs = [r[0] for r in steady]
    for i, name in ((1, "RSS"), (2, "PSS")):
        ys = [r[i] for r in steady]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
                 / max(sum((x - mx) ** 2 for x in xs), 1e-9))
        ratio = statistics.mean(r[i] for r in last) / statistics.mean(r[i] for r in first)
        print(f"{name}: last / first = {ratio:.3f} (target: at most 1.10); least-squares trend "
              f"{slope * 600:+.1f} MiB per 10 min")


# ---------------------------------------------------------------------------------------------
# Profile of one process
# ---------------------------------------------------------------------------------------------


def run_profile(samples, n: int, draws) -> None:
    samples[0]  # open the arrays first
    _read_sample(draws[0])
    profile = cProfile.Profile()
    start = time.process_time()  # CPU seconds of every thread (zarr decodes in threads)
    profile.enable()
    for g in range(1, n + 1):
        samples[g]
    profile.disable()
    ours = time.process_time() - start
    start = time.process_time()
    for reads in draws[1:n + 1]:
        _read_sample(reads)
    raw = time.process_time() - start
    _read_sample(draws[0], kind="chunks")
    start = time.process_time()
    for reads in draws[1:n + 1]:
        _read_sample(reads, kind="chunks")
    direct = time.process_time() - start
    print(f"one process, {n} samples, CPU time: ours {ours / n * 1e3:.0f} ms/sample (profiled), "
          f"raw zarr reads {raw / n * 1e3:.0f} ms/sample (raw / ours = {raw / ours:.2f}), "
          f"the same reads by zarr_chunks {direct / n * 1e3:.0f} ms/sample")
    stats = pstats.Stats(profile).sort_stats("tottime")
    stats.print_stats(18)
    device_share(samples, n)


def device_share(samples, n: int) -> None:
    print(f"left to the device (Batch.to + Augmenter.device on this CPU, one thread): "
          f"{device_seconds(samples, range(1, n + 1)) / n * 1e3:.0f} ms/sample")


def device_seconds(samples, indices) -> float:
    """CPU seconds of what is still done to these samples on the device (``Batch.to``:
    normalising raw EM; ``Augmenter.device``: rotation and zoom with ``resample_on=device``,
    intensity changes), one sample (a batch of one) at a time on one thread: the price of a
    CPU-only run; a GPU does it in next to no time."""
    import torch

    from torchtitan.data.sampling.augment import Augmenter
    from torchtitan.data.sampling.batch import collate

    batches = [collate([samples[g]]) for g in indices]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Augmenter.device(batches[0].to("cpu"))
        start = time.process_time()
        for batch in batches:
            Augmenter.device(batch.to("cpu"))
        spent = time.process_time() - start
    finally:
        torch.set_num_threads(threads)
    return spent


# One augmentation option at a time (the others off, flips included), then all of them: what
# each costs a loader worker per sample, and what it leaves to the device.
BREAKDOWN = {
    "none": {"flips": False},
    "flips": {"flips": True},
    "rot90": {"flips": False, "rot90": True},
    "rotate_deg": {"flips": False, "rotate_deg": AUGMENT_ALL["rotate_deg"],
                   "resample_on": "workers"},
    "scale": {"flips": False, "scale": AUGMENT_ALL["scale"], "resample_on": "workers"},
    "rotate_deg+scale@device": {"flips": False, "rotate_deg": AUGMENT_ALL["rotate_deg"],
                                "scale": AUGMENT_ALL["scale"], "resample_on": "device"},
    "intensity": {"flips": False, **{k: AUGMENT_ALL[k] for k in
                                     ("contrast", "gamma", "noise_std", "blur_sigma")}},
    "all": {**AUGMENT_ALL, "resample_on": "workers"},
    "all@device": {**AUGMENT_ALL, "resample_on": "device"},
}


def run_breakdown(args, n: int) -> None:
    """CPU milliseconds per sample, in this process (no workers), of every BREAKDOWN setting:
    the worker's part (``samples[g]``: reading, moving, composing targets) and the device's
    part (``device_seconds``), with the chunk reads of the same boxes (raw[chunks]) as the
    floor. Settings alternate their order over --repeats, each repeat on new samples; medians."""
    built = {}
    for name, chosen in BREAKDOWN.items():
        cfg = job_config_with(args, chosen)
        built[name] = (cfg, build_ours(cfg))
    samples = built["none"][1]
    for _, s in built.values():
        s[0]  # open the arrays first
    draws = raw_draws(samples, samples.crops, args.classes, n * args.repeats + 1, args.seed,
                      args.crop)
    _read_sample(draws[0], kind="chunks")
    names = ["raw[chunks]", *BREAKDOWN]
    worker = {k: [] for k in names}
    device = {k: [] for k in BREAKDOWN}
    for repeat in range(args.repeats):
        indices = range(1 + repeat * n, 1 + (repeat + 1) * n)
        for name in names if repeat % 2 == 0 else names[::-1]:
            start = time.process_time()
            if name == "raw[chunks]":
                for reads in draws[indices.start:indices.stop]:
                    _read_sample(reads, kind="chunks")
                worker[name].append((time.process_time() - start) / n * 1e3)
                continue
            s = built[name][1]
            for g in indices:
                s[g]
            worker[name].append((time.process_time() - start) / n * 1e3)
            device[name].append(device_seconds(s, indices) / n * 1e3)
            print(f"  repeat {repeat}: {name:24s} workers {worker[name][-1]:6.1f} ms, "
                  f"device {device[name][-1]:6.1f} ms", flush=True)
    print(f"\n{args.crop}^3 samples at {VOXEL_NM[0]:g} nm, classes {','.join(args.classes)}, "
          f"one process, {n} samples per repeat, median of {args.repeats} (min-max), CPU ms "
          "per sample; 'workers' = samples[g] (what a loader worker does), 'device' = Batch.to "
          "+ Augmenter.device on this CPU, one thread")
    med = {k: statistics.median(v) for k, v in worker.items()}
    print(f"{'setting':24s} {'workers ms':>20s} {'x none':>7s} {'device ms':>20s}  "
          "options switched on")
    for name in names:
        w = worker[name]
        cells = f"{med[name]:6.1f} ({min(w):6.1f}-{max(w):6.1f})"
        d = device.get(name)
        dev = f"{statistics.median(d):6.1f} ({min(d):6.1f}-{max(d):6.1f})" if d else "-"
        on = augment_summary(*built[name]) if name in built else "the chunk reads alone"
        print(f"{name:24s} {cells:>20s} {med[name] / med['none']:7.2f} {dev:>20s}  {on}")


# ---------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path("/tmp/bench_data_loader"),
                   help="benchmark store (written there once)")
    p.add_argument("--classes", default="nuc,mito,er,cell", type=lambda s: s.split(","),
                   help="label classes (default: the training default nuc,mito,er,cell)")
    p.add_argument("--crop", type=int, default=128, help="crop edge in voxels (default 128)")
    p.add_argument("--workers", type=int, default=2, help="worker processes, every reader")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--batches", type=int, default=16, help="timed batches per measurement")
    p.add_argument("--skip", type=int, default=0,
                   help="batches before timing starts (default: 2 x workers + 1)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--augment", default="flips,all,all@device",
                   help="our augmentation settings to measure, comma-separated, of 'flips' (the "
                        "config's default: flips and y/x transposes), 'all' (every option the "
                        "config has, switched on, EM rotated and zoomed in the workers), "
                        "'all@device' (the same, EM rotated and zoomed on the device, as on a "
                        "GPU) and 'none' (default: flips,all,all@device)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cellmap-python", default=None,
                   help="python of an environment with cellmap-data installed")
    p.add_argument("--quick", action="store_true", help="1 repeat of 4 batches")
    p.add_argument("--ts-cache-mb", type=int, default=0,
                   help="raw[ts], raw[ts-http]: TensorStore chunk cache per process, MiB "
                        "(default 0: off)")
    p.add_argument("--no-http", action="store_true", help="skip raw[ts-http]")
    p.add_argument("--duration", type=float, default=0,
                   help="memory mode: run our loader this many seconds")
    p.add_argument("--interval", type=float, default=2.0, help="memory mode: seconds per sample")
    p.add_argument("--memory-log", default=None, help="memory mode: write the samples as CSV")
    p.add_argument("--profile", type=int, default=0,
                   help="cProfile this many samples of our dataset in one process")
    p.add_argument("--breakdown", type=int, default=0,
                   help="CPU time per sample of each augmentation option alone and of all, "
                        "this many samples per repeat, in one process (see BREAKDOWN)")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.batches = 1, 4
    args.skip = args.skip or 2 * args.workers + 1

    make_store(args.data, seed=0)
    if args.breakdown:
        run_breakdown(args, args.breakdown)
        return
    augments = args.augment.split(",")
    built = {}
    for a in augments:
        cfg = job_config(args, a)
        built[a] = (cfg, build_ours(cfg))
    cfg, samples = built[augments[0]]
    crops = samples.crops
    if args.duration:
        run_memory(cfg, samples, args)
        return
    n_draws = (args.skip + args.batches) * args.batch_size
    if args.profile:
        run_profile(samples, args.profile, raw_draws(samples, crops, args.classes,
                                                     args.profile + 1, args.seed, args.crop))
        return

    from torchtitan.data.io.stores import StoreContext, StoreSettings

    _TS["stores"] = StoreContext(StoreSettings(cache_bytes=args.ts_cache_mb << 20))
    server = None if args.no_http else start_http_server(args.data)
    readers = ["raw", "raw[chunks]", "raw[ts]", *[f"ours[{a}]" for a in augments]]
    if server:
        readers.insert(3, "raw[ts-http]")
    readers += ["cellmap"] if args.cellmap_python else []
    rates: dict[str, list[float]] = {r: [] for r in readers}
    failures = {}
    for repeat in range(args.repeats):
        order = readers if repeat % 2 == 0 else readers[::-1]
        for reader in order:
            if reader.startswith("raw"):
                draws = raw_draws(samples, crops, args.classes, n_draws, args.seed + 1000 + repeat,
                                  args.crop)
                rates[reader].append(run_raw(draws, args, kind=RAW_KINDS[reader]))
            elif reader.startswith("ours"):
                cfg_a, samples_a = built[reader[5:-1]]
                rates[reader].append(run_ours(cfg_a, samples_a, args, repeat))
            else:
                rate, why = run_cellmap(samples, crops, args, repeat)
                if rate is None:
                    failures[reader] = why
                else:
                    rates[reader].append(rate)
            if rates[reader]:
                wall, per_cpu = rates[reader][-1]
                print(f"  repeat {repeat}: {reader:12s} {wall / 1e6:8.2f} Mvoxel/s "
                      f"{per_cpu / 1e6:8.2f} Mvoxel/CPU-s", flush=True)

    print(f"\n{args.crop}^3 crops at {VOXEL_NM[0]:g} nm, classes {','.join(args.classes)}, "
          f"{args.workers} workers, batch {args.batch_size}, {args.batches} timed batches after "
          f"{args.skip}, median of {args.repeats} (min-max)")
    for a in augments:
        print(f"  ours[{a}] augmentation: {augment_summary(*built[a])}")
    if args.cellmap_python:
        print("  cellmap augmentation: mirror z/y/x, transpose (random permutation of the axes)")
    print("  Mvoxel/CPU-s: voxels per CPU-second of the main process and its workers (the rate "
          "per fully used core; robust to other load)")
    print("  raw[chunks]: the raw reads through torchtitan.data.io.zarr_chunks, the reader ours "
          "uses (ours / raw[chunks] is the cost of everything but reading)")
    print(f"{'reader':12s} {'Mvoxel/s':>19s} {'Mvoxel/CPU-s':>19s} {'ours/raw':>9s} "
          f"{'ours/raw[chunks]':>17s} {'ours/cellmap':>13s}")
    med = {r: [statistics.median(x[i] for x in rates[r]) for i in (0, 1)]
           for r in readers if rates[r]}
    for reader in readers:
        if reader not in med:
            print(f"{reader:12s} failed: {failures.get(reader, '?')}")
            continue
        cells = []
        for i in (0, 1):
            vals = [x[i] / 1e6 for x in rates[reader]]
            cells.append(f"{med[reader][i] / 1e6:6.2f} ({min(vals):5.2f}-{max(vals):5.2f})")
        ratio = lambda other: "/".join(f"{med[reader][i] / med[other][i]:.2f}" for i in (0, 1))
        vs_raw = ratio("raw") if reader.startswith("ours") else "-"
        vs_chunks = ratio("raw[chunks]") if reader.startswith("ours") and "raw[chunks]" in med else "-"
        vs_cm = ratio("cellmap") if reader.startswith("ours") and "cellmap" in med else "-"
        print(f"{reader:12s} {cells[0]:>19s} {cells[1]:>19s} {vs_raw:>9s} {vs_chunks:>17s} "
              f"{vs_cm:>13s}")
    print("ratios: wall / CPU; targets: ours / raw at least 0.8, ours / cellmap at least 2")
    if "ours[none]" in med:
        for a in augments:
            if a != "none":
                print(f"ours[{a}] / ours[none] (wall / CPU): "
                      + "/".join(f"{med[f'ours[{a}]'][i] / med['ours[none]'][i]:.2f}"
                                 for i in (0, 1)))
    for r in ("raw[ts]", "raw[ts-http]"):
        if r in med and "raw[chunks]" in med:
            print(f"{r} / raw[chunks] (wall / CPU): "
                  f"{med[r][0] / med['raw[chunks]'][0]:.2f} / {med[r][1] / med['raw[chunks]'][1]:.2f}")
    if server:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
