"""Optimizer parameter groups: weight decay and layer-wise LR decay."""

import pytest
import torch

from torchtitan.config.manager import ConfigManager
from torchtitan.errors import ConfigError
from torchtitan.models import build_backbone
from torchtitan.models.segmentation import SegmentationModel
from torchtitan.optimizer import build_lr_scheduler, build_optimizer, layer_depth


def _model():
    backbone = build_backbone("vit_debug", ndim=2, in_chans=1, patch_size=8)
    model = SegmentationModel(backbone, 3, head="multiscale", head_channels=16)
    model.init_weights()
    return model


def _cfg(*flags):
    return ConfigManager().parse_args(["--optimizer.lr", "1e-3", "--training.warmup_steps", "0",
                                       *flags])


def _lr_of(optimizer) -> dict[int, float]:
    return {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}


def test_without_layer_decay_two_groups_and_every_parameter_once():
    model = _model()
    opt = build_optimizer(model, _cfg())
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len(set(map(id, params))) == len(list(model.parameters()))
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)
    # Which parameters decay: every weight matrix and convolution kernel; no norm, bias,
    # LayerScale or token.
    decaying = {id(p) for p in opt.param_groups[0]["params"]}
    for name, p in model.named_parameters():
        token = name.split(".")[-1] in ("cls_token", "mask_token", "storage_tokens")
        assert (id(p) in decaying) == (p.ndim >= 2 and not token), name


def test_weight_matrices_decay_and_norms_do_not():
    """One AdamW step with zero gradients: a decaying parameter shrinks by exactly
    (1 - lr * weight_decay), the others stay as they were."""
    model = _model()
    opt = build_optimizer(model, _cfg("--optimizer.weight_decay", "0.1"))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    decaying = {id(p) for p in opt.param_groups[0]["params"]}
    kinds = {True: 0, False: 0}
    for name, p in model.named_parameters():
        shrunk = id(p) in decaying
        kinds[shrunk] += 1
        expected = before[name] * (1 - 1e-3 * 0.1) if shrunk else before[name]
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=0, msg=name)
    assert kinds[True] > 0 and kinds[False] > 0, kinds


def test_layer_decay_scales_the_lr_by_depth():
    model = _model()
    blocks = len(model.backbone.blocks)
    opt = build_optimizer(model, _cfg("--optimizer.layer_decay", "0.5"))
    lr = _lr_of(opt)
    named = dict(model.named_parameters())
    assert lr[id(named["head.classifier.weight"])] == pytest.approx(1e-3)
    assert lr[id(named["backbone.norm.weight"])] == pytest.approx(1e-3)
    last = blocks - 1
    assert lr[id(named[f"backbone.blocks.{last}.attn.qkv.weight"])] == pytest.approx(1e-3 * 0.5)
    assert lr[id(named["backbone.blocks.0.attn.qkv.weight"])] == pytest.approx(1e-3 * 0.5**blocks)
    assert lr[id(named["backbone.patch_embed.proj.weight"])] == pytest.approx(1e-3 * 0.5 ** (blocks + 1))
    assert lr[id(named["backbone.cls_token"])] == pytest.approx(1e-3 * 0.5 ** (blocks + 1))
    # Weight decay still follows the parameter's kind, and the schedule keeps the ratios.
    for g in opt.param_groups:
        kinds = {p.ndim <= 1 for p in g["params"]}
        assert len(kinds) == 1 or g["weight_decay"] == 0.0
    sched = build_lr_scheduler(opt, _cfg("--optimizer.layer_decay", "0.5", "--training.steps", "10"))
    for _ in range(5):
        opt.step()
        sched.step()
    lr5 = _lr_of(opt)
    head, first = id(named["head.classifier.weight"]), id(named["backbone.blocks.0.attn.qkv.weight"])
    assert lr5[head] < 1e-3
    assert lr5[first] / lr5[head] == pytest.approx(0.5**blocks)


def test_backbone_frozen_steps_hold_the_backbone_then_thaw_it():
    """The backbone's groups learn nothing for the first steps, then ramp up over the warmup
    into the schedule; the head follows the schedule from the first step."""
    torch.manual_seed(0)
    model = _model()
    cfg = _cfg("--lr_scheduler.backbone_frozen_steps", "3", "--training.warmup_steps", "2",
               "--training.steps", "10", "--lr_scheduler.decay_type", "constant")
    opt = build_optimizer(model, cfg)
    sched = build_lr_scheduler(opt, cfg, model)
    named = dict(model.named_parameters())
    backbone = [p for n, p in named.items() if n.startswith("backbone.")]
    # Groups hold the backbone or the rest, never both; the head's come first (logged LR).
    ids = {id(p) for p in backbone}
    kinds = [{id(p) in ids for p in g["params"]} for g in opt.param_groups]
    assert all(len(k) == 1 for k in kinds) and kinds[0] == {False}
    head, block = named["head.classifier.weight"], named["backbone.blocks.0.attn.qkv.weight"]
    x = torch.randn(2, 1, 32, 32)
    seen = []
    for step in range(5):
        before = block.detach().clone(), head.detach().clone()
        seen.append((_lr_of(opt)[id(head)], _lr_of(opt)[id(block)]))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        assert torch.equal(block, before[0]) == (step < 3), step
        assert not torch.equal(head, before[1]), step
    # head: warmup 0.5, 1, then constant; backbone: 0 for 3 steps, then 0.5 and 1 of that.
    expected = [(5e-4, 0), (1e-3, 0), (1e-3, 0), (1e-3, 5e-4), (1e-3, 1e-3)]
    assert [v for pair in seen for v in pair] == pytest.approx([v for e in expected for v in e])


def test_without_frozen_steps_the_groups_are_as_before():
    model = _model()
    plain = build_optimizer(model, _cfg())
    kept = build_optimizer(model, _cfg("--lr_scheduler.backbone_frozen_steps", "0"))
    assert len(plain.param_groups) == len(kept.param_groups) == 2
    with pytest.raises(ValueError, match="needs the model"):
        build_lr_scheduler(plain, _cfg("--lr_scheduler.backbone_frozen_steps", "2"))


def test_layer_depth_of_mae_and_segmentation_names():
    assert layer_depth("encoder.patch_embed.proj.weight", 4) == 0
    assert layer_depth("encoder.blocks.2.mlp.fc1.weight", 4) == 3
    assert layer_depth("encoder.norm.weight", 4) == 5
    assert layer_depth("decoder.blocks.0.attn.qkv.weight", 4) == 5
    assert layer_depth("head.proj.weight", 4) == 5


def test_layer_decay_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'optimizer\.layer_decay'.*1\.5 \(must be in \[0, 1\]\)"):
        _cfg("--optimizer.layer_decay", "1.5")


def _adamw_reference(params: list[torch.Tensor], grads: list[list[torch.Tensor]], group) -> list[torch.Tensor]:
    """AdamW written out in float64 (Loshchilov & Hutter's decoupled decay, bias-corrected
    moments, as torch.optim.AdamW defines it): the parameters after the recorded steps."""
    lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    out = []
    for k, p in enumerate(params):
        p = p.double().clone()
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        for t, step_grads in enumerate(grads, start=1):
            g = step_grads[k]
            p *= 1 - lr * decay
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
            p -= lr * m_hat / (v_hat.sqrt() + eps)
        out.append(p)
    return out


def test_the_fused_kernel_takes_adamw_steps():
    """The optimizer runs torch's fused kernel where it can, and its steps give the parameters
    of AdamW written out by hand in float64 on the same gradients (to float32 rounding)."""
    torch.manual_seed(0)
    x = torch.randn(2, 1, 32, 32)
    model = _model()
    opt = build_optimizer(model, _cfg())
    groups = opt.param_groups
    assert groups[0]["fused"] and not groups[0]["foreach"]
    assert {g["weight_decay"] for g in groups} == {0.05, 0.0}  # both kinds are exercised
    start = [[p.detach().clone() for p in g["params"]] for g in groups]
    grads: list[list[list[torch.Tensor]]] = [[] for _ in groups]
    for _ in range(3):
        model(x).square().mean().backward()
        for k, g in enumerate(groups):
            grads[k].append([p.grad.double().clone() for p in g["params"]])
        opt.step()
        opt.zero_grad()
    for k, g in enumerate(groups):
        expected = _adamw_reference(start[k], grads[k], g)
        # Every parameter that had a gradient moved (the comparison is not vacuous).
        for i, (p, p0) in enumerate(zip(g["params"], start[k])):
            assert torch.equal(p.detach(), p0) == all(not step[i].any() for step in grads[k])
        for p, ref in zip(g["params"], expected):
            torch.testing.assert_close(p.detach().double(), ref, rtol=1e-5, atol=1e-6)


def test_fused_falls_back_to_foreach_where_torch_has_no_fused_kernel(caplog):
    model = _model().to("meta")  # a device without fused Adam kernels
    with caplog.at_level("WARNING"):
        opt = build_optimizer(model, _cfg())
    group = opt.param_groups[0]
    assert not group["fused"] and group["foreach"]
    assert "no fused AdamW kernel" in caplog.text


def test_a_removed_option_says_what_replaced_it():
    with pytest.raises(ConfigError, match=r"'optimizer\.implementation' on the command line "
                                          r"is no longer an option: .*fused kernel"):
        _cfg("--optimizer.implementation", "foreach")
