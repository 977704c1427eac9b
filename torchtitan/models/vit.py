"""DINOv3 vision transformer for 2D images and 3D volumes.

The architecture and the state-dict key names are those of Meta's DINOv3
(``dinov3/models/vision_transformer.py``), so a Meta ``.pth`` checkpoint loads with
``strict=True`` into a 2D model built with the same hyperparameters:

    cls_token (1, 1, D)          storage_tokens (1, R, D)        mask_token (1, D)
    patch_embed.proj             Conv2d / Conv3d, kernel = stride = patch_size
    rope_embed.periods           RoPE periods buffer
    blocks.{i}.norm1 / .attn.qkv (+ .attn.qkv.bias_mask) / .attn.proj / .ls1.gamma
    blocks.{i}.norm2 / .mlp.fc1, .mlp.fc2 ("mlp") or .mlp.w1, .w2, .w3 ("swiglu*") / .ls2.gamma
    norm                         final norm
    local_cls_norm               only with untie_global_and_local_cls_norm (ViT-7B)

The token sequence is ``[cls, storage_1..R, patch_1..N]``; patches are in C order over the
patch grid (z, y, x). RoPE rotates only patch tokens, so the prefix tokens are position-free.

Besides Meta's entry points (``forward_features``, ``get_intermediate_layers``, ``forward``),
the model exposes the steps separately (``embed_patches``, ``prepend_prefix_tokens``,
``forward_tokens``) so that an MAE encoder can run on a per-sample subset of patches with
the matching per-sample RoPE tables.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import ATTENTION_BACKENDS, attention
from .context import SequenceShard, in_use
from .rope import RopePositionEmbedding, rope_apply

Rope = tuple[Tensor, Tensor]  # (sin, cos), each (N, head_dim) or (B, N, head_dim)

NORM_LAYERS: dict[str, Callable[[int], nn.Module]] = {
    "layernorm": lambda dim: nn.LayerNorm(dim, eps=1e-6),
    "layernormbf16": lambda dim: nn.LayerNorm(dim, eps=1e-5),
    "rmsnorm": lambda dim: nn.RMSNorm(dim, eps=1e-5),
}

# FFN name -> alignment of the SwiGLU hidden size (None: plain GELU MLP).
FFN_LAYERS: dict[str, int | None] = {
    "mlp": None,
    "swiglu": 8,
    "swiglu32": 32,
    "swiglu64": 64,
    "swiglu128": 128,
}


# ----------------------------------------------------------------------------- layers
def unfold_patches(x: Tensor, patch_size: int) -> Tensor:
    """(B, C, *spatial) -> (B, N, C * p^ndim): one row per patch, patches in C order over the
    grid, each row's values in the order of a convolution weight's (C, p, p[, p]) flattened,
    so that ``F.linear(rows, weight.flatten(1), bias)`` is the strided convolution's output."""
    B, C, *spatial = x.shape
    p = patch_size
    grid = [s // p for s in spatial]
    split = [n for g in grid for n in (g, p)]  # (g0, p, g1, p, ...)
    x = x.reshape(B, C, *split)
    nd = len(grid)
    order = [0, *(2 + 2 * i for i in range(nd)), 1, *(3 + 2 * i for i in range(nd))]
    return x.permute(order).reshape(B, math.prod(grid), C * p**nd)


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens (2D or 3D): a strided convolution, or the same
    product as one GEMM on the unfolded patches.

    The parameters are always those of the ``Conv2d``/``Conv3d`` ``proj`` (Meta's names and
    shapes, ``(D, C, p, p[, p])``). ``gemm`` chooses how they are applied: True reshapes the
    input into (B, N, C * p^ndim) patch rows and multiplies them by the flattened weight;
    False runs the convolution; None (the default) takes the GEMM for CUDA inputs and the
    convolution elsewhere. The two agree to float rounding (the sums run in another order),
    so on a CPU the convolution stays, and with it the bits of every CPU result; on a GPU the
    GEMM avoids cuDNN's strided 3D convolution kernels, whose weight gradient for a
    one-channel 16^3 kernel is far from a GEMM's rate (bench/device_check.py, "micro").
    """

    def __init__(self, ndim: int, patch_size: int, in_chans: int, embed_dim: int,
                 gemm: bool | None = None):
        super().__init__()
        conv = {2: nn.Conv2d, 3: nn.Conv3d}[ndim]
        self.ndim = ndim
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.gemm = gemm
        self.proj = conv(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        """(B, C, *spatial) -> tokens (B, N, D) and the patch grid shape."""
        if x.dim() != self.ndim + 2:
            raise ValueError(
                f"Expected a (B, C, {'D, ' if self.ndim == 3 else ''}H, W) input for a "
                f"{self.ndim}D model, got shape {tuple(x.shape)}"
            )
        spatial = tuple(x.shape[2:])
        if any(s % self.patch_size for s in spatial):
            raise ValueError(
                f"Spatial size {spatial} is not a multiple of the patch size {self.patch_size}"
            )
        if self.gemm if self.gemm is not None else x.is_cuda:
            grid = tuple(s // self.patch_size for s in spatial)
            return F.linear(unfold_patches(x, self.patch_size), self.proj.weight.flatten(1),
                            self.proj.bias), grid
        x = self.proj(x)  # (B, D, *grid)
        grid = tuple(x.shape[2:])
        return x.flatten(2).transpose(1, 2), grid

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # Meta's init: uniform in +-1/sqrt(fan_in) for weight and bias.
        fan_in = self.in_chans * self.patch_size**self.ndim
        bound = fan_in**-0.5
        nn.init.uniform_(self.proj.weight, -bound, bound)
        if self.proj.bias is not None:
            nn.init.uniform_(self.proj.bias, -bound, bound)


class LinearKMaskedBias(nn.Linear):
    """The qkv projection whose key bias is forced to zero.

    A bias on k adds the same term to every score of a query, which softmax ignores; Meta
    keeps the parameter (for checkpoint compatibility) but multiplies it by ``bias_mask``,
    a buffer of ones with zeros on the k third.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        if out_features % 3 != 0:
            raise ValueError("LinearKMaskedBias expects a fused qkv output (multiple of 3)")
        if bias:
            self.register_buffer("bias_mask", torch.empty(out_features))
            self.reset_bias_mask()
        else:
            self.bias_mask = None

    @torch.no_grad()
    def reset_bias_mask(self) -> None:
        if self.bias_mask is not None:
            o = self.out_features
            self.bias_mask.fill_(1.0)
            # fill_ on a slice, not slice assignment: also works on a (tensor-parallel) DTensor.
            self.bias_mask[o // 3 : 2 * o // 3].fill_(0.0)

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias * self.bias_mask.to(self.bias.dtype)
        return F.linear(x, self.weight, bias)


class SelfAttention(nn.Module):
    """Multi-head self-attention with RoPE on the trailing (patch) tokens."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        mask_k_bias: bool = False,
        attention: str = "sdpa",
    ):
        super().__init__()
        if dim % num_heads != 0:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attention = attention
        linear = LinearKMaskedBias if mask_k_bias else nn.Linear
        self.qkv = linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)
        self.context: SequenceShard | None = None  # context parallelism (see context.py)

    @staticmethod
    def apply_rope(q: Tensor, k: Tensor, rope: Rope) -> tuple[Tensor, Tensor]:
        """Rotate the last ``rope``-many tokens of q and k (the prefix tokens stay as they are).

        Computed in the dtype of the RoPE tables (fp32) and cast back, as Meta does.
        """
        sin, cos = rope
        n_prefix = q.shape[-2] - sin.shape[-2]
        if n_prefix < 0:
            raise ValueError(f"RoPE has {sin.shape[-2]} positions for {q.shape[-2]} tokens")
        if n_prefix == 0:  # tables cover every token (see rope_for_tokens): no slicing, no cat
            return (rope_apply(q.to(sin.dtype), sin, cos).to(q.dtype),
                    rope_apply(k.to(sin.dtype), sin, cos).to(k.dtype))
        out = []
        for t in (q, k):
            t_rot = rope_apply(t[:, :, n_prefix:].to(sin.dtype), sin, cos).to(t.dtype)
            out.append(torch.cat([t[:, :, :n_prefix], t_rot], dim=2))
        return out[0], out[1]

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        B, N, _ = x.shape
        # (B, N, 3 * heads * hd) -> three (B, heads, N, hd); -1 keeps this valid when
        # tensor parallelism leaves only a shard of the heads on this rank.
        qkv = self.qkv(x).reshape(B, N, 3, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        if rope is not None:
            q, k = self.apply_rope(q, k, rope)
        shard = in_use(self.context)
        if shard is not None:
            # Context parallelism: this rank's queries attend to every rank's keys and values.
            k, v = shard.gather_kv(k, v)
        x = attention(q, k, v, self.attention)
        return self.proj(x.transpose(1, 2).reshape(B, N, -1))


def rope_for_tokens(rope: Rope | None, n_tokens: int) -> Rope | None:
    """RoPE tables covering all ``n_tokens`` tokens: identity rows (sin 0, cos 1) prepended
    for the prefix tokens. Done once per forward, so that no block has to slice q and k into
    prefix and patches and concatenate them again. Rotating a prefix token by these rows
    returns it unchanged (x * 1 + rotate_half(x) * 0 = x, exactly)."""
    if rope is None:
        return None
    sin, cos = rope
    n_prefix = n_tokens - sin.shape[-2]
    if n_prefix <= 0:
        return rope
    shape = (*sin.shape[:-2], n_prefix, sin.shape[-1])
    return (torch.cat([sin.new_zeros(shape), sin], dim=-2),
            torch.cat([cos.new_ones(shape), cos], dim=-2))


class LayerScale(nn.Module):
    """Learned per-channel scale of a residual branch, initialised small."""

    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.init_values = init_values
        self.gamma = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.gamma, self.init_values)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class Mlp(nn.Module):
    """fc1 -> GELU -> fc2."""

    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def swiglu_hidden_dim(hidden: int, align_to: int) -> int:
    """Meta's SwiGLU width: 2/3 of the MLP width (same parameter count), rounded up."""
    d = int(hidden * 2 / 3)
    return d + (-d % align_to)


class SwiGLUFFN(nn.Module):
    """w3(silu(w1 x) * w2 x)."""

    def __init__(self, dim: int, hidden: int, bias: bool = True, align_to: int = 8):
        super().__init__()
        hidden = swiglu_hidden_dim(hidden, align_to)
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def drop_path(x: Tensor, p: float, training: bool) -> Tensor:
    """Stochastic depth: zero a residual branch for a random subset of samples."""
    if p == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1.0 - p)
    return x * keep / (1.0 - p)


class Block(nn.Module):
    """Pre-norm transformer block: x + ls1(attn(norm1 x)), then x + ls2(mlp(norm2 x))."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        ffn_ratio: float = 4.0,
        ffn_layer: str = "mlp",
        qkv_bias: bool = True,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        layerscale_init: float | None = 1e-5,
        mask_k_bias: bool = False,
        norm_layer: str = "layernormbf16",
        drop_path_rate: float = 0.0,
        attention: str = "sdpa",
    ):
        super().__init__()
        if ffn_layer not in FFN_LAYERS:
            raise ValueError(f"Unknown ffn_layer {ffn_layer!r}; expected one of {list(FFN_LAYERS)}")
        if norm_layer not in NORM_LAYERS:
            raise ValueError(f"Unknown norm_layer {norm_layer!r}; expected one of {list(NORM_LAYERS)}")
        make_norm = NORM_LAYERS[norm_layer]
        self.norm1 = make_norm(dim)
        self.attn = SelfAttention(dim, num_heads, qkv_bias, proj_bias, mask_k_bias, attention)
        self.ls1 = LayerScale(dim, layerscale_init) if layerscale_init else nn.Identity()
        self.norm2 = make_norm(dim)
        hidden = int(dim * ffn_ratio)
        align_to = FFN_LAYERS[ffn_layer]
        if align_to is None:
            self.mlp = Mlp(dim, hidden, bias=ffn_bias)
        else:
            self.mlp = SwiGLUFFN(dim, hidden, bias=ffn_bias, align_to=align_to)
        self.ls2 = LayerScale(dim, layerscale_init) if layerscale_init else nn.Identity()
        self.drop_path_rate = drop_path_rate

    def forward(self, x: Tensor, rope: Rope | None = None) -> Tensor:
        x = x + drop_path(self.ls1(self.attn(self.norm1(x), rope)), self.drop_path_rate, self.training)
        x = x + drop_path(self.ls2(self.mlp(self.norm2(x))), self.drop_path_rate, self.training)
        return x


@torch.no_grad()
def init_vit_module(module: nn.Module) -> None:
    """Meta's per-module init: trunc-normal(0.02) linears with zero bias, default norms."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, LinearKMaskedBias):
            module.reset_bias_mask()
    elif isinstance(module, (nn.LayerNorm, nn.RMSNorm, LayerScale, PatchEmbed)):
        module.reset_parameters()
    elif isinstance(module, RopePositionEmbedding):
        module.reset_parameters()


# ----------------------------------------------------------------------------- model
class DinoVisionTransformer(nn.Module):
    """Meta's DINOv3 ViT, generalised to ``ndim`` = 2 (images) or 3 (volumes).

    Arguments keep Meta's names; ``img_size`` is accepted and ignored (RoPE makes the model
    size-agnostic). ``attention`` is "sdpa", "fa4" or "auto" (see ``attention.py``).
    The RoPE augmentations (``pos_embed_rope_shift/jitter/rescale_coords``) are off unless set.
    """

    def __init__(
        self,
        *,
        ndim: int = 2,
        img_size: int | None = None,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        ffn_ratio: float = 4.0,
        ffn_layer: str = "mlp",
        qkv_bias: bool = True,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        drop_path_rate: float = 0.0,
        layerscale_init: float | None = 1e-5,
        norm_layer: str = "layernormbf16",
        n_storage_tokens: int = 4,
        mask_k_bias: bool = True,
        untie_global_and_local_cls_norm: bool = False,
        pos_embed_rope_base: float | None = 100.0,
        pos_embed_rope_min_period: float | None = None,
        pos_embed_rope_max_period: float | None = None,
        pos_embed_rope_normalize_coords: str = "separate",
        pos_embed_rope_shift_coords: float | None = None,
        pos_embed_rope_jitter_coords: float | None = None,
        pos_embed_rope_rescale_coords: float | None = None,
        pos_embed_rope_dtype: str = "fp32",
        attention: str = "sdpa",
    ):
        super().__init__()
        if ndim not in (2, 3):
            raise ValueError(f"ndim must be 2 or 3, got {ndim}")
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"Unknown attention {attention!r}; expected one of {ATTENTION_BACKENDS}")
        self.ndim = ndim
        self.patch_size = patch_size
        self.in_chans = in_chans
        self.num_features = self.embed_dim = embed_dim
        self.n_blocks = depth
        self.num_heads = num_heads
        self.n_storage_tokens = n_storage_tokens

        self.patch_embed = PatchEmbed(ndim, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.empty(1, 1, embed_dim))
        if n_storage_tokens > 0:
            self.storage_tokens = nn.Parameter(torch.empty(1, n_storage_tokens, embed_dim))
        else:
            self.storage_tokens = None
        self.rope_embed = RopePositionEmbedding(
            embed_dim,
            num_heads=num_heads,
            ndim=ndim,
            base=pos_embed_rope_base,
            min_period=pos_embed_rope_min_period,
            max_period=pos_embed_rope_max_period,
            normalize_coords=pos_embed_rope_normalize_coords,
            shift_coords=pos_embed_rope_shift_coords,
            jitter_coords=pos_embed_rope_jitter_coords,
            rescale_coords=pos_embed_rope_rescale_coords,
            dtype=pos_embed_rope_dtype,
        )
        self.blocks = nn.ModuleList(
            Block(
                embed_dim,
                num_heads,
                ffn_ratio=ffn_ratio,
                ffn_layer=ffn_layer,
                qkv_bias=qkv_bias,
                proj_bias=proj_bias,
                ffn_bias=ffn_bias,
                layerscale_init=layerscale_init,
                mask_k_bias=mask_k_bias,
                norm_layer=norm_layer,
                drop_path_rate=drop_path_rate,
                attention=attention,
            )
            for _ in range(depth)
        )
        self.norm = NORM_LAYERS[norm_layer](embed_dim)
        # ViT-7B trained a separate norm for the cls/storage tokens of local crops; it is
        # never used at evaluation time but must exist for its checkpoint to load strictly.
        self.untie_global_and_local_cls_norm = untie_global_and_local_cls_norm
        if untie_global_and_local_cls_norm:
            self.local_cls_norm = NORM_LAYERS[norm_layer](embed_dim)
        else:
            self.local_cls_norm = None
        self.mask_token = nn.Parameter(torch.empty(1, embed_dim))
        self.context: SequenceShard | None = None  # context parallelism (see context.py)
        if not self.cls_token.is_meta:  # on meta, init_weights runs after to_empty instead
            self.init_weights()

    # ------------------------------------------------------------------ init
    @property
    def num_prefix_tokens(self) -> int:
        """Number of tokens before the patches: cls + storage."""
        return 1 + self.n_storage_tokens

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer (also after ``to_empty`` from meta)."""
        nn.init.normal_(self.cls_token, std=0.02)
        if self.storage_tokens is not None:
            nn.init.normal_(self.storage_tokens, std=0.02)
        nn.init.zeros_(self.mask_token)
        for module in self.modules():
            init_vit_module(module)

    # ----------------------------------------------------------- token steps
    def embed_patches(self, x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        """(B, C, *spatial) -> patch tokens (B, N, D) and grid shape."""
        return self.patch_embed(x)

    def prepend_prefix_tokens(self, x: Tensor, masked: bool = False) -> Tensor:
        """[cls, storage..., x]. ``0 * mask_token`` keeps mask_token in the autograd graph
        when it is not otherwise used (as Meta does), so DDP sees a gradient for it."""
        B = x.shape[0]
        cls_token = self.cls_token if masked else self.cls_token + 0 * self.mask_token
        prefix = [cls_token.expand(B, -1, -1)]
        if self.storage_tokens is not None:
            prefix.append(self.storage_tokens.expand(B, -1, -1))
        return torch.cat([t.to(x.dtype) for t in prefix] + [x], dim=1)

    def prepare_tokens(self, x: Tensor, masks: Tensor | None = None) -> tuple[Tensor, tuple[int, ...]]:
        """Image -> (tokens (B, 1 + R + N, D), grid). ``masks`` (B, N) bool replaces those
        patches by ``mask_token``."""
        x, grid = self.embed_patches(x)
        if masks is not None:
            x = torch.where(masks.unsqueeze(-1), self.mask_token.to(x.dtype).unsqueeze(0), x)
        return self.prepend_prefix_tokens(x, masked=masks is not None), grid

    def patch_rope(self, grid: Sequence[int]) -> Rope:
        """RoPE tables for the patches of ``grid``. Under context parallelism ``grid`` is this
        rank's slab of a grid ``size`` times as deep, and the rows are the slab's, taken from
        the whole grid (positions are global)."""
        shard = in_use(self.context)
        if shard is None:
            return self.rope_embed(grid)
        sin, cos = self.rope_embed((grid[0] * shard.size, *grid[1:]))
        return shard.slab(sin, 0), shard.slab(cos, 0)

    def forward_tokens(self, x: Tensor, rope: Rope | None) -> Tensor:
        """Run all blocks; ``rope`` covers the trailing patch tokens ((N, hd) or (B, N, hd))."""
        rope = rope_for_tokens(rope, x.shape[1])
        for block in self.blocks:
            x = block(x, rope)
        return x

    def split_and_norm(self, x: Tensor) -> dict[str, Tensor]:
        """Final norm, then split the sequence into cls, storage and patch tokens."""
        x_norm = self.norm(x)
        r = self.num_prefix_tokens
        return {
            "x_norm_clstoken": x_norm[:, 0],
            "x_storage_tokens": x_norm[:, 1:r],
            "x_norm_patchtokens": x_norm[:, r:],
        }

    # ------------------------------------------------------------ Meta's API
    def forward_features(self, x: Tensor, masks: Tensor | None = None) -> dict[str, Tensor]:
        tokens, grid = self.prepare_tokens(x, masks)
        tokens = self.forward_tokens(tokens, self.patch_rope(grid))
        return {**self.split_and_norm(tokens), "x_prenorm": tokens, "masks": masks}

    def get_intermediate_layers(
        self,
        x: Tensor,
        n: int | Sequence[int] = 1,
        reshape: bool = False,
        return_class_token: bool = False,
        return_extra_tokens: bool = False,
        norm: bool = True,
    ) -> tuple:
        """Outputs of selected blocks: the last ``n`` if ``n`` is an int, else block indices.

        Each output is the patch tokens (B, N, D), or with ``reshape`` a map (B, D, *grid);
        with ``return_class_token`` / ``return_extra_tokens`` each entry becomes a tuple
        (patches, cls) / (patches, storage) / (patches, cls, storage), as in Meta's code.
        """
        depth = len(self.blocks)
        take = list(range(depth - n, depth)) if isinstance(n, int) else [i % depth for i in n]
        tokens, grid = self.prepare_tokens(x)
        rope = rope_for_tokens(self.patch_rope(grid), tokens.shape[1])
        outputs = {}
        for i, block in enumerate(self.blocks):
            tokens = block(tokens, rope)
            if i in take:
                outputs[i] = tokens
            if len(outputs) == len(set(take)):
                break  # later blocks are not needed
        r = self.num_prefix_tokens
        results = []
        for i in take:
            out = self.norm(outputs[i]) if norm else outputs[i]
            patches = out[:, r:]
            if reshape:
                patches = patches.transpose(1, 2).reshape(x.shape[0], -1, *grid).contiguous()
            entry = [patches]
            if return_class_token:
                entry.append(out[:, 0])
            if return_extra_tokens:
                entry.append(out[:, 1:r])
            results.append(entry[0] if len(entry) == 1 else tuple(entry))
        return tuple(results)

    def forward(self, x: Tensor, masks: Tensor | None = None) -> Tensor:
        """Normalised cls token features (B, D)."""
        return self.forward_features(x, masks)["x_norm_clstoken"]


def use_attention(model: nn.Module, backend: str) -> None:
    """Give every attention layer of ``model`` (encoder, decoder, any wrapper) ``backend``:
    "sdpa" or "fa4" as :func:`~torchtitan.models.attention.resolve_attention_backend` chose
    it for the device. Call it before compiling, so compiled blocks see a fixed choice."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"Unknown attention {backend!r}; expected one of {ATTENTION_BACKENDS}")
    for module in model.modules():
        if isinstance(module, SelfAttention):
            module.attention = backend
