"""Semantic segmentation on a DINOv3 ViT backbone: multi-layer features -> a head -> logits.

Both heads read the same features: the outputs of a few blocks (by default four at even
intervals), each normalised with the backbone's final norm and reshaped to a patch grid,
concatenated on channels.

* ``LinearHead`` ("linear"): DINOv3's linear segmentation head without its BatchNorm. A 1x1
  convolution maps the features to class logits on the patch grid; the logits are upsampled
  (bilinear / trilinear) to the requested output size.
* ``UpConvHead`` ("upconv"): a light convolutional decoder for thin structures (membranes a few
  voxels thick), which a patch-resolution prediction cannot draw. A 1x1 convolution projects
  the features to ``head_channels``; stages of (x2 transposed convolution, 3x3 convolution,
  GroupNorm, GELU) then double the resolution and halve the channels (down to 16) until the
  input resolution is reached, where a few convolutions on the input image itself join as a
  skip connection before the last convolution and the 1x1 classifier.
* ``UpConvHead`` with image levels ("multiscale"): the same decoder, with the input image also
  encoded at 1/2 and 1/4 resolution and fused where the decoder passes through those scales
  (UNETR / nnU-Net style skips), so fine structure reaches every decoder stage.

There is no BatchNorm anywhere: every normalisation is per sample, so results do not depend
on how a batch is split across ranks.

The losses live in ``losses.py``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchtitan.choices import HEAD_IMAGE_LEVELS, OUT_LAYER_SETS

from .context import ContextParallelModel, SequenceShard
from .resize import resize_linear
from .vit import DinoVisionTransformer


# FLOPs per multiply-accumulate, as in flops.py (which imports this module): 2 in the forward
# pass, 4 in the backward pass (gradients of input and weight; 2 when the input needs none).
_FORWARD, _BACKWARD = 2, 4


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


def _conv_training_flops(conv: nn.Module, positions: int, input_needs_grad: bool = True) -> int:
    """Forward + backward FLOPs of a convolution evaluated at ``positions`` places (output
    positions for a convolution, input positions for a transposed one)."""
    per_mac = _FORWARD + (_BACKWARD if input_needs_grad else _BACKWARD // 2)
    return per_mac * positions * conv.weight.numel()


# ----------------------------------------------------------------------------- linear head
class LinearHead(nn.Module):
    """Concatenated patch tokens -> dropout -> 1x1 conv to class logits (on the patch grid).

    It reads the backbone's tokens as they are, (B, N, C) per layer, and applies its 1x1
    convolution as a linear layer over their channels: only the logits (a few channels) take
    the grid's layout, not the features of every layer."""

    def __init__(self, ndim: int, in_channels: int, num_classes: int, dropout: float = 0.0):
        super().__init__()
        conv = {2: nn.Conv2d, 3: nn.Conv3d}[ndim]
        self.dropout = nn.Dropout(dropout)
        self.conv = conv(in_channels, num_classes, kernel_size=1)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.conv.weight, std=0.01)
        nn.init.zeros_(self.conv.bias)

    def forward(self, tokens: list[Tensor], grid: Sequence[int]) -> Tensor:
        """Logits (B, K, *grid) from each layer's normalised patch tokens (B, N, C), N the
        number of grid cells in row-major order."""
        x = self.dropout(torch.cat(tokens, dim=-1))
        logits = F.linear(x, self.conv.weight.flatten(1), self.conv.bias)  # (B, N, K)
        return logits.transpose(1, 2).reshape(x.shape[0], -1, *grid)

    def training_flops(self, grid: Sequence[int], features_need_grad: bool = True) -> int:
        """Forward + backward FLOPs for one sample whose patch grid is ``grid``."""
        return _conv_training_flops(self.conv, math.prod(grid), features_need_grad)


# ----------------------------------------------------------------------------- upconv head
def _group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with up to 8 groups (a divisor of ``channels``): per sample, batch-split safe."""
    groups = next(g for g in (8, 4, 2, 1) if channels % g == 0)
    return nn.GroupNorm(groups, channels)


class ConvNormAct(nn.Sequential):
    """3x3 (x3) convolution, 'same' padding -> GroupNorm -> GELU."""

    def __init__(self, ndim: int, in_channels: int, out_channels: int):
        conv = {2: nn.Conv2d, 3: nn.Conv3d}[ndim]
        super().__init__(
            conv(in_channels, out_channels, kernel_size=3, padding=1),
            _group_norm(out_channels),
            nn.GELU(),
        )


class UpStage(nn.Module):
    """x2 upsampling by a stride-2 transposed convolution, then ConvNormAct."""

    def __init__(self, ndim: int, in_channels: int, out_channels: int):
        super().__init__()
        up = {2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[ndim]
        self.up = up(in_channels, out_channels, kernel_size=2, stride=2)
        self.conv = ConvNormAct(ndim, out_channels, out_channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(self.up(x))


class DownStage(nn.Sequential):
    """x1/2 downsampling by a stride-2 3x3 convolution (GN, GELU), then ConvNormAct."""

    def __init__(self, ndim: int, in_channels: int, out_channels: int):
        conv = {2: nn.Conv2d, 3: nn.Conv3d}[ndim]
        super().__init__(
            conv(in_channels, out_channels, kernel_size=3, stride=2, padding=1),
            _group_norm(out_channels),
            nn.GELU(),
            ConvNormAct(ndim, out_channels, out_channels),
        )


class UpConvHead(nn.Module):
    """Patch features -> full-resolution logits, for thin structures.

    Shapes for patch size p = 2^S, ``channels`` = C, ``min_channels`` = m (c_s = max(C / 2^s,
    m); m = 16 by default) and
    ``image_levels`` = K (1: "upconv"; 3: "multiscale")::

        features (B, F, *grid) -- dropout, 1x1 conv ---------------> (B, C,   *grid)
        S x UpStage: x2 transposed conv, 3x3 conv, GN, GELU -------> (B, c_S, *grid * p)
        image (B, in_chans, *grid * p) -- 2 x ConvNormAct ---------> (B, m,   *grid * p)
        concat -> ConvNormAct -> 1x1 conv -------------------------> (B, num_classes, *grid * p)

    With K > 1 the image is also encoded at 1/2, ..., 1/2^(K-1) of its resolution (a stride-2
    DownStage each, m * 2^k channels), and each of those maps is concatenated and fused
    (ConvNormAct) where the decoder passes through that resolution, as in UNETR's and
    nnU-Net's skip connections: edges and thin tubes a few voxels wide, which no patch token
    resolves, reach the decoder at every scale. The ViT features enter at the patch grid, the
    outputs of several blocks concatenated (``out_layers``).
    """

    # Dimensions whose decoder runs channels-last (bench/model_step.py --head-layouts)
    CHANNELS_LAST_NDIMS: tuple[int, ...] = (3,)

    def __init__(
        self,
        ndim: int,
        in_channels: int,
        num_classes: int,
        patch_size: int,
        image_channels: int,
        channels: int = 64,
        dropout: float = 0.0,
        image_levels: int = 1,
        min_channels: int = 16,
    ):
        super().__init__()
        if patch_size < 1 or patch_size & (patch_size - 1):
            raise ValueError(
                f"The 'upconv' and 'multiscale' heads upsample by x2 per stage and need a "
                f"power-of-two patch size; got patch_size={patch_size} (use e.g. 4, 8 or 16, "
                "or the 'linear' head)"
            )
        conv = {2: nn.Conv2d, 3: nn.Conv3d}[ndim]
        self.ndim = ndim
        self.patch_size = patch_size
        num_stages = patch_size.bit_length() - 1  # log2(patch_size)
        # Image levels beyond the patch grid's resolution would have nothing to join.
        self.image_levels = min(image_levels, num_stages + 1)
        min_channels = min(min_channels, channels)

        self.dropout = nn.Dropout(dropout)
        self.proj = conv(in_channels, channels, kernel_size=1)
        # Decoder widths per resolution level: level S is the patch grid, level 0 full size.
        widths = {num_stages: channels}
        for level in range(num_stages - 1, -1, -1):
            widths[level] = max(widths[level + 1] // 2, min_channels)
        self.stages = nn.ModuleList(UpStage(ndim, widths[level + 1], widths[level])
                                    for level in range(num_stages - 1, -1, -1))
        # Skip from the input: edges a voxel wide survive no patch embedding, so look again.
        self.skip = nn.Sequential(
            ConvNormAct(ndim, image_channels, min_channels),
            ConvNormAct(ndim, min_channels, min_channels),
        )
        self.fuse = ConvNormAct(ndim, widths[0] + min_channels, widths[0])
        # Coarser image levels 1 .. K-1: encoder stages and their fusions in the decoder.
        skip_widths = [min_channels * 2**k for k in range(self.image_levels)]
        self.down = nn.ModuleList(DownStage(ndim, skip_widths[k - 1], skip_widths[k])
                                  for k in range(1, self.image_levels))
        self.down_fuse = nn.ModuleList(ConvNormAct(ndim, widths[k] + skip_widths[k], widths[k])
                                       for k in range(1, self.image_levels))
        self.classifier = conv(widths[0], num_classes, kernel_size=1)

    @torch.no_grad()
    def init_weights(self) -> None:
        """PyTorch's default init for every layer, the classifier included.

        Not the linear head's small classifier (std 0.01): behind a decoder, weights that
        small pass almost no gradient back to it for the first hundred steps, and which
        direction they start in then decides the run (the loss after 150 steps on real EM
        ranged 0.90-0.98 over four seeds, against 0.77-0.88 with the default scale;
        docs/benchmarks/findings.md)."""
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                                   nn.GroupNorm)):
                module.reset_parameters()

    def forward(self, features: list[Tensor], image: Tensor) -> Tensor:
        """Logits (B, num_classes, *image size). In 3D the decoder runs channels-last (what
        oneDNN's and cuDNN's convolutions compute in: no reorder of every activation to and
        from their layout; on the CPU the head's forward and backward take 0.73-0.78x the time,
        ``bench/model_step.py --head-layouts``; in 2D the same took 1.05x, so 2D keeps the
        default layout); the logits come back in the default layout. A traced graph (TorchScript
        and ONNX export) keeps the default layout: ONNX has no memory formats."""
        layout = torch.contiguous_format
        if self.ndim in self.CHANNELS_LAST_NDIMS and not torch.jit.is_tracing():
            layout = torch.channels_last_3d if self.ndim == 3 else torch.channels_last
        x = torch.cat(features, dim=1).contiguous(memory_format=layout)
        x = self.proj(self.dropout(x))
        # The image has one channel, for which both layouts are the same: set it after the
        # first convolution, so that every layer behind it runs channels-last.
        first = self.skip[0](image.to(x.dtype)).contiguous(memory_format=layout)
        skips = [self.skip[1](first)]
        for down in self.down:
            skips.append(down(skips[-1]))
        level = len(self.stages)
        for stage in [None, *self.stages]:
            if stage is not None:
                x = stage(x)
                level -= 1
            if 0 < level < self.image_levels:
                x = self.down_fuse[level - 1](torch.cat([x, skips[level]], dim=1))
        x = torch.cat([x, skips[0]], dim=1)
        return self.classifier(self.fuse(x)).contiguous()

    def training_flops(self, grid: Sequence[int], features_need_grad: bool = True) -> int:
        """Forward + backward FLOPs for one sample whose patch grid is ``grid`` (convolutions
        only; norms, activations and the concatenation are cheap next to them)."""
        scale = 2**self.ndim
        n = math.prod(grid)
        full = n * scale ** len(self.stages)  # positions at the input resolution
        flops = _conv_training_flops(self.proj, n, features_need_grad)
        for stage in self.stages:
            flops += _conv_training_flops(stage.up, n)  # transposed conv: input positions
            n *= scale
            flops += _conv_training_flops(stage.conv[0], n)
        first, second = self.skip[0][0], self.skip[1][0]
        flops += _conv_training_flops(first, full, input_needs_grad=False)  # the image needs none
        flops += _conv_training_flops(second, full) + _conv_training_flops(self.fuse[0], full)
        for k, (down, fuse) in enumerate(zip(self.down, self.down_fuse), start=1):
            positions = full // scale**k
            flops += _conv_training_flops(down[0], positions)
            flops += _conv_training_flops(down[3][0], positions)
            flops += _conv_training_flops(fuse[0], positions)
        return flops + _conv_training_flops(self.classifier, full)


# ----------------------------------------------------------------------------- model
# The implementation of each head name of ``torchtitan.choices.HEADS`` (the config's choices;
# tests/test_choices.py keeps the two equal). The convolutional heads differ by their default
# image levels (``HEAD_IMAGE_LEVELS``).
HEAD_TYPES: dict[str, type[nn.Module]] = {
    "linear": LinearHead,
    "upconv": UpConvHead,
    "multiscale": UpConvHead,
}


def boundary_from_affinities(logits: Tensor, faces: Sequence[tuple[int, int]]) -> Tensor:
    """Logits (B, 1, *spatial) of a boundary taken from face-neighbour affinity logits.

    ``faces``: (channel, axis) of each face-neighbour affinity, channel ``c`` at voxel ``v``
    saying whether ``v`` and ``v + e_axis`` hold the same object. A voxel is a boundary voxel
    where one of its face neighbours (``v + e`` or ``v - e`` along any axis) holds another
    object, so its probability is 1 minus the least affinity to a neighbour: the logit is minus
    the least of those logits (sigmoid is monotone). A neighbour outside the window does not
    count."""
    inf = torch.finfo(logits.dtype).max
    edges = []
    for channel, axis in faces:
        a = logits[:, channel]  # (B, *spatial): v with v + e
        dim = 1 + axis
        n = a.shape[dim]
        high = a.narrow(dim, 0, n - 1)  # v + e inside
        pad = torch.full_like(a.narrow(dim, 0, 1), inf)
        edges.append(torch.cat([high, pad], dim))  # v with v + e (none at the last)
        edges.append(torch.cat([pad, high], dim))  # v with v - e (none at the first)
    return -torch.stack(edges).amin(0).unsqueeze(1)


class SegmentationModel(ContextParallelModel):
    """Backbone + head; ``forward(x, output_size=None) -> (B, num_classes, *size)``.

    ``head``: "linear", "upconv" or "multiscale" (``head_channels`` sets the width of the
    convolutional heads, ``head_min_channels`` their narrowest, at full resolution;
    ``head_image_levels`` the number of resolutions at which they encode
    and fuse the input image, 0 for the head's own: 1 for "upconv", 3 for "multiscale").
    ``freeze_backbone``: train only the head. The backbone's parameters stop requiring
    gradients (the optimizer skips them), its forward runs under ``torch.no_grad`` (no
    activations kept for backward) and it stays in eval mode (no stochastic depth), as in
    DINOv3's linear probing.
    """

    def __init__(
        self,
        backbone: DinoVisionTransformer,
        num_classes: int,
        head: str = "linear",
        out_layers: str | Sequence[int] = "four_even_intervals",
        head_channels: int = 64,
        head_image_levels: int = 0,
        freeze_backbone: bool = False,
        head_min_channels: int = 16,
        dropout: float = 0.0,
        boundary_from: tuple[int, Sequence[tuple[int, int]]] | None = None,
    ):
        super().__init__()
        if head not in HEAD_TYPES:
            raise ValueError(f"Unknown head {head!r}; available: {', '.join(map(repr, HEAD_TYPES))}")
        self.backbone = backbone
        self.ndim = backbone.ndim
        self.num_classes = num_classes
        self.head_name = head
        # (index, faces): output channel ``index`` is not the head's but a boundary taken from
        # its face-affinity channels (boundary_from_affinities; ``faces`` index the head's
        # outputs), so the head predicts one channel fewer.
        self.boundary_from = boundary_from
        if boundary_from is not None:
            if HEAD_TYPES[head] is LinearHead:
                raise ValueError("a boundary from affinities needs a convolutional head "
                                 "(full-resolution logits), not 'linear'")
            num_classes -= 1
        self.out_indices = backbone_out_indices(len(backbone.blocks), out_layers)
        in_channels = backbone.embed_dim * len(self.out_indices)
        if HEAD_TYPES[head] is LinearHead:
            self.head = LinearHead(self.ndim, in_channels, num_classes, dropout)
        else:
            self.head = UpConvHead(
                self.ndim, in_channels, num_classes, backbone.patch_size, backbone.in_chans,
                channels=head_channels, dropout=dropout,
                image_levels=head_image_levels or HEAD_IMAGE_LEVELS[head],
                min_channels=head_min_channels,
            )
        if not next(self.head.parameters()).is_meta:  # on meta, init_weights runs after to_empty
            self.head.init_weights()

        self.context: SequenceShard | None = None  # context parallelism (see context.py)
        self.freeze_backbone = freeze_backbone
        if freeze_backbone:
            self.backbone.requires_grad_(False)
            self.backbone.eval()

    def train(self, mode: bool = True) -> "SegmentationModel":
        super().train(mode)
        if self.freeze_backbone:
            self.backbone.eval()
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise backbone and head (also after ``to_empty`` from the meta device)."""
        self.backbone.init_weights()
        self.head.init_weights()

    def forward(self, x: Tensor, output_size: Sequence[int] | None = None,
                resize: bool = True) -> Tensor:
        """Logits (B, num_classes, *output_size); the default output size is the input's.
        ``resize=False``: the head's logits before their linear resize to ``output_size`` (on
        the patch grid for the linear head), for a loss that resizes them itself
        (``Loss.resized``); ignored under context parallelism in training, where the output
        is always this rank's slab at ``output_size``."""
        output_size = tuple(x.shape[2:] if output_size is None else output_size)
        shard = self.context_shard()
        if shard is not None:
            return self._forward_context_parallel(x, output_size, shard)
        if isinstance(self.head, LinearHead):
            logits = self._head_logits(x)
        else:
            logits = self._with_boundary(self.head(self._features(x), x))
        return self._resize(logits, output_size) if resize else logits

    def _with_boundary(self, logits: Tensor) -> Tensor:
        """The head's logits with the boundary channel of ``boundary_from`` put in place."""
        if self.boundary_from is None:
            return logits
        index, faces = self.boundary_from
        faces = [(c if c < index else c - 1, axis) for c, axis in faces]  # the head's channels
        boundary = boundary_from_affinities(logits, faces)
        return torch.cat([logits[:, :index], boundary, logits[:, index:]], dim=1)

    def _features(self, x: Tensor, reshape: bool = True) -> list[Tensor]:
        """The normalised outputs of the head's blocks: maps (B, C, *grid), or tokens (B, N, C)."""
        frozen = torch.no_grad() if self.freeze_backbone else contextlib.nullcontext()
        with frozen:
            return list(self.backbone.get_intermediate_layers(x, n=self.out_indices,
                                                              reshape=reshape, norm=True))

    def _head_logits(self, x: Tensor) -> Tensor:
        """The linear head's logits on the patch grid of ``x``."""
        grid = [s // self.backbone.patch_size for s in x.shape[2:]]
        return self.head(self._features(x, reshape=False), grid)

    def _resize(self, logits: Tensor, size: Sequence[int]) -> Tensor:
        if tuple(logits.shape[2:]) == tuple(size):
            return logits
        return resize_linear(logits, size)

    def _forward_context_parallel(self, x: Tensor, output_size: tuple[int, ...],
                                  shard: SequenceShard) -> Tensor:
        """This rank's slab (along the first spatial axis) of the logits, under context
        parallelism. ``x`` is the whole input (every rank of the group reads the same samples);
        the backbone runs on this rank's slab of it.

        The linear head is a 1x1 convolution: it runs on the slab, and only its logits on the
        patch grid (a few channels) are gathered, so that the upsampling of the slab's edge
        rows sees the neighbouring rows, as it does on one process. The convolutional heads
        mix neighbours at every stage and normalise over the whole sample (GroupNorm): they get
        the gathered feature map and run on the whole sample on every rank (their memory does
        not shrink with the group), then the slab of their output is kept."""
        if not isinstance(self.head, LinearHead):
            features = self._features(shard.slab(x, 2))
            logits = self.head([shard.gather(torch.cat(features, dim=1), 2)], x)
            return shard.slab(self._resize(self._with_boundary(logits), output_size), 2)
        logits = shard.gather(self._head_logits(shard.slab(x, 2)), 2)  # (B, K, *grid), whole
        rows, out_rows = logits.shape[2], output_size[0]
        if out_rows % rows or tuple(logits.shape[2:]) == output_size:
            return shard.slab(self._resize(logits, output_size), 2)
        # Upsample this rank's rows with one neighbouring row on each side, then crop: with
        # an integer factor, every output row depends only on the two nearest grid rows.
        factor, n = out_rows // rows, rows // shard.size
        lo = shard.rank * n
        a, b = max(lo - 1, 0), min(lo + n + 1, rows)
        part = self._resize(logits[:, :, a:b], ((b - a) * factor, *output_size[1:]))
        return part[:, :, (lo - a) * factor:(lo - a + n) * factor]
