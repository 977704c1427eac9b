"""Per-rank memory of parameters + gradients + optimizer state: FSDP vs DDP, side by side.

    python bench/memory.py [--backbone dinov3_vits16] [--nproc 2]

Launches two 2-process torchrun jobs (gloo, CPU) on the same model, one sharded (FSDP2) and
one replicated (DDP), through the project's own parallelize / optimizer code. After one
AdamW step each rank sums the bytes of the tensors it holds: its parameter shards, its
gradient shards and its optimizer state (exp_avg, exp_avg_sq). These are the memory FSDP
is meant to divide by the number of ranks; activations depend on the batch and are left out.
Prints a table and the FSDP / DDP ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _local_bytes(t) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def worker(mode: str, backbone: str, out: str) -> None:
    """One rank: build, parallelise, take one step, report the bytes held."""
    import torch
    import torch.distributed as dist

    from torchtitan.config.manager import ConfigManager
    from torchtitan.models import SegmentationModel, build_backbone
    from torchtitan.optimizer import build_optimizer
    from torchtitan.parallelisms.parallel_dims import ParallelDims
    from torchtitan.parallelisms.parallelize import parallelize, wrap_ddp

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    shard, replicate = (world, 1) if mode == "fsdp" else (1, world)
    cfg = ConfigManager().parse_args([
        "--training.data_parallel_shard_degree", str(shard),
        "--training.data_parallel_replicate_degree", str(replicate),
        "--training.mixed_precision_param", "float32"])
    dims = ParallelDims(replicate, shard, 1, world)
    mesh = dims.build_mesh("cpu")
    with torch.device("meta"):
        model = SegmentationModel(build_backbone(backbone, ndim=2, in_chans=1), num_classes=4)
    model = parallelize(model, dims, mesh, cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    model = wrap_ddp(model, dims, mesh)
    optimizer = build_optimizer(model, cfg)
    x = torch.randn(2, 1, 64, 64)
    model(x).float().square().mean().backward()
    optimizer.step()
    params = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters())
    states = sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.dim() > 0)
    report = {"rank": dist.get_rank(), "params": params, "grads": grads, "optimizer": states,
              "total": params + grads + states}
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    # Free DDP's reducer while the process group still exists (else exit can hang).
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


def run(mode: str, backbone: str, nproc: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", str(nproc), __file__, "--worker", mode,
                        "--backbone", backbone, "--out", str(out)],
                       check=True, env=env, cwd=REPO, capture_output=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backbone", default="dinov3_vits16")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", choices=("fsdp", "ddp"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.backbone, args.out)
        return
    results = {mode: run(mode, args.backbone, args.nproc) for mode in ("ddp", "fsdp")}
    mib = 2**20
    print(f"backbone {args.backbone}, {args.nproc} ranks, AdamW, float32; MiB per rank (max over ranks)")
    print(f"{'':6s} {'params':>9s} {'grads':>9s} {'optim':>9s} {'total':>9s}")
    peak = {}
    for mode, reports in results.items():
        worst = max(reports, key=lambda r: r["total"])
        peak[mode] = worst["total"]
        print(f"{mode:6s} {worst['params'] / mib:9.2f} {worst['grads'] / mib:9.2f} "
              f"{worst['optimizer'] / mib:9.2f} {worst['total'] / mib:9.2f}")
    print(f"FSDP / DDP = {peak['fsdp'] / peak['ddp']:.3f}")


if __name__ == "__main__":
    main()
