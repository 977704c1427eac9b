"""Pictures of EM with ground-truth and predicted masks: frames, GIFs, TensorBoard images.

Built from the pieces of ``drawing`` (class colours, ``overlay`` of one slice, legends and
panels), on plain arrays (numpy, or torch tensors, which are converted):

* ``comparison_frames``: for evenly spaced z slices of a volume, one picture of
  [EM | EM + ground truth | EM + prediction] with titles and a legend.
* ``grid_frames``: several volumes side by side in a grid, stepping through depth together.
* ``mae_frame``: masked input / reconstruction / input of a masked autoencoder
  (``mae_rows``: one such row per sample of a batch).
* ``save_gif``, ``frames_to_tensorboard_image``: output.
* ``write_validation_visuals`` and ``write_mae_visuals``: the picture writers that the entry
  scripts hand to the segmentation and MAE tasks (a product: the tasks never import it).

Axis order is (z, y, x) as everywhere in the project; masks are (K, D, H, W) with one channel
per class, in the order of ``classes``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw

from torchtitan.pictures.drawing import (
    BACKGROUND,
    GAP,
    HATCH_GREY,
    MUTED,
    TEXT,
    as_binary,
    as_numpy,
    auto_scale,
    class_color,
    compose_panels,
    default_font,
    legend_image,
    line_height,
    overlay,
    text_size,
    to_uint8,
    upscale,
)

# ---------------------------------------------------------------------------------------------
# Volumes
# ---------------------------------------------------------------------------------------------


def _volume_arrays(em, truth, pred, valid):
    """Bring EM, masks and validity to (D, H, W) uint8 / (K, D, H, W) bool.

    Accepts EM as (H, W), (D, H, W) or (1, D, H, W); masks as (K, H, W) for 2D data or
    (K, D, H, W); validity as None, (D, H, W), (K, D, H, W) or the 2D equivalents.
    """
    em = as_numpy(em)
    if em.ndim == 4:
        if em.shape[0] != 1:
            raise ValueError(f"EM with a channel axis must have one channel, got {em.shape}")
        em = em[0]
    if em.ndim == 2:
        em = em[None]
    if em.ndim != 3:
        raise ValueError(f"EM must be (H, W), (D, H, W) or (1, D, H, W), got shape {em.shape}")
    em = to_uint8(em)  # one intensity range for the whole volume, so frames do not flicker

    def masks_4d(m, what):
        if m is None:
            return None
        m = as_binary(m)
        if m.ndim == 3 and m.shape[1:] == em.shape[1:] and em.shape[0] == 1:
            m = m[:, None]
        if m.ndim != 4 or m.shape[1:] != em.shape:
            raise ValueError(f"{what} must be (K, D, H, W) matching EM {em.shape}, got {m.shape}")
        return m

    truth = masks_4d(truth, "truth")
    pred = masks_4d(pred, "pred")
    if valid is not None:
        valid = as_binary(valid)
        if valid.shape == em.shape or valid.shape == em.shape[1:]:
            valid = valid.reshape(em.shape)[None]  # one validity mask for all classes
        else:
            valid = masks_4d(valid, "valid")
    return em, truth, pred, valid


def frame_slices(depth: int, max_frames: int) -> list[int]:
    """Evenly spaced slice indices, at most ``max_frames`` of them, first and last included."""
    if depth <= max_frames:
        return list(range(depth))
    return sorted({int(round(z)) for z in np.linspace(0, depth - 1, max_frames)})


def _not_annotated(classes: Sequence[str], valid: np.ndarray | None) -> set[str]:
    """Classes without a single annotated voxel (a crop that does not label them)."""
    if valid is None or valid.shape[0] != len(classes):
        return set()
    return {c for c, v in zip(classes, valid) if not v.any()}


def comparison_frames(
    em,
    truth,
    pred,
    classes: Sequence[str],
    valid=None,
    max_frames: int = 32,
    scale: int | None = None,
    title: str | None = None,
) -> list[Image.Image]:
    """One picture per z slice: [EM | EM + ground truth | EM + prediction].

    Args:
        em: (D, H, W) or (1, D, H, W) EM (uint8, or float normalised EM), or (H, W) for 2D.
        truth, pred: (K, D, H, W) masks (bool, or probabilities thresholded at 0.5), K =
            ``len(classes)``; (K, H, W) for 2D. ``pred=None`` leaves out the prediction panel.
        classes: class names, for colours and the legend.
        valid: annotated voxels, (K, D, H, W) per class or (D, H, W) for all; pixels that no
            class annotates are hatched in both mask panels, and classes with no annotated
            voxel at all are marked "(n/a)" in the legend.
        max_frames: at most this many evenly spaced slices (first and last included).
        scale: integer zoom; default: enough for about 256 pixels per panel.
        title: text at the start of the header line (e.g. the crop name).

    Returns one PIL image per chosen slice (a single one for 2D data).
    """
    em, truth, pred, valid = _volume_arrays(em, truth, pred, valid)
    classes = list(classes)
    if truth.shape[0] != len(classes) or (pred is not None and pred.shape[0] != len(classes)):
        raise ValueError(f"masks have {truth.shape[0]} channels for {len(classes)} classes")
    if valid is not None:
        truth = truth & valid  # ground truth means nothing where it is not annotated
    depth, height, width = em.shape
    s = scale or auto_scale(height, width)
    font = default_font()
    not_annotated = _not_annotated(classes, valid)
    n_panels = 2 if pred is None else 3
    frame_width = n_panels * width * s + (n_panels + 1) * GAP
    show_invalid = valid is not None and not valid.any(axis=0).all()
    legend = legend_image(classes, frame_width, font, not_annotated, show_invalid)

    frames = []
    for z in frame_slices(depth, max_frames):
        grey = upscale(em[z], s)
        v = None if valid is None else upscale(valid[:, z], s)
        panels = [
            ("EM", np.repeat(grey[..., None], 3, axis=2)),
            ("ground truth", overlay(grey, upscale(truth[:, z], s), classes, valid=v)),
        ]
        if pred is not None:
            panels.append(("prediction", overlay(grey, upscale(pred[:, z], s), classes, valid=v)))
        parts = [title] if title else []
        if depth > 1:
            parts.append(f"z = {z + 1} / {depth}")
        frames.append(compose_panels(panels, "    ".join(parts), legend, font))
    return _tag_palette(frames, classes)


def grid_frames(
    tiles: Sequence[dict],
    classes: Sequence[str],
    cols: int = 4,
    max_frames: int = 32,
    tile_px: int = 256,
    title: str | None = None,
) -> list[Image.Image]:
    """Several volumes in a grid, stepping through depth together.

    Each tile is a dict with ``em`` ((D, H, W) or (1, D, H, W)), ``masks`` ((K, D, H, W),
    K = ``len(classes)``), optional ``valid`` (as in ``comparison_frames``) and optional
    ``title``. Volumes may differ in depth: frame ``t`` of ``n`` shows every volume at the same
    relative depth ``(t + 0.5) / n``. Each volume is zoomed to fit a ``tile_px`` square.
    """
    if not tiles:
        raise ValueError("grid_frames needs at least one tile")
    classes = list(classes)
    font = default_font()
    line = line_height(font)
    prepared = []
    not_annotated = set(classes)
    show_invalid = False
    for tile in tiles:
        em, masks, _, valid = _volume_arrays(tile["em"], tile["masks"], None, tile.get("valid"))
        if masks.shape[0] != len(classes):
            raise ValueError(f"tile masks have {masks.shape[0]} channels for {len(classes)} classes")
        if valid is not None:
            masks = masks & valid
        not_annotated &= _not_annotated(classes, valid) if valid is not None else set()
        show_invalid |= valid is not None and not valid.any(axis=0).all()
        prepared.append((em, masks, valid, tile.get("title", "")))

    cols = max(1, min(cols, len(prepared)))
    rows = math.ceil(len(prepared) / cols)
    cell_w, cell_h = tile_px + GAP, tile_px + 2 * line + GAP
    width = cols * cell_w + GAP
    legend = legend_image(classes, width, font, not_annotated, show_invalid)
    n_frames = min(max_frames, max(em.shape[0] for em, *_ in prepared))

    frames = []
    for t in range(n_frames):
        depth_fraction = (t + 0.5) / n_frames
        frame = Image.new("RGB", (width, line + rows * cell_h + legend.height), BACKGROUND)
        draw = ImageDraw.Draw(frame)
        header = f"{title}    " if title else ""
        draw.text((GAP, 3), f"{header}depth {depth_fraction:.0%}", fill=TEXT, font=font)
        for i, (em, masks, valid, name) in enumerate(prepared):
            depth, height, w = em.shape
            z = min(depth - 1, int(depth_fraction * depth))
            s = max(1, tile_px // max(height, w))
            grey = upscale(em[z], s)
            v = None if valid is None else upscale(valid[:, z], s)
            picture = Image.fromarray(overlay(grey, upscale(masks[:, z], s), classes, valid=v))
            if max(picture.size) > tile_px:  # a big volume: shrink to fit
                f = tile_px / max(picture.size)
                picture = picture.resize((max(1, round(picture.width * f)), max(1, round(picture.height * f))),
                                         Image.Resampling.BILINEAR)
            x0 = GAP + (i % cols) * cell_w
            y0 = line + (i // cols) * cell_h
            draw.text((x0, y0 + 2), _fit_text(font, name, tile_px), fill=TEXT, font=font)
            draw.text((x0, y0 + line), f"z = {z + 1} / {depth}", fill=MUTED, font=font)
            frame.paste(picture, (x0 + (tile_px - picture.width) // 2, y0 + 2 * line))
        frame.paste(legend, (0, line + rows * cell_h))
        frames.append(frame)
    return _tag_palette(frames, classes)


def _tag_palette(frames: list[Image.Image], classes: Sequence[str]) -> list[Image.Image]:
    """Note the class colours on each frame, for ``save_gif`` to keep them exact."""
    colors = [class_color(c) for c in classes]
    for frame in frames:
        frame.info[PALETTE_KEY] = colors
    return frames


def _fit_text(font, text: str, width: int) -> str:
    """``text`` shortened with an ellipsis so that it fits ``width`` pixels."""
    if text_size(font, text)[0] <= width:
        return text
    while text and text_size(font, text + "...")[0] > width:
        text = text[:-1]
    return text + "..."


# ---------------------------------------------------------------------------------------------
# MAE
# ---------------------------------------------------------------------------------------------


def _mae_slice(x) -> np.ndarray:
    """(H, W), (C, H, W) or (C, D, H, W) -> (H, W) grey or (H, W, 3) colour float32; 3D takes
    the middle slice, more than one channel (other than three) takes the first."""
    a = as_numpy(x).astype(np.float32)
    if a.ndim == 2:
        a = a[None]
    if a.ndim == 4:
        a = a[:, a.shape[1] // 2]
    if a.ndim != 3:
        raise ValueError(f"expected (H, W), (C, H, W) or (C, D, H, W), got shape {a.shape}")
    return np.moveaxis(a, 0, -1) if a.shape[0] == 3 else a[0]


def mae_frame(image, masked_image, reconstruction, scale: int | None = None,
              title: str | None = None) -> Image.Image:
    """Masked input, reconstruction and input (the original) of a masked autoencoder side by
    side: what the model saw, what it made of it, what it should have made.

    Each is (H, W), (C, H, W) or, for 3D, (C, D, H, W) (the middle slice is shown). All three
    share the input's intensity range, so a reconstruction that is too dark looks too dark.
    Pixels that are NaN (e.g. the masked patches of ``masked_image``) are drawn as a dark
    checkerboard.
    """
    slices = [_mae_slice(a) for a in (image, masked_image, reconstruction)]
    if len({s.shape for s in slices}) != 1:
        raise ValueError(f"shapes differ: {[s.shape for s in slices]}")
    finite = slices[0][np.isfinite(slices[0])]
    lo, hi = np.percentile(finite, (0.5, 99.5)) if finite.size else (0.0, 1.0)
    height, width = slices[0].shape[:2]
    s = scale or auto_scale(height, width)
    panels = []
    for name, a in zip(("masked", "reconstruction", "original"), slices[1:] + slices[:1]):
        missing = ~np.isfinite(a) if a.ndim == 2 else ~np.isfinite(a).all(axis=-1)
        rgb = to_uint8(a, lo, hi)
        rgb = rgb if rgb.ndim == 3 else np.repeat(rgb[..., None], 3, axis=2)
        rgb = np.moveaxis(upscale(np.moveaxis(rgb, -1, 0), s), 0, -1)
        if missing.any():
            missing = upscale(missing, s)
            yy, xx = np.indices(missing.shape)
            checker = ((yy // 4 + xx // 4) % 2).astype(np.uint8) * 25 + 30
            rgb[missing] = checker[missing][:, None]
        panels.append((name, np.ascontiguousarray(rgb)))
    return compose_panels(panels, title or "", None, default_font())


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


# Key of ``Image.info`` under which frame makers list the colours a GIF palette must keep
# exactly (the legend's class colours): an adaptive palette would otherwise merge a small
# legend swatch into a neighbouring colour.
PALETTE_KEY = "palette_colors"


def _gif_palette(frames: Sequence[Image.Image]) -> Image.Image:
    """One 256-colour palette for all frames: the fixed colours (text, background, hatch,
    the legend's class colours), then a median-cut palette of a few frames spread over the
    sequence, so the colours stay steady while stepping through z."""
    reserved = [BACKGROUND, TEXT, MUTED, (int(HATCH_GREY),) * 3]
    for color in frames[0].info.get(PALETTE_KEY, []):
        if tuple(color) not in reserved:
            reserved.append(tuple(color))
    reserved = reserved[:128]
    sample = [frames[i].convert("RGB") for i in sorted({0, len(frames) // 3, 2 * len(frames) // 3, len(frames) - 1})]
    montage = Image.new("RGB", (max(f.width for f in sample), sum(f.height for f in sample)))
    y = 0
    for f in sample:
        montage.paste(f, (0, y))
        y += f.height
    n = 256 - len(reserved)
    adaptive = montage.quantize(colors=n, method=Image.Quantize.MEDIANCUT).getpalette()[: 3 * n]
    palette = [c for rgb in reserved for c in rgb] + adaptive
    image = Image.new("P", (1, 1))
    image.putpalette(palette + [0] * (768 - len(palette)))
    return image


def save_gif(frames: Sequence[Image.Image], path, duration_ms: int = 150) -> Path:
    """Write ``frames`` as a looping GIF; written under a temporary name and renamed, so a
    reader (or a crash) never sees half a file. Returns the path."""
    if not frames:
        raise ValueError("save_gif needs at least one frame")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    palette = _gif_palette(frames)
    images = [f.convert("RGB").quantize(palette=palette, dither=Image.Dither.NONE) for f in frames]
    try:
        images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:],
                       duration=duration_ms, loop=0, optimize=False)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def frames_to_tensorboard_image(frame: Image.Image) -> np.ndarray:
    """A PIL image as the (3, H, W) uint8 array that ``SummaryWriter.add_image`` takes."""
    return np.ascontiguousarray(np.asarray(frame.convert("RGB")).transpose(2, 0, 1))


def sanitize_name(name: str) -> str:
    """A name safe for a file name and a TensorBoard tag: ``jrc_synth-1/crop1`` ->
    ``jrc_synth-1_crop1``."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._")
    return safe or "volume"


def write_validation_visuals(
    out_dir,
    name: str,
    step: int,
    em,
    truth,
    pred,
    classes: Sequence[str],
    valid=None,
    writer=None,
    max_frames: int = 32,
) -> Path:
    """Save the comparison GIF of one validation volume as ``out_dir/<name>_step<step>.gif``
    and, given a TensorBoard ``SummaryWriter``, log its middle frame as image
    ``visuals/<name>`` at ``step``. Arrays as in ``comparison_frames``. Returns the GIF path."""
    safe = sanitize_name(name)
    frames = comparison_frames(em, truth, pred, classes, valid=valid, max_frames=max_frames,
                               title=f"{name}   step {step}")
    path = save_gif(frames, Path(out_dir) / f"{safe}_step{step}.gif")
    if writer is not None:
        writer.add_image(f"visuals/{safe}", frames_to_tensorboard_image(frames[len(frames) // 2]),
                         global_step=step, dataformats="CHW")
    return path


def mae_rows(images, masked_images, reconstructions, title: str = "") -> Image.Image:
    """One ``mae_frame`` row per sample of a batch ((N, C, *spatial) each), stacked."""
    rows = [mae_frame(i, m, r, title=f"{title}, validation sample {k + 1}" if title
                      else f"validation sample {k + 1}")
            for k, (i, m, r) in enumerate(zip(images, masked_images, reconstructions))]
    if not rows:
        raise ValueError("no samples to draw")
    frame = Image.new("RGB", (max(r.width for r in rows), sum(r.height for r in rows)),
                      BACKGROUND)
    y = 0
    for row in rows:
        frame.paste(row, (0, y))
        y += row.height
    return frame


def write_mae_visuals(out_dir, step: int, image, masked_image, reconstruction, writer=None) -> Path:
    """Save the MAE picture of a few held-out samples (batches (N, C, *spatial), one row each,
    see ``mae_frame``) as ``out_dir/mae_step<step>.png`` and, given a TensorBoard
    ``SummaryWriter``, log it as image ``visuals/mae`` at ``step``. Returns the PNG path."""
    frame = mae_rows(image, masked_image, reconstruction, title=f"step {step}")
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"mae_step{step}.png"
    frame.save(path)
    if writer is not None:
        writer.add_image("visuals/mae", frames_to_tensorboard_image(frame), global_step=step,
                         dataformats="CHW")
    return path
