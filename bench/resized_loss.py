"""The segmentation loss on the linear head's logits: slab by slab (``Loss.resized``, what the
trainer runs) against the whole resized logits (``loss(resize_linear(logits), ...)``), side
by side in one process.

    python bench/resized_loss.py [--size 96] [--classes 4] [--batch 2] [--patch 16] [--repeats 15]

For each loss: forward + backward milliseconds (median, the ways interleaved; the third is the
first with the loss compiled, as ``training.compile = true`` runs it), and the
bytes autograd keeps between forward and backward (every tensor saved for the backward pass,
counted by a saved-tensor hook, but for the logits, targets and mask, which live anyway): the
memory that grows with the crop and the classes. Targets
are random 0/1 (uint8) with a per-voxel validity mask (uint8), as the loader gives them.

A last line gives the floor of any BCE step on these logits: one softplus (the loss) and one
sigmoid (its derivative) of every full-resolution logit, in place on a slab that stays in the
cache, with no resize, mask or target: the element-wise work that no layout of the loss avoids.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from torchtitan.models import LOSSES, build_loss
from torchtitan.models.resize import SLAB_ELEMENTS, resize_linear


def saved_bytes(fn, inputs: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the tensors autograd saves while ``fn()`` builds its graph (each storage once),
    but for the storages of ``inputs``, which live anyway."""
    skip = {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=96, help="crop edge (3D)")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    size = (args.size,) * 3
    grid = args.size // args.patch
    low = torch.randn(args.batch, args.classes, grid, grid, grid, requires_grad=True)
    shape = (args.batch, args.classes, *size)
    targets = (torch.rand(shape) > 0.7).to(torch.uint8)
    valid = (torch.rand(shape) > 0.1).to(torch.uint8)
    full_mb = low.new_empty(shape).nbytes / 2**20
    print(f"### logits {args.batch} x {args.classes} x {args.size}^3 from a {grid}^3 patch grid "
          f"({full_mb:.0f} MB of float32 at full resolution), {torch.get_num_threads()} threads, "
          f"slabs of about {SLAB_ELEMENTS['cpu']} elements on the CPU, median of {args.repeats}\n")
    print("| loss | slab by slab (ms) | whole logits (ms) | speed-up | slab by slab, compiled "
          "(ms) | kept for backward: slabs | whole |")
    print("|---|---|---|---|---|---|---|")
    for name in LOSSES:
        loss = build_loss(name)
        fused = build_loss(name, compiled=True)  # what training.compile = true runs

        def slabs():
            total, count = loss.resized(low, size, targets, valid)
            return total / count

        def compiled():
            total, count = fused.resized(low, size, targets, valid)
            return total / count

        def whole():
            total, count = loss(resize_linear(low, size), targets, valid)
            return total / count

        times = {slabs: [], whole: [], compiled: []}
        for fn in times:
            fn().backward()  # and compiles
        for r in range(args.repeats):
            for fn in (list(times) if r % 2 == 0 else list(times)[::-1]):
                t0 = time.perf_counter()
                fn().backward()
                times[fn].append(time.perf_counter() - t0)
        a, b, c = (statistics.median(times[fn]) * 1e3 for fn in (slabs, whole, compiled))
        inputs = (low, targets, valid)
        ka, kb = saved_bytes(slabs, inputs) / 2**20, saved_bytes(whole, inputs) / 2**20
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {c:.1f} | {ka:.2f} MB | "
              f"{kb:.0f} MB |")
        sys.stdout.flush()
    print(f"\nfloor of bce: {element_floor(shape, args.repeats) * 1e3:.1f} ms (softplus + sigmoid "
          "of every full-resolution logit, slab by slab, nothing else)")
    return 0


def element_floor(shape: tuple[int, ...], repeats: int) -> float:
    """Median seconds of one softplus and one sigmoid of ``prod(shape)`` logits, taken in
    slabs of ``SLAB_ELEMENTS["cpu"]`` elements computed in place (cache-resident)."""
    n = 1
    for d in shape:
        n *= d
    slab = torch.randn(min(n, SLAB_ELEMENTS["cpu"]))
    out = torch.empty_like(slab)
    pieces = -(-n // slab.numel())
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(pieces):
            torch.nn.functional.softplus(slab, out=out)
            torch.sigmoid(slab, out=out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


if __name__ == "__main__":
    sys.exit(main())
