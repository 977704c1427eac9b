"""Run by test_context_parallel.py under ``torchrun --nproc_per_node 2`` (gloo, float32).

Each rank builds the same small 3D models twice from one seed: a reference, run on the whole
batch in this process alone, and a copy whose sequences are split over the two ranks
(``apply_cp``). For each model it checks that the context-parallel loss (each rank's (sum,
count) over its slab, added over the ranks) and the parameter gradients (each rank's, summed
over the ranks, as FSDP's reduction over the CP ranks does) equal the reference's to 1e-5,
and that in eval mode the copy returns the reference's whole output. The losses are the
tasks' own (``SegmentationTask.loss_terms``, ``MAETask.loss_terms``), so that what training
computes is what is checked. Prints ``CP OK <case>`` per case; any mismatch raises.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torchtitan.config.job_config import JobConfig
from torchtitan.data.sampling.batch import Batch
from torchtitan.models.mae import MaskedAutoencoder
from torchtitan.models.segmentation import SegmentationModel
from torchtitan.models.vit import DinoVisionTransformer
from torchtitan.parallelisms.context_parallel import apply_cp
from torchtitan.tasks.mae import MAETask
from torchtitan.tasks.segmentation import SegmentationTask

TOL = 1e-5
PATCH = 4
SPATIAL = (16, 12, 8)  # patch grid (4, 3, 2): 24 tokens, 12 per rank


def backbone() -> DinoVisionTransformer:
    return DinoVisionTransformer(ndim=3, patch_size=PATCH, in_chans=1, embed_dim=32, depth=4,
                                 num_heads=2, n_storage_tokens=2, ffn_layer="swiglu",
                                 layerscale_init=1.0)


def job_config(**sections) -> JobConfig:
    """The defaults with the settings the tasks read here (the segmentation task's outputs,
    loss_terms): a real config, so that a new option has its default."""
    cfg = JobConfig()
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


SEGMENTATION = SegmentationTask(job_config(model={"loss": "bce", "class_weights": []},
                                           data={"classes": ["a"]}))
MAE = MAETask(job_config(model={"mask_ratio": 0.5, "patch_size": PATCH, "norm_pix_loss": True}))


def batch(image, valid, **fields) -> Batch:
    n = image.shape[0]
    return Batch(image=image, valid=valid, index=torch.arange(n), resampled=torch.zeros(n, dtype=torch.int64),
                 **fields)


def check_close(name: str, ours: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().clamp_min(1e-12)
    err = float((ours - ref).abs().max() / scale)
    if not err <= TOL:
        raise AssertionError(f"{name}: relative error {err:.2e} > {TOL}")
    return err


def check_case(name, reference, loss_fn, eval_fn, mesh):
    torch.manual_seed(0)  # same inputs on every rank: a CP group shares its samples
    cp = copy.deepcopy(reference)
    apply_cp(cp, mesh)
    reference.train(), cp.train()
    s, c = loss_fn(reference)
    (s / c).backward()
    s_cp, c_cp = loss_fn(cp)
    total = torch.stack([s_cp.detach(), c_cp.detach()])
    dist.all_reduce(total)
    (s_cp / total[1]).backward()
    worst = check_close(f"{name} loss", total[0] / total[1], (s / c).detach())
    for (key, p), q in zip(reference.named_parameters(), cp.parameters()):
        if p.grad is None:
            assert q.grad is None or not q.grad.any(), key
            continue
        g = q.grad.clone() if q.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        worst = max(worst, check_close(f"{name} grad {key}", g, p.grad))
    reference.eval(), cp.eval()
    with torch.no_grad():
        worst = max(worst, check_close(f"{name} eval output", eval_fn(cp), eval_fn(reference)))
    if dist.get_rank() == 0:
        print(f"CP OK {name} loss {float((s / c).detach()):.6f} worst relative error {worst:.1e}", flush=True)


def main() -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    image = torch.randn(2, 1, *SPATIAL)
    target = (torch.rand(2, 3, *SPATIAL) > 0.7).float()
    valid = torch.rand(2, 3, *SPATIAL) > 0.1
    valid[1, 2] = False  # a class not annotated in one sample
    for head in ("linear", "multiscale"):
        torch.manual_seed(1)
        model = SegmentationModel(backbone(), 3, head=head, head_channels=16)
        seg_batch = batch(image, valid, target=target)
        check_case(f"segmentation_3d_{head}", model,
                   lambda m: SEGMENTATION.loss_terms(m, seg_batch), lambda m: m(image), mesh)
    torch.manual_seed(2)
    mae = MaskedAutoencoder(backbone(), decoder_dim=32, decoder_depth=2, decoder_num_heads=2)
    noise = torch.rand(2, 24)
    mae_valid = torch.ones(2, 1, *SPATIAL)
    mae_valid[0, :, :3] = 0  # padding in the first rows of one sample
    mae_batch = batch(image, mae_valid, noise=noise)
    check_case("mae_3d", mae, lambda m: MAE.loss_terms(m, mae_batch),
               lambda m: m(image, 0.5, noise)[0], mesh)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
