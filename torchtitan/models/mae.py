"""Masked autoencoder (MAE) pretraining around a DINOv3 ViT encoder, in 2D or 3D.

Follows Meta's MAE (``models_mae.py``): hide a random ``mask_ratio`` of the patches, encode
only the visible ones (plus the cls/storage tokens), then a light decoder fills the hidden
positions with a learned mask token and predicts their pixels (voxels). The loss is the mean
squared error on hidden patches only.

Differences from the original, and why:

* Positions come from RoPE, not from added sin-cos tables: the encoder gathers, per sample, the
  RoPE rows of the patches it keeps; the decoder has its own RoPE over the full grid.
* The masking noise (B, N) comes from the caller, so a sample's mask depends only on the
  sample (the trainer draws it from a generator keyed by the global sample index), not on how
  the batch is split across ranks.
* ``forward`` returns (pred, mask), not the loss: the caller computes the loss, once, with
  ``loss_terms`` / ``mae_loss_terms``. Under FSDP mixed precision the model's inputs are cast
  to bf16 on the way in, and the loss wants the fp32 image as its target; computed outside, it
  also returns (sum, count), so a caller can average over the global batch.
* An optional per-voxel ``valid`` mask (B, 1, *spatial) removes padding from the loss.

Attribute names are stable for checkpoints and parallelism: ``encoder`` (the backbone, whose
``encoder.*`` keys load into a segmentation model's ``backbone.*``) and ``decoder.blocks``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchtitan.choices import num_kept_patches

from .context import ContextParallelModel, SequenceShard, in_use
from .rope import RopePositionEmbedding
from .vit import Block, DinoVisionTransformer, init_vit_module


# ------------------------------------------------------------------------- patches
def patchify(imgs: Tensor, patch_size: int, ndim: int) -> Tensor:
    """(B, C, *spatial) -> (B, N, patch_size**ndim * C).

    Patches are in C order over the grid (like the ViT's tokens); inside a patch the
    values are ordered (voxel offsets..., channel), channel last, as in Meta's MAE.
    """
    B, C = imgs.shape[:2]
    spatial = imgs.shape[2:]
    if len(spatial) != ndim or any(s % patch_size for s in spatial):
        raise ValueError(f"Cannot cut {tuple(imgs.shape)} into {ndim}D patches of {patch_size}")
    grid = [s // patch_size for s in spatial]
    shape = [B, C]
    for g in grid:
        shape += [g, patch_size]
    x = imgs.reshape(shape)
    # (B, C, g0, p, g1, p, ...) -> (B, g0, g1, ..., p, p, ..., C)
    perm = [0] + [2 + 2 * i for i in range(ndim)] + [3 + 2 * i for i in range(ndim)] + [1]
    return x.permute(perm).reshape(B, -1, patch_size**ndim * C)


def unpatchify(x: Tensor, patch_size: int, grid: tuple[int, ...], in_chans: int) -> Tensor:
    """Inverse of ``patchify``: (B, N, patch_size**ndim * C) -> (B, C, *spatial)."""
    ndim = len(grid)
    B = x.shape[0]
    x = x.reshape([B, *grid] + [patch_size] * ndim + [in_chans])
    # (B, g0, g1, ..., p, p, ..., C) -> (B, C, g0, p, g1, p, ...)
    perm = [0, 2 * ndim + 1]
    for i in range(ndim):
        perm += [1 + i, 1 + ndim + i]
    return x.permute(perm).reshape([B, in_chans] + [g * patch_size for g in grid])


# ------------------------------------------------------------------------- masking
def random_masking(x: Tensor, mask_ratio: float, noise: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Keep the ``(1 - mask_ratio)`` fraction of tokens with the smallest noise, per sample.

    Args:
        x: patch tokens (B, N, D).
        noise: (B, N) values whose order decides what is kept (e.g. uniform in [0, 1)).
    Returns:
        x_kept (B, N_keep, D); mask (B, N), 1 for hidden and 0 for kept patches;
        ids_restore (B, N), which undoes the shuffle; ids_keep (B, N_keep), kept indices.
    """
    B, N, D = x.shape
    if noise.shape != (B, N):
        raise ValueError(f"noise must be (B, N) = {(B, N)}, got {tuple(noise.shape)}")
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
    len_keep = num_kept_patches(N, mask_ratio)
    ids_shuffle = torch.argsort(noise, dim=1, stable=True)  # ascending: small noise is kept
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :len_keep]
    x_kept = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, D))
    mask = torch.ones(B, N, device=x.device, dtype=x.dtype)
    mask[:, :len_keep] = 0
    mask = torch.gather(mask, 1, ids_restore)  # back to the original patch order
    return x_kept, mask, ids_restore, ids_keep


# --------------------------------------------------------------------------- loss
def _normalize_patches(target: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Per-patch standardisation (MAE's norm_pix_loss) over the valid values of each patch.

    target (B, N, V, C), weight (B, N, V, 1) in {0, 1}. Padding values never enter the
    statistics, so they cannot change the loss.
    """
    w = weight.expand_as(target)
    n = w.sum(dim=(-2, -1), keepdim=True)
    t = torch.where(w > 0, target, torch.zeros_like(target))
    mean = t.sum(dim=(-2, -1), keepdim=True) / n.clamp_min(1)
    sq = torch.where(w > 0, (target - mean) ** 2, torch.zeros_like(target))
    var = sq.sum(dim=(-2, -1), keepdim=True) / (n - 1).clamp_min(1)  # unbiased, like Meta
    return (target - mean) / (var + eps).sqrt()


def mae_loss_terms(
    imgs: Tensor,
    pred: Tensor,
    mask: Tensor,
    patch_size: int,
    valid: Tensor | None = None,
    norm_pix_loss: bool = False,
) -> tuple[Tensor, Tensor]:
    """(sum of squared errors, number of terms) over hidden patches and valid voxels, in fp32.

    imgs (B, C, *spatial); pred (B, N, patch_size**ndim * C), in any float dtype (bf16 under
    mixed precision); mask (B, N) with 1 = hidden; valid (B, 1, *spatial), nonzero where a
    voxel is real data (not padding).
    """
    ndim = imgs.dim() - 2
    C = imgs.shape[1]
    B, N = mask.shape
    target = patchify(imgs.float(), patch_size, ndim).reshape(B, N, -1, C)
    pred = pred.float().reshape(B, N, -1, C)
    if valid is None:
        weight = torch.ones_like(target[..., :1])
    else:
        weight = (patchify(valid, patch_size, ndim) > 0).to(pred.dtype).reshape(B, N, -1, 1)
    if norm_pix_loss:
        target = _normalize_patches(target, weight)
    weight = (weight * mask.to(pred.dtype)[:, :, None, None]).expand_as(pred)
    # where(), not a product: padding may hold anything, even non-finite values.
    err = torch.where(weight > 0, (pred - target) ** 2, torch.zeros_like(pred))
    return err.sum(), weight.sum()


# ------------------------------------------------------------------------ decoder
class MAEDecoder(nn.Module):
    """Linear embed -> mask tokens at hidden positions -> ViT blocks with RoPE -> norm ->
    linear prediction of each patch's values."""

    def __init__(
        self,
        ndim: int,
        encoder_dim: int,
        patch_dim: int,
        dim: int = 256,
        depth: int = 2,
        num_heads: int = 4,
        ffn_ratio: float = 4.0,
        attention: str = "sdpa",
    ):
        super().__init__()
        self.dim = dim
        self.embed = nn.Linear(encoder_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.rope_embed = RopePositionEmbedding(dim, num_heads=num_heads, ndim=ndim)
        # Plain MAE decoder blocks: no LayerScale, no k-bias masking.
        self.blocks = nn.ModuleList(
            Block(dim, num_heads, ffn_ratio=ffn_ratio, layerscale_init=None, mask_k_bias=False,
                  attention=attention)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim, eps=1e-5)
        self.pred = nn.Linear(dim, patch_dim)
        self.context: SequenceShard | None = None  # context parallelism (see context.py)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.mask_token, std=0.02)
        for module in self.modules():
            init_vit_module(module)

    def forward(self, x: Tensor, ids_restore: Tensor, grid: tuple[int, ...], n_prefix: int) -> Tensor:
        """x: encoder output (B, n_prefix + N_keep, D_enc) -> predictions (B, N, patch_dim).

        Under context parallelism ``x`` holds this rank's part of the kept tokens: the parts
        of all ranks are gathered (they are in the shuffled order, so the hidden ones can be
        placed), and the decoder runs on this rank's slab of the patch grid; the predictions
        are those of the slab's patches."""
        shard = in_use(self.context)
        x = self.embed(x)
        prefix, visible = x[:, :n_prefix], x[:, n_prefix:]
        if shard is not None:
            visible = shard.gather(visible, 1)
        B, N = ids_restore.shape
        hidden = self.mask_token.to(x.dtype).expand(B, N - visible.shape[1], -1)
        patches = torch.cat([visible, hidden], dim=1)  # in shuffled order
        patches = torch.gather(patches, 1, ids_restore.unsqueeze(-1).expand(-1, -1, self.dim))
        rope = self.rope_embed(grid)
        if shard is not None:
            patches = shard.slab(patches, 1)
            rope = (shard.slab(rope[0], 0), shard.slab(rope[1], 0))
        x = torch.cat([prefix, patches], dim=1)
        for block in self.blocks:
            x = block(x, rope)
        return self.pred(self.norm(x)[:, n_prefix:])


# --------------------------------------------------------------------------- model
class MaskedAutoencoder(ContextParallelModel):
    """MAE with a ``DinoVisionTransformer`` encoder.

    ``forward(imgs, mask_ratio, noise) -> (pred, mask)``; then
    ``loss_terms(imgs, pred, mask, valid=None) -> (sum, count)`` of the squared errors, whose
    ratio is the mean over hidden, valid values.
    """

    def __init__(
        self,
        encoder: DinoVisionTransformer,
        decoder_dim: int = 256,
        decoder_depth: int = 2,
        decoder_num_heads: int = 4,
        norm_pix_loss: bool = False,
    ):
        super().__init__()
        self.encoder = encoder
        self.ndim = encoder.ndim
        self.patch_size = encoder.patch_size
        self.in_chans = encoder.in_chans
        self.norm_pix_loss = norm_pix_loss
        attention = encoder.blocks[0].attn.attention if len(encoder.blocks) else "sdpa"
        self.decoder = MAEDecoder(
            ndim=self.ndim,
            encoder_dim=encoder.embed_dim,
            patch_dim=self.patch_size**self.ndim * self.in_chans,
            dim=decoder_dim,
            depth=decoder_depth,
            num_heads=decoder_num_heads,
            attention=attention,
        )
        self.context: SequenceShard | None = None  # context parallelism (see context.py)
        if not self.decoder.mask_token.is_meta:  # on meta, init_weights runs after to_empty
            self.decoder.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise encoder and decoder (also after ``to_empty`` from the meta device)."""
        self.encoder.init_weights()
        self.decoder.init_weights()

    def forward_encoder(
        self, imgs: Tensor, mask_ratio: float, noise: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, tuple[int, ...]]:
        """Encode the visible patches. Returns (latent (B, R+1+N_keep, D), mask, ids_restore, grid).

        Under context parallelism every rank embeds and masks the whole sample (the same
        noise gives the same mask everywhere) and encodes its ``1/size`` of the kept tokens,
        a contiguous part of them in their shuffled order; ``latent`` holds that part."""
        enc = self.encoder
        x, grid = enc.embed_patches(imgs)
        x, mask, ids_restore, ids_keep = random_masking(x, mask_ratio, noise)
        shard = self.context_shard()
        if shard is not None:
            x, ids_keep = shard.slab(x, 1), shard.slab(ids_keep, 1)
        sin, cos = enc.rope_embed(grid)  # (N, head_dim)
        rope = (sin[ids_keep], cos[ids_keep])  # (B, N_keep, head_dim): each sample's positions
        x = enc.forward_tokens(enc.prepend_prefix_tokens(x), rope)
        return enc.norm(x), mask, ids_restore, grid

    def forward_decoder(self, latent: Tensor, ids_restore: Tensor, grid: tuple[int, ...]) -> Tensor:
        return self.decoder(latent, ids_restore, grid, self.encoder.num_prefix_tokens)

    def loss_terms(
        self, imgs: Tensor, pred: Tensor, mask: Tensor, valid: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(sum, count) of squared errors over hidden patches and valid voxels."""
        return mae_loss_terms(imgs, pred, mask, self.patch_size, valid, self.norm_pix_loss)

    def forward(self, imgs: Tensor, mask_ratio: float, noise: Tensor) -> tuple[Tensor, Tensor]:
        """Predictions for every patch (B, N, patch_dim) and the mask (B, N), 1 = hidden.
        Under context parallelism (training), those of this rank's slab of the patch grid:
        ``context.local_part(context_shard(model), imgs)`` gives the matching slab of the
        image for the loss."""
        latent, mask, ids_restore, grid = self.forward_encoder(imgs, mask_ratio, noise)
        pred = self.forward_decoder(latent, ids_restore, grid)
        shard = self.context_shard()
        if shard is not None:
            mask = shard.slab(mask, 1)
        return pred, mask
