"""The throughput counters: FLOPs per sample (MAE at its configured mask ratio) and MFU
against the peak of the precision the step runs in."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from torchtitan.config.manager import ConfigManager
from torchtitan.data.sampling.batch import Batch
from torchtitan.logging_metrics import PEAK_FLOPS, Throughput, matmul_precision, peak_flops
from torchtitan.tasks.mae import MAETask


@pytest.mark.parametrize("mask_ratio", [0.5, 0.9])
def test_mae_flops_per_sample_follow_the_configured_mask_ratio(mask_ratio):
    """Against torch's FLOP counter on one real training forward and backward of the task
    (at the default 0.75 the encoder would see a different number of tokens)."""
    cfg = ConfigManager().parse_args([
        "--job.config_file", "train_configs/debug_mae_2d.toml", "--model.backbone", "vit_debug",
        "--model.crop_size", "32,32", "--model.mask_ratio", str(mask_ratio)])
    task = MAETask(cfg)
    torch.manual_seed(0)
    model = task.build_model()
    model.init_weights()
    batch_size = 2
    image = torch.randn(batch_size, 1, 32, 32)
    batch = Batch(image=image, valid=torch.ones_like(image), index=torch.arange(batch_size),
                  resampled=torch.zeros(batch_size, dtype=torch.int64),
                  noise=torch.rand(batch_size, task.num_patches()))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        total, count = task.loss_terms(model, batch)
        (total / count).backward()
    measured = counter.get_total_flops() / batch_size
    estimate = task.flops_per_sample(model)
    assert abs(estimate - measured) / measured < 0.05, (estimate, measured)


def test_peak_flops_by_precision():
    h100 = "NVIDIA H100 80GB HBM3"
    assert peak_flops(h100, "bfloat16") == 989e12
    assert peak_flops(h100, "tf32") == 494.5e12
    assert peak_flops(h100, "float32") == 66.9e12
    assert peak_flops("NVIDIA GH200 480GB", "tf32") == PEAK_FLOPS["GH200"]["tf32"]
    assert peak_flops("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12
    assert peak_flops("Some Other GPU", "bfloat16") is None
    # Every GPU has all three.
    assert {frozenset(v) for v in PEAK_FLOPS.values()} == {frozenset({"bfloat16", "tf32", "float32"})}


def test_the_step_precision_picks_the_peak():
    """bf16 steps use the bf16 peak; float32 steps the TF32 one when float32 matmuls run as
    TF32, else the IEEE float32 one."""
    assert matmul_precision(torch.bfloat16) == "bfloat16"
    saved = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        assert matmul_precision(torch.float32) == "tf32"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert matmul_precision(torch.float32) == "float32"
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved
    with pytest.raises(ValueError, match="float16"):
        matmul_precision(torch.float16)


def test_throughput_on_a_cpu_reports_no_mfu():
    meter = Throughput(1000, 1e9, 4, 1, torch.device("cpu"), torch.float32)
    meter.tick()
    out = meter.report()
    assert "mfu_percent" not in out and out["tflops_per_device"] > 0
