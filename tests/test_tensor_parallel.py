"""Tensor-parallel plan and checks that need no process group (the multi-process parity and
checkpoint tests are in test_parity.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from torchtitan.config.manager import ConfigManager
from torchtitan.models.vit import Block
from torchtitan.parallelisms.parallel_dims import ParallelDims, ParallelismError
from torchtitan.parallelisms.parallelize import check_parallelism
from torchtitan.parallelisms.parallelize import clip_grad_norm_
from torchtitan.parallelisms.tensor_parallel import (
    PackedColwiseParallel,
    block_plan,
    from_storage_layout,
    to_storage_layout,
)
from torchtitan.tasks.mae import MAETask
from torchtitan.tasks.segmentation import SegmentationTask


def _meta_model(task_cls, *args):
    cfg = ConfigManager().parse_args(list(args))
    with torch.device("meta"):
        return task_cls(cfg).build_model(), cfg


def test_plan_shards_packed_qkv_per_head_and_swiglu_output_rowwise():
    plan = block_plan(Block(64, 4, ffn_layer="swiglu"))
    assert isinstance(plan["attn.qkv"], PackedColwiseParallel) and plan["attn.qkv"].parts == 3
    assert isinstance(plan["attn.proj"], RowwiseParallel)
    # w3(silu(w1 x) * w2 x): w1 and w2 are input projections, w3 the output projection.
    assert type(plan["mlp.w1"]) is ColwiseParallel and type(plan["mlp.w2"]) is ColwiseParallel
    assert isinstance(plan["mlp.w3"], RowwiseParallel)
    plan = block_plan(Block(64, 4, ffn_layer="mlp"))
    assert type(plan["mlp.fc1"]) is ColwiseParallel and isinstance(plan["mlp.fc2"], RowwiseParallel)


def test_heads_not_divisible_by_tp_names_the_backbone():
    model, cfg = _meta_model(SegmentationTask, "--model.backbone", "vit_tiny")  # 3 heads
    with pytest.raises(ParallelismError, match=r"model\.backbone='vit_tiny'.*degree in \[1, 3\]"):
        check_parallelism(model, ParallelDims(1, -1, 2, 2), cfg)
    model, cfg = _meta_model(SegmentationTask, "--model.backbone", "vit_debug")  # 2 heads
    check_parallelism(model, ParallelDims(1, -1, 2, 2), cfg)


def test_mae_decoder_heads_not_divisible_by_tp_names_the_decoder_option():
    model, cfg = _meta_model(MAETask, "--model.backbone", "vit_debug", "--model.decoder_dim", "48",
                             "--model.decoder_num_heads", "3")
    with pytest.raises(ParallelismError, match=r"decoder\.blocks has 3 heads.*decoder_num_heads"):
        check_parallelism(model, ParallelDims(1, -1, 2, 2), cfg)


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, foreach=False)
    assert float(clip_grad_norm_(ours, 0.5)) == float(expected)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)


def test_storage_layout_leaves_plain_tensors_alone():
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {}, "param_groups": [{"lr": 1}]}}
    stored = to_storage_layout(state)
    assert stored["model"]["w"] is state["model"]["w"]
    assert from_storage_layout(stored, state)["optimizer"] == state["optimizer"]
