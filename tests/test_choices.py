"""Every name the config offers (``torchtitan.choices``) builds what it names, and the shared
facts there (EM scale, isotropy, voxel-size equality) behave as the readers rely on."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from torchtitan import choices
from torchtitan.config.job_config import JobConfig
from torchtitan.data.sampling.batch import Batch
from torchtitan.data.crops.reader import em_to_model_input
from torchtitan.models import build_backbone
from torchtitan.models.attention import attention, resolve_attention_backend
from torchtitan.models.losses import LOSSES, build_loss
from torchtitan.models.segmentation import HEAD_TYPES, SegmentationModel, UpConvHead


@pytest.fixture(scope="module")
def config_choices():
    cfg = JobConfig()
    out = {}
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            if f.metadata.get("choices"):
                out[f"{section.name}.{f.name}"] = tuple(f.metadata["choices"])
    return out


def test_the_config_offers_the_shared_names(config_choices):
    assert config_choices["model.head"] == choices.HEADS
    assert config_choices["model.loss"] == choices.LOSSES
    assert config_choices["model.attention"] == choices.ATTENTION_BACKENDS
    assert config_choices["model.backbone_out_layers"] == choices.OUT_LAYER_SETS
    assert config_choices["data.planes"] == choices.PLANES
    assert config_choices["inference.planes"] == choices.PLANES
    assert JobConfig().inference.threshold == choices.PROBABILITY_THRESHOLD


def test_every_head_name_builds_its_head():
    assert tuple(HEAD_TYPES) == choices.HEADS
    assert set(choices.HEAD_IMAGE_LEVELS) == {h for h, t in HEAD_TYPES.items() if t is UpConvHead}
    backbone = build_backbone("vit_debug", ndim=2, in_chans=1, patch_size=8)
    for name in choices.HEADS:
        model = SegmentationModel(backbone, 2, head=name, head_channels=8)
        assert type(model.head) is HEAD_TYPES[name]
        if name in choices.HEAD_IMAGE_LEVELS:
            assert model.head.image_levels == choices.HEAD_IMAGE_LEVELS[name]


def test_every_loss_name_has_its_loss():
    assert tuple(LOSSES) == choices.LOSSES
    assert set(choices.MULTI_LABEL_LOSSES) < set(choices.LOSSES)
    logits = torch.randn(1, 2, 8, 8)
    target = (torch.rand(1, 2, 8, 8) > 0.5).float()
    valid = torch.ones_like(target, dtype=torch.bool)
    for name in choices.LOSSES:
        total, count = build_loss(name)(logits, target, valid)
        assert torch.isfinite(total) and count > 0, name


def test_every_attention_name_is_served():
    q = torch.randn(1, 2, 5, 4)
    for name in choices.ATTENTION_BACKENDS:
        try:
            backend = resolve_attention_backend(name, "cpu")
        except RuntimeError as e:  # fa4 on a CPU: says why
            assert name == "fa4" and "FlashAttention-4" in str(e)
            continue
        assert backend in choices.ATTENTION_BACKENDS
        torch.testing.assert_close(attention(q, q, q, backend), attention(q, q, q, "sdpa"))
    with pytest.raises(ValueError, match="expected one of"):
        resolve_attention_backend("flash", "cpu")


def test_em_scale_is_the_one_both_normalisations_apply():
    raw = np.arange(256, dtype=np.uint8).reshape(1, 16, 16)
    host = em_to_model_input(raw)
    np.testing.assert_array_equal(host, raw.astype(np.float32) / np.float32(choices.EM_SCALE) - 1)
    assert host.min() == -1.0 and host.max() == 1.0
    batch = Batch(image=torch.from_numpy(raw[None]), valid=torch.ones(1, 1, 16, 16, dtype=torch.bool),
                  index=torch.zeros(1, dtype=torch.int64), resampled=torch.zeros(1, dtype=torch.int64))
    np.testing.assert_array_equal(batch.to(torch.device("cpu")).image.numpy()[0], host)


def test_isotropy_and_kept_patches():
    assert choices.is_isotropic([8.0, 8.0, 8.0])
    assert choices.is_isotropic([8.0, 8.0 * (1 + 1e-9), 8.0])
    assert not choices.is_isotropic([40.0, 8.0, 8.0])
    assert choices.num_kept_patches(64, 0.75) == 16
    assert choices.num_kept_patches(10, 0.99) == 1


def test_voxel_sizes_compare_with_the_one_tolerance():
    assert choices.same_size(4.0, 4.0 * (1 + 1e-9))  # a float read back from metadata
    assert not choices.same_size(4.0, 4.001)
    assert choices.same_voxel_size((40.0, 4.0, 4.0), np.array([40.0, 4.0, 4.0 + 1e-9]))
    assert not choices.same_voxel_size((40.0, 4.0, 4.0), (4.0, 4.0, 4.0))
    assert not choices.same_voxel_size((4.0, 4.0), (4.0, 4.0, 4.0))
