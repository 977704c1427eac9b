"""Sliding-window throughput: ours (torchtitan.inference.sliding_window) vs MONAI's sliding_window_inference.

    .venv/bin/pip install --no-deps monai==1.6.1      # benchmark only, not a project dependency
    python bench/inference.py [--repeats 5] [--cases 3d,planes] [--models copy,conv,vit]

Both predict the same volume with the same model, window, overlap (0.25), windows per
forward (--batch) and Gaussian blending. MONAI is given our weight map (``roi_weight_map``),
so both blend with identical weights (sigma = window / 8 either way; MONAI's own map differs
only by its 1e-3 floor), and the sizes are chosen so that both place the windows at the same
offsets. The outputs must agree within 1e-4 (asserted). Timings are taken side by side in one
process, alternating which runs first, and the median of --repeats is reported as voxels per
second, split into the time spent inside the model's forwards and the rest (reading windows,
weighting, accumulating, normalising: the sliding window's own cost).

Cases (--cases):
  3d      a 3D model on a 1x128x160x160 volume, windows 32x64x64
  planes  a 2D model plane by plane on a 1x64x256x256 volume, windows 64x64 (1x64x64 in 3D;
          MONAI gets the same model wrapped to take and return one-plane-thick windows)
Models (--models), each in 2D or 3D as the case needs:
  copy    no model: the input repeated to 4 channels, so only the sliding window's own cost
  conv    a small CNN: 3x3(x3) conv to 8 channels, ReLU, 1x1(x1) conv to 4, sigmoid
  vit     the project's vit_tiny segmentation model (patch 8, linear head) + sigmoid
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from torchtitan.inference.sliding_window import blending_weights, grid_starts, predict_volume

NUM_CLASSES = 4
CASES = {  # name: (volume D,H,W, model window, window in 3D)
    "3d": ((128, 160, 160), (32, 64, 64), (32, 64, 64)),
    "planes": ((64, 256, 256), (64, 64), (1, 64, 64)),
}


class _Copy(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, NUM_CLASSES, *[1] * (x.ndim - 2))


def build_model(name: str, ndim: int) -> torch.nn.Module:
    """A model mapping (B, 1, *window) to (B, NUM_CLASSES, *window) probabilities."""
    torch.manual_seed(0)
    conv = torch.nn.Conv3d if ndim == 3 else torch.nn.Conv2d
    if name == "copy":
        return _Copy()
    if name == "conv":
        net = torch.nn.Sequential(conv(1, 8, 3, padding=1), torch.nn.ReLU(),
                                  conv(8, NUM_CLASSES, 1), torch.nn.Sigmoid())
    elif name == "vit":
        from torchtitan.models import SegmentationModel, build_backbone

        backbone = build_backbone("vit_tiny", ndim=ndim, in_chans=1, patch_size=8)
        seg = SegmentationModel(backbone, NUM_CLASSES, head="linear")
        seg.init_weights()
        net = torch.nn.Sequential(seg, torch.nn.Sigmoid())
    else:
        raise SystemExit(f"unknown model {name!r}: copy, conv or vit")
    return net.eval()


def monai_starts(size: int, window: int, overlap: float) -> list[int]:
    """Window offsets along one axis as MONAI places them (fixed interval, last one moved
    back to end at the volume's end)."""
    if size <= window:
        return [0]
    interval = max(int(window * (1 - overlap)), 1)
    starts, i = [], 0
    while True:
        s = i * interval
        starts.append(min(s, size - window))
        if s + window >= size:
            return starts
        i += 1


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_case(case: str, model_name: str, args, sliding_window_inference) -> dict:
    shape, window, window3 = CASES[case]
    for s, w in zip(shape, window3):
        ours, theirs = grid_starts(s, w, args.overlap), monai_starts(s, w, args.overlap)
        assert ours == theirs, f"axis {s}, window {w}: window offsets differ ({ours} vs {theirs})"
    torch.manual_seed(0)
    volume = torch.rand(1, 1, *shape)
    weight = blending_weights(window3, "gaussian")
    model = build_model(model_name, len(window))
    inside = [0.0]  # seconds spent inside the model during the current run

    def timed_model(x):
        t0 = time.perf_counter()
        y = model(x)
        inside[0] += time.perf_counter() - t0
        return y

    def model3(x):  # MONAI: one-plane-thick 3D windows for a 2D model
        return timed_model(x[:, :, 0]).unsqueeze(2) if len(window) == 2 else timed_model(x)

    def ours():
        return predict_volume(timed_model, volume[0], window, NUM_CLASSES, args.overlap,
                              "gaussian", args.batch)

    def theirs():
        return sliding_window_inference(volume, window3, args.batch, model3, args.overlap,
                                        mode="gaussian", roi_weight_map=weight)[0]

    with torch.no_grad():
        diff = (ours() - theirs()).abs().max().item()  # also the warm-up
        assert diff <= 1e-4, f"{case}/{model_name}: outputs differ by {diff:.2e} (> 1e-4)"
        times: dict[str, list[float]] = {"ours": [], "monai": [], "ours_model": [], "monai_model": []}
        for r in range(args.repeats):
            order = [("ours", ours), ("monai", theirs)]
            for key, fn in (order if r % 2 == 0 else order[::-1]):
                inside[0] = 0.0
                times[key].append(timed(fn))
                times[f"{key}_model"].append(inside[0])
    n_windows = 1
    for s, w in zip(shape, window3):
        n_windows *= len(grid_starts(s, w, args.overlap))
    return {"case": case, "model": model_name, "shape": shape, "window": window3,
            "windows": n_windows, "voxels": volume.numel(), "diff": diff,
            **{k: statistics.median(v) for k, v in times.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="3d,planes")
    p.add_argument("--models", default="copy,conv,vit")
    p.add_argument("--overlap", type=float, default=0.25)
    p.add_argument("--batch", type=int, default=8, help="windows per forward, both (default 8)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    try:
        from monai.inferers import sliding_window_inference
    except ImportError:
        print("MONAI is not installed; it is needed for this benchmark only:\n"
              "    .venv/bin/pip install --no-deps monai==1.6.1", file=sys.stderr)
        return 1
    import monai

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"overlap {args.overlap}, {args.batch} windows per forward, Gaussian blending; "
          f"torch {torch.__version__}, MONAI {monai.__version__}, {torch.get_num_threads()} "
          f"threads; median of {args.repeats} side-by-side repeats")
    print()
    print("| case | model | windows | ours (s) | MONAI (s) | ours Mvoxel/s | MONAI Mvoxel/s "
          "| speed-up | in the model: ours / MONAI (s) | tiling + blending: ours / MONAI (s) "
          "| max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        for name in args.models.split(","):
            r = run_case(case, name, args, sliding_window_inference)
            vol = "x".join(map(str, r["shape"]))
            win = "x".join(map(str, r["window"]))
            print(f"| {case} {vol}, window {win} | {name} | {r['windows']} "
                  f"| {r['ours']:.3f} | {r['monai']:.3f} "
                  f"| {r['voxels'] / r['ours'] / 1e6:.1f} | {r['voxels'] / r['monai'] / 1e6:.1f} "
                  f"| {r['monai'] / r['ours']:.2f}x "
                  f"| {r['ours_model']:.3f} / {r['monai_model']:.3f} "
                  f"| {r['ours'] - r['ours_model']:.3f} / {r['monai'] - r['monai_model']:.3f} "
                  f"| {r['diff']:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
