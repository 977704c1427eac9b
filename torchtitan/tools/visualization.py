"""Pictures of EM with ground-truth and predicted masks: overlays, GIFs, TensorBoard images.

Everything here works on plain arrays (numpy, or torch tensors, which are converted):

* ``overlay``: one (H, W) EM slice with K binary masks drawn in their class colours; voxels
  that no class annotates are hatched grey.
* ``comparison_frames``: for evenly spaced z slices of a volume, one picture of
  [EM | EM + ground truth | EM + prediction] with titles and a legend.
* ``grid_frames``: several volumes side by side in a grid, stepping through depth together.
* ``save_gif``, ``frames_to_tensorboard_image``: output.
* ``mae_frame``: input / masked input / reconstruction of a masked autoencoder.
* ``write_validation_visuals`` and ``write_mae_visuals``: the picture writers that the entry
  scripts hand to the segmentation and MAE tasks (a tool: the tasks never import it).

Axis order is (z, y, x) as everywhere in the project; masks are (K, D, H, W) with one channel
per class, in the order of ``classes``. Small crops are upscaled by an integer factor with
nearest-neighbour sampling, so every voxel stays a sharp square and outlines stay thin.
"""

from __future__ import annotations

import colorsys
import hashlib
import math
import os
import re
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from torchtitan.cellmap.classes import CLASS_PARTS

RGB = tuple[int, int, int]

# ---------------------------------------------------------------------------------------------
# Class colours
# ---------------------------------------------------------------------------------------------

# One fixed colour per CellMap class, saturated and bright enough to read on grey EM. Related
# classes share a hue: a membrane ("_mem") is a darker shade, a lumen ("_lum") a lighter one.
# Which classes are parts of which is the class table's (``torchtitan.cellmap.classes``).
_BASE_COLORS: dict[str, RGB] = {
    "ecs": (50, 110, 255),  # blue: extracellular space
    "pm": (255, 230, 0),  # yellow: plasma membrane
    "cell": (255, 120, 190),  # pink: whole cells (large; drawn faintly, see overlay)
    "cyto": (255, 170, 120),  # peach
    "nuc": (175, 70, 235),  # purple: nucleus
    "ne": (120, 40, 190),  # nuclear envelope
    "np": (235, 150, 255),  # nuclear pores
    "nucpl": (200, 130, 255),  # nucleoplasm
    "nucleo": (90, 20, 140),  # nucleolus
    "chrom": (150, 90, 200),
    "hchrom": (110, 60, 170),
    "nhchrom": (190, 150, 230),
    "echrom": (130, 80, 190),
    "nechrom": (205, 170, 240),
    "mito": (40, 205, 70),  # green: mitochondria
    "mito_ribo": (220, 255, 60),
    "er": (0, 225, 225),  # cyan: endoplasmic reticulum
    "eres": (0, 160, 200),  # ER exit sites
    "golgi": (255, 190, 90),  # light orange
    "ves": (255, 130, 0),  # orange: vesicles
    "endo": (185, 105, 45),  # brown: endosomes
    "lyso": (255, 60, 140),  # magenta-red: lysosomes
    "ld": (235, 30, 30),  # red: lipid droplets
    "perox": (170, 255, 0),  # lime: peroxisomes
    "mt": (255, 80, 255),  # magenta: microtubules
    "cent": (255, 255, 255),  # white: centrioles
    "cent_dapp": (210, 210, 210),
    "cent_sdapp": (170, 170, 170),
    "ribo": (255, 250, 150),
    "vim": (140, 255, 200),
    "glyco": (200, 255, 255),
    "isg": (255, 215, 200),  # insulin secretory granules
}

# How much darker (< 1) or lighter (> 1) than its organelle a part of each kind is drawn.
_PART_SHADES = {"_mem": 0.55, "_lum": 1.45, "_out": 0.6, "_in": 1.4}
# The demo data's mitochondria: a dark green envelope around a pale green lumen.
_SPECIAL_PART_COLORS: dict[str, RGB] = {"mito_mem": (0, 120, 40), "mito_lum": (150, 255, 130)}


def _shade(color: RGB, factor: float) -> RGB:
    """Darker (factor < 1: towards black) or lighter (factor > 1: towards white) ``color``."""
    c = np.asarray(color, dtype=np.float32)
    c = c * factor if factor < 1 else c + (255 - c) * (factor - 1)
    return tuple(int(round(v)) for v in np.clip(c, 0, 255))  # type: ignore[return-value]


def _with_parts(base: dict[str, RGB]) -> dict[str, RGB]:
    """Add the CellMap part classes of each class right after it: its parts named
    ``<x>_mem`` / ``<x>_out`` darker, ``<x>_lum`` / ``<x>_in`` lighter than ``<x>`` (parts of
    another organelle, such as the nuclear envelope inside ``er``, keep their own colours)."""
    out: dict[str, RGB] = {}
    for name, color in base.items():
        out[name] = color
        for part in CLASS_PARTS.get(name, ()):
            suffix = part[len(name):]
            if part.startswith(name) and suffix in _PART_SHADES:
                out.setdefault(part, _SPECIAL_PART_COLORS.get(part) or _shade(color, _PART_SHADES[suffix]))
    return out


CLASS_COLORS: dict[str, RGB] = _with_parts(_BASE_COLORS)


def class_color(name: str) -> RGB:
    """The colour of class ``name``: fixed for CellMap classes, else derived from a hash of
    the name (stable across runs and machines, unlike Python's ``hash``)."""
    if name in CLASS_COLORS:
        return CLASS_COLORS[name]
    digest = hashlib.md5(name.encode("utf-8")).digest()
    hue = digest[0] / 256.0
    saturation = 0.65 + 0.3 * digest[1] / 255.0
    value = 0.85 + 0.15 * digest[2] / 255.0
    r, g, b = colorsys.hsv_to_rgb(hue, saturation, value)
    return int(r * 255), int(g * 255), int(b * 255)


def _resolve_colors(colors: Sequence, k: int) -> list[np.ndarray]:
    """Colours given as class names or RGB triples -> K float32 RGB vectors."""
    if isinstance(colors, str):
        colors = [colors]
    if len(colors) != k:
        raise ValueError(f"got {len(colors)} colours for {k} masks")
    return [np.asarray(class_color(c) if isinstance(c, str) else c, dtype=np.float32) for c in colors]


# ---------------------------------------------------------------------------------------------
# Array helpers
# ---------------------------------------------------------------------------------------------


def _numpy(x) -> np.ndarray | None:
    """A torch tensor or array-like as a numpy array (None stays None)."""
    if x is None:
        return None
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    return np.asarray(x)


def to_uint8(image, lo: float | None = None, hi: float | None = None) -> np.ndarray:
    """Grey values in 0..255. uint8 passes through; booleans become 0/255; anything else is
    stretched from ``lo``..``hi`` (default: its 0.5th and 99.5th percentiles, ignoring NaN)."""
    a = _numpy(image)
    if a.dtype == np.uint8:
        return a
    if a.dtype == bool:
        return a.astype(np.uint8) * 255
    a = a.astype(np.float32)
    if lo is None or hi is None:
        finite = a[np.isfinite(a)]
        p_lo, p_hi = np.percentile(finite, (0.5, 99.5)) if finite.size else (0.0, 1.0)
        lo = p_lo if lo is None else lo
        hi = p_hi if hi is None else hi
    scale = 255.0 / max(float(hi) - float(lo), 1e-6)
    return np.clip((np.nan_to_num(a, nan=float(lo)) - lo) * scale, 0, 255).round().astype(np.uint8)


def upscale(a: np.ndarray, factor: int) -> np.ndarray:
    """Repeat every pixel of the last two axes ``factor`` times (nearest-neighbour zoom)."""
    if factor == 1:
        return a
    return np.repeat(np.repeat(a, factor, axis=-2), factor, axis=-1)


def auto_scale(height: int, width: int, min_px: int = 256) -> int:
    """The integer zoom that makes the longer side at least ``min_px`` pixels."""
    return max(1, math.ceil(min_px / max(height, width, 1)))


def _edges(mask: np.ndarray) -> np.ndarray:
    """The pixels of ``mask`` with a 4-neighbour outside it (the image border does not count,
    so a mask running off the picture is not outlined along the frame)."""
    p = np.pad(mask, 1, mode="edge")
    inner = p[1:-1, 1:-1] & p[:-2, 1:-1] & p[2:, 1:-1] & p[1:-1, :-2] & p[1:-1, 2:]
    return mask & ~inner


def _hatch(shape: tuple[int, int], period: int = 8, width: int = 2) -> np.ndarray:
    """Diagonal stripes: True on lines ``width`` pixels wide, ``period`` pixels apart."""
    yy, xx = np.indices(shape)
    return (yy + xx) % period < width


# ---------------------------------------------------------------------------------------------
# One slice
# ---------------------------------------------------------------------------------------------

BIG_CLASS_FRACTION = 0.35  # classes covering more of the slice than this are drawn faintly
INVALID_GREY = 128.0
HATCH_GREY = 215.0


def overlay(
    em_slice,
    masks,
    colors: Sequence,
    alpha: float = 0.45,
    valid=None,
) -> np.ndarray:
    """Draw binary masks in their colours over a grey EM slice.

    Args:
        em_slice: (H, W) uint8, or float (stretched to its own percentile range).
        masks: (K, H, W) bool (float masks are thresholded at 0.5).
        colors: K class names or RGB triples.
        alpha: opacity of the mask fill.
        valid: optional (H, W) or (K, H, W) bool, True where annotated. Pixels that no class
            annotates (outside the crop, unknown) are tinted grey and hatched.

    Nested classes: each pixel is filled with the colour of the smallest class covering it (a
    mitochondrion shows on top of its cell), and every class gets a 1-pixel outline in its
    full colour, drawn largest first, so a big class stays visible by its border. A class
    that covers most of the slice (a whole cell) is filled faintly, so it does not drown the
    EM.

    Returns the (H, W, 3) uint8 picture.
    """
    grey = to_uint8(em_slice).astype(np.float32)
    if grey.ndim != 2:
        raise ValueError(f"em_slice must be (H, W), got shape {grey.shape}")
    masks = _binary(masks)
    if masks.ndim == 2:
        masks = masks[None]
    if masks.shape[1:] != grey.shape:
        raise ValueError(f"masks {masks.shape} do not match the EM slice {grey.shape}")
    rgb = np.repeat(grey[..., None], 3, axis=2)
    palette = _resolve_colors(colors, masks.shape[0])

    # Each pixel takes the colour of the smallest class that covers it, blended once, so the
    # EM stays equally visible under one class or three nested ones.
    areas = masks.reshape(masks.shape[0], -1).sum(axis=1)
    order = [int(k) for k in np.argsort(-areas, kind="stable") if areas[k]]  # largest first
    top = np.full(grey.shape, -1, np.int64)
    for k in order:
        top[masks[k]] = k
    covered = top >= 0
    if covered.any():
        opacity = np.array([alpha if a < BIG_CLASS_FRACTION * grey.size else alpha * 0.4 for a in areas],
                           np.float32)
        a = opacity[top[covered]][:, None]
        rgb[covered] = (1 - a) * rgb[covered] + a * np.stack(palette)[top[covered]]
    # Outlines in full colour, small classes last so that they stay on top.
    for k in order:
        edge = _edges(masks[k])
        rgb[edge] = 0.15 * rgb[edge] + 0.85 * palette[k]

    if valid is not None:
        annotated = _binary(valid)
        if annotated.ndim == 3:
            annotated = annotated.any(axis=0)
        invalid = ~annotated
        if invalid.any():
            rgb[invalid] = 0.45 * rgb[invalid] + 0.55 * INVALID_GREY
            stripes = invalid & _hatch(invalid.shape)
            rgb[stripes] = HATCH_GREY
    return np.clip(rgb, 0, 255).round().astype(np.uint8)


def _binary(x) -> np.ndarray:
    """bool array; numbers are True above 0.5 (probabilities, 0/1 floats, label values)."""
    a = _numpy(x)
    return a if a.dtype == bool else a > 0.5


# ---------------------------------------------------------------------------------------------
# Text and layout
# ---------------------------------------------------------------------------------------------

BACKGROUND: RGB = (22, 22, 26)
TEXT: RGB = (235, 235, 235)
MUTED: RGB = (140, 140, 140)
GAP = 6  # pixels between and around panels


def _font(size: int = 13):
    """Pillow's built-in font: the scalable one when FreeType is there, else the bitmap one."""
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError, ImportError):
        return ImageFont.load_default()


def _text_size(font, text: str) -> tuple[int, int]:
    box = font.getbbox(text)
    return box[2] - box[0], box[3] - box[1]


def _line_height(font) -> int:
    return _text_size(font, "Ag(|z")[1] + 6


def _legend(
    classes: Sequence[str],
    width: int,
    font,
    not_annotated: set[str] = frozenset(),
    show_invalid: bool = False,
) -> Image.Image:
    """Colour swatches with class names, wrapped into rows ``width`` pixels wide. Classes in
    ``not_annotated`` are listed in grey with "(n/a)"; ``show_invalid`` adds the hatch key."""
    entries: list[tuple[str, np.ndarray | None, bool]] = []
    for name in classes:
        muted = name in not_annotated
        entries.append((f"{name} (n/a)" if muted else name, np.asarray(class_color(name)), muted))
    if show_invalid:
        entries.append(("not annotated", None, True))

    swatch, pad = 12, 14
    line = max(_line_height(font), swatch + 4)
    rows: list[list[tuple[int, tuple]]] = [[]]
    x = GAP
    for entry in entries:
        w = swatch + 4 + _text_size(font, entry[0])[0] + pad
        if x + w > width - GAP and rows[-1]:
            rows.append([])
            x = GAP
        rows[-1].append((x, entry))
        x += w
    img = Image.new("RGB", (width, len(rows) * line + GAP), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for r, row in enumerate(rows):
        y = GAP // 2 + r * line
        for x, (label, color, muted) in row:
            box = (x, y + (line - swatch) // 2, x + swatch, y + (line - swatch) // 2 + swatch)
            if color is None:  # the hatch pattern of unannotated pixels
                tile = np.full((swatch, swatch, 3), INVALID_GREY * 0.8, np.float32)
                tile[_hatch((swatch, swatch), period=6, width=2)] = HATCH_GREY
                img.paste(Image.fromarray(tile.astype(np.uint8)), box[:2])
            else:
                draw.rectangle(box, fill=tuple(int(c) for c in color), outline=TEXT if not muted else MUTED)
            text_y = y + (line - _text_size(font, "Ag")[1]) // 2 - 2
            draw.text((x + swatch + 4, text_y), label, fill=MUTED if muted else TEXT, font=font)
    return img


def _compose(
    panels: Sequence[tuple[str, np.ndarray]],
    header: str,
    legend: Image.Image | None,
    font,
) -> Image.Image:
    """Panels side by side under their titles, a header line on top and the legend below."""
    line = _line_height(font)
    ph = max(p.shape[0] for _, p in panels)
    widths = [p.shape[1] for _, p in panels]
    width = sum(widths) + GAP * (len(panels) + 1)
    if legend is not None and legend.width != width:
        raise ValueError("legend width must match the frame width")
    height = line + line + ph + GAP + (legend.height if legend is not None else 0)
    frame = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(frame)
    draw.text((GAP, 3), header, fill=TEXT, font=font)
    x = GAP
    for (title, pixels), w in zip(panels, widths):
        draw.text((x, line + 2), title, fill=TEXT, font=font)
        frame.paste(Image.fromarray(pixels), (x, 2 * line))
        x += w + GAP
    if legend is not None:
        frame.paste(legend, (0, 2 * line + ph + GAP))
    return frame


# ---------------------------------------------------------------------------------------------
# Volumes
# ---------------------------------------------------------------------------------------------


def _volume_arrays(em, truth, pred, valid):
    """Bring EM, masks and validity to (D, H, W) uint8 / (K, D, H, W) bool.

    Accepts EM as (H, W), (D, H, W) or (1, D, H, W); masks as (K, H, W) for 2D data or
    (K, D, H, W); validity as None, (D, H, W), (K, D, H, W) or the 2D equivalents.
    """
    em = _numpy(em)
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
        m = _binary(m)
        if m.ndim == 3 and m.shape[1:] == em.shape[1:] and em.shape[0] == 1:
            m = m[:, None]
        if m.ndim != 4 or m.shape[1:] != em.shape:
            raise ValueError(f"{what} must be (K, D, H, W) matching EM {em.shape}, got {m.shape}")
        return m

    truth = masks_4d(truth, "truth")
    pred = masks_4d(pred, "pred")
    if valid is not None:
        valid = _binary(valid)
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
    font = _font()
    not_annotated = _not_annotated(classes, valid)
    n_panels = 2 if pred is None else 3
    frame_width = n_panels * width * s + (n_panels + 1) * GAP
    show_invalid = valid is not None and not valid.any(axis=0).all()
    legend = _legend(classes, frame_width, font, not_annotated, show_invalid)

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
        frames.append(_compose(panels, "    ".join(parts), legend, font))
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
    font = _font()
    line = _line_height(font)
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
    legend = _legend(classes, width, font, not_annotated, show_invalid)
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
    if _text_size(font, text)[0] <= width:
        return text
    while text and _text_size(font, text + "...")[0] > width:
        text = text[:-1]
    return text + "..."


# ---------------------------------------------------------------------------------------------
# MAE
# ---------------------------------------------------------------------------------------------


def _mae_slice(x) -> np.ndarray:
    """(H, W), (C, H, W) or (C, D, H, W) -> (H, W) grey or (H, W, 3) colour float32; 3D takes
    the middle slice, more than one channel (other than three) takes the first."""
    a = _numpy(x).astype(np.float32)
    if a.ndim == 2:
        a = a[None]
    if a.ndim == 4:
        a = a[:, a.shape[1] // 2]
    if a.ndim != 3:
        raise ValueError(f"expected (H, W), (C, H, W) or (C, D, H, W), got shape {a.shape}")
    return np.moveaxis(a, 0, -1) if a.shape[0] == 3 else a[0]


def mae_frame(image, masked_image, reconstruction, scale: int | None = None,
              title: str | None = None) -> Image.Image:
    """Input, masked input and reconstruction of a masked autoencoder side by side.

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
    for name, a in zip(("input", "masked", "reconstruction"), slices):
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
    return _compose(panels, title or "", None, _font())


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


def write_mae_visuals(out_dir, step: int, image, masked_image, reconstruction, writer=None) -> Path:
    """Save the MAE picture of one held-out sample (arrays as in ``mae_frame``) as
    ``out_dir/mae_step<step>.png`` and, given a TensorBoard ``SummaryWriter``, log it as image
    ``visuals/mae`` at ``step``. Returns the PNG path."""
    frame = mae_frame(image, masked_image, reconstruction, title=f"step {step}")
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"mae_step{step}.png"
    frame.save(path)
    if writer is not None:
        writer.add_image("visuals/mae", frames_to_tensorboard_image(frame), global_step=step,
                         dataformats="CHW")
    return path
