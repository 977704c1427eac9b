"""Model zoo: backbone names -> hyperparameters, and the builders the trainer calls.

Named backbones are Meta's DINOv3 hub names (their checkpoints load with ``strict=True`` into
a 2D model built here with ``in_chans=3``), plus small generic sizes for debugging on CPU and
a generic ~2B encoder for scaling runs. Any hyperparameter can be overridden, e.g.
``build_backbone("dinov3_vitl16", ndim=3, in_chans=1)``.

Meta trained with ``pos_embed_rope_rescale_coords=2``; that augmentation is off here unless
passed as an override.

Build large models on the meta device and initialise them after sharding::

    with torch.device("meta"):
        model = build_backbone("dinov3_vit7b16", ndim=3, in_chans=1)
    ... parallelize ...
    model.to_empty(device="cuda"); model.init_weights()
"""

from __future__ import annotations

import copy
from typing import Any

from .attention import attention, resolve_attention_backend
from .flops import training_flops_per_sample
from .losses import LOSSES, build_loss, masked_bce_loss, predict_probabilities
from .mae import MaskedAutoencoder
from .rope import RopePositionEmbedding, rope_apply
from .segmentation import SegmentationModel
from .vit import Block, DinoVisionTransformer, use_attention

# Settings every DINOv3 backbone shares.
_DINOV3_COMMON: dict[str, Any] = dict(
    patch_size=16,
    qkv_bias=True,
    proj_bias=True,
    ffn_bias=True,
    layerscale_init=1e-5,
    norm_layer="layernormbf16",
    n_storage_tokens=4,
    mask_k_bias=True,
    pos_embed_rope_base=100.0,
    pos_embed_rope_normalize_coords="separate",
    pos_embed_rope_dtype="fp32",
)


def _dinov3(embed_dim: int, depth: int, num_heads: int, ffn_ratio: float, ffn_layer: str, **extra) -> dict:
    return {**_DINOV3_COMMON, "embed_dim": embed_dim, "depth": depth, "num_heads": num_heads,
            "ffn_ratio": ffn_ratio, "ffn_layer": ffn_layer, **extra}


# name -> DinoVisionTransformer keyword arguments. Parameter counts (2D, in_chans=3) in comments.
BACKBONES: dict[str, dict[str, Any]] = {
    # Meta's DINOv3 hub backbones.
    "dinov3_vits16": _dinov3(384, 12, 6, 4.0, "mlp"),  # 21.6M
    "dinov3_vits16plus": _dinov3(384, 12, 6, 6.0, "swiglu"),  # 28.7M
    "dinov3_vitb16": _dinov3(768, 12, 12, 4.0, "mlp"),  # 85.7M
    # 303M; its SAT-493M weights need the override untie_global_and_local_cls_norm=True.
    "dinov3_vitl16": _dinov3(1024, 24, 16, 4.0, "mlp"),
    "dinov3_vitl16plus": _dinov3(1024, 24, 16, 6.0, "swiglu"),  # 404M
    "dinov3_vith16plus": _dinov3(1280, 32, 20, 6.0, "swiglu"),  # 841M
    "dinov3_vit7b16": _dinov3(
        4096, 40, 32, 3.0, "swiglu64", qkv_bias=False, untie_global_and_local_cls_norm=True
    ),  # 6716M
    # Small generic sizes for CPU debugging and tests.
    "vit_debug": _dinov3(64, 2, 2, 4.0, "mlp"),  # 0.15M
    "vit_tiny": _dinov3(96, 4, 3, 4.0, "mlp"),  # 0.52M
    # A generic 16-layer encoder of 1.82B parameters (head_dim 128), for scaling runs.
    "vit_2b_generic": _dinov3(3072, 16, 24, 4.0, "mlp"),  # 1815M
}


def list_backbones() -> list[str]:
    """Names accepted by ``build_backbone``."""
    return list(BACKBONES)


def backbone_config(name: str, **overrides) -> dict[str, Any]:
    """The keyword arguments ``build_backbone(name, **overrides)`` passes to the ViT."""
    if name not in BACKBONES:
        raise ValueError(f"Unknown backbone {name!r}; known backbones: {', '.join(BACKBONES)}")
    return {**copy.deepcopy(BACKBONES[name]), **overrides}


def build_backbone(name: str, **overrides) -> DinoVisionTransformer:
    """Build a named backbone; ``overrides`` replace or add ViT keyword arguments
    (e.g. ``ndim=3, in_chans=1, attention="fa4"``)."""
    return DinoVisionTransformer(**backbone_config(name, **overrides))


__all__ = [
    "BACKBONES",
    "Block",
    "DinoVisionTransformer",
    "LOSSES",
    "MaskedAutoencoder",
    "RopePositionEmbedding",
    "SegmentationModel",
    "attention",
    "backbone_config",
    "build_backbone",
    "build_loss",
    "list_backbones",
    "masked_bce_loss",
    "predict_probabilities",
    "resolve_attention_backend",
    "rope_apply",
    "training_flops_per_sample",
    "use_attention",
]
