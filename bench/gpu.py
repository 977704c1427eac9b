"""GPU benchmark (one H200): MFU and voxels/s of ViT-L/16 3D training, data-loader headroom,
and sliding-window inference against MONAI. One script, about 6 minutes.

    python bench/gpu.py                      # on the GPU: sizes below, bf16
    python bench/gpu.py --dry-run            # every section on the CPU at toy sizes (< 1 min)
    python bench/gpu.py --sections train --budget-s 200
    python bench/gpu.py --sections train --steps 20 --train-only "* 128^3 x8, sdpa, *"
    python bench/gpu.py --sections train --train-only "seg 128^3 x8, sdpa, eager" \
        --profile "seg 128^3 x8, sdpa, eager"   # and the operators that take the time

Sections (--sections, all by default):
  train      training steps (forward + backward + fused AdamW, bf16 autocast, fp32 weights) of
             ``dinov3_vitl16`` in 3D (1 channel, patch 16) on 128^3 (batch 8) and 256^3 (batch 2)
             crops: the backbone alone (loss: mean square of its patch tokens), the segmentation
             model (linear head) with a mean square of its resized logits ("seg") and with the
             trainer's BCE ("seg bce"), both taken slab by slab as the trainer takes its loss;
             and the MAE (256^3, batch 2) at mask ratio 0.75 and 0.9. Attention SDPA and FlashAttention-4 (a row says "not
             installed" where it cannot run), eager and ``torch.compile`` (per block, as the
             trainer does), without and with selective activation checkpointing (per op, as
             ``activation_checkpoint.mode = "selective"``, ``selective_ac_option = "op"``).
             Reports s/step, voxels/s, TFLOP/s (FLOPs of ``torchtitan/models/flops.py``), MFU
             against the card's data-sheet dense bf16 peak (PEAK_BF16_TFLOPS, or --peak-tflops)
             and against a bf16 GEMM measured in the same run, and peak memory.
  loader     data-loader headroom: samples/s of the training loader (128^3 crops, every
             augmentation on, rotation/zoom resampled on the device as cluster runs do;
             bench/data_loader.py's store and config) over the model's samples/s (the best
             segmentation 128^3 row). Above 1 the loader keeps up.
  inference  sliding-window inference of the ViT-L/16 segmentation model in bf16: ours
             (``torchtitan.inference.sliding_window.predict_volume``) against MONAI's
             ``sliding_window_inference`` on the same model, windows (128^3, overlap 0.25,
             Gaussian blending, the same weight map as in bench/inference.py), windows per
             forward and output placement (windows on the GPU, the volume on the host).
  cp         context parallelism: ``bench/context_parallel.py`` on every GPU of the machine
             (NCCL), the 3D segmentation ViT-L (patch 8, 256^2 slices of growing depth) with one
             sample's tokens split in N slabs against one GPU: activation and peak memory per
             rank, s/step, the longest sequence under one GPU's activation memory at the middle
             length. Needs 2 or more GPUs (a row says so otherwise).

Rows run in order until --budget-s seconds have passed; later rows say "skipped". --dry-run
uses a 2-block 64-wide ViT, 32^3 crops, a few steps, a demo-data store in a temporary folder,
and does not compile (inductor needs minutes on a CPU); its numbers mean nothing, only that
every section runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from torchtitan.inference.sliding_window import blending_weights, grid_starts, predict_volume
from torchtitan.models import (MaskedAutoencoder, SegmentationModel, build_backbone,
                               training_flops_per_sample, use_attention)
from torchtitan.models.attention import _fa4_kernels, fa4_unavailable_reason

# Sibling scripts: `python bench/gpu.py` puts bench/ first on the import path (bench/ is a
# folder of scripts, not an installed package).
from inference import monai_starts
from model_step import bce_of_resized, mean_square_of_resized

SECTIONS = ("train", "loader", "inference", "cp")
MONAI_HINT = "pip install --no-deps monai==1.6.1 einops==0.8.1"
NUM_CLASSES = 4


@dataclass
class Sizes:
    backbone_overrides: dict
    seg_crops: tuple[tuple[int, int], ...]  # (crop edge, batch)
    mae_crop: tuple[int, int]
    mae_ratios: tuple[float, ...]
    steps: int
    warmup: int
    gemm: int
    loader_crop: int
    loader_batches: int
    window: int
    volume: int  # edge of the cubic inference volume
    infer_batch: int
    cp_args: tuple[str, ...] = ()  # sizes for bench/context_parallel.py


FULL = Sizes({}, ((128, 8), (256, 2)), (256, 2), (0.75, 0.9), steps=6, warmup=2, gemm=8192,
             loader_crop=128, loader_batches=16, window=128, volume=320, infer_batch=4,
             cp_args=("--dim", "1024", "--depth", "24", "--heads", "16", "--patch", "8",
                      "--side", "256", "--rows", "4,8,16", "--max-rows", "64", "--steps", "3"))
DRY = Sizes({"embed_dim": 64, "depth": 2, "num_heads": 2}, ((32, 2),), (32, 2), (0.75, 0.9),
            steps=2, warmup=1, gemm=256, loader_crop=32, loader_batches=3, window=32,
            volume=56, infer_batch=4,
            cp_args=("--dim", "32", "--depth", "1", "--heads", "2", "--side", "16",
                     "--rows", "2,4", "--max-rows", "8", "--steps", "1"))


class Table:
    """Rows of one section, printed as a markdown table."""

    def __init__(self, section: str, columns: list[str]):
        self.section, self.columns, self.rows = section, columns, []

    def add(self, **cells) -> None:
        self.rows.append([str(cells.get(c, "")) for c in self.columns])
        print(f"[{self.section}] " + ", ".join(f"{c}={v}" for c, v in zip(self.columns, self.rows[-1])
                                               if v), flush=True)

    def print(self) -> None:
        print(f"\n## {self.section}\n")
        print("| " + " | ".join(self.columns) + " |")
        print("|" + "---|" * len(self.columns))
        for row in self.rows:
            print("| " + " | ".join(row) + " |")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_tflops(n: int, device: torch.device, dtype: torch.dtype) -> float:
    """TFLOP/s of an n^3 matmul in ``dtype`` (the best of 5)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


# Dense bf16 tensor-core peaks from NVIDIA's data sheets (TFLOP/s, without sparsity), by a
# part of the name torch.cuda.get_device_name gives; the first match counts ("H100 80GB HBM3"
# is the SXM card).
PEAK_BF16_TFLOPS = (("GH200", 989.0), ("H200 NVL", 835.0), ("H200", 989.0),
                    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0))


def peak_bf16_tflops(device_name: str) -> float | None:
    """The data-sheet dense bf16 peak of the card called ``device_name``; None if unknown."""
    for part, peak in PEAK_BF16_TFLOPS:
        if part in device_name:
            return peak
    return None


def copy_gbps(n_bytes: int, device: torch.device) -> float:
    """GB/s of a device-to-device copy of ``n_bytes`` (read + write, the best of 5)."""
    a = torch.empty(n_bytes // 4, device=device, dtype=torch.float32).uniform_()
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.numel() * 4 / best / 1e9


def attention_status(backend: str, device: torch.device) -> str | None:
    """None when ``backend`` can run here, else what the row should say."""
    if backend == "sdpa":
        return None
    if _fa4_kernels() is None:
        return "not installed (pip install -r requirements-gpu.txt)"
    return fa4_unavailable_reason(device)


def build_model(kind: str, sizes: Sizes, attention: str, compile_: bool, ac: bool | str,
                device: torch.device, backbone: str = "dinov3_vitl16",
                mae: dict | None = None) -> torch.nn.Module:
    """``kind`` "backbone", "seg*" or "mae" around ``backbone`` (3D, one channel, with
    ``sizes.backbone_overrides``); ``mae``: the MaskedAutoencoder's decoder arguments. ``ac``:
    True for selective per-op checkpointing, or an ``activation_checkpoint.mode``."""
    from torchtitan.parallelisms.parallelize import apply_ac, apply_compile

    torch.manual_seed(0)
    backbone = build_backbone(backbone, ndim=3, in_chans=1, **sizes.backbone_overrides)
    if kind == "backbone":
        model = backbone
    elif kind.startswith("seg"):
        model = SegmentationModel(backbone, NUM_CLASSES, head="linear")
    else:
        model = MaskedAutoencoder(backbone, **(mae or {}))
    model.to(device)
    use_attention(model, attention)
    if ac is True:
        apply_ac(model, "selective", "op")
    elif ac:
        apply_ac(model, ac, "op")
    if compile_:
        apply_compile(model)
    return model


def train_rows(args, sizes: Sizes, device: torch.device, table: Table, deadline: float) -> dict:
    """Fill the train table; returns {row name: samples/s} of the rows that ran."""
    peak_gemm = gemm_tflops(sizes.gemm, device, torch.bfloat16)
    print(f"bf16 GEMM {sizes.gemm}^3: {peak_gemm:.1f} TFLOP/s", flush=True)
    configs = []
    for crop, batch in sizes.seg_crops:  # the backbone alone, then with the head and each loss
        for kind in ("backbone", "seg", "seg bce"):
            configs.append((kind, crop, batch, None))
    for ratio in sizes.mae_ratios:
        configs.append(("mae", *sizes.mae_crop, ratio))
    rates = {}
    for kind, crop, batch, ratio in configs:
        for attention in ("sdpa", "fa4"):
            for compile_ in (False, True):
                for ac in (False, True):
                    name = (f"{f'MAE {ratio}' if kind == 'mae' else kind} {crop}^3 x{batch}, "
                            f"{attention}, {'compiled' if compile_ else 'eager'}"
                            f"{', selective AC' if ac else ''}")
                    why = attention_status(attention, device)
                    if args.train_only and not any(fnmatch.fnmatchcase(name, pattern)
                                                   for pattern in args.train_only):
                        why = "skipped: not in --train-only"
                    if why is None and compile_ and args.dry_run:
                        why = "skipped: --dry-run does not compile (minutes on a CPU)"
                    if why is None and time.perf_counter() > deadline:
                        why = "skipped: time budget (--budget-s)"
                    if why is not None:
                        table.add(config=name, status=why)
                        continue
                    try:
                        profiled = args.profile and any(fnmatch.fnmatchcase(name, pattern)
                                                        for pattern in args.profile)
                        row = run_train(kind, crop, batch, ratio, attention, compile_, ac, sizes,
                                        device, peak_gemm, args.peak_tflops,
                                        profile=name if profiled else None)
                    except Exception as e:  # report and go on: one config must not end the run
                        table.add(config=name, status=f"failed: {type(e).__name__}: {e}"[:200])
                        continue
                    finally:
                        torch._dynamo.reset()
                    table.add(config=name, status="ok", **row)
                    rates[name] = row["_samples_per_s"]
    return rates


def profile_steps(step, device: torch.device, name: str, steps: int = 3, rows: int = 20,
                  top: int = 5) -> dict:
    """torch.profiler over ``steps`` more steps: prints the operators that take the most
    device time (CPU time on a CPU); returns a summary: how busy the GPU was (the union of
    its kernels' intervals over the wall time), kernels per step, and the ``top`` kernels by
    time with their ms per step and share."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    wall_us = (time.perf_counter() - t0) * 1e6
    events = prof.key_averages()
    key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sum(e.count for e in on_device)
    print(f"\n### profile of {name}: {steps} steps, {kernels / steps:.0f} kernels per step\n"
          + events.table(sort_by=key, row_limit=rows, max_name_column_width=60), flush=True)
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in intervals:  # the union: overlapping kernels (several streams) count once
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    ranked = sorted(on_device, key=lambda e: e.device_time_total, reverse=True)[:top]
    total = sum(e.device_time_total for e in on_device) or 1.0
    return {"gpu_busy": f"{busy / wall_us:.0%}" if intervals else "n/a (no GPU)",
            "kernels_per_step": round(kernels / steps),
            "top_kernels": [{"name": e.key[:80], "ms_per_step": round(e.device_time_total
                                                                     / steps / 1e3, 3),
                             "share": f"{e.device_time_total / total:.0%}"} for e in ranked]}


def run_train(kind, crop, batch, ratio, attention, compile_, ac, sizes, device, peak_gemm,
              peak_spec, profile: str | None = None, model=None, profile_n: int = 3) -> dict:
    """Time ``sizes.steps`` training steps of ``model`` (or of :func:`build_model`'s);
    ``peak_spec`` None: MFU against the data sheet is not known."""
    model = model or build_model(kind, sizes, attention, compile_, ac, device)
    model.train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    shape = (1, crop, crop, crop)
    x = torch.randn(batch, *shape, device=device)
    flops = training_flops_per_sample(model, shape, mask_ratio=ratio or 0.75)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step():
        with autocast:
            if kind == "backbone":  # the mean square of the final-normalised patch tokens
                loss = model.forward_features(x)["x_norm_patchtokens"].square().mean()
            elif kind == "seg":  # a loss on the head's logits as the trainer takes them
                loss = mean_square_of_resized(model, x)
            elif kind == "seg bce":  # the trainer's default loss
                loss = bce_of_resized(model, x)
            else:
                noise = torch.rand(batch, math.prod(s // model.patch_size for s in shape[1:]),
                                   device=device)
                pred, mask = model(x, ratio, noise)
                loss_sum, count = model.loss_terms(x, pred, mask)
                loss = loss_sum / count
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(sizes.warmup + (1 if compile_ else 0)):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(sizes.steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    summary = profile_steps(step, device, profile, steps=profile_n) if profile else None
    med = statistics.median(times)
    tflops = flops * batch / med / 1e12
    mem = (f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f}" if device.type == "cuda"
           else "n/a (CPU)")
    return {"s/step min / median / max": f"{min(times):.4f} / {med:.4f} / {max(times):.4f}",
            "Mvoxel/s": f"{batch * crop**3 / med / 1e6:.3g}",
            "TFLOP/s": f"{tflops:.2f}",
            "MFU": (f"{tflops / peak_spec:.1%}" if device.type == "cuda" and peak_spec
                    else "n/a (CPU)" if device.type != "cuda" else "n/a (unknown card)"),
            "of bf16 GEMM": f"{tflops / peak_gemm:.1%}",
            "peak GiB": mem, "_samples_per_s": batch / med, "_profile": summary}


def loader_rows(args, sizes: Sizes, model_rates: dict, table: Table, deadline: float) -> None:
    import data_loader as dl  # a sibling script, as monai_starts above

    seg = {k: v for k, v in model_rates.items() if k.startswith(f"seg {sizes.loader_crop}^3")}
    if time.perf_counter() > deadline:
        table.add(config="loader", status="skipped: time budget (--budget-s)")
        return
    with contextlib.ExitStack() as stack:
        if args.dry_run:
            from torchtitan.demo.data import generate_demo_data

            root = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "demo"
            generate_demo_data(root, seed=0, scale=0.25)
            classes = ["nuc", "mito"]
            workers = 1
        else:
            root = Path(args.loader_data)
            dl.make_store(root, seed=0)
            classes = ["nuc", "mito", "er", "cell"]
            workers = args.loader_workers
        ns = SimpleNamespace(data=root, classes=classes, workers=workers, crop=sizes.loader_crop,
                             batch_size=2, seed=0, batches=sizes.loader_batches, skip=workers + 1)
        cfg = dl.job_config(ns, "all@device")
        samples = dl.build_ours(cfg)
        loader = dl.our_loader(cfg, samples)
        it = iter(loader)
        try:
            seconds, _ = dl.time_batches(it, ns.skip, ns.batches)
        finally:
            if hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()
    loader_rate = ns.batches * ns.batch_size / seconds
    best = max(seg.values()) if seg else None
    table.add(config=f"{sizes.loader_crop}^3, batch 2, {workers} workers, every augmentation "
                     f"(resample on device)", status="ok",
              **{"loader samples/s": f"{loader_rate:.2f}",
                 "model samples/s (best seg row)": f"{best:.2f}" if best else "no seg row ran",
                 "headroom": f"{loader_rate / best:.2f}x" if best else ""})


def inference_rows(args, sizes: Sizes, device: torch.device, table: Table, deadline: float) -> None:
    if time.perf_counter() > deadline:
        table.add(config="inference", status="skipped: time budget (--budget-s)")
        return
    try:
        import einops  # noqa: F401  (MONAI needs it in places)
        from monai.inferers import sliding_window_inference
    except ImportError:
        table.add(config="MONAI sliding_window_inference",
                  status=f"MONAI not installed (benchmark only): {MONAI_HINT}")
        sliding_window_inference = None
    w, v = sizes.window, sizes.volume
    for start_ours, start_monai in ((grid_starts(v, w, 0.25), monai_starts(v, w, 0.25)),):
        assert start_ours == start_monai, f"window offsets differ: {start_ours} vs {start_monai}"
    model = build_model("seg", sizes, "sdpa" if attention_status("fa4", device) else "fa4",
                        False, False, device).eval()
    window = (w, w, w)

    @torch.no_grad()  # not inference_mode: MONAI scales the outputs in place
    def predict(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return model(x.to(device, non_blocking=True)).float().sigmoid().cpu()

    torch.manual_seed(0)
    volume = torch.rand(1, 1, v, v, v)

    def ours():
        return predict_volume(predict, volume[0], window, NUM_CLASSES, 0.25, "gaussian",
                              sizes.infer_batch)

    def theirs():
        return sliding_window_inference(volume, window, sizes.infer_batch, predict, 0.25,
                                        mode="gaussian", roi_weight_map=blending_weights(window,
                                                                                        "gaussian"),
                                        sw_device="cpu", device="cpu")[0]

    runs = {"ours": ours} if sliding_window_inference is None else {"ours": ours, "MONAI": theirs}
    outs = {k: fn() for k, fn in runs.items()}  # also the warm-up
    diff = (outs["ours"] - outs["MONAI"]).abs().max().item() if "MONAI" in outs else None
    times = {k: [] for k in runs}
    for r in range(args.infer_repeats):
        for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            sync(device)
            t0 = time.perf_counter()
            runs[k]()
            sync(device)
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(t) for k, t in times.items()}
    for k in runs:
        table.add(config=f"{k}: volume {v}^3, window {w}^3, overlap 0.25, {sizes.infer_batch} "
                         f"windows/forward, bf16", status="ok",
                  **{"s min / median / max": f"{min(times[k]):.3f} / {med[k]:.3f} / "
                                             f"{max(times[k]):.3f}",
                     "Mvoxel/s": f"{v**3 / med[k] / 1e6:.3g}",
                     "vs MONAI": f"{med['MONAI'] / med[k]:.2f}x" if "MONAI" in med else "",
                     "max abs diff": f"{diff:.1e}" if diff is not None else ""})


_LAUNCH_ERRORS = ("Connection reset", "Connection refused", "Connection closed",
                  "Address already in use", "RendezvousError", "DistNetworkError",
                  "Socket Timeout", "timed out")


def _failure_reason(stderr: str) -> str:
    """The line that says why a torchrun launch failed: the last exception line of a rank's
    traceback, not the launcher's banner of '=' that ends its summary."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ("Error" in ln or "Exception" in ln) and ":" in ln
              and not ln.startswith(("File ", "Traceback", "torch.distributed.elastic"))]
    if errors:
        return errors[-1][:300]
    text = [ln for ln in lines if set(ln) != {"="}]
    return text[-1][:300] if text else "no output"


def _launch_failure(stderr: str) -> bool:
    return any(k in stderr for k in _LAUNCH_ERRORS)


def cp_rows(args, sizes: Sizes, table: Table, deadline: float) -> None:
    """CP 1 against CP N through bench/context_parallel.py (N = the GPUs; 2 CPU processes in
    the dry run), one row per sequence length and one for the longest-sequence search."""
    import subprocess

    nproc = 2 if args.dry_run else torch.cuda.device_count()
    if nproc < 2:
        table.add(config="CP", status=f"skipped: context parallelism needs 2 or more GPUs, "
                                      f"this machine has {nproc}")
        return
    if time.perf_counter() > deadline:
        table.add(config=f"CP {nproc}", status="skipped: over --budget-s")
        return
    script = Path(__file__).resolve().parent / "context_parallel.py"
    cmd = [sys.executable, str(script), "--cp-degree", str(nproc), *sizes.cp_args]
    if not args.dry_run:
        cmd += ["--device", "cuda"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    retried = ""
    if r.returncode != 0 and _launch_failure(r.stderr):
        # A rendezvous or socket failure of the launcher, not of the benchmark: once more,
        # and say so in the row.
        retried = f"retried after: {_failure_reason(r.stderr)}"
        print(r.stderr, file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        table.add(config=f"CP {nproc}", status="failed: " + _failure_reason(r.stderr),
                  note=retried)
        return
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0].isdigit():
            table.add(config=f"CP 1 vs CP {nproc}, {cells[0]} tokens", status="ok",
                      **{"activation MB (CP 1 / CP N per rank)": f"{cells[1]} / {cells[2]}",
                         "ratio": cells[3], "s/step (CP 1 / CP N)": f"{cells[4]} / {cells[5]}",
                         "peak MB (CP 1 / CP N per rank)":
                             f"{cells[6]} / {cells[7]}" if len(cells) > 7 else "-",
                         "note": retried})
        elif line.startswith("Longest sequence"):
            table.add(config=f"CP 1 vs CP {nproc}, longest sequence", status="ok",
                      ratio=line.rsplit("(", 1)[1].rstrip(")"), note=line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="every section on the CPU at toy sizes (a test that the script runs)")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, of {', '.join(SECTIONS)} (default all)")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="start no new row after this many seconds (default 330)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's dense bf16 peak for MFU (default: the data sheet's for the "
                        "card, PEAK_BF16_TFLOPS: 989 for H100 SXM, H200, GH200)")
    p.add_argument("--loader-data", default="/tmp/bench_data_loader",
                   help="bench/data_loader.py's store (written there once, about a minute)")
    p.add_argument("--loader-workers", type=int, default=8)
    p.add_argument("--infer-repeats", type=int, default=3)
    p.add_argument("--train-only", nargs="+", default=None, metavar="PATTERN",
                   help="run only the train rows whose name matches one of these shell-style "
                        "patterns, e.g. 'seg 128^3 x8, *, compiled' (the others say skipped)")
    p.add_argument("--steps", type=int, default=0,
                   help="timed steps per train row (default: 6 on a GPU, 2 with --dry-run)")
    p.add_argument("--profile", nargs="+", default=None, metavar="PATTERN",
                   help="after timing the train rows that match, profile 3 more steps of "
                        "each and print the operators that take the most time")
    args = p.parse_args(argv)
    sections = args.sections.split(",")
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise SystemExit(f"--sections: unknown {bad}; expected some of {', '.join(SECTIONS)}")
    if args.dry_run:
        device, sizes = torch.device("cpu"), DRY
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench/gpu.py needs a CUDA GPU (or --dry-run to check it on a CPU)")
        device, sizes = torch.device("cuda"), FULL
        if args.peak_tflops is None:
            args.peak_tflops = peak_bf16_tflops(torch.cuda.get_device_name(device))
            if args.peak_tflops is None:
                print(f"unknown card {torch.cuda.get_device_name(device)!r}: no data-sheet "
                      "peak, MFU not reported (give --peak-tflops)", flush=True)
    if args.steps:
        sizes = dataclasses.replace(sizes, steps=args.steps)
    start = time.perf_counter()
    deadline = start + args.budget_s
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
          f"{', dry run' if args.dry_run else ''}", flush=True)
    tables = []
    rates: dict = {}
    if "train" in sections:
        t = Table("train", ["config", "status", "s/step min / median / max", "Mvoxel/s",
                            "TFLOP/s", "MFU", "of bf16 GEMM", "peak GiB"])
        rates = train_rows(args, sizes, device, t, deadline)
        tables.append(t)
    if "loader" in sections:
        t = Table("loader", ["config", "status", "loader samples/s",
                             "model samples/s (best seg row)", "headroom"])
        loader_rows(args, sizes, rates, t, deadline)
        tables.append(t)
    if "inference" in sections:
        t = Table("inference", ["config", "status", "s min / median / max", "Mvoxel/s",
                                "vs MONAI", "max abs diff"])
        inference_rows(args, sizes, device, t, deadline)
        tables.append(t)
    if "cp" in sections:
        t = Table("cp", ["config", "status", "activation MB (CP 1 / CP N per rank)", "ratio",
                         "s/step (CP 1 / CP N)", "peak MB (CP 1 / CP N per rank)", "note"])
        cp_rows(args, sizes, t, deadline)
        tables.append(t)
    for t in tables:
        t.print()
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
