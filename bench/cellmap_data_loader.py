"""Throughput of cellmap-data's training loader; run by bench/data_loader.py in its own env.

    /tmp/cellmap_env/bin/python bench/cellmap_data_loader.py \
        --raw <ds>.zarr/recon-1/em/fibsem-uint8 \
        --crops <ds>.zarr/recon-1/labels/groundtruth/crop1 ... --classes nuc,mito,er,cell

cellmap-data pins zarr<3 and so cannot share the project's environment. Set one up with the
project's CPU torch (so that pip does not fetch a CUDA build):

    python3 -m venv /tmp/cellmap_env
    /tmp/cellmap_env/bin/pip install torch==2.13.0            # the local CPU wheel
    echo torch==2.13.0 > /tmp/cellmap_constraints.txt
    /tmp/cellmap_env/bin/pip install -c /tmp/cellmap_constraints.txt cellmap-data

pip then takes PyPI's torchvision 0.28.0, a CUDA build whose compiled ops do not load beside
the CPU torch, and ``import torchvision`` fails with "operator torchvision::nms does not
exist" while registering fake kernels for those ops. cellmap-data uses only the pure-Python
``torchvision.transforms.v2``, so this script skips the two registration modules (see
_import_cellmap_data) and changes nothing else.

One CellMapDataset per crop, as cellmap-data's CellMapDataSplit builds them from a
``dataset_dict`` (raw = the EM multiscale group, gt = ``crop<N>/[class,...]``), with its default
value transforms, mirror of every axis and transposes as augmentation, combined by
``train_datasets_combined`` and loaded by CellMapDataLoader (its random sampler, batches of
--batch-size, --workers workers). Prints one JSON line: voxels per second and per CPU-second
(this process and its workers) from the arrival of batch --skip to that of batch --skip +
--batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out + [g for c in out for g in _children(c)]


def tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (default: this one) and its live descendants,
    all threads. Standard library only: bench/data_loader.py imports it from here."""
    pid = os.getpid() if pid is None else pid
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return total


def _import_cellmap_data():
    # PyPI's torchvision is a CUDA build: its C++ ops fail to load beside the CPU torch, and
    # these two modules, which only register meta/autograd kernels for those ops, then raise.
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))
    import cellmap_data

    return cellmap_data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--raw", required=True, help="EM multiscale group (recon-1/em/fibsem-uint8)")
    p.add_argument("--crops", nargs="+", required=True, help="label crop groups (crop<N>)")
    p.add_argument("--classes", required=True)
    p.add_argument("--crop", type=int, default=128)
    p.add_argument("--voxel-size", type=float, nargs=3, default=[8.0, 8.0, 8.0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--rotate-deg", type=float, default=0.0, help="also rotate about z (degrees)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch

    cellmap_data = _import_cellmap_data()
    torch.manual_seed(args.seed)
    classes = args.classes.split(",")
    shape = (args.crop,) * 3
    arrays = {"shape": shape, "scale": tuple(args.voxel_size)}
    spatial = {"mirror": {"axes": {"z": 0.5, "y": 0.5, "x": 0.5}}, "transpose": True}
    if args.rotate_deg:
        spatial["rotate"] = {"axes": {"z": args.rotate_deg}}
    split = cellmap_data.CellMapDataSplit(
        input_arrays={"raw": arrays},
        target_arrays={"labels": arrays},
        classes=classes,
        pad=True,
        dataset_dict={"train": [{"raw": args.raw, "gt": f"{c}/[{','.join(classes)}]"}
                                for c in args.crops]},
        spatial_transforms=spatial,
    )
    if len(split.train_datasets) != len(args.crops):
        raise SystemExit(f"cellmap-data built {len(split.train_datasets)} of {len(args.crops)} "
                         "datasets (see its warnings above)")
    dataset = split.train_datasets_combined
    loader = cellmap_data.CellMapDataLoader(
        dataset, classes=classes, batch_size=args.batch_size, num_workers=args.workers,
        is_train=True, device="cpu", persistent_workers=args.workers > 0,
        prefetch_factor=2 if args.workers > 0 else None)
    it = iter(loader)
    first = next(it)
    want = (args.batch_size, len(classes), *shape)
    raw_shape = (args.batch_size, 1, *shape)
    if tuple(first["labels"].shape) != want or tuple(first["raw"].shape) != raw_shape:
        raise SystemExit(f"unexpected batch shapes: raw {tuple(first['raw'].shape)}, labels "
                         f"{tuple(first['labels'].shape)} (expected labels {want})")
    for _ in range(args.skip - 1):
        next(it)
    start, cpu = time.perf_counter(), tree_cpu_seconds()
    for _ in range(args.batches):
        next(it)
    seconds, cpu = time.perf_counter() - start, tree_cpu_seconds() - cpu
    voxels = args.batches * args.batch_size * args.crop**3
    print(json.dumps({"voxels_per_s": voxels / seconds, "voxels_per_cpu_s": voxels / cpu,
                      "seconds": seconds, "cpu_seconds": cpu,
                      "samples_in_dataset": len(dataset),
                      "cellmap_data": getattr(cellmap_data, "__version__", "?")}))


if __name__ == "__main__":
    main()
