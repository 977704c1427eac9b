"""Context parallelism: activation memory per rank and step time of a 3D ViT against the
sequence length, CP 1 (one process) against CP N (N processes, one sample split in N slabs).

    python bench/context_parallel.py                 # CPU, 2 gloo processes, a few minutes
    python bench/context_parallel.py --device cuda --dim 1024 --depth 24 --heads 16 \\
        --rows 16,32,64 --side 256 --patch 8         # on GPUs (NCCL), the same measurement

The model is the 3D segmentation model (``SegmentationModel``, linear head, BCE loss) through
the project's own ``apply_cp``; one sample of ``rows x side/patch x side/patch`` patches.

What is measured, per rank:
* ``activation MB``: the bytes of the tensors the forward pass saves for the backward pass
  (saved-tensor hooks; each storage counted once; parameters left out). These are what grows
  with the sequence and what CP divides; on a GPU the script also reports the peak of
  ``torch.cuda.max_memory_allocated`` over the step.
* ``step s``: forward + backward, median of ``--steps`` after one warm-up (each process uses
  ``--threads`` threads on the CPU, the same for CP 1 and CP N).
* The longest sequence that fits a per-rank cap (``--cap-mb``, default: CP 1's activation
  memory at the middle length) among lengths of 1..``--max-rows`` rows of patches (forward
  only, to count the saved bytes).

Prints a Markdown table (the one in docs/benchmarks/context_parallel.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class SavedBytes:
    """Sums the bytes of the distinct storages saved for backward while active."""

    def __init__(self, exclude):
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self.seen: dict[int, int] = {}

    def pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.exclude:
            self.seen[ptr] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def build(args, device):
    import torch

    from torchtitan.models.segmentation import SegmentationModel
    from torchtitan.models.vit import DinoVisionTransformer

    torch.manual_seed(0)
    vit = DinoVisionTransformer(ndim=3, patch_size=args.patch, in_chans=1, embed_dim=args.dim,
                                depth=args.depth, num_heads=args.heads, ffn_layer="mlp")
    return SegmentationModel(vit, num_classes=4, head="linear").to(device)


def step(model, rows, args, device, backward=True):
    """One forward (+ backward); returns the saved bytes of the forward."""
    import torch

    from torchtitan.models.context import context_shard, local_part
    from torchtitan.models.losses import build_loss

    side = args.side
    x = torch.randn(1, 1, rows * args.patch, side, side, device=device)
    target = (x > 0).float().expand(1, 4, *x.shape[2:])
    valid = torch.ones_like(target, dtype=torch.bool)
    meter = SavedBytes(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t):
        logits = model(x)
        shard = context_shard(model)
        loss, count = build_loss("bce")(logits, local_part(shard, target),
                                        local_part(shard, valid))
    if backward:
        (loss / count).backward()
        model.zero_grad(set_to_none=True)
    return meter.total


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.parallelisms.context_parallel import apply_cp

    cuda = args.device == "cuda"
    rank = int(os.environ.get("RANK", 0))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if cuda else "cpu")
    torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    rows_list = [int(r) for r in args.rows.split(",")]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def measure(model, rows, cp):
        """(activation bytes, step seconds, peak bytes on the GPU or None)."""
        saved = step(model, rows, args, device)  # warm-up
        times = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            step(model, rows, args, device)
            sync()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() if cuda else None
        return saved, statistics.median(times), peak

    def longest(model, cap, together):
        """Binary search over multiples of the group size (memory grows with the length)."""
        lo, hi = 0, args.max_rows // world  # in units of `world` rows; lo fits (0: nothing)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            try:
                saved = step(model, mid * world, args, device, backward=False)
            except torch.OutOfMemoryError:  # on a GPU: does not fit either
                saved = float("inf")
                torch.cuda.empty_cache()
            fits = torch.tensor([float(saved <= cap)], device=device)
            if together:  # every rank of the group takes the same branch
                dist.all_reduce(fits, op=dist.ReduceOp.MIN)
            if fits.item():
                lo = mid
            else:
                hi = mid - 1
        return lo * world

    results = {"cp1": {}, f"cp{world}": {}}
    single = build(args, device)
    single.train()
    if rank == 0:  # CP 1: one process; the others wait
        for rows in rows_list:
            results["cp1"][rows] = measure(single, rows, 1)
    dist.barrier()
    model = build(args, device)
    apply_cp(model, init_device_mesh(device.type, (world,), mesh_dim_names=("cp",)))
    model.train()
    for rows in rows_list:
        results[f"cp{world}"][rows] = measure(model, rows, world)
    cap = args.cap_mb * 2**20 if args.cap_mb else None
    if rank == 0:
        if cap is None:
            cap = results["cp1"][rows_list[len(rows_list) // 2]][0]
        results["cap"] = cap
        results["longest_cp1"] = longest(single, cap, together=False)
    cap_t = torch.tensor([float(cap or 0)], device=device)
    dist.broadcast(cap_t, 0)
    results[f"longest_cp{world}"] = longest(model, cap_t.item(), together=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    # Free what holds on to the process group (the CP model's gather, the mesh) while the group
    # exists: a gloo group torn down after destroy_process_group can abort a rank at exit.
    del single, model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def report(results: dict, args, world: int) -> None:
    tokens_per_row = (args.side // args.patch) ** 2
    cpn = f"cp{world}"
    gpu = args.device == "cuda"
    print(f"\n3D ViT (dim {args.dim}, depth {args.depth}, {args.heads} heads, patch "
          f"{args.patch}), one sample of rows x {args.side // args.patch} x "
          f"{args.side // args.patch} patches, linear head, {args.device}\n")
    head = (f"| tokens | CP 1 activation MB | CP {world} activation MB / rank | ratio | "
            f"CP 1 step s | CP {world} step s |")
    sep = "|---:|---:|---:|---:|---:|---:|"
    if gpu:
        head += f" CP 1 peak MB | CP {world} peak MB / rank |"
        sep += "---:|---:|"
    print(head)
    print(sep)
    mb = 2**20
    for rows, (saved1, t1, peak1) in sorted(results["cp1"].items(), key=lambda kv: int(kv[0])):
        saved2, t2, peak2 = results[cpn][rows]
        line = (f"| {int(rows) * tokens_per_row} | {saved1 / mb:.1f} | {saved2 / mb:.1f} | "
                f"{saved2 / saved1:.2f} | {t1:.3f} | {t2:.3f} |")
        if gpu:
            line += f" {peak1 / mb:.0f} | {peak2 / mb:.0f} |"
        print(line)
    l1, l2 = results["longest_cp1"], results[f"longest_{cpn}"]
    print(f"\nLongest sequence whose activations fit {results['cap'] / mb:.1f} MB per rank: "
          f"CP 1 {l1 * tokens_per_row} tokens, CP {world} {l2 * tokens_per_row} tokens "
          f"({l2 / max(l1, 1):.2f}x)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp-degree", type=int, default=2,
                   help="CP degree (processes; not --nproc, which torchrun would take as its own)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--side", type=int, default=64, help="crop height and width (voxels)")
    p.add_argument("--rows", default="8,16,32",
                   help="sequence lengths to time, in rows of patches (each side/patch squared "
                        "tokens); multiples of --cp-degree")
    p.add_argument("--max-rows", type=int, default=96, help="longest length the cap search tries")
    p.add_argument("--cap-mb", type=float, default=0.0,
                   help="per-rank activation cap for the longest-sequence search (default: CP 1's "
                        "activation memory at the middle length)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        forwarded = [a for a in (argv if argv is not None else sys.argv[1:])]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(args.cp_degree), str(Path(__file__).resolve()),
               *forwarded, "--worker", "--out", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        r = subprocess.run(cmd, cwd=REPO, env=env)
        if r.returncode != 0:
            return r.returncode
        report(json.loads(out.read_text()), args, args.cp_degree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
