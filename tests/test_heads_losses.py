"""Tests of the segmentation heads (linear, upconv, multiscale), frozen backbones and the losses
(bce, dice, bce_dice, ce): shapes, meta init, validity masks, batch-split invariance."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from torchtitan.config.job_config import JobConfig
from torchtitan.data.sampling.batch import Batch
from torchtitan.models import SegmentationModel, build_backbone, build_loss, predict_probabilities
from torchtitan.models.losses import LOSSES, masked_bce_loss, soft_dice_loss
from torchtitan.models.segmentation import UpConvHead
from torchtitan.tasks.segmentation import SegmentationTask

from conftest import assert_meta_init_is_finite

HEADS = ("linear", "upconv", "multiscale")
# (input size, output size): non-cubic, and an output size unlike the input's.
SIZES = {2: ((32, 48), (40, 30)), 3: ((16, 32, 24), (20, 36, 12))}


def seg_model(ndim: int, head: str, **kw) -> SegmentationModel:
    backbone = build_backbone("vit_debug", ndim=ndim, in_chans=1, patch_size=8)
    return SegmentationModel(backbone, num_classes=3, head=head, head_channels=32, **kw)


# ------------------------------------------------------------------------------- heads
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("head", HEADS)
def test_head_shapes(head, ndim):
    torch.manual_seed(0)
    model = seg_model(ndim, head)
    size, out_size = SIZES[ndim]
    x = torch.randn(2, 1, *size)
    assert model(x).shape == (2, 3, *size)
    logits = model(x, output_size=out_size)
    assert logits.shape == (2, 3, *out_size)
    logits.square().mean().backward()
    assert model.backbone.blocks[0].attn.qkv.weight.grad is not None
    assert all(p.grad is not None for p in model.head.parameters())
    assert not any("BatchNorm" in type(m).__name__ for m in model.modules())


def test_upconv_channel_schedule():
    model = seg_model(2, "upconv", out_layers="last")
    head = model.head
    assert [s.up.out_channels for s in head.stages] == [16, 16, 16]  # 32 -> 16, min 16
    assert head.proj.in_channels == model.backbone.embed_dim
    wide = UpConvHead(3, 64, 2, patch_size=16, image_channels=1, channels=128)
    assert [s.up.out_channels for s in wide.stages] == [64, 32, 16, 16]


def test_head_min_channels_sets_the_full_resolution_width():
    """``model.head_min_channels`` from the config to the head: the decoder halves down to
    it, the image skip and encoder start at it, and it shapes the checkpoint's model."""
    from torchtitan.run.launch_history import MODEL_SHAPING_KEYS

    cfg = JobConfig()
    cfg.data.classes = ["mito", "er"]
    m = cfg.model
    m.backbone, m.ndim, m.patch_size, m.crop_size = "vit_debug", 2, 16, [32, 32]
    m.head, m.head_channels, m.head_image_levels, m.head_min_channels = "multiscale", 128, 4, 32
    head = SegmentationTask(cfg).build_model().head
    assert [s.up.out_channels for s in head.stages] == [64, 32, 32, 32]
    assert head.classifier.in_channels == 32 and head.skip[0][0].out_channels == 32
    assert [d[0].out_channels for d in head.down] == [64, 128, 256]
    assert "model.head_min_channels" in MODEL_SHAPING_KEYS["segmentation"]


def test_upconv_sees_single_voxels():
    """Through its image skip, the upconv head answers a one-voxel change of the input at
    that voxel and its neighbours, not across whole patches."""
    torch.manual_seed(0)
    model = seg_model(2, "upconv", out_layers="last").eval()
    x = torch.randn(1, 1, 32, 32)
    y = x.clone()
    y[0, 0, 3, 5] += 10.0
    with torch.no_grad():
        diff = (model(y) - model(x)).abs()[0, 0]
    assert diff[3, 5] > 0
    # Elsewhere in the same patch (beyond the skip's 7x7 field of view) only the backbone's
    # patch-level change and the GroupNorm statistics reach.
    assert diff[3, 5] > 2 * diff[7, 7]


@pytest.mark.parametrize("patch_size", [4, 8, 16])
def test_multiscale_fuses_the_image_at_full_half_and_quarter_resolution(patch_size):
    """Image levels 1/2 and 1/4 join the decoder where it passes through their scale (for
    patch 4, the 1/4 level joins at the patch grid itself, before any upsampling)."""
    torch.manual_seed(0)
    head = UpConvHead(2, 64, 2, patch_size=patch_size, image_channels=1, channels=64,
                      image_levels=3)
    assert len(head.down) == len(head.down_fuse) == 2
    assert [d[0].out_channels for d in head.down] == [32, 64]
    size = 4 * patch_size
    grid = size // patch_size
    seen = {}

    def record(name):
        def hook(module, args, out):
            seen[name] = tuple(out.shape[2:])
        return hook

    for k, fuse in enumerate(head.down_fuse, start=1):
        fuse.register_forward_hook(record(k))
    head.fuse.register_forward_hook(record(0))
    out = head([torch.randn(1, 64, grid, grid)], torch.randn(1, 1, size, size))
    assert out.shape == (1, 2, size, size)
    assert seen == {k: (size // 2**k,) * 2 for k in (0, 1, 2)}
    # Patch 2 has no 1/4 level to join: the head keeps the levels it can use.
    small = UpConvHead(2, 64, 2, patch_size=2, image_channels=1, image_levels=3)
    assert small.image_levels == 2 and len(small.down) == 1


@pytest.mark.parametrize("patch_size", [6, 12])
def test_upconv_rejects_non_power_of_two_patch(patch_size):
    backbone = build_backbone("vit_debug", ndim=2, in_chans=1, patch_size=patch_size)
    with pytest.raises(ValueError, match="power-of-two patch size"):
        SegmentationModel(backbone, num_classes=2, head="upconv")
    SegmentationModel(backbone, num_classes=2, head="linear")  # the linear head takes any


def test_unknown_head():
    with pytest.raises(ValueError, match="upconv"):
        seg_model(2, "mlp")


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("head", HEADS)
def test_meta_init(head, ndim):
    with torch.device("meta"):
        model = seg_model(ndim, head)
    assert_meta_init_is_finite(model)
    size, out_size = SIZES[ndim]
    out = model(torch.randn(2, 1, *size), output_size=out_size)
    assert out.shape == (2, 3, *out_size) and torch.isfinite(out).all()


@pytest.mark.parametrize("head", HEADS)
def test_freeze_backbone(head):
    torch.manual_seed(0)
    model = seg_model(3, head, freeze_backbone=True)
    model.train()
    assert not model.backbone.training and model.head.training
    assert not any(p.requires_grad for p in model.backbone.parameters())
    x = torch.randn(2, 1, 16, 16, 16)
    model(x).square().mean().backward()
    assert all(p.grad is None for p in model.backbone.parameters())
    assert all(p.grad is not None for p in model.head.parameters())
    # The flag survives a meta-device build.
    with torch.device("meta"):
        meta = seg_model(3, head, freeze_backbone=True)
    meta.to_empty(device="cpu")
    meta.init_weights()
    assert not any(p.requires_grad for p in meta.backbone.parameters())
    assert all(p.requires_grad for p in meta.head.parameters())


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("head", HEADS)
def test_head_training_flops_match_flop_counter(head, ndim):
    model = seg_model(ndim, head)
    size, _ = SIZES[ndim]
    grid = [s // 8 for s in size]
    image = torch.randn(2, 1, *size)
    if head == "linear":  # it reads the tokens (B, N, C)
        features = [torch.randn(2, math.prod(grid), model.backbone.embed_dim, requires_grad=True)
                    for _ in model.out_indices]
        args = (features, grid)
    else:
        features = [torch.randn(2, model.backbone.embed_dim, *grid, requires_grad=True)
                    for _ in model.out_indices]
        args = (features, image)
    with FlopCounterMode(display=False) as counter:
        model.head(*args).sum().backward()
    measured = counter.get_total_flops() / 2
    assert model.head.training_flops(grid) == measured


# ------------------------------------------------------------------------------ losses
def loss_inputs(ndim: int, batch: int = 4, classes: int = 3, seed: int = 0):
    """Random logits, 0/1 targets (255 where unknown) and a per-class validity mask with one
    class not annotated in one sample and one sample with no annotation at all."""
    g = torch.Generator().manual_seed(seed)
    spatial = (5, 6, 7)[-ndim:]
    shape = (batch, classes, *spatial)
    logits = torch.randn(shape, generator=g) * 2
    targets = (torch.rand(shape, generator=g) > 0.6).float()
    valid = (torch.rand(shape, generator=g) > 0.3).float()
    valid[1, 2] = 0  # class 2 not annotated in sample 1
    valid[2] = 0  # sample 2 has no label at all
    targets[valid == 0] = 255
    return logits, targets, valid


def ignored_entries(name: str, valid: torch.Tensor) -> torch.Tensor:
    """Entries that must get no gradient: invalid ones; for ce, every class of a voxel where
    any class is invalid."""
    if name == "ce":
        return (valid == 0).any(1, keepdim=True).expand_as(valid)
    return valid == 0


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("name", list(LOSSES))
def test_invalid_voxels_are_ignored(name, ndim):
    logits, targets, valid = loss_inputs(ndim)
    loss = build_loss(name, [1.0, 2.0, 0.5])
    x = logits.clone().requires_grad_(True)
    total, count = loss(x, targets, valid)
    assert torch.isfinite(total) and count > 0
    (total / count).backward()
    ignored = ignored_entries(name, valid)
    assert torch.all(x.grad[ignored] == 0)
    assert (x.grad[~ignored] != 0).float().mean() > 0.9
    # Whatever the targets hold at ignored entries changes nothing.
    other = targets.clone()
    other[ignored] = torch.randint(0, 2, (int(ignored.sum()),)).float()
    y = logits.clone().requires_grad_(True)
    total2, count2 = loss(y, other, valid)
    (total2 / count2).backward()
    torch.testing.assert_close(total2, total)
    assert count2 == count
    torch.testing.assert_close(y.grad, x.grad)


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("name", list(LOSSES))
def test_losses_add_up_over_batch_splits(name, ndim):
    """(sum, count) of a batch = the sum over its parts, so a global count normalises right."""
    logits, targets, valid = loss_inputs(ndim)
    loss = build_loss(name, torch.tensor([1.0, 2.0, 0.5]))
    total, count = loss(logits, targets, valid)
    for split in ([2, 2], [1, 3], [1, 1, 1, 1]):
        chunks = zip(logits.split(split), targets.split(split), valid.split(split))
        parts = [loss(l, t, v) for l, t, v in chunks]
        torch.testing.assert_close(sum(s for s, _ in parts), total)
        assert sum(c for _, c in parts) == count


@pytest.mark.parametrize("ndim", [2, 3])
def test_bce_matches_torch(ndim):
    logits, targets, valid = loss_inputs(ndim)
    total, count = masked_bce_loss(logits, targets, valid)
    keep = valid == 1
    ref = F.binary_cross_entropy_with_logits(logits[keep], targets[keep], reduction="sum")
    torch.testing.assert_close(total, ref)
    assert count == keep.sum()
    # Per-crop class annotation broadcasts over space.
    total_b, count_b = masked_bce_loss(logits, targets.clamp(max=1), torch.ones(4, 3, *[1] * ndim))
    assert count_b == logits.numel() and torch.isfinite(total_b)


@pytest.mark.parametrize("ndim", [2, 3])
def test_dice(ndim):
    logits, targets, valid = loss_inputs(ndim)
    total, count = soft_dice_loss(logits, targets, valid)
    # Sample 2 has no label and class 2 of sample 1 none either: 4 * 3 - 3 - 1 pairs.
    assert count == 8
    # Reference for one pair, straight from the formula.
    keep = valid[0, 1] == 1
    p, t = torch.sigmoid(logits[0, 1][keep]), targets[0, 1][keep]
    ref = 1 - (2 * (p * t).sum() + 1) / (p.sum() + t.sum() + 1)
    one, _ = soft_dice_loss(logits[:1, 1:2], targets[:1, 1:2], valid[:1, 1:2])
    torch.testing.assert_close(one, ref)
    # A perfect, confident prediction scores ~0.
    perfect = torch.where(targets == 1, 20.0, -20.0)
    total, count = soft_dice_loss(perfect, targets, valid)
    assert total / count < 1e-6


@pytest.mark.parametrize("ndim", [2, 3])
def test_bce_dice_is_per_sample_mean(ndim):
    logits, targets, valid = loss_inputs(ndim)
    total, count = build_loss("bce_dice")(logits, targets, valid)
    assert count == 3  # sample 2 has no label
    expected = 0.0
    for b in (0, 1, 3):
        sl = slice(b, b + 1)
        bce_sum, bce_count = masked_bce_loss(logits[sl], targets[sl], valid[sl])
        # Dice over the classes this sample's valid voxels contain (empty targets: BCE only).
        dices = [soft_dice_loss(logits[sl, k:k + 1], targets[sl, k:k + 1], valid[sl, k:k + 1])[0]
                 for k in range(targets.shape[1])
                 if ((targets[b, k] == 1) & (valid[b, k] == 1)).any()]
        dice = sum(dices) / len(dices) if dices else 0.0
        expected = expected + bce_sum / bce_count + dice
    torch.testing.assert_close(total, expected)
    # A sample whose valid voxels hold no class: its loss is its BCE alone.
    empty = torch.zeros_like(targets[:1])
    total_e, count_e = build_loss("bce_dice")(logits[:1], empty, valid[:1])
    bce_sum, bce_count = masked_bce_loss(logits[:1], empty, valid[:1])
    assert count_e == 1
    torch.testing.assert_close(total_e, bce_sum / bce_count)


@pytest.mark.parametrize("ndim", [2, 3])
def test_ce_matches_torch_with_implicit_background(ndim):
    logits, targets, valid = loss_inputs(ndim)
    # Exclusive classes: at most one present class per voxel.
    first = targets.clamp(max=1).cumsum(1) == 1
    targets = torch.where(valid == 1, (targets == 1) & first, targets).float()
    index = torch.where(targets.clamp(max=1).amax(1) > 0, targets.clamp(max=1).argmax(1) + 1, 0)
    index[(valid == 0).any(1)] = -100
    full = torch.cat([torch.zeros_like(logits[:, :1]), logits], 1)
    total, count = build_loss("ce")(logits, targets, valid)
    assert count == (index != -100).sum()
    torch.testing.assert_close(total, F.cross_entropy(full, index, reduction="sum"))
    # Weighted: class weights multiply the terms of their voxels; background weighs 1.
    total_w, count_w = build_loss("ce", [2.0, 1.0, 3.0])(logits, targets, valid)
    ref_w = F.cross_entropy(full, index, weight=torch.tensor([1.0, 2.0, 1.0, 3.0]), reduction="sum")
    torch.testing.assert_close(total_w, ref_w)
    assert count_w == count
    # Probabilities: the classes of the same softmax, without the background.
    probs = predict_probabilities(logits, "ce")
    torch.testing.assert_close(probs, torch.softmax(full, 1)[:, 1:])
    assert torch.all(probs.sum(1) < 1)


@pytest.mark.parametrize("name", ["bce", "dice", "bce_dice"])
def test_class_weights_scale_their_class(name):
    logits, targets, valid = loss_inputs(3)
    weights = torch.tensor([0.5, 2.0, 3.0])
    total, count = build_loss(name, weights)(logits, targets, valid)
    # Linear in the weights, with unweighted counts.
    one_hot = [build_loss(name, torch.eye(3)[k])(logits, targets, valid) for k in range(3)]
    torch.testing.assert_close(total, sum(w * s for w, (s, _) in zip(weights, one_hot)))
    assert all(c == count for _, c in one_hot)
    # A weight on one class reaches only that class's logits.
    x = logits.clone().requires_grad_(True)
    build_loss(name, [0.0, 1.0, 0.0])(x, targets, valid)[0].backward()
    assert torch.all(x.grad[:, [0, 2]] == 0) and x.grad[:, 1].abs().sum() > 0
    # No weights = all ones.
    torch.testing.assert_close(build_loss(name, [])(logits, targets, valid)[0],
                               build_loss(name, [1.0, 1.0, 1.0])(logits, targets, valid)[0])


def test_predict_probabilities_and_names():
    logits = torch.randn(2, 3, 4, 4)
    for name in ("bce", "dice", "bce_dice"):
        torch.testing.assert_close(predict_probabilities(logits, name), torch.sigmoid(logits))
    with pytest.raises(ValueError, match="bce_dice"):
        build_loss("focal")
    with pytest.raises(ValueError, match="focal"):
        predict_probabilities(logits, "focal")
    with pytest.raises(ValueError, match="one weight per class"):
        build_loss("bce", [1.0, 2.0])(logits, logits > 0, torch.ones_like(logits))


# ------------------------------------------------------------------------------- task
@pytest.mark.parametrize("loss", list(LOSSES))
def test_task_builds_model_and_loss_from_config(loss):
    cfg = JobConfig()
    cfg.data.classes = ["mito", "er"]
    m = cfg.model
    m.backbone, m.ndim, m.patch_size, m.crop_size = "vit_debug", 2, 8, [16, 16]
    m.head, m.head_channels, m.freeze_backbone = "upconv", 16, True
    m.loss, m.class_weights = loss, [1.0, 2.0]
    task = SegmentationTask(cfg)
    model = task.build_model()
    assert isinstance(model.head, UpConvHead) and model.freeze_backbone
    assert model.head.proj.out_channels == 16
    target = (torch.rand(2, 2, 16, 16) > 0.5).to(torch.uint8)
    valid = torch.ones(2, 2, 16, 16, dtype=torch.uint8)
    batch = Batch(image=torch.randn(2, 1, 16, 16), target=target, valid=valid,
                  index=torch.arange(2), resampled=torch.zeros(2, dtype=torch.int64))
    total, count = task.loss_terms(model, batch)
    expected = build_loss(loss, torch.tensor([1.0, 2.0]))(model(batch.image).float(), target, valid)
    torch.testing.assert_close(total, expected[0])
    assert count == expected[1] and count > 0


def debug_task(cfg: JobConfig, loss: str):
    """The task of ``cfg`` with a debug 2D ViT (patch 8, 16 x 16 crops) and ``loss``, and its
    model built from seed 0."""
    m = cfg.model
    m.backbone, m.ndim, m.patch_size, m.crop_size, m.loss = "vit_debug", 2, 8, [16, 16], loss
    task = SegmentationTask(cfg)
    torch.manual_seed(0)
    return task, task.build_model()


@pytest.mark.parametrize("loss_weight", [0.0, 1.0, 6.0])
def test_affinity_loss_weight_is_shared_by_a_class_offsets(loss_weight):
    """``affinities.loss_weight``: all of a class's affinity channels together weigh that
    much, each offset its share (0: each channel 1, as many classes' worth as offsets)."""
    cfg = JobConfig()
    cfg.data.classes = ["pm", "cell"]
    cfg.affinities.classes = ["cell"]
    cfg.affinities.offsets = ["0:1", "1:0", "0:4"]
    cfg.affinities.loss_weight = loss_weight
    task, model = debug_task(cfg, "bce_dice")
    g = torch.Generator().manual_seed(0)
    target = (torch.rand(2, 5, 16, 16, generator=g) > 0.5).to(torch.uint8)
    valid = torch.ones(2, 5, 16, 16, dtype=torch.uint8)
    batch = Batch(image=torch.randn(2, 1, 16, 16, generator=g), target=target, valid=valid,
                  index=torch.arange(2), resampled=torch.zeros(2, dtype=torch.int64))
    total, count = task.loss_terms(model, batch)
    each = loss_weight / 3 if loss_weight else 1.0
    weights = torch.tensor([1.0, 1.0, each, each, each])
    expected = build_loss("bce_dice", weights)(model(batch.image).float(), target, valid)
    torch.testing.assert_close(total, expected[0])
    if loss_weight == 6.0:  # the affinities pull twice as hard as with 1 per channel
        plain = build_loss("bce_dice")(model(batch.image).float(), target, valid)
        assert total > plain[0]


def test_task_compiles_its_loss_with_the_model():
    """``training.compile = true`` compiles the loss the task takes (once per run), with the
    same sum and count as the eager one."""
    results = {}
    for compiled in (False, True):
        cfg = JobConfig()
        cfg.data.classes = ["mito", "er"]
        cfg.training.compile = compiled
        task, model = debug_task(cfg, "bce")
        g = torch.Generator().manual_seed(0)
        batch = Batch(image=torch.randn(2, 1, 16, 16, generator=g),
                      target=(torch.rand(2, 2, 16, 16, generator=g) > 0.5).to(torch.uint8),
                      valid=torch.ones(2, 2, 16, 16, dtype=torch.uint8),
                      index=torch.arange(2), resampled=torch.zeros(2, dtype=torch.int64))
        results[compiled] = task.loss_terms(model, batch)
        assert task._loss.compiled is compiled
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-6)
    assert results[True][1] == results[False][1]


def test_affinity_channels_take_the_bce_and_dice_terms_like_the_classes():
    """The Dice term of an affinity channel measures the joins (p against t), as for a class
    channel; the BCE term takes every channel alike."""
    cfg = JobConfig()
    cfg.data.classes = ["cell"]
    cfg.affinities.classes, cfg.affinities.offsets = ["cell"], ["1:0", "0:1"]
    m = cfg.model
    m.backbone, m.ndim, m.patch_size, m.crop_size = "vit_debug", 2, 8, [16, 16]
    m.head, m.head_channels, m.loss = "upconv", 16, "bce_dice"
    task = SegmentationTask(cfg)
    model = task.build_model()
    target = (torch.rand(2, 3, 16, 16) > 0.2).to(torch.uint8)  # affinities: mostly joins
    valid = (torch.rand(2, 3, 16, 16) > 0.1).to(torch.uint8)
    batch = Batch(image=torch.randn(2, 1, 16, 16), target=target, valid=valid,
                  index=torch.arange(2), resampled=torch.zeros(2, dtype=torch.int64))
    total, count = task.loss_terms(model, batch)
    z = model(batch.image).float()
    p, t, v = torch.sigmoid(z), target.float(), valid.float()
    bce = F.binary_cross_entropy_with_logits(z, target.float(), reduction="none")
    per_sample = (bce * v).sum((1, 2, 3)) / v.sum((1, 2, 3))
    pt, ps, ts = ((x * v).sum((2, 3)) for x in (p * t, p, t))
    dice = 1 - (2 * pt + 1) / (ps + ts + 1)  # every (sample, channel) has targets here
    expected = (per_sample + dice.mean(1)).sum()
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
    assert count == 2


def test_head_image_levels_reach_the_patch_grid():
    """``head_image_levels`` = log2(patch) + 1 encodes the image down to the patch grid (a
    U-Net encoder of 16, 32, 64, ... channels beside the ViT) and fuses each level; 0 keeps
    the head's own levels."""
    torch.manual_seed(0)
    full = seg_model(2, "multiscale", head_image_levels=4)  # patch 8: 1, 1/2, 1/4, 1/8
    assert full.head.image_levels == 4
    assert [d[0].out_channels for d in full.head.down] == [32, 64, 128]
    assert seg_model(2, "multiscale").head.image_levels == 3
    assert seg_model(2, "upconv").head.image_levels == 1
    x = torch.randn(2, 1, 32, 48)
    logits = full(x)
    assert logits.shape == (2, 3, 32, 48)
    logits.square().mean().backward()
    assert all(p.grad is not None for p in full.head.down[2].parameters())


def test_task_passes_head_image_levels():
    cfg = JobConfig()
    cfg.data.classes = ["mito"]
    m = cfg.model
    m.backbone, m.patch_size, m.crop_size = "vit_debug", 8, [16, 16]
    m.head, m.head_image_levels = "multiscale", 4
    assert SegmentationTask(cfg).build_model().head.image_levels == 4


@pytest.mark.parametrize("shape,size", [((2, 4, 6, 6, 6), (96, 96, 96)),
                                        ((1, 3, 4, 3, 2), (16, 12, 8)),  # up, per axis
                                        ((1, 2, 6, 6, 6), (4, 9, 6)),  # down, up, same
                                        ((2, 4, 5, 7), (40, 56))])  # bilinear
def test_resize_linear_matches_interpolate_forward_and_backward(shape, size):
    from torchtitan.models.resize import resize_linear

    torch.manual_seed(0)
    x = torch.randn(shape, requires_grad=True)
    mode = "trilinear" if len(size) == 3 else "bilinear"
    ref = F.interpolate(x, size=size, mode=mode, align_corners=False)
    ours = resize_linear(x, size)
    assert ours.shape == ref.shape and ours.is_contiguous()
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-6)
    grad = torch.randn_like(ref)
    ref_grad, = torch.autograd.grad(ref, x, grad)
    our_grad, = torch.autograd.grad(ours, x, grad)
    # Each input gathers hundreds of terms: compare relative to the largest gradient.
    assert (our_grad - ref_grad).abs().max() <= 2e-5 * ref_grad.abs().max()


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("grid,size,per_class,dtype", [
    ((3, 4, 2), (20, 17, 8), False, torch.float32),  # 3D, up
    ((3, 4, 2), (20, 17, 8), False, torch.uint8),  # what the loader gives
    ((5, 3, 4), (5, 12, 16), True, torch.uint8),  # first axis kept, per-class validity
    ((4, 5), (33, 40), False, torch.float32)])  # 2D
def test_resized_loss_equals_the_loss_of_the_resized_logits(name, grid, size, per_class, dtype,
                                                            monkeypatch):
    """``Loss.resized`` (slab by slab, what training does on the linear head's logits) gives
    the sum, count and gradient of the loss taken on the whole resized logits, for every loss,
    with class weights, per-voxel or per-class validity, float or uint8 targets and masks, and
    slabs that do not divide the rows."""
    from torchtitan.models import resize

    monkeypatch.setitem(resize.SLAB_ELEMENTS, "cpu", 4 * 3 * 3 * math.prod(size[1:]))  # 3 rows
    logits, targets, valid = loss_inputs(len(size))
    full = F.interpolate(targets, size=size, mode="nearest")
    valid = F.interpolate(valid, size=size, mode="nearest")
    if per_class:
        valid = valid.amax(dim=tuple(range(2, valid.dim())), keepdim=True)
    full[valid.expand_as(full) == 0] = 255
    full, valid = full.to(dtype), valid.to(dtype)
    low = torch.randn(4, 3, *grid, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = build_loss(name, [1.0, 2.0, 0.5])
    total, count = loss(resize.resize_linear(low, size), full.float(), valid.float())
    grad, = torch.autograd.grad(total / count, low)
    total_s, count_s = loss.resized(low, size, full, valid)
    grad_s, = torch.autograd.grad(total_s / count_s, low)
    torch.testing.assert_close(total_s, total, rtol=1e-5, atol=1e-6)
    assert count_s == count
    assert (grad_s - grad).abs().max() <= 1e-5 * grad.abs().max()
    assert grad.abs().max() > 0


def test_compiled_loss_takes_the_same_sums_and_gradient(monkeypatch):
    """``build_loss(..., compiled=True)`` (training.compile) fuses the statistics and their
    written-out gradient; the sum, count and gradient stay those of the eager loss, slab by
    slab over slabs of two sizes and on whole logits."""
    from torchtitan.models import resize

    size = (9, 10, 12)
    monkeypatch.setitem(resize.SLAB_ELEMENTS, "cpu", 4 * 3 * 2 * 10 * 12)  # 2 rows: 5 slabs
    _, targets, valid = loss_inputs(3)
    full = F.interpolate(targets, size=size, mode="nearest").to(torch.uint8)
    valid = F.interpolate(valid, size=size, mode="nearest").to(torch.uint8)
    low = torch.randn(4, 3, 3, 4, 5, generator=torch.Generator().manual_seed(1),
                      requires_grad=True)
    eager, fused = build_loss("bce_dice", [1.0, 2.0, 0.5]), build_loss("bce_dice", [1.0, 2.0, 0.5],
                                                                      compiled=True)
    for run in (lambda loss: loss.resized(low, size, full, valid),
                lambda loss: loss(resize.resize_linear(low, size), full, valid)):
        (total, count), (total_c, count_c) = run(eager), run(fused)
        grad, = torch.autograd.grad(total / count, low)
        grad_c, = torch.autograd.grad(total_c / count_c, low)
        torch.testing.assert_close(total_c, total, rtol=1e-5, atol=1e-6)
        assert count_c == count
        assert (grad_c - grad).abs().max() <= 1e-5 * grad.abs().max() and grad.abs().max() > 0


def test_slab_statistics_keep_no_full_resolution_tensor_for_the_backward():
    """The point of the slabs: what autograd keeps between forward and backward (seen by a
    saved-tensor hook) is far below one tensor of full-resolution logits."""
    from torchtitan.models.resize import slab_statistics

    low = torch.randn(1, 2, 4, 4, 4, requires_grad=True)
    size = (64, 64, 64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        (sq,) = slab_statistics(lambda z, t, v: (z.square().sum(),), low, size)
    sq.backward()
    full = 2 * math.prod(size)
    assert max(saved) < full / 8
    resized = F.interpolate(low, size=size, mode="trilinear", align_corners=False)
    torch.testing.assert_close(sq, resized.square().sum(), rtol=1e-5, atol=0)
    grad, = torch.autograd.grad(resized.square().sum(), low)
    torch.testing.assert_close(low.grad, grad, rtol=1e-4, atol=1e-4)


def test_slab_pass_with_derivatives_computes_each_slab_once(monkeypatch):
    """Given the sums' per-voxel derivatives, the forward pass sends them to the grid as it
    goes: each slab is computed once (no statistics recomputed in the backward pass), and
    the gradient is autograd's of the whole resized logits. Without gradients only the
    statistics run."""
    from torchtitan.models import resize

    size = (12, 10, 9)
    monkeypatch.setitem(resize.SLAB_ELEMENTS, "cpu", 2 * 3 * 3 * 10 * 9)  # 3 rows: 4 slabs
    calls = []

    def statistics(z, t, v):
        calls.append("statistics")
        return (z.square().sum(dim=(2, 3, 4)), (z > 0).sum(dim=(1, 2, 3, 4)))

    def derivatives(z, t, v):
        calls.append("derivatives")
        return statistics(z, t, v), (2 * z, None)

    low = torch.randn(2, 3, 3, 4, 5, requires_grad=True)
    sq, positive = resize.slab_statistics(statistics, low, size, derivatives=derivatives)
    weights = torch.randn(2, 3)
    (sq * weights).sum().backward()
    assert calls == ["derivatives", "statistics"] * 4 and not positive.requires_grad
    whole = resize.resize_linear(low, size)
    torch.testing.assert_close(sq, whole.square().sum(dim=(2, 3, 4)), rtol=1e-5, atol=1e-5)
    grad, = torch.autograd.grad((whole.square().sum(dim=(2, 3, 4)) * weights).sum(), low)
    assert (low.grad - grad).abs().max() <= 1e-5 * grad.abs().max()
    calls.clear()
    with torch.no_grad():
        resize.slab_statistics(statistics, low, size, derivatives=derivatives)
    assert calls == ["statistics"] * 4


@pytest.mark.parametrize("ndim", [2, 3])
def test_linear_head_on_tokens_is_its_1x1_convolution_on_the_feature_maps(ndim):
    """The linear head applies its 1x1 convolution to the tokens as a linear layer; the
    logits are those of the convolution on the concatenated feature maps."""
    model = seg_model(ndim, "linear")
    grid = (3, 4, 5)[-ndim:]
    tokens = [torch.randn(2, math.prod(grid), model.backbone.embed_dim) for _ in model.out_indices]
    maps = [t.transpose(1, 2).reshape(2, -1, *grid) for t in tokens]
    with torch.no_grad():
        model.head.conv.weight.normal_()
        torch.testing.assert_close(model.head(tokens, grid),
                                   model.head.conv(torch.cat(maps, dim=1)), rtol=1e-5, atol=1e-5)
