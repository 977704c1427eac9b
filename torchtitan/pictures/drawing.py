"""The drawing pieces the pictures are made of: class colours, one EM slice with its masks
(``overlay``), and text, legends and panels laid out in a frame.

``visualization`` builds its frames (comparison and grid GIFs, MAE pictures) from these. Works on
plain arrays (numpy, or torch tensors, which are converted). Axis order is (z, y, x); masks are
(K, H, W) with one channel per class, in the order of the colours given. Small crops are
upscaled by an integer factor with nearest-neighbour sampling, so every voxel stays a sharp
square and outlines stay thin.
"""

from __future__ import annotations

import colorsys
import hashlib
import math
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


def as_numpy(x) -> np.ndarray | None:
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
    a = as_numpy(image)
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
    masks = as_binary(masks)
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
        annotated = as_binary(valid)
        if annotated.ndim == 3:
            annotated = annotated.any(axis=0)
        invalid = ~annotated
        if invalid.any():
            rgb[invalid] = 0.45 * rgb[invalid] + 0.55 * INVALID_GREY
            stripes = invalid & _hatch(invalid.shape)
            rgb[stripes] = HATCH_GREY
    return np.clip(rgb, 0, 255).round().astype(np.uint8)


def as_binary(x) -> np.ndarray:
    """bool array; numbers are True above 0.5 (probabilities, 0/1 floats, label values)."""
    a = as_numpy(x)
    return a if a.dtype == bool else a > 0.5


# ---------------------------------------------------------------------------------------------
# Text and layout
# ---------------------------------------------------------------------------------------------

BACKGROUND: RGB = (22, 22, 26)
TEXT: RGB = (235, 235, 235)
MUTED: RGB = (140, 140, 140)
GAP = 6  # pixels between and around panels


def default_font(size: int = 13):
    """Pillow's built-in font: the scalable one when FreeType is there, else the bitmap one."""
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError, ImportError):
        return ImageFont.load_default()


def text_size(font, text: str) -> tuple[int, int]:
    box = font.getbbox(text)
    return box[2] - box[0], box[3] - box[1]


def line_height(font) -> int:
    return text_size(font, "Ag(|z")[1] + 6


def legend_image(
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
    line = max(line_height(font), swatch + 4)
    rows: list[list[tuple[int, tuple]]] = [[]]
    x = GAP
    for entry in entries:
        w = swatch + 4 + text_size(font, entry[0])[0] + pad
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
            text_y = y + (line - text_size(font, "Ag")[1]) // 2 - 2
            draw.text((x + swatch + 4, text_y), label, fill=MUTED if muted else TEXT, font=font)
    return img


def compose_panels(
    panels: Sequence[tuple[str, np.ndarray]],
    header: str,
    legend: Image.Image | None,
    font,
) -> Image.Image:
    """Panels side by side under their titles, a header line on top and the legend below."""
    line = line_height(font)
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
