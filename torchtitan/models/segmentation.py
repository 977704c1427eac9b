"""Semantic segmentation on a DINOv3 ViT backbone: a linear head on multi-layer features.

The head is DINOv3's linear segmentation head without its BatchNorm: features of a few
blocks (by default four at even intervals), each normalised with the backbone's final norm,
are reshaped to patch grids, concatenated on channels and mapped to class logits by a 1x1
convolution; the logits are upsampled (bilinear / trilinear) to the requested output size.
There is no BatchNorm anywhere, so results do not depend on how a batch is split across ranks.

Labels are one binary channel per class, so the loss is a per-voxel, per-class sigmoid
cross-entropy, counted only where the label is known (``masked_bce_loss``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .vit import DinoVisionTransformer

OUT_LAYER_SETS = ("last", "four_last", "four_even_intervals")


def backbone_out_indices(depth: int, out_layers: str | Sequence[int]) -> list[int]:
    """Block indices whose outputs feed the head.

    "last": the last block; "four_last": the last four; "four_even_intervals": Meta's choice
    ``[d/4 - 1, d/2 - 1, 3d/4 - 1, d - 1]`` (e.g. 2, 5, 8, 11 for depth 12), or every block
    when depth < 4. A list of ints is taken as given (negative indices count from the end).
    """
    if not isinstance(out_layers, str):
        indices = [i % depth for i in out_layers]
    elif out_layers == "last":
        indices = [depth - 1]
    elif out_layers == "four_last":
        indices = list(range(max(0, depth - 4), depth))
    elif out_layers == "four_even_intervals":
        # Equal to Meta's [i * (depth // 4) - 1] when depth is a multiple of 4.
        indices = list(range(depth)) if depth < 4 else [i * depth // 4 - 1 for i in range(1, 5)]
    else:
        raise ValueError(f"Unknown out_layers {out_layers!r}; expected one of {OUT_LAYER_SETS} or a list")
    if not indices:
        raise ValueError("out_layers selects no block")
    return indices


class LinearHead(nn.Module):
    """Concatenated feature maps -> dropout -> 1x1 conv to class logits."""

    def __init__(self, ndim: int, in_channels: int, num_classes: int, dropout: float = 0.0):
        super().__init__()
        conv = {2: nn.Conv2d, 3: nn.Conv3d}[ndim]
        self.dropout = nn.Dropout(dropout)
        self.conv = conv(in_channels, num_classes, kernel_size=1)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.conv.weight, std=0.01)
        nn.init.zeros_(self.conv.bias)

    def forward(self, features: list[Tensor]) -> Tensor:
        return self.conv(self.dropout(torch.cat(features, dim=1)))


class SegmentationModel(nn.Module):
    """Backbone + linear head; ``forward(x, output_size=None) -> (B, num_classes, *size)``."""

    def __init__(
        self,
        backbone: DinoVisionTransformer,
        num_classes: int,
        head: str = "linear",
        out_layers: str | Sequence[int] = "four_even_intervals",
        dropout: float = 0.0,
    ):
        super().__init__()
        if head != "linear":
            raise ValueError(f"Unknown head {head!r}; available: 'linear'")
        self.backbone = backbone
        self.ndim = backbone.ndim
        self.num_classes = num_classes
        self.out_indices = backbone_out_indices(len(backbone.blocks), out_layers)
        in_channels = backbone.embed_dim * len(self.out_indices)
        self.head = LinearHead(self.ndim, in_channels, num_classes, dropout)
        if not self.head.conv.weight.is_meta:  # on meta, init_weights runs after to_empty
            self.head.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise backbone and head (also after ``to_empty`` from the meta device)."""
        self.backbone.init_weights()
        self.head.init_weights()

    def forward(self, x: Tensor, output_size: Sequence[int] | None = None) -> Tensor:
        """Logits (B, num_classes, *output_size); the default output size is the input's."""
        if output_size is None:
            output_size = x.shape[2:]
        features = self.backbone.get_intermediate_layers(x, n=self.out_indices, reshape=True, norm=True)
        logits = self.head(list(features))
        mode = "bilinear" if self.ndim == 2 else "trilinear"
        return F.interpolate(logits, size=tuple(output_size), mode=mode, align_corners=False)


def masked_bce_loss(logits: Tensor, targets: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Binary cross-entropy with logits, summed over valid entries: returns (sum, count).

    logits, targets: (B, K, *spatial); valid broadcastable to them (e.g. (B, K, *spatial) or
    (B, K, 1, 1, 1) for per-crop class annotation), nonzero where the label is known.
    Invalid entries contribute nothing and get zero gradient, whatever their targets hold.
    """
    valid = (valid > 0).expand_as(logits)
    safe_targets = torch.where(valid, targets.to(logits.dtype), torch.zeros_like(logits))
    bce = F.binary_cross_entropy_with_logits(logits, safe_targets, reduction="none")
    total = torch.where(valid, bce, torch.zeros_like(bce)).sum()
    return total, valid.sum().to(logits.dtype)
