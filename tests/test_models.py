"""Tests of torchtitan/models: DINOv3 parity, 2D/3D shapes, RoPE, meta init, MAE,
segmentation, attention backends and FLOPs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from torchtitan.models import (
    BACKBONES,
    DinoVisionTransformer,
    MaskedAutoencoder,
    RopePositionEmbedding,
    SegmentationModel,
    build_backbone,
    list_backbones,
    masked_bce_loss,
    resolve_attention_backend,
    rope_apply,
    training_flops_per_sample,
)
from torchtitan.models.attention import attention
from torchtitan.models.mae import patchify, random_masking, unpatchify
from torchtitan.models.segmentation import backbone_out_indices

from conftest import assert_meta_init_is_finite

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


def small_vit(ndim: int = 2, **kw) -> DinoVisionTransformer:
    cfg = dict(ndim=ndim, patch_size=8, in_chans=1, embed_dim=48, depth=3, num_heads=2)
    cfg.update(kw)
    return DinoVisionTransformer(**cfg)


# --------------------------------------------------------------------------- parity
@pytest.fixture(scope="module")
def reference():
    path = FIXTURES / "dinov3_reference_outputs.pt"
    if not path.exists():
        pytest.skip(f"DINOv3 reference fixtures not found at {path}")
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("name", ["tiny_mlp", "tiny_swiglu"])
def test_dinov3_parity(reference, name):
    ref = reference[name]
    model = DinoVisionTransformer(ndim=2, **ref["config"])
    model.load_state_dict(ref["state_dict"], strict=True)
    model.eval()
    with torch.no_grad():
        out = model.forward_features(ref["input"])
        inter = model.get_intermediate_layers(
            ref["input"], n=[0, 2], reshape=True, norm=True, return_class_token=True
        )
    for key in ("x_norm_clstoken", "x_storage_tokens", "x_norm_patchtokens"):
        assert out[key].shape == ref[key].shape
        assert (out[key] - ref[key]).abs().max() < 1e-4, key
    assert len(inter) == len(ref["intermediate_layers"])
    for (patch_map, cls), ref_map, ref_cls in zip(
        inter, ref["intermediate_patch_maps"], ref["intermediate_class_tokens"]
    ):
        assert patch_map.shape == ref_map.shape
        assert (patch_map - ref_map).abs().max() < 1e-4
        assert (cls - ref_cls).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["tiny_mlp", "tiny_swiglu"])
def test_fresh_buffers_match_meta(reference, name):
    """Our own init computes the same RoPE periods and k-bias mask as Meta's."""
    ref = reference[name]
    model = DinoVisionTransformer(ndim=2, **ref["config"])
    sd = model.state_dict()
    assert torch.equal(sd["rope_embed.periods"], ref["state_dict"]["rope_embed.periods"])
    assert torch.equal(sd["blocks.0.attn.qkv.bias_mask"], ref["state_dict"]["blocks.0.attn.qkv.bias_mask"])


def test_meta_pth_files_load_strictly():
    for fname, ffn in [("dinov3_tiny_mlp.pth", "mlp"), ("dinov3_tiny_swiglu.pth", "swiglu")]:
        path = FIXTURES / fname
        if not path.exists():
            pytest.skip(f"{path} not found")
        sd = torch.load(path, weights_only=True)
        model = DinoVisionTransformer(
            ndim=2, embed_dim=64, depth=3, num_heads=4, ffn_layer=ffn, ffn_ratio=4.0 if ffn == "mlp" else 6.0
        )
        model.load_state_dict(sd, strict=True)


def test_strict_load_reports_missing_key():
    model = small_vit()
    sd = model.state_dict()
    del sd["blocks.1.ls1.gamma"]
    with pytest.raises(RuntimeError, match="blocks.1.ls1.gamma"):
        small_vit().load_state_dict(sd, strict=True)


def test_state_dict_names():
    keys = set(build_backbone("vit_debug", ffn_layer="swiglu").state_dict())
    for key in ("cls_token", "storage_tokens", "mask_token", "patch_embed.proj.weight", "rope_embed.periods",
                "blocks.0.attn.qkv.bias_mask", "blocks.1.mlp.w3.weight", "blocks.0.ls2.gamma", "norm.weight"):
        assert key in keys
    with torch.device("meta"):
        big = build_backbone("dinov3_vit7b16")
    keys = set(big.state_dict())
    assert "local_cls_norm.weight" in keys and "blocks.0.attn.qkv.bias" not in keys
    assert big.blocks[0].mlp.w1.out_features % 64 == 0


# --------------------------------------------------------------------------- shapes
def test_forward_3d_non_cubic():
    model = build_backbone("vit_debug", ndim=3, in_chans=1).eval()
    x = torch.randn(2, 1, 32, 48, 64)
    out = model.forward_features(x)
    assert out["x_norm_patchtokens"].shape == (2, 2 * 3 * 4, 64)
    assert out["x_storage_tokens"].shape == (2, 4, 64)
    assert model(x).shape == (2, 64)
    maps = model.get_intermediate_layers(x, n=2, reshape=True)
    assert len(maps) == 2 and maps[0].shape == (2, 64, 2, 3, 4)
    # The reshaped last map is the patch tokens laid out on the (z, y, x) grid.
    torch.testing.assert_close(maps[-1].flatten(2).transpose(1, 2), out["x_norm_patchtokens"])


def test_forward_2d_non_square():
    model = small_vit(ndim=2).eval()
    x = torch.randn(3, 1, 24, 40)
    out = model.forward_features(x)
    assert out["x_norm_patchtokens"].shape == (3, 15, 48)
    (maps,) = model.get_intermediate_layers(x, n=[1], reshape=True)
    assert maps.shape == (3, 48, 3, 5)
    with pytest.raises(ValueError, match="multiple of the patch size"):
        model(torch.randn(1, 1, 20, 40))


def test_masked_forward_uses_mask_token():
    model = small_vit().eval()
    x = torch.randn(2, 1, 16, 16)
    masks = torch.zeros(2, 4, dtype=torch.bool)
    masks[0, 1] = True
    with torch.no_grad():
        model.mask_token.normal_()
        a = model.forward_features(x)["x_norm_patchtokens"]
        b = model.forward_features(x, masks)["x_norm_patchtokens"]
    assert torch.allclose(a[1], b[1]) and not torch.allclose(a[0], b[0])


# ----------------------------------------------------------------------------- rope
def _scores(rope: RopePositionEmbedding, coords: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    sin, cos = rope.sincos_from_coords(coords)
    return rope_apply(q, sin, cos) @ rope_apply(k, sin, cos).transpose(-1, -2)


def test_rope_3d_relative_positions():
    rope = RopePositionEmbedding(128, num_heads=2, ndim=3)  # head_dim 64: 10 periods per axis
    assert rope.periods.shape == (10,)
    coords = rope.grid_coords((2, 3, 4))
    assert coords.shape == (24, 3) and coords.min() > -1 and coords.max() < 1
    q, k = torch.randn(2, 1, 24, 64, dtype=torch.float64).unbind(0)
    rope.dtype = torch.float64
    rope.periods = rope.periods.double()
    base = _scores(rope, coords.double(), q, k)
    shifted = _scores(rope, coords.double() + torch.tensor([0.3, -1.7, 2.5], dtype=torch.float64), q, k)
    torch.testing.assert_close(base, shifted)
    # Positions matter: a different relative layout changes the scores.
    assert not torch.allclose(base, _scores(rope, coords.double() * 2, q, k))


def test_rope_shapes_and_passthrough():
    rope = RopePositionEmbedding(64, num_heads=1, ndim=3)
    sin, cos = rope((2, 3, 4))
    assert sin.shape == cos.shape == (24, 64)
    # 2 * 3 * 10 = 60 rotated channels; the 4 left over (2 in each half) are not rotated.
    assert torch.all(sin[:, 30:32] == 0) and torch.all(cos[:, 30:32] == 1)
    assert torch.all(sin[:, 62:] == 0)
    rope2d = RopePositionEmbedding(64, num_heads=4, ndim=2)
    assert rope2d.periods.shape == (4,)
    assert rope2d((3, 5))[0].shape == (15, 16)


def test_block_accepts_per_sample_rope():
    model = small_vit(ndim=3).eval()
    sin, cos = model.rope_embed((2, 2, 2))
    x = torch.randn(3, model.num_prefix_tokens + 8, 48)
    block = model.blocks[0]
    a = block(x, (sin, cos))
    b = block(x, (sin.expand(3, -1, -1), cos.expand(3, -1, -1)))
    torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------- meta init
def test_meta_device_build_and_init():
    torch.manual_seed(0)
    cpu_model = build_backbone("vit_debug", ndim=3, in_chans=1)
    with torch.device("meta"):
        model = build_backbone("vit_debug", ndim=3, in_chans=1)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    with torch.no_grad():  # to_empty leaves garbage: make sure init overwrites everything
        for t in list(model.parameters()) + list(model.buffers()):
            t.fill_(float("nan"))
    model.init_weights()
    cpu_sd, sd = cpu_model.state_dict(), model.state_dict()
    assert list(cpu_sd) == list(sd)
    for key in sd:
        assert sd[key].shape == cpu_sd[key].shape and torch.isfinite(sd[key]).all(), key
    torch.testing.assert_close(sd["rope_embed.periods"], cpu_sd["rope_embed.periods"])
    torch.testing.assert_close(sd["blocks.1.attn.qkv.bias_mask"], cpu_sd["blocks.1.attn.qkv.bias_mask"])
    assert torch.all(sd["blocks.0.ls1.gamma"] == 1e-5)
    out = model.forward_features(torch.randn(1, 1, 32, 32, 32))
    assert torch.isfinite(out["x_norm_patchtokens"]).all()


def test_meta_init_of_mae_and_segmentation():
    with torch.device("meta"):
        mae = MaskedAutoencoder(build_backbone("vit_debug", ndim=2, in_chans=1), decoder_dim=32, decoder_num_heads=2)
        seg = SegmentationModel(build_backbone("vit_debug", ndim=2, in_chans=1), num_classes=3)
    for model in (mae, seg):
        assert_meta_init_is_finite(model)
    x = torch.randn(2, 1, 32, 32)
    pred, mask = mae(x, 0.75, torch.rand(2, 4))
    assert torch.isfinite(mae.loss_terms(x, pred, mask)[0]) and torch.isfinite(seg(x)).all()


# ----------------------------------------------------------------------- registry
# Published sizes (millions): Meta's model cards round S to 21M and L to 300M; the
# exact counts of their checkpoints are 21.6M and 303.1M.
EXPECTED_PARAMS_M = {
    "dinov3_vits16": 21.6,
    "dinov3_vits16plus": 28.7,
    "dinov3_vitb16": 85.7,
    "dinov3_vitl16": 303.1,
    "dinov3_vith16plus": 840.6,
    "dinov3_vit7b16": 6716.0,
}


@pytest.mark.parametrize("name", list(EXPECTED_PARAMS_M))
def test_backbone_parameter_counts(name):
    with torch.device("meta"):
        model = build_backbone(name)
    count = sum(p.numel() for p in model.parameters()) / 1e6
    assert abs(count - EXPECTED_PARAMS_M[name]) / EXPECTED_PARAMS_M[name] < 0.01, count


def test_registry():
    assert set(EXPECTED_PARAMS_M) | {"vit_tiny", "vit_debug", "vit_2b_generic", "dinov3_vitl16plus"} <= set(
        list_backbones()
    )
    with torch.device("meta"):
        model = build_backbone("vit_2b_generic", ndim=3, in_chans=1)
    assert 1.7e9 < sum(p.numel() for p in model.parameters()) < 2.1e9
    with pytest.raises(ValueError, match="dinov3_vitb16"):
        build_backbone("vit_gigantic")
    model = build_backbone("vit_tiny", depth=1)
    assert len(model.blocks) == 1 and BACKBONES["vit_tiny"]["depth"] == 4  # registry untouched


# ----------------------------------------------------------------------------- MAE
@pytest.mark.parametrize("ndim,size", [(2, (32, 48)), (3, (16, 32, 24))])
def test_patchify_roundtrip(ndim, size):
    imgs = torch.randn(2, 3, *size)
    patches = patchify(imgs, 8, ndim)
    grid = tuple(s // 8 for s in size)
    assert patches.shape == (2, torch.Size(grid).numel(), 8**ndim * 3)
    torch.testing.assert_close(unpatchify(patches, 8, grid, 3), imgs)
    # The first patch holds the corner block, channel last.
    corner = imgs[(slice(None), slice(None)) + (slice(0, 8),) * ndim]
    torch.testing.assert_close(patches[:, 0], corner.movedim(1, -1).reshape(2, -1))


def test_random_masking():
    x = torch.randn(3, 10, 4)
    noise = torch.rand(3, 10)
    kept, mask, ids_restore, ids_keep = random_masking(x, 0.75, noise)
    assert kept.shape == (3, 2, 4) and mask.shape == (3, 10)
    assert torch.all(mask.sum(1) == 8)
    for b in range(3):
        assert set(ids_keep[b].tolist()) == set(torch.where(mask[b] == 0)[0].tolist())
        assert set(ids_keep[b].tolist()) == set(noise[b].argsort()[:2].tolist())


@pytest.mark.parametrize("ndim,size", [(2, (32, 48)), (3, (16, 32, 24))])
def test_mae_forward_backward(ndim, size):
    torch.manual_seed(0)
    mae = MaskedAutoencoder(small_vit(ndim), decoder_dim=32, decoder_depth=1, decoder_num_heads=2)
    imgs = torch.randn(2, 1, *size)
    n = torch.Size([s // 8 for s in size]).numel()
    pred, mask = mae(imgs, 0.75, torch.rand(2, n))
    assert pred.shape == (2, n, 8**ndim)
    assert torch.all(mask.sum(1) == n - int(n * 0.25))
    total, count = mae.loss_terms(imgs, pred, mask)
    assert count == mask.sum() * 8**ndim
    (total / count).backward()
    assert mae.encoder.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert mae.decoder.blocks[0].mlp.fc1.weight.grad.abs().sum() > 0
    assert mae.encoder.patch_embed.proj.weight.grad.abs().sum() > 0


def test_mae_encoder_gathers_rope_per_sample():
    """With nothing hidden but a random order per sample, the encoder must give each patch
    the same features as the plain ViT: RoPE follows the tokens through the shuffle."""
    torch.manual_seed(0)
    vit = small_vit(3).eval()
    mae = MaskedAutoencoder(vit, decoder_dim=32, decoder_num_heads=2).eval()
    imgs = torch.randn(2, 1, 16, 16, 24)
    noise = torch.rand(2, 12)
    with torch.no_grad():
        latent, mask, _, _ = mae.forward_encoder(imgs, 0.0, noise)
        full = vit.forward_features(imgs)["x_norm_patchtokens"]
    assert mask.sum() == 0
    order = noise.argsort(dim=1)
    expected = torch.stack([full[b, order[b]] for b in range(2)])
    torch.testing.assert_close(latent[:, vit.num_prefix_tokens:], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_mae_loss_ignores_padding(norm_pix_loss):
    torch.manual_seed(0)
    mae = MaskedAutoencoder(small_vit(3), decoder_dim=32, decoder_num_heads=2, norm_pix_loss=norm_pix_loss)
    imgs = torch.randn(2, 1, 16, 16, 16)
    valid = torch.ones(2, 1, 16, 16, 16)
    valid[:, :, :, :, 12:] = 0  # padding on the x border
    with torch.no_grad():
        pred, mask = mae(imgs, 0.5, torch.rand(2, 8))
    changed = imgs.clone()
    changed[valid.expand_as(imgs) == 0] = 1e3 * torch.randn(int((valid == 0).sum()))
    total, count = mae.loss_terms(imgs, pred, mask, valid)
    total2, count2 = mae.loss_terms(changed, pred, mask, valid)
    torch.testing.assert_close(total, total2)
    assert count == count2 == mask.sum() * 8**3 * 12 / 16
    # And the padding does matter when it is declared valid.
    assert not torch.allclose(mae.loss_terms(changed, pred, mask)[0], mae.loss_terms(imgs, pred, mask)[0])


def test_mae_loss_terms_add_up_across_batch_splits():
    """Per-sample noise makes masks independent of batch splitting, and (sum, count) add up."""
    torch.manual_seed(0)
    mae = MaskedAutoencoder(small_vit(2), decoder_dim=32, decoder_num_heads=2).eval()
    imgs, noise = torch.randn(4, 1, 32, 32), torch.rand(4, 16)
    with torch.no_grad():
        pred, mask = mae(imgs, 0.75, noise)
        total, count = mae.loss_terms(imgs, pred, mask)
        parts = []
        for sl in (slice(0, 1), slice(1, 4)):
            p, m = mae(imgs[sl], 0.75, noise[sl])
            assert torch.equal(m, mask[sl])
            parts.append(mae.loss_terms(imgs[sl], p, m))
    torch.testing.assert_close(sum(t for t, _ in parts), total)
    assert sum(c for _, c in parts) == count


def test_mae_state_dict_loads_into_segmentation_backbone():
    mae = MaskedAutoencoder(build_backbone("vit_debug", ndim=3, in_chans=1), decoder_dim=32, decoder_num_heads=2)
    encoder_sd = {k[len("encoder."):]: v for k, v in mae.state_dict().items() if k.startswith("encoder.")}
    seg = SegmentationModel(build_backbone("vit_debug", ndim=3, in_chans=1), num_classes=2)
    seg.backbone.load_state_dict(encoder_sd, strict=True)
    assert any(k.startswith("decoder.blocks.1.") for k in mae.state_dict())


# -------------------------------------------------------------------- segmentation
def test_out_indices():
    assert backbone_out_indices(12, "four_even_intervals") == [2, 5, 8, 11]
    assert backbone_out_indices(24, "four_even_intervals") == [5, 11, 17, 23]
    assert backbone_out_indices(40, "four_even_intervals") == [9, 19, 29, 39]
    assert backbone_out_indices(2, "four_even_intervals") == [0, 1]
    assert backbone_out_indices(12, "four_last") == [8, 9, 10, 11]
    assert backbone_out_indices(12, "last") == [11]
    assert backbone_out_indices(12, [0, -1]) == [0, 11]
    with pytest.raises(ValueError):
        backbone_out_indices(12, "all")


@pytest.mark.parametrize(
    "ndim,size,out_size", [(2, (32, 48), (40, 30)), (3, (16, 32, 24), (20, 36, 12))]
)
def test_segmentation_shapes(ndim, size, out_size):
    model = SegmentationModel(small_vit(ndim), num_classes=5)
    x = torch.randn(2, 1, *size)
    assert model(x).shape == (2, 5, *size)
    logits = model(x, output_size=out_size)
    assert logits.shape == (2, 5, *out_size)
    logits.mean().backward()
    assert model.backbone.blocks[0].attn.qkv.weight.grad is not None
    assert not any("BatchNorm" in type(m).__name__ for m in model.modules())


def test_masked_bce_zero_gradient_on_invalid():
    logits = torch.randn(2, 3, 4, 5, 6, requires_grad=True)
    targets = (torch.rand(2, 3, 4, 5, 6) > 0.5).float()
    valid = (torch.rand(2, 3, 4, 5, 6) > 0.3).float()
    valid[1, 2] = 0  # class 2 not annotated in sample 1
    targets[valid == 0] = 255  # unknown labels may hold anything
    total, count = masked_bce_loss(logits, targets, valid)
    (total / count).backward()
    assert count == valid.sum()
    assert torch.all(logits.grad[valid == 0] == 0)
    assert torch.all(logits.grad[valid == 1] != 0)
    ref = torch.nn.functional.binary_cross_entropy_with_logits(
        logits[valid == 1], targets[valid == 1], reduction="sum"
    )
    torch.testing.assert_close(total, ref)
    # Per-class validity broadcast over space.
    total_b, count_b = masked_bce_loss(logits, targets.clamp(max=1), torch.ones(2, 3, 1, 1, 1))
    assert count_b == logits.numel() and torch.isfinite(total_b)


# ----------------------------------------------------------------------- attention
def test_attention_backends_on_cpu(caplog):
    with pytest.raises(RuntimeError, match="sdpa"):
        resolve_attention_backend("fa4", torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="torchtitan.models.attention"):
        assert resolve_attention_backend("auto", "cpu") == "sdpa"
    assert "sdpa" in caplog.text
    assert resolve_attention_backend("sdpa", "cpu") == "sdpa"
    with pytest.raises(ValueError):
        resolve_attention_backend("flash", "cpu")
    with pytest.raises(ValueError):
        DinoVisionTransformer(attention="flash")
    q, k, v = torch.randn(3, 2, 4, 7, 16).unbind(0)
    ref = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
    torch.testing.assert_close(attention(q, k, v, "sdpa"), ref)
    torch.testing.assert_close(attention(q, k, v, "auto"), ref)


# --------------------------------------------------------------------------- flops
def _measured_flops(loss_fn) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss_fn().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("ndim,size", [(2, (32, 48)), (3, (16, 32, 24))])
def test_flops_match_flop_counter(ndim, size):
    torch.manual_seed(0)
    batch = 2
    x = torch.randn(batch, 1, *size)
    n = torch.Size([s // 8 for s in size]).numel()
    vit = small_vit(ndim, ffn_layer="swiglu")
    mae = MaskedAutoencoder(vit, decoder_dim=32, decoder_num_heads=2)
    seg = SegmentationModel(small_vit(ndim), num_classes=3, out_layers=[0, 1])
    cases = [
        (vit, lambda: vit.forward_features(x)["x_norm_patchtokens"].sum(), {}),
        (mae, lambda: mae(x, 0.75, torch.rand(batch, n))[0].sum(), {"mask_ratio": 0.75}),
        (seg, lambda: seg(x).sum(), {}),
    ]
    for model, loss_fn, kw in cases:
        measured = _measured_flops(loss_fn) / batch
        estimate = training_flops_per_sample(model, size, **kw)
        assert abs(estimate - measured) / measured < 0.05, (type(model).__name__, estimate, measured)
    # (channels, *spatial) is accepted too.
    assert training_flops_per_sample(seg, (1, *size)) == training_flops_per_sample(seg, size)


@pytest.mark.parametrize("per_sample", [False, True])
def test_rope_apply_matches_the_rotate_half_formula_and_its_gradient(per_sample):
    """rope_apply's one-node rotation equals x * cos + [-x_b, x_a] * sin (forward and
    gradient, float64 gradcheck), also on a strided view of a qkv tensor, and with learned
    (gradient-carrying) tables."""
    torch.manual_seed(0)
    table = (2, 7, 16) if per_sample else (7, 16)
    sin, cos = (torch.randn(*table, dtype=torch.float64) for _ in range(2))

    def textbook(x, sin, cos):
        if sin.dim() == 3:
            sin, cos = sin.unsqueeze(1), cos.unsqueeze(1)
        x_a, x_b = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x_b, x_a], dim=-1) * sin

    qkv = torch.randn(2, 7, 3, 3, 16, dtype=torch.float64, requires_grad=True)
    q = qkv.unbind(2)[0].transpose(1, 2)  # (B, heads, N, hd), not contiguous
    grad = torch.randn(2, 3, 7, 16, dtype=torch.float64)
    ours = rope_apply(q, sin, cos)
    torch.testing.assert_close(ours, textbook(q, sin, cos))
    g_ours, = torch.autograd.grad(ours, qkv, grad)
    g_ref, = torch.autograd.grad(textbook(q, sin, cos), qkv, grad)
    torch.testing.assert_close(g_ours, g_ref)
    x = torch.randn(2, 3, 7, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: rope_apply(x, sin, cos), (x,))
    learned = [t.clone().requires_grad_() for t in (sin, cos)]
    assert torch.autograd.gradcheck(rope_apply, (x, *learned))
