"""Adapt pretrained 2D DINOv3 weights to other inputs: fewer channels, or volumes (2D -> 3D).

Only two entries of a DINOv3 backbone state dict depend on the input:

* ``patch_embed.proj.weight``, the patch kernel (D, C, p, p) in 2D, (D, C, p, p, p) in 3D,
  depends on the channel count C and on the number of spatial axes;
* ``rope_embed.periods``, the RoPE periods, has ``head_dim // (2 * ndim)`` entries: each axis
  gets its share of every head's channels, so the 3D model has fewer periods than the 2D one.

Everything else (tokens, blocks, norms, the patch-embedding bias) acts on token vectors and
is the same for any input, so it is kept as it is.

Channels (``adapt_in_chans``). A pretrained RGB kernel is reduced to one channel by
*summing* over its colour channels, not by averaging: a grey image x in one channel then
gives exactly the embedding that the RGB model gives for the same image repeated over its
three channels (``sum_c W_c * x``). Averaging would scale every patch token by 1/3 relative to
the residual stream the pretrained blocks expect. For other channel counts the kernel is
tiled over the new channels and rescaled by ``old / new`` (the convention of timm's
``adapt_input_conv``), which again keeps the output for inputs whose channels are all equal
when ``new`` is a multiple of ``old``, and keeps it on average otherwise.

Depth (``inflate_state_dict_2d_to_3d``). The 2D kernel is repeated along a new depth axis
and divided by the depth of the kernel (I3D-style "inflation"): a volume made of identical
slices then gives, in every patch, exactly the 2D embedding of one slice, so the pretrained
blocks see the tokens they were trained on. The RoPE periods of the 3D model are not derived
from the 2D ones: they are passed in from the 3D model (its own, freshly computed buffer), or
dropped from the state dict if not given.
"""

from __future__ import annotations

from torch import Tensor

PATCH_WEIGHT = "patch_embed.proj.weight"
ROPE_PERIODS = "rope_embed.periods"


def adapt_patch_kernel_in_chans(weight: Tensor, in_chans: int) -> Tensor:
    """Patch kernel (D, C, *k) -> (D, in_chans, *k); see the module docstring for the rule."""
    if in_chans < 1:
        raise ValueError(f"in_chans must be >= 1, got {in_chans}")
    old = weight.shape[1]
    if in_chans == old:
        return weight.clone()
    if in_chans == 1:
        # Grey input == the same image in every colour channel.
        return weight.sum(dim=1, keepdim=True)
    repeats = -(-in_chans // old)  # ceil
    tiled = weight.repeat(1, repeats, *([1] * (weight.dim() - 2)))[:, :in_chans]
    return tiled * (old / in_chans)


def adapt_in_chans(sd: dict[str, Tensor], in_chans: int) -> dict[str, Tensor]:
    """A copy of a backbone state dict whose patch kernel takes ``in_chans`` input channels.

    Works on 2D and 3D kernels; every other entry is passed through unchanged.
    """
    if PATCH_WEIGHT not in sd:
        raise KeyError(f"state dict has no {PATCH_WEIGHT!r}; is it a DINOv3 backbone state dict?")
    out = dict(sd)
    out[PATCH_WEIGHT] = adapt_patch_kernel_in_chans(sd[PATCH_WEIGHT], in_chans)
    return out


def inflate_patch_kernel(weight: Tensor, depth_patch: int) -> Tensor:
    """2D patch kernel (D, C, p, p) -> 3D (D, C, depth_patch, p, p), repeated over depth and
    divided by ``depth_patch``, so that a stack of identical slices embeds like one slice."""
    if weight.dim() != 4:
        raise ValueError(f"expected a 2D patch kernel (D, C, p, p), got shape {tuple(weight.shape)}")
    if depth_patch < 1:
        raise ValueError(f"depth_patch must be >= 1, got {depth_patch}")
    return weight.unsqueeze(2).repeat(1, 1, depth_patch, 1, 1) / depth_patch


def inflate_state_dict_2d_to_3d(
    sd: dict[str, Tensor],
    patch_size: int,
    depth_patch: int | None = None,
    rope_periods: Tensor | None = None,
) -> dict[str, Tensor]:
    """A 3D backbone state dict made from a 2D one (Meta's DINOv3 key names).

    Args:
        sd: the 2D state dict; its patch kernel must be (D, C, patch_size, patch_size).
        patch_size: the in-plane patch size (checked against the kernel).
        depth_patch: the kernel's extent along depth; defaults to ``patch_size`` (the 3D
            models here use cubic patches).
        rope_periods: the 3D model's ``rope_embed.periods``, put in place of the 2D ones.
            When None, the entry is dropped, and the 3D model keeps its own buffer (load with
            ``strict=False``, or add it afterwards).

    Every other entry is passed through unchanged (same tensor objects).
    """
    if PATCH_WEIGHT not in sd:
        raise KeyError(f"state dict has no {PATCH_WEIGHT!r}; is it a DINOv3 backbone state dict?")
    weight = sd[PATCH_WEIGHT]
    if weight.dim() != 4:
        raise ValueError(
            f"{PATCH_WEIGHT} has shape {tuple(weight.shape)}; a 2D kernel (D, C, p, p) was expected "
            "(is this state dict already 3D?)"
        )
    if tuple(weight.shape[2:]) != (patch_size, patch_size):
        raise ValueError(
            f"{PATCH_WEIGHT} is a {weight.shape[2]}x{weight.shape[3]} kernel but patch_size is "
            f"{patch_size}; build the model with the patch size of the checkpoint"
        )
    out = dict(sd)
    out[PATCH_WEIGHT] = inflate_patch_kernel(weight, depth_patch or patch_size)
    if rope_periods is None:
        out.pop(ROPE_PERIODS, None)
    else:
        out[ROPE_PERIODS] = rope_periods.detach().clone()
    return out


__all__ = [
    "adapt_in_chans",
    "adapt_patch_kernel_in_chans",
    "inflate_patch_kernel",
    "inflate_state_dict_2d_to_3d",
]
