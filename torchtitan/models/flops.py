"""Analytic FLOPs of one training sample (forward + backward), for throughput and MFU.

Only matrix multiplications are counted (as ``torch.utils.flop_counter`` does); norms,
activations, RoPE and interpolation are cheap next to them. Per sample:

* A linear layer applied to T tokens with a weight of W entries costs 2*T*W in the forward
  pass and 4*T*W in the backward pass (gradients of input and of weight): 6*T*W in all.
* Attention over T tokens of width D costs 4*T^2*D forward (q k^T and attn v) and twice that
  backward: 12*T^2*D per layer.
* The patch embedding sees the input, which needs no gradient, so its backward computes only
  the weight gradient: 4*N*W in all.

Counts read layer sizes from the model, so they hold for any configuration, also for a
model on the meta device.
"""

from __future__ import annotations

import math
from typing import Sequence

from torch import nn

from torchtitan.choices import num_kept_patches

from .mae import MaskedAutoencoder
from .segmentation import SegmentationModel
from .vit import DinoVisionTransformer

FORWARD, BACKWARD = 2, 4  # FLOPs per multiply-accumulate


def _linear_weights(module: nn.Module) -> int:
    """Entries of all linear weights inside ``module`` (each is one MAC per token)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def block_training_flops(block: nn.Module, n_tokens: int) -> int:
    """One transformer block on ``n_tokens`` tokens: linears plus attention scores."""
    dim = block.attn.qkv.in_features
    macs = n_tokens * _linear_weights(block) + 2 * n_tokens * n_tokens * dim
    return (FORWARD + BACKWARD) * macs


def linear_training_flops(n_tokens: int, weight_numel: int, input_needs_grad: bool = True) -> int:
    """A linear map (or 1x1 / patch convolution) on ``n_tokens`` positions."""
    per_mac = FORWARD + (BACKWARD if input_needs_grad else BACKWARD // 2)
    return per_mac * n_tokens * weight_numel


def _grid(model_ndim: int, patch_size: int, input_shape: Sequence[int]) -> tuple[int, ...]:
    """Patch grid for ``input_shape``, given as spatial size or as (channels, *spatial)."""
    shape = tuple(input_shape)
    if len(shape) == model_ndim + 1:
        shape = shape[1:]
    if len(shape) != model_ndim:
        raise ValueError(f"input_shape {tuple(input_shape)} does not fit a {model_ndim}D model")
    return tuple(s // patch_size for s in shape)


def _vit_training_flops(vit: DinoVisionTransformer, n_patches: int, n_encoded: int, n_blocks: int) -> int:
    """Patch embedding of all patches, then ``n_blocks`` blocks on the prefix + encoded tokens."""
    flops = linear_training_flops(n_patches, vit.patch_embed.proj.weight.numel(), input_needs_grad=False)
    tokens = vit.num_prefix_tokens + n_encoded
    return flops + sum(block_training_flops(b, tokens) for b in list(vit.blocks)[:n_blocks])


def training_flops_per_sample(model: nn.Module, input_shape: Sequence[int], mask_ratio: float = 0.75) -> int:
    """FLOPs of forward + backward for one sample of ``input_shape``.

    Supports a bare ``DinoVisionTransformer`` (``forward_features``), a
    ``MaskedAutoencoder`` (``mask_ratio`` of the patches hidden) and a ``SegmentationModel``
    (backbone up to its last used block, then its head).
    """
    if isinstance(model, MaskedAutoencoder):
        enc, dec = model.encoder, model.decoder
        grid = _grid(enc.ndim, enc.patch_size, input_shape)
        n = math.prod(grid)
        n_keep = num_kept_patches(n, mask_ratio)
        flops = _vit_training_flops(enc, n, n_keep, len(enc.blocks))
        r = enc.num_prefix_tokens
        flops += linear_training_flops(r + n_keep, dec.embed.weight.numel())
        flops += sum(block_training_flops(b, r + n) for b in dec.blocks)
        flops += linear_training_flops(n, dec.pred.weight.numel())
        return flops
    if isinstance(model, SegmentationModel):
        vit = model.backbone
        grid = _grid(vit.ndim, vit.patch_size, input_shape)
        n = math.prod(grid)
        flops = _vit_training_flops(vit, n, n, max(model.out_indices) + 1)
        frozen = model.freeze_backbone
        if frozen:
            flops //= 3  # forward only: a frozen backbone runs no backward
        return flops + model.head.training_flops(grid, features_need_grad=not frozen)
    if isinstance(model, DinoVisionTransformer):
        grid = _grid(model.ndim, model.patch_size, input_shape)
        n = math.prod(grid)
        return _vit_training_flops(model, n, n, len(model.blocks))
    raise TypeError(f"No FLOPs formula for {type(model).__name__}")
