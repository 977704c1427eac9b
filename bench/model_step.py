"""Training-step speed of our ViTs against MONAI's and timm's, side by side, and how much of
the machine's matmul peak each reaches.

    .venv/bin/pip install --no-deps monai==1.6.1 einops==0.8.1     # peers: benchmark only
    .venv/bin/pip install --no-deps timm==1.0.31 torchvision==0.28.0
    python bench/model_step.py [--cases 3d,2d] [--modes eager,compiled] [--repeats 9]
                               [--max-repeats 41] [--target-iqr 0.05] [--multiscale]
    python bench/model_step.py --tiny              # every case at toy sizes (seconds; CI)
    python bench/model_step.py --profile 3d        # torch.profiler table of our step
    python bench/model_step.py --head-layouts      # the multiscale head, by layout

One step is forward + backward + ``torch.optim.AdamW`` step + ``zero_grad``, float32, the
same batch, optimizer setting (--adamw) and threads for every model. Models are timed in
one process in rounds: one step of each model per round, the order reversed every other round.
Min / median / max seconds per step are reported with samples/s; each ratio a goal is about
(the peer's step over ours; a head's step over the backbone's) is taken within every round; its
median is reported with that median's 95 % interval and IQR (distribution-free, from order
statistics: how well the rounds settle it), the rounds' own q1-q3 (the machine's noise, which
more rounds do not shrink), the ratio of the medians and of the minima. Past --repeats rounds
the run stops as soon as every goal ratio's median has an IQR under --target-iqr of itself,
or at --max-repeats.

Cases (--cases):
  3d  our 3D segmentation ViT at ViT-S/16 sizes (``dinov3_vits16``, ndim 3, 1 channel: width
      384, depth 12, 6 heads, MLP 1536, patch 16) on 96^3 crops, batch 2, against MONAI's
      ``ViT`` (spatial_dims 3, the same sizes, ``classification=False``). MONAI's ViT has no
      dense head, so the goal's ratio is backbone to backbone: each model's final-normalised
      patch tokens, loss = their mean square. "ours+linear" is the full segmentation model
      (the same backbone, features of four blocks, 1x1 conv to 4 classes, trilinear upsampling
      to 96^3, loss = mean square of the logits), for what the head costs; its logits are
      upsampled and reduced slab by slab as the trainer's loss takes them (``Loss.resized``,
      the derivative written out and sent to the grid in the forward pass).
      "ours+linear, bce" is that model with the trainer's default loss (BCE against random
      0/1 targets, per-voxel validity), the step a user's training runs. With --multiscale,
      also "ours+multiscale": the backbone with the multiscale head (default widths), loss =
      mean square of its full-resolution logits (about 15x the backbone's step).
  2d  our ``dinov3_vitb16`` (2D, 3 channels) at 224^2, batch 8, against timm's DINOv3 ViT-B
      (``vit_base_patch16_dinov3``, ``num_classes=0``: the same architecture, with RoPE,
      LayerScale and 4 register tokens); loss = mean square of the final-normalised patch
      tokens of each. The eager run also loads one random state dict into both (mapped by
      name) and reports the largest difference of their outputs.

Modes (--modes): "eager", and "compiled": every transformer block of every model wrapped in
``torch.compile`` (as the trainer compiles, ``parallelize.apply_compile``).

Hardware efficiency: achieved FLOP/s = training FLOPs per sample x samples / median step time,
divided by the float32 matmul rate of a --gemm x --gemm GEMM measured in the same rounds
(median). FLOPs are those of ``torchtitan/models/flops.py`` (matmuls and attention scores);
for the peers the same formulas are applied to their layers (patch convolution, every linear
of every block, attention over all tokens).

GEMMs alone: the matmuls of one step of each model (every linear layer's forward,
input-gradient and weight-gradient GEMM at the shapes its forward sees, the patch
convolution's, and attention's six batched matmuls per block), timed back to back on their
own right after each of the model's timed steps (median). The "ceiling" line divides the
peer's median step by our model's GEMMs-alone time: the largest ratio any step of ours doing
the same matmuls in the same dtype could reach.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from torchtitan.models import (SegmentationModel, build_backbone, build_loss,
                               training_flops_per_sample)
from torchtitan.models.resize import slab_statistics
from torchtitan.models.flops import block_training_flops, linear_training_flops

MONAI_HINT = ".venv/bin/pip install --no-deps monai==1.6.1 einops==0.8.1"
TIMM_HINT = ".venv/bin/pip install --no-deps timm==1.0.31 torchvision==0.28.0"

# Sizes per case: (full, tiny).
SIZES = {
    "3d": ({"dim": 384, "depth": 12, "heads": 6, "patch": 16, "size": 96, "batch": 2},
           {"dim": 64, "depth": 2, "heads": 2, "patch": 16, "size": 32, "batch": 2}),
    "2d": ({"dim": 768, "depth": 12, "heads": 12, "patch": 16, "size": 224, "batch": 8},
           {"dim": 64, "depth": 2, "heads": 2, "patch": 16, "size": 64, "batch": 2}),
}


@dataclass
class Entry:
    """One model under test: how to build its loss, and its counts."""

    name: str
    model: nn.Module
    loss: Callable[[torch.Tensor], torch.Tensor]
    flops_per_sample: int
    blocks: nn.ModuleList | nn.Sequential
    params_note: str = ""
    times: list[float] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    gemms: StepGemms | None = None
    gemm_times: list[float] = field(default_factory=list)


def import_timm():
    """timm, or SystemExit saying how to install it. PyPI's torchvision (which timm imports)
    is a CUDA build; beside the CPU torch its compiled ops do not load, and the two modules
    that register kernels for them raise. timm's ViT uses none of them, so they are skipped."""
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))
    try:
        import timm
    except ImportError as e:
        raise SystemExit(f"timm is needed for the 2d case ({e}); benchmark only:\n    {TIMM_HINT}")
    return timm


def import_monai_vit():
    try:
        import einops  # noqa: F401  (MONAI's attention block needs it)
        from monai.networks.nets import ViT
    except ImportError as e:
        raise SystemExit(f"MONAI (and einops) are needed for the 3d case ({e}); benchmark only:"
                         f"\n    {MONAI_HINT}")
    return ViT


def peer_training_flops(model: nn.Module, patch_conv: nn.Module, blocks, n_patches: int,
                        n_tokens: int) -> int:
    """flops.py's formulas on a peer ViT: patch convolution (no input gradient), then every
    block on ``n_tokens`` tokens."""
    flops = linear_training_flops(n_patches, patch_conv.weight.numel(), input_needs_grad=False)
    return flops + sum(block_training_flops(b, n_tokens) for b in blocks)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def our_extras(vit) -> str:
    """What ours has that a plain ViT has not (parameters)."""
    d = vit.embed_dim
    ls = sum(b.ls1.gamma.numel() + b.ls2.gamma.numel() for b in vit.blocks
             if hasattr(b.ls1, "gamma"))
    kbias = sum(b.attn.qkv.bias.numel() // 3 for b in vit.blocks if b.attn.qkv.bias is not None)
    return (f"registers {vit.n_storage_tokens * d}, cls+mask token {2 * d}, LayerScale {ls}, "
            f"masked k-bias {kbias} (always 0), RoPE 0 (a {vit.rope_embed.periods.numel()}-value "
            f"buffer), no position table")


def mean_square_of_resized(model: SegmentationModel, x: torch.Tensor) -> torch.Tensor:
    """Mean square of the model's logits resized to the input's size, the way the trainer
    takes its loss on them: slab by slab from the patch grid, with the derivative written out
    and sent to the grid in the forward pass, as for the trainer's sigmoid losses
    (``Loss.resized``)."""
    logits = model(x, resize=False)
    (sq,) = slab_statistics(lambda z, t, v: (z.square().sum(),), logits, x.shape[2:],
                            derivatives=lambda z, t, v: ((z.square().sum(),), (2 * z,)))
    return sq / (logits.shape[0] * logits.shape[1] * x[0, 0].numel())


def bce_of_resized(model: SegmentationModel, x: torch.Tensor) -> torch.Tensor:
    """The trainer's default loss (``model.loss = "bce"``), as ``SegmentationTask.loss_terms``
    takes it, against fixed random 0/1 targets with a per-voxel validity mask."""
    logits = model(x, resize=False)
    shape = (x.shape[0], logits.shape[1], *x.shape[2:])
    if getattr(model, "bench_targets", None) is None or model.bench_targets.shape != shape:
        g = torch.Generator().manual_seed(2)
        model.bench_targets = (torch.rand(shape, generator=g) > 0.7).to(x.device, torch.uint8)
        model.bench_valid = torch.ones(shape, dtype=torch.uint8, device=x.device)
    # Compiled, as the trainer's, when the blocks are (training.compile).
    compiled = any(hasattr(b, "_orig_mod") for b in model.backbone.blocks)
    if getattr(model, "bench_loss", (None, None))[0] is not compiled:
        model.bench_loss = (compiled, build_loss("bce", compiled=compiled))
    total, count = model.bench_loss[1].resized(logits, x.shape[2:], model.bench_targets,
                                               model.bench_valid)
    return total / count


def build_3d(s: dict, num_classes: int = 4,
             multiscale: bool = False) -> tuple[list[Entry], tuple[int, ...]]:
    ViT = import_monai_vit()
    torch.manual_seed(0)
    grid = s["size"] // s["patch"]
    n = grid**3
    def backbone():
        return build_backbone("dinov3_vits16", ndim=3, in_chans=1, embed_dim=s["dim"],
                              depth=s["depth"], num_heads=s["heads"], patch_size=s["patch"])

    ours = backbone()
    seg = SegmentationModel(backbone(), num_classes, head="linear")
    seg_bce = SegmentationModel(backbone(), num_classes, head="linear")
    monai = ViT(in_channels=1, img_size=s["size"], patch_size=s["patch"], hidden_size=s["dim"],
                mlp_dim=4 * s["dim"], num_layers=s["depth"], num_heads=s["heads"],
                spatial_dims=3, classification=False)
    shape = (1, s["size"], s["size"], s["size"])
    entries = [
        Entry("ours", ours, lambda x, m=ours: m.forward_features(x)["x_norm_patchtokens"]
              .square().mean(), training_flops_per_sample(ours, shape), ours.blocks,
              our_extras(ours)),
        Entry("ours+linear", seg, lambda x, m=seg: mean_square_of_resized(m, x),
              training_flops_per_sample(seg, shape), seg.backbone.blocks,
              f"the backbone + a linear head of {n_params(seg.head)}"),
        Entry("ours+linear, bce", seg_bce, lambda x, m=seg_bce: bce_of_resized(m, x),
              training_flops_per_sample(seg_bce, shape), seg_bce.backbone.blocks,
              "the same, with the trainer's default loss (BCE against 0/1 targets, per-voxel "
              "validity)"),
    ]
    if multiscale:
        seg_ms = SegmentationModel(backbone(), num_classes, head="multiscale")
        entries.append(Entry(
            "ours+multiscale", seg_ms, lambda x, m=seg_ms: m(x).square().mean(),
            training_flops_per_sample(seg_ms, shape), seg_ms.backbone.blocks,
            f"the backbone + the multiscale head of {n_params(seg_ms.head)} (a convolutional "
            "decoder to full resolution, the image encoded at 1, 1/2 and 1/4 of it)"))
    entries += [
        Entry("MONAI ViT", monai, lambda x, m=monai: m(x)[0].square().mean(),
              peer_training_flops(monai, monai.patch_embedding.patch_embeddings, monai.blocks,
                                  n, n), monai.blocks,
              f"learned position table {monai.patch_embedding.position_embeddings.numel()}, "
              f"no qkv bias, an unused cross-attention norm per block "
              f"{sum(b.norm_cross_attn.weight.numel() * 2 for b in monai.blocks)}"),
    ]
    return entries, (s["batch"], *shape)


def timm_dinov3(timm, s: dict) -> nn.Module:
    """timm's DINOv3 ViT (an ``Eva`` with DINOv3's RoPE, LayerScale and 4 register tokens):
    ``vit_base_patch16_dinov3`` itself at the full sizes, the same family at toy sizes."""
    sizes = {} if s["dim"] == 768 else {"embed_dim": s["dim"], "depth": s["depth"],
                                        "num_heads": s["heads"]}
    return timm.create_model("vit_base_patch16_dinov3", pretrained=False, num_classes=0,
                             img_size=s["size"], **sizes)


def timm_state_dict(ours: nn.Module) -> dict[str, torch.Tensor]:
    """Our backbone's weights under the names of timm's DINOv3 ViT. timm's
    ``vit_base_patch16_dinov3`` has no qkv bias (Meta's released B/16 biases are zero), so ours
    must be zero to map; the mask token (MAE only) and the RoPE periods (a buffer computed
    from the same formula on both sides) are not mapped."""
    out = {}
    for k, v in ours.state_dict().items():
        if k.endswith("qkv.bias"):
            if v.any():
                raise ValueError(f"{k} is not zero: timm's vit_base_patch16_dinov3 has no qkv bias")
            continue
        if k in ("mask_token", "rope_embed.periods") or k.endswith("bias_mask"):
            continue
        out[k.replace("storage_tokens", "reg_token").replace("ls1.gamma", "gamma_1")
             .replace("ls2.gamma", "gamma_2")] = v
    return out


def timm_parity(ours: nn.Module, peer: nn.Module, shape: tuple[int, ...]) -> str:
    """Load random weights of ours (qkv bias zero) into copies of both models and compare
    their final-normalised tokens on one random batch: the largest absolute difference, and
    relative to the largest output."""
    import copy

    a, b = copy.deepcopy(ours).eval(), copy.deepcopy(peer).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in a.named_parameters():  # every weight random, norms and gammas near 1
            r = torch.randn(p.shape, generator=g)
            if name.endswith("qkv.bias"):
                p.zero_()
            elif p.dim() > 1:
                p.copy_(0.02 * r)
            elif name.endswith(("weight", "gamma")):
                p.copy_(1 + 0.1 * r)
            else:
                p.copy_(0.1 * r)
        b.load_state_dict(timm_state_dict(a), strict=True)
        x = torch.randn(*shape, generator=g)
        fa, fb = a.forward_features(x), b.forward_features(x)
    r = b.num_prefix_tokens
    diffs = {"patch tokens": fa["x_norm_patchtokens"] - fb[:, r:],
             "class token": fa["x_norm_clstoken"] - fb[:, 0],
             "register tokens": fa["x_storage_tokens"] - fb[:, 1:r]}
    top = fb.abs().max().item()
    worst = max(d.abs().max().item() for d in diffs.values())
    return (f"ours and timm's {type(b).__name__} on the same random weights (mapped by name), "
            f"batch {shape[0]}, eval: largest difference of the final-normalised tokens "
            f"{worst:.1e} (outputs up to {top:.2f}, relative {worst / top:.1e}; "
            + ", ".join(f"{k} {d.abs().max().item():.1e}" for k, d in diffs.items()) + ")")


def build_2d(s: dict) -> tuple[list[Entry], tuple[int, ...]]:
    timm = import_timm()

    torch.manual_seed(0)
    grid = s["size"] // s["patch"]
    n = grid**2
    ours = build_backbone("dinov3_vitb16", ndim=2, in_chans=3, embed_dim=s["dim"],
                          depth=s["depth"], num_heads=s["heads"], patch_size=s["patch"])
    peer = timm_dinov3(timm, s)
    r = peer.num_prefix_tokens
    shape = (3, s["size"], s["size"])
    entries = [
        Entry("ours", ours, lambda x, m=ours: m.forward_features(x)["x_norm_patchtokens"]
              .square().mean(), training_flops_per_sample(ours, shape), ours.blocks,
              our_extras(ours)),
        Entry("timm DINOv3 ViT", peer, lambda x, m=peer: m.forward_features(x)[:, r:]
              .square().mean(),
              peer_training_flops(peer, peer.patch_embed.proj, peer.blocks, n, n + r),
              peer.blocks, f"the same tokens (class + {r - 1} registers), RoPE and LayerScale, "
              "no qkv bias"),
    ]
    return entries, (s["batch"], *shape)


def step_gemms(e: Entry, x: torch.Tensor, heads: int, head_dim: int) -> list[tuple[int, ...]]:
    """The matmuls of one training step of ``e``, as (batch, m, k, n) shapes: found by
    running its forward once with hooks on every linear layer and the patch convolution
    (forward, input-gradient and weight-gradient GEMMs), plus the six batched matmuls per
    block of attention (forward scores and output; backward dP, dV, dQ, dK)."""
    shapes: list[tuple[int, ...]] = []

    def add_layer(m: int, k: int, n: int, input_grad: bool) -> None:
        shapes.append((1, m, k, n))              # forward
        if input_grad:
            shapes.append((1, m, n, k))          # gradient of the input
        shapes.append((1, n, m, k))              # gradient of the weight

    def on_linear(mod, inputs, out):
        a = inputs[0]
        add_layer(a.numel() // mod.in_features, mod.in_features, mod.out_features,
                  a.requires_grad)

    def on_patch_conv(mod, inputs, out):  # a convolution whose kernel equals its stride
        w = mod.weight
        add_layer(out.numel() // w.shape[0], w[0].numel(), w.shape[0], inputs[0].requires_grad)

    def on_attention(mod, inputs, out):
        b, t, _ = inputs[0].shape
        shapes.extend([(b * heads, t, head_dim, t), (b * heads, t, t, head_dim)] * 3)

    hooks = [m.register_forward_hook(on_linear) for m in e.model.modules()
             if isinstance(m, nn.Linear)]
    hooks += [m.register_forward_hook(on_patch_conv) for m in e.model.modules()
              if isinstance(m, (nn.Conv2d, nn.Conv3d)) and m.kernel_size == m.stride]
    hooks += [b.register_forward_hook(on_attention) for b in e.blocks]
    try:
        e.loss(x)
    finally:
        for h in hooks:
            h.remove()
    return shapes


class StepGemms:
    """The GEMMs of one step (shapes from :func:`step_gemms`), with their operands, to be
    timed back to back on their own."""

    def __init__(self, shapes: list[tuple[int, ...]]):
        self.shapes = shapes
        self.operands = {}
        for b, m, k, n in shapes:
            if (b, m, k, n) not in self.operands:
                self.operands[b, m, k, n] = (torch.randn(b, m, k).squeeze(0),
                                             torch.randn(b, k, n).squeeze(0))

    def seconds(self) -> float:
        t0 = time.perf_counter()
        for shape in self.shapes:
            a, w = self.operands[shape]
            torch.matmul(a, w)
        return time.perf_counter() - t0


def make_optimizer(model: nn.Module, impl: str) -> torch.optim.Optimizer:
    kw = {"foreach": impl == "foreach", "fused": True if impl == "fused" else None}
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, **kw)


def compile_blocks(blocks) -> None:
    for i in range(len(blocks)):
        blocks[i] = torch.compile(blocks[i])


def train_step(e: Entry, x: torch.Tensor) -> None:
    e.loss(x).backward()
    e.optimizer.step()
    e.optimizer.zero_grad(set_to_none=True)


def gemm_rate(n: int, dtype: torch.dtype) -> float:
    """FLOP/s of one n x n x n matmul (the best of 3)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def run_case(case: str, mode: str, args) -> None:
    s = SIZES[case][1 if args.tiny else 0]
    entries, shape = build_3d(s, multiscale=args.multiscale) if case == "3d" else build_2d(s)
    torch.manual_seed(1)
    x = torch.randn(*shape)
    for e in entries:
        e.model.train()
        e.gemms = StepGemms(step_gemms(e, x, s["heads"], s["dim"] // s["heads"]))
    for e in entries:
        if mode == "compiled":
            compile_blocks(e.blocks)
        e.optimizer = make_optimizer(e.model, args.adamw)
    warm = args.warmup + (1 if mode == "compiled" else 0)
    t0 = time.perf_counter()
    for e in entries:
        for _ in range(warm):
            train_step(e, x)
        e.gemms.seconds()
    setup = time.perf_counter() - t0
    gemm = gemm_rate(args.gemm, x.dtype)  # also warms the GEMM up
    gemms = []
    ours, peer = entries[0], entries[-1]
    # The ratios the goals are about, each taken within a round (two steps back to back).
    pairs = [(peer, ours, f"ours vs {peer.name} (its step / ours)")]
    pairs += [(e, ours, f"{e.name} / the backbone (step / step)") for e in entries[1:-1]]
    rounds = max(args.repeats, args.max_repeats)
    for r in range(rounds):
        order = entries if r % 2 == 0 else entries[::-1]
        for e in order:
            t0 = time.perf_counter()
            train_step(e, x)
            e.times.append(time.perf_counter() - t0)
            e.gemm_times.append(e.gemms.seconds())
        gemms.append(gemm_rate(args.gemm, x.dtype))
        if r + 1 >= args.repeats and all(
                ratio_spread(num.times, den.times)[1] < args.target_iqr for num, den, _ in pairs):
            break
    gemm = statistics.median(gemms)
    batch = shape[0]
    size = "x".join(map(str, shape[2:]))
    print(f"\n### {case}, {mode}: input {size}, batch {batch}, float32, AdamW ({args.adamw}), "
          f"{torch.get_num_threads()} threads, {len(ours.times)} rounds "
          f"(warm-up and compile {setup:.0f} s)")
    print(f"GEMM {args.gemm}^3 float32, median of the rounds: {gemm / 1e9:.1f} GFLOP/s "
          f"(min {min(gemms) / 1e9:.1f}, max {max(gemms) / 1e9:.1f})\n")
    print("| model | params (M) | s/step min / median / max | samples/s "
          "| GFLOP/sample | GFLOP/s | of GEMM peak | its GEMMs alone (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for e in entries:
        med = statistics.median(e.times)
        achieved = e.flops_per_sample * batch / med
        print(f"| {e.name} | {n_params(e.model) / 1e6:.2f} | {min(e.times):.3f} / {med:.3f} / "
              f"{max(e.times):.3f} | {batch / med:.2f} | "
              f"{e.flops_per_sample / 1e9:.2f} | {achieved / 1e9:.1f} | {achieved / gemm:.0%} | "
              f"{statistics.median(e.gemm_times):.3f} |")
    print("\n| ratio | median of the rounds' ratios | its 95% interval | its IQR / median "
          "| the rounds' q1-q3 | ratio of medians | ratio of minima |")
    print("|---|---|---|---|---|---|---|")
    for num, den, label in pairs:
        med, spread, (lo, hi), q1, q3 = ratio_spread(num.times, den.times, full=True)
        print(f"| {label} | **{med:.3f}x** | {lo:.3f}-{hi:.3f} | {spread:.1%} | "
              f"{q1:.3f}-{q3:.3f} | "
              f"{statistics.median(num.times) / statistics.median(den.times):.3f}x | "
              f"{min(num.times) / min(den.times):.3f}x |")
    ceiling = statistics.median(peer.times) / statistics.median(ours.gemm_times)
    print(f"\nceiling: {peer.name}'s median step / our model's GEMMs alone = {ceiling:.2f}x; "
          f"no {mode} step of ours that does these GEMMs in float32 can beat {peer.name} by "
          "more (everything else at zero cost)")
    print(f"\nparameters: ours / {peer.name} = {n_params(ours.model) / n_params(peer.model):.4f}; "
          f"ours has {ours.params_note}; {peer.name} has {peer.params_note}")
    for e in entries[1:-1]:
        print(f"{e.name}: {e.params_note}")
    if case == "2d" and mode == "eager":
        print("\nparity: " + timm_parity(ours.model, peer.model, (2, *shape[1:])))
    sys.stdout.flush()


def ratio_spread(num: list[float], den: list[float], full: bool = False):
    """The ratio of two models' steps taken within each round: (median, the median's IQR /
    median), and with ``full`` also the median's 95 % interval and the rounds' own q1, q3.

    The rounds' spread (q1-q3 of the per-round ratios) is the machine's noise and does not
    shrink with more rounds; the median's interval does (as 1 / sqrt(rounds)). Both
    intervals of the median are distribution-free, from order statistics (the ranks
    n/2 -+ z sqrt(n)/2, z = 0.674 for the IQR, 1.96 for 95 %). Fewer than 4 rounds have no
    spread (infinite)."""
    ratios = sorted(a / b for a, b in zip(num, den))
    med = statistics.median(ratios)
    if len(ratios) < 4:
        return (med, float("inf"), (med, med), med, med) if full else (med, float("inf"))
    lo50, hi50 = median_interval(ratios, 0.674)
    spread = (hi50 - lo50) / med
    if not full:
        return med, spread
    q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return med, spread, median_interval(ratios, 1.96), q1, q3


def median_interval(ordered: list[float], z: float) -> tuple[float, float]:
    """The interval of the median of ``ordered`` (sorted) values at the normal quantile
    ``z``: the order statistics of ranks floor(n/2 - z sqrt(n)/2) and ceil(1 + n/2 + z
    sqrt(n)/2) (1-based, clamped), which hold the median with that probability whatever the
    distribution."""
    n = len(ordered)
    half = z * math.sqrt(n) / 2
    lo = max(1, math.floor(n / 2 - half))
    hi = min(n, math.ceil(1 + n / 2 + half))
    return ordered[lo - 1], ordered[hi - 1]


def head_layouts(args) -> None:
    """Forward + backward of the multiscale head alone (random features), its decoder
    channels-last against the default layout, interleaved: in 3D at the 3D case's sizes, and
    in 2D at ``train_configs/own_em_segmentation_2d.toml``'s (vit_tiny, patch 16, 256^2, batch
    4, 128 channels, 4 image levels)."""
    from torchtitan.models.segmentation import UpConvHead

    s = SIZES["3d"][1 if args.tiny else 0]
    side2d = 64 if args.tiny else 256
    cases = {  # ndim: (head, features, image)
        3: (UpConvHead(3, s["dim"] * 4, 4, s["patch"], 1, image_levels=3),
            (s["batch"], s["dim"] * 4, *(s["size"] // s["patch"],) * 3),
            (s["batch"], 1, *(s["size"],) * 3)),
        2: (UpConvHead(2, 192 * 4, 3, 16, 1, channels=128, image_levels=4),
            (4, 192 * 4, side2d // 16, side2d // 16), (4, 1, side2d, side2d)),
    }
    default = UpConvHead.CHANNELS_LAST_NDIMS
    for ndim, (head, feature_shape, image_shape) in cases.items():
        torch.manual_seed(0)
        head.init_weights()
        features = [torch.randn(feature_shape, requires_grad=True)]
        image = torch.randn(image_shape)
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.repeats + 1):
            for last in ((True, False) if r % 2 == 0 else (False, True)):
                UpConvHead.CHANNELS_LAST_NDIMS = (ndim,) if last else ()
                t0 = time.perf_counter()
                head(features, image).square().mean().backward()
                if r:  # the first round warms up
                    times[last].append(time.perf_counter() - t0)
        UpConvHead.CHANNELS_LAST_NDIMS = default
        a, b = statistics.median(times[True]), statistics.median(times[False])
        print(f"\n### the {ndim}D multiscale head alone, forward + backward, input "
              f"{'x'.join(map(str, image_shape[2:]))}, batch {image_shape[0]}, {args.repeats} "
              f"repeats\n\nchannels-last {a:.3f} s, default layout {b:.3f} s (median): "
              f"**{a / b:.2f}x** (used in {ndim}D: {'yes' if ndim in default else 'no'})")


def profile_case(case: str, args) -> None:
    """torch.profiler (CPU) of a few steps of our model in ``case``: the top operators."""
    from torch.profiler import ProfilerActivity, profile

    s = SIZES[case][1 if args.tiny else 0]
    entries, shape = build_3d(s) if case == "3d" else build_2d(s)
    names = [x.name for x in entries]
    if args.profile_model not in names:
        raise SystemExit(f"--profile-model {args.profile_model!r}: not a model of {case} "
                         f"({', '.join(names)})")
    e = entries[names.index(args.profile_model)]
    print(f"### {e.name}, {case}, {args.repeats} steps")
    e.optimizer = make_optimizer(e.model, args.adamw)
    x = torch.randn(*shape)
    train_step(e, x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.repeats):
            train_step(e, x)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="3d,2d", help="comma-separated: 3d, 2d (default both)")
    p.add_argument("--modes", default="eager",
                   help="comma-separated: eager, compiled (default eager)")
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds at least (one timed step per model each; default 5)")
    p.add_argument("--max-repeats", type=int, default=0,
                   help="rounds at most: past --repeats, stop once the median of every ratio "
                        "has an IQR under --target-iqr of itself (default: --repeats, no "
                        "adaptive stop)")
    p.add_argument("--target-iqr", type=float, default=0.05,
                   help="the spread (the IQR of a ratio's median over the median) to reach "
                        "(default 0.05)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per model (default 1; "
                   "one more when compiled)")
    p.add_argument("--adamw", choices=("foreach", "for-loop", "fused"), default="fused",
                   help="AdamW implementation, the same for every model (default fused, "
                   "what the trainer runs where torch has a fused kernel)")
    p.add_argument("--gemm", type=int, default=4096, help="edge of the peak-rate GEMM")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    p.add_argument("--multiscale", action="store_true",
                   help="3d: also time the backbone with the multiscale head")
    p.add_argument("--tiny", action="store_true", help="toy sizes, for a quick check")
    p.add_argument("--profile", default=None, metavar="CASE",
                   help="profile our model's step in CASE (3d or 2d) instead of comparing")
    p.add_argument("--profile-model", default="ours",
                   help="the model --profile runs (a name of the comparison's table)")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--head-layouts", action="store_true",
                   help="time the multiscale head alone (3D and 2D), channels-last against the "
                        "default layout, instead of comparing")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tiny:
        args.gemm = min(args.gemm, 512)
    cases = args.cases.split(",")
    modes = args.modes.split(",")
    for name, allowed in (("--cases", SIZES), ("--modes", ("eager", "compiled"))):
        bad = [v for v in (cases if name == "--cases" else modes) if v not in allowed]
        if bad:
            raise SystemExit(f"{name}: unknown {bad}; expected some of {', '.join(allowed)}")
    if args.profile:
        if args.profile not in SIZES:
            raise SystemExit(f"--profile: expected one of {', '.join(SIZES)}, got {args.profile!r}")
        profile_case(args.profile, args)
        return 0
    if args.head_layouts:
        head_layouts(args)
        return 0
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for case in cases:
        for mode in modes:
            run_case(case, mode, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
