"""The patch embedding as a GEMM on unfolded patches equals the strided convolution, and the
RoPE tables, built once per grid, equal freshly built ones and follow the module's device and
``periods``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.rope import RopePositionEmbedding
from torchtitan.models.vit import DinoVisionTransformer, PatchEmbed


@pytest.mark.parametrize("ndim, in_chans, patch, spatial", [
    (3, 1, 16, (32, 48, 16)), (3, 2, 4, (8, 12, 4)), (2, 3, 16, (32, 64)), (2, 1, 8, (24, 8))])
def test_gemm_patch_embedding_equals_convolution(ndim, in_chans, patch, spatial):
    torch.manual_seed(0)
    embed = PatchEmbed(ndim, patch, in_chans, 24)
    embed.reset_parameters()
    x = torch.randn(2, in_chans, *spatial, requires_grad=True)
    conv = {2: F.conv2d, 3: F.conv3d}[ndim](x, embed.proj.weight, embed.proj.bias, stride=patch)
    embed.gemm = True
    tokens, grid = embed(x)
    assert grid == tuple(conv.shape[2:])
    torch.testing.assert_close(tokens, conv.flatten(2).transpose(1, 2), atol=1e-5, rtol=1e-5)
    # The gradients reach the same parameters (Meta's names and shapes) and the input.
    tokens.square().sum().backward()
    grads = [t.grad.clone() for t in (x, embed.proj.weight, embed.proj.bias)]
    for t in (x, embed.proj.weight, embed.proj.bias):
        t.grad = None
    conv.square().sum().backward()
    for g, t in zip(grads, (x, embed.proj.weight, embed.proj.bias)):
        torch.testing.assert_close(g, t.grad, atol=1e-4, rtol=1e-4)


def test_patch_embedding_keeps_the_convolution_on_cpu_by_default():
    embed = PatchEmbed(3, 4, 1, 8)
    assert embed.gemm is None  # the GEMM for CUDA inputs only: CPU results keep their bits
    x = torch.randn(1, 1, 8, 8, 8)
    tokens, _ = embed(x)
    assert torch.equal(tokens, embed.proj(x).flatten(2).transpose(1, 2))
    assert set(embed.state_dict()) == {"proj.weight", "proj.bias"}


def test_rope_tables_are_built_once_and_equal_fresh_ones():
    rope = RopePositionEmbedding(64, num_heads=2, ndim=3)
    rope.eval()
    first = rope((2, 3, 4))
    assert rope((2, 3, 4))[0] is first[0]  # the cache is hit
    fresh = rope._tables((2, 3, 4), augmented=False)
    assert all(torch.equal(a, b) for a, b in zip(first, fresh))
    assert rope((4, 3, 2))[0].shape == (24, 32) and rope((4, 3, 2))[0] is not first[0]
    rope.train()  # no augmentation configured: training uses the same tables
    assert rope((2, 3, 4))[0] is first[0]


def test_rope_cache_follows_periods_device_dtype_and_augmentation():
    rope = RopePositionEmbedding(64, num_heads=2, ndim=2)
    sin, _ = rope((3, 3))
    with torch.no_grad():  # what load_state_dict does: a copy into the buffer
        rope.periods.mul_(2)
    assert not torch.equal(rope((3, 3))[0], sin)
    rope.to(torch.float64)  # _apply (.to, .cuda, to_empty) empties the cache
    assert "_tables_cache" not in rope.__dict__
    assert "_tables_cache" not in str(rope.state_dict().keys())
    with torch.inference_mode():  # tables made here are not reused outside inference mode
        inference_sin, _ = rope((3, 3))
    assert rope((3, 3))[0] is not inference_sin
    augmented = RopePositionEmbedding(64, num_heads=2, ndim=2, jitter_coords=2.0)
    augmented.train()
    assert not torch.equal(augmented((3, 3))[0], augmented((3, 3))[0])  # drawn each call


def test_model_from_meta_device_gets_valid_tables():
    """A model built on meta caches nothing there; after to_empty and init the tables are
    those of a model built directly."""
    kw = dict(ndim=3, patch_size=4, in_chans=1, embed_dim=32, depth=1, num_heads=2)
    torch.manual_seed(0)
    direct = DinoVisionTransformer(**kw)
    with torch.device("meta"):
        meta = DinoVisionTransformer(**kw)
    meta.patch_rope((2, 2, 2))  # on meta: computed, not cached
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    meta.init_weights()
    for a, b in zip(meta.patch_rope((2, 2, 2)), direct.patch_rope((2, 2, 2))):
        assert torch.equal(a, b)
