"""Run every shipped config in ``train_configs/`` for a few steps, as shipped, at a reduced size.

A shipped config is a promise: this runs each one with torchrun, changing only what cannot run
on the machine at hand, and prints one PASS/FAIL line per config.

    python bench/shipped_configs.py --data data/demo                 # 2 CPU processes (gloo)
    python bench/shipped_configs.py --data data/demo --dry-run       # print the commands only
    bash bench/gpu_smoke.sh                     # cluster configs on every GPU of a node (NCCL)

What is changed (``reduced_overrides``): the dataset path (the demo data; for a config whose
targets need object ids, ``[affinities]``, a small volume of touching cells with ids imported as
connectomics ground truth is, :func:`neuron_data`), the dump folder, the
step count, the backbone (on CPU: the debug size with the same feed-forward type; on GPU the
shipped one unless ``--backbone debug``), the MAE decoder width (CPU), the crop size (a few
patches per axis, the patch size kept), the batch size (one sample per process), the loader
workers (at most 1), and the class list (the shipped classes that the data annotates: the demo
data has no endosomes, lysosomes, peroxisomes or microtubules). Everything else stays as shipped:
compile, attention "auto", activation checkpointing, mixed precision, augmentation, class
balancing, head, loss, checkpoint and evaluation cadence (with 2 steps, the last step
checkpoints and validates, as every run's last step does).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train_configs"


def shipped_configs() -> list[Path]:
    """Every TOML in ``train_configs/``: a config added later is picked up by itself."""
    return sorted(CONFIGS.glob("*.toml"))


def entry_script(config: dict) -> str:
    """MAE configs set MAE-only model keys; every other config trains segmentation."""
    model = config.get("model", {})
    return "train_mae.py" if "mask_ratio" in model or "decoder_dim" in model else "train_segmentation.py"


def debug_backbone(name: str, min_head_dim: int = 0) -> str:
    """The smallest registry backbone with the feed-forward type of ``name`` (and Meta's
    other architecture flags, which every registry entry shares) whose heads are at least
    ``min_head_dim`` wide (GPU attention kernels such as FA4 want 64 or more)."""
    from torchtitan.models import BACKBONES

    ffn = BACKBONES[name]["ffn_layer"]
    candidates = [n for n, kw in BACKBONES.items() if kw["ffn_layer"] == ffn
                  and kw["embed_dim"] // kw["num_heads"] >= min_head_dim]
    smallest = min(candidates, key=lambda n: BACKBONES[n]["embed_dim"] * BACKBONES[n]["depth"])
    if not min_head_dim and BACKBONES[smallest]["embed_dim"] > 128:
        raise ValueError(
            f"no debug-size backbone with ffn_layer={ffn!r} (that of {name!r}) in "
            "torchtitan/models/__init__.py BACKBONES; add one so the config can be tested on CPU")
    return smallest


def annotated_classes(data: Path, classes: list[str]) -> list[str]:
    """Those of ``classes`` that at least one label crop of the dataset folder annotates
    (itself or through all of its parts), in the given order."""
    from torchtitan.data.crops.layout import discover
    from torchtitan.data.io.stores import StoreContext
    from torchtitan.data.crops.reader import annotates

    crops = [crop for source in discover(StoreContext(), str(data)) for crop in source.crops]
    return [c for c in classes if any(annotates(crop, c) for crop in crops)]


def needs_ids(config: dict) -> bool:
    """Whether a config's targets are made of stored object ids (``[affinities]``): it runs on
    :func:`neuron_data`, not on the demo data, whose classes are masks."""
    return bool(config.get("affinities", {}).get("classes"))


def write_neuron_h5(path: Path, shape=(64, 64, 64), cells: int = 40) -> None:
    """EM and neuron ids of touching cells (the nearest of random centres: every voxel in a
    cell, as in dense neuropil; dark membranes where the ids change), 10 nm voxels, laid out
    as the CREMI challenge's HDF5 files."""
    import h5py
    import numpy as np
    import scipy.ndimage as ndi

    rng = np.random.default_rng(0)
    centres = np.zeros(shape, np.int32)
    for k, point in enumerate(rng.integers(0, shape, size=(cells, 3)), start=1):
        centres[tuple(point)] = k
    _, (iz, iy, ix) = ndi.distance_transform_edt(centres == 0, return_indices=True)
    ids = centres[iz, iy, ix].astype(np.uint64) * 1000  # large, sparse ids as stored
    edge = np.zeros(shape, bool)
    for axis in range(3):
        change = np.diff(ids, axis=axis) != 0
        edge[tuple(slice(None, -1) if a == axis else slice(None) for a in range(3))] |= change
    em = np.where(edge, 60, 160) + rng.normal(0, 10, shape)
    with h5py.File(path, "w") as f:
        raw = f.create_dataset("volumes/raw", data=np.clip(em, 0, 255).astype(np.uint8))
        labels = f.create_dataset("volumes/labels/neuron_ids", data=ids, compression="gzip")
        for dataset in (raw, labels):
            dataset.attrs["resolution"] = [10.0, 10.0, 10.0]


def neuron_data(out: Path) -> Path:
    """A dataset folder made from :func:`write_neuron_h5` by ``helpers/import_stack.py`` as
    docs/own_em.md imports connectomics ground truth (``cell`` with ids, ``pm`` their boundaries;
    sections 0-47 ``crop1``, 48-63 ``crop2``, the own-EM configs' validation crop)."""
    out.mkdir(parents=True, exist_ok=True)
    h5 = out / "neurons.h5"
    write_neuron_h5(h5)
    subprocess.run([sys.executable, str(REPO / "helpers" / "import_stack.py"),
                    "--em", f"{h5}:volumes/raw", "--labels", f"{h5}:volumes/labels/neuron_ids",
                    "--ids", "cell", "--boundary", "pm", "--out", str(out / "data"),
                    "--name", "neurons", "--crop", "crop1=0-47", "--crop", "crop2=48-63"],
                   check=True, capture_output=True)
    return out / "data"


@dataclass
class Reduction:
    # "debug": same ffn type, debug size; "small": same ffn type, smallest with 64-wide heads
    # (for GPU kernels); "shipped": as shipped
    backbone: str = "debug"
    patches_2d: int = 4  # crop side in patches
    patches_3d: int = 2
    max_workers: int = 1
    steps: int = 2
    decoder_dim: int | None = 64  # MAE decoder width (heads: 2); None keeps the shipped one


def reduced_overrides(path: Path, data: Path, dump: Path, nproc: int,
                      reduction: Reduction = Reduction()) -> list[str]:
    """The ``--section.key value`` flags that make the shipped config at ``path`` run here."""
    config = tomllib.loads(path.read_text())
    model, d = config.get("model", {}), config.get("data", {})
    patch = model.get("patch_size", 16)
    ndim = model.get("ndim", 2)
    side = patch * (reduction.patches_3d if ndim == 3 else reduction.patches_2d)
    crop = [min(c, side) for c in model.get("crop_size", [side] * ndim)]
    args = [
        "--job.config_file", str(path),
        "--job.dump_folder", str(dump),
        "--data.dataset_path", str(data),
        "--training.steps", str(reduction.steps),
        "--training.batch_size", str(nproc),
        "--model.crop_size", ",".join(map(str, crop)),
        "--data.num_workers", str(min(d.get("num_workers", 0), reduction.max_workers)),
    ]
    backbone = model.get("backbone")
    if backbone and reduction.backbone != "shipped":
        min_head_dim = 64 if reduction.backbone == "small" else 0
        args += ["--model.backbone", debug_backbone(backbone, min_head_dim)]
    if entry_script(config) == "train_mae.py" and reduction.decoder_dim:
        args += ["--model.decoder_dim", str(reduction.decoder_dim),
                 "--model.decoder_num_heads", "2"]
    if "classes" in d and data.exists():
        kept = annotated_classes(data, d["classes"])
        if kept != d["classes"]:
            args += ["--data.classes", ",".join(kept)]
    return args


def command(path: Path, overrides: list[str], nproc: int) -> list[str]:
    config = tomllib.loads(path.read_text())
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(nproc), str(REPO / entry_script(config)), *overrides]


def config_data(path: Path, data: Path, neuron_root: Path, make: bool = True) -> Path:
    """The dataset folder the config at ``path`` runs on: ``data`` (the demo data), or for a
    config whose targets are object ids the :func:`neuron_data` under ``neuron_root`` (made
    there first when ``make`` and it is missing)."""
    if not needs_ids(tomllib.loads(path.read_text())):
        return data
    if make and not (neuron_root / "data").exists():
        neuron_data(neuron_root)
    return neuron_root / "data"


def run_config(path: Path, data: Path, dump: Path, nproc: int, reduction: Reduction,
               timeout: float, extra: Sequence[str] = ()) -> tuple[bool, float, str]:
    """Run the config at ``path`` reduced (:func:`reduced_overrides`, then ``extra`` flags)
    with torchrun; returns (passed, seconds, the last 3000 characters of its output)."""
    cmd = command(path, [*reduced_overrides(path, data, dump, nproc, reduction), *extra], nproc)
    t0 = time.perf_counter()
    try:
        result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        ok, tail = result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        ok, tail = False, f"timed out after {timeout:.0f} s"
    return ok, time.perf_counter() - t0, tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO / "data" / "demo",
                        help="a CellMap-layout dataset folder (default: data/demo; made by "
                             "helpers/make_demo_data.py if missing)")
    parser.add_argument("--neuron-data", type=Path, default=REPO / "data" / "neurons",
                        help="where the id volume for configs with [affinities] is made "
                             "(neuron_data), unless it holds one already")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "shipped_configs",
                        help="dump folders go to OUT/<config name>")
    parser.add_argument("--nproc", type=int, default=0,
                        help="processes per run (default: every GPU, or 2 on CPU)")
    parser.add_argument("--backbone", choices=("debug", "small", "shipped"), default="debug",
                        help="debug: the debug size with the same ffn type (default); small: "
                             "the smallest with the same ffn type and 64-wide heads; shipped: "
                             "the config's own backbone")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per config")
    parser.add_argument("--only", nargs="*", default=None, help="config names to run")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each command without running it")
    args = parser.parse_args(argv)

    import torch

    gpus = torch.cuda.device_count()
    nproc = args.nproc or gpus or 2
    backbone = args.backbone
    reduction = Reduction(backbone=backbone, steps=args.steps,
                          decoder_dim=None if backbone == "shipped" else 64)
    from torchtitan.models.attention import fa4_unavailable_reason

    fa4 = fa4_unavailable_reason("cuda" if gpus else "cpu")
    if not args.data.exists() and not args.dry_run:
        subprocess.run([sys.executable, str(REPO / "helpers" / "make_demo_data.py"), "--out",
                        str(args.data)], check=True)
    selected = [p for p in shipped_configs() if not args.only or p.stem in args.only]
    print(f"{len(selected)} shipped configs, {nproc} processes "
          f"({'NCCL' if gpus else 'gloo'}), backbone {backbone}, {args.steps} steps; "
          f"FlashAttention-4: {'available' if fa4 is None else 'no (' + fa4 + ')'}", flush=True)
    failed = 0
    start = time.perf_counter()
    for path in selected:
        data = config_data(path, args.data, args.neuron_data, make=not args.dry_run)
        if args.dry_run:
            cmd = command(path, reduced_overrides(path, data, args.out / path.stem, nproc,
                                                  reduction), nproc)
            print(f"DRY-RUN {path.name}: {' '.join(cmd)}", flush=True)
            continue
        ok, seconds, tail = run_config(path, data, args.out / path.stem, nproc, reduction,
                                       args.timeout)
        print(f"{'PASS' if ok else 'FAIL'} {path.name} ({seconds:.0f} s)", flush=True)
        if not ok:
            failed += 1
            print("    " + tail.replace("\n", "\n    "), flush=True)
    if not args.dry_run:
        print(f"{failed} failed, {time.perf_counter() - start:.0f} s in all", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
