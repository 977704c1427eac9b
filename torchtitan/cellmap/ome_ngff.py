"""OME-NGFF ``multiscales`` groups: reading their levels, writing them (one writer).

Reading accepts OME-NGFF 0.4 (``.zattrs`` of zarr format 2) and 0.5 (under ``ome`` in the
``zarr.json`` of zarr format 3). Writing produces 0.4 in zarr format 2, the layout of the
CellMap challenge data: demo data and prediction output are both written by
:func:`create_multiscale_group`, so they carry the same metadata.

A pyramid follows the voxel-centre convention of :mod:`.grids`: level k, downsampled by the
factor ``f_k`` per axis from level 0, has ``scale_k = scale_0 * f_k`` and ``translation_k =
translation_0 + (scale_k - scale_0) / 2``. By default ``f_k = 2**k`` on every axis (a 2x
pyramid); anisotropic volumes (thin sections: 50 x 4 x 4 nm) halve only their finer axes until
they approach the coarsest (:func:`pyramid_steps`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from torchtitan.cellmap.errors import DatasetError
from torchtitan.cellmap.grids import AXES, ScaleLevel
from torchtitan.choices import VOXEL_RTOL

UNIT = "nanometer"

# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


# A metadata reader: the parsed JSON document at a location (local path or URL), None when
# absent. The default reads local files; ``read_json`` of a ``torchtitan.data.io.stores.
# StoreContext`` also reads remote stores (S3, GCS, HTTP), so the functions below work on
# either.
JsonReader = Callable[[str], "dict | None"]


def read_local_json(location: str) -> dict | None:
    """A local JSON file, parsed; None when it does not exist."""
    p = Path(location)
    return json.loads(p.read_text()) if p.is_file() else None


def child(location, name: str) -> str:
    """``location/name`` for a local path or a URL (``s3://``, ``https://``, ...)."""
    location = str(location)
    if "://" in location:
        return location.rstrip("/") + "/" + name
    return str(Path(location) / name)


def read_attrs(group_path, read_json: JsonReader = read_local_json) -> dict:
    """Attributes of a zarr group, format 2 (.zattrs) or 3 (zarr.json); {} when it has none."""
    v2 = read_json(child(group_path, ".zattrs"))
    if v2 is not None:
        return v2
    v3 = read_json(child(group_path, "zarr.json"))
    if v3 is not None:
        return v3.get("attributes", {})
    return {}


def array_shape(array_path, read_json: JsonReader = read_local_json) -> tuple[int, ...]:
    """Shape of a zarr array (format 2 or 3), from its metadata alone."""
    v2 = read_json(child(array_path, ".zarray"))
    if v2 is not None:
        return tuple(v2["shape"])
    meta = read_json(child(array_path, "zarr.json"))
    if meta is not None and meta.get("node_type") == "array":
        return tuple(meta["shape"])
    raise DatasetError(f"{array_path}: not a zarr array (no .zarray or zarr.json)")


def is_multiscale_group(attrs: dict) -> bool:
    """Whether group attributes carry OME-NGFF metadata (0.4 or 0.5)."""
    return "multiscales" in attrs or "ome" in attrs


def read_multiscales(group_path: str | os.PathLike,
                     read_json: JsonReader = read_local_json) -> list[ScaleLevel]:
    """Read the OME-NGFF ``multiscales`` of a group (0.4 in zarr format 2 ``.zattrs``, or 0.5
    under ``ome`` in a zarr format 3 ``zarr.json``): one ScaleLevel per dataset path. A URL
    group needs a ``read_json`` that reads remote documents."""
    if "://" not in str(group_path):
        group_path = Path(group_path)
    attrs = read_attrs(group_path, read_json)
    ms = attrs.get("multiscales") or attrs.get("ome", {}).get("multiscales")
    if not ms:
        raise DatasetError(
            f"{group_path}: no OME-NGFF 'multiscales' attribute; every EM and label group must "
            "describe its levels: add 'multiscales' (OME-NGFF 0.4, in .zattrs) or "
            "'ome': {'multiscales': ...} (0.5, in zarr.json) with axes z, y, x in nanometer and "
            "a scale and translation per level"
        )
    ms = ms[0]
    axes = ms.get("axes", [])
    names = tuple(a.get("name") if isinstance(a, dict) else a for a in axes)
    if names != AXES:
        raise DatasetError(
            f"{group_path}: multiscales axes are {names}, expected {AXES}; only 3D EM and "
            "labels are supported: store the arrays as (z, y, x) and list exactly those axes"
        )
    for a in axes:
        unit = a.get("unit") if isinstance(a, dict) else None
        if unit not in (None, UNIT):
            raise DatasetError(
                f"{group_path}: axis {a['name']!r} has unit {unit!r}; only 'nanometer' is "
                "supported: convert the scale and translation of every level to nanometres "
                "and set the axis unit to 'nanometer'"
            )
    if not ms.get("datasets"):
        raise DatasetError(f"{group_path}: multiscales lists no 'datasets' (levels s0, s1, ...)")
    levels = []
    for ds in ms["datasets"]:
        scale, translation = (1.0, 1.0, 1.0), (0.0, 0.0, 0.0)
        for t in ds.get("coordinateTransformations", []):
            if t["type"] == "scale":
                scale = tuple(float(s) for s in t["scale"])
            elif t["type"] == "translation":
                translation = tuple(float(s) for s in t["translation"])
        path = child(group_path, ds["path"])
        shape = array_shape(path, read_json)
        if len(shape) != 3:
            raise DatasetError(f"{path}: expected a 3D (z, y, x) array, got shape {shape}")
        if min(scale) <= 0:
            raise DatasetError(f"{path}: scale {list(scale)} must be positive (nm per voxel)")
        levels.append(ScaleLevel(shape=shape, scale=scale, translation=translation, path=str(path)))
    return levels


def stored_intensity_range(group_path: str | os.PathLike,
                           read_json: JsonReader = read_local_json) -> tuple[float, float] | None:
    """The intensity window an image group stores (OME-NGFF ``omero`` channel 0, 0.4 or under
    ``ome``): ``start``/``end``, else ``min``/``max``; None when it stores none."""
    attrs = read_attrs(group_path, read_json)
    omero = attrs.get("omero") or attrs.get("ome", {}).get("omero")
    try:
        window = omero["channels"][0]["window"]
    except (TypeError, KeyError, IndexError):
        return None
    for lo_key, hi_key in (("start", "end"), ("min", "max")):
        lo, hi = window.get(lo_key), window.get(hi_key)
        if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo < hi:
            return float(lo), float(hi)
    return None


# ---------------------------------------------------------------------------------------------
# Writing (OME-NGFF 0.4, zarr format 2)
# ---------------------------------------------------------------------------------------------


def level_factors(n_levels: int, steps=None) -> list[tuple[int, int, int]]:
    """Per level, its downsampling factor from level 0 on each axis (z, y, x): the product of
    the ``steps`` (per level after the first, the factor from the level before; default 2 on
    every axis)."""
    if steps is None:
        steps = [(2, 2, 2)] * (n_levels - 1)
    if len(steps) != n_levels - 1:
        raise ValueError(f"{n_levels} levels need {n_levels - 1} steps, got {len(steps)}")
    factors = [(1, 1, 1)]
    for step in steps:
        factors.append(tuple(int(f) * int(s) for f, s in zip(factors[-1], step)))
    return factors


def pyramid_steps(scale0, shape0, coarsest_side: int = 64, max_levels: int = 10) -> list[tuple[int, int, int]]:
    """Steps of a pyramid for a volume of ``shape0`` voxels of ``scale0`` nm, one per level
    after the first, until the largest side is at most ``coarsest_side`` voxels.

    Each step halves the axes whose voxels are at most half as large as the coarsest axis's
    (an anisotropic stack of 50 x 4.6 x 4.6 nm halves y and x to 9.2, 18.4 and 36.8 nm), and
    every axis once they are all within 2x (isotropic volumes: a plain 2x pyramid). An axis
    down to one voxel is left as it is (and out of the comparison).
    """
    scale, shape = [float(s) for s in scale0], [int(n) for n in shape0]
    steps: list[tuple[int, int, int]] = []
    while max(shape) > coarsest_side and len(steps) + 1 < max_levels:
        active = [n > 1 for n in shape]
        coarsest = max(s for s, a in zip(scale, active) if a)
        fine = [a and 2 * s <= coarsest * (1 + VOXEL_RTOL) for s, a in zip(scale, active)]
        step = tuple(2 if fine[d] or (active[d] and not any(fine)) else 1 for d in range(3))
        steps.append(step)
        scale = [s * f for s, f in zip(scale, step)]
        shape = [-(-n // f) for n, f in zip(shape, step)]
    return steps


def multiscales_attrs(name: str, scale0, translation0, n_levels: int, steps=None) -> list[dict]:
    """OME-NGFF 0.4 ``multiscales`` metadata of a pyramid ``s0 .. s{n_levels-1}``: 2x per
    level on every axis, or the per-axis ``steps`` (see :func:`level_factors`).

    Translations follow the voxel-centre convention: level k's voxel 0 is centred at
    ``translation0 + (scale_k - scale0) / 2``.
    """
    datasets = []
    for k, factor in enumerate(level_factors(n_levels, steps)):
        scale = [float(s) * f for s, f in zip(scale0, factor)]
        translation = [float(t) + (s - float(s0)) / 2 for t, s, s0 in zip(translation0, scale, scale0)]
        datasets.append(
            {
                "path": f"s{k}",
                "coordinateTransformations": [
                    {"type": "scale", "scale": scale},
                    {"type": "translation", "translation": translation},
                ],
            }
        )
    axes = [{"name": a, "type": "space", "unit": UNIT} for a in AXES]
    return [{"version": "0.4", "name": name, "axes": axes, "datasets": datasets}]


def create_multiscale_group(parent, path: str, scale0, translation0, n_levels: int = 1,
                            extra_attrs: dict | None = None, steps=None):
    """The zarr group ``parent/path`` with OME-NGFF 0.4 ``multiscales`` metadata of a pyramid
    of ``n_levels`` levels (2x, or the per-axis ``steps``; plus ``extra_attrs``); its arrays
    ``s0 ..`` are the caller's to write. An existing group keeps its arrays and gets the new
    metadata."""
    head, _, name = path.rpartition("/")
    attrs = {"multiscales": multiscales_attrs(name, scale0, translation0, n_levels, steps)}
    attrs.update(extra_attrs or {})
    # Parents are made with require_group so that every level of the hierarchy is a real
    # zarr v2 group (with its own .zgroup), as readers of the challenge data expect.
    if head:
        parent = parent.require_group(head)
    group = parent.require_group(name)
    group.attrs.update(attrs)
    return group


def write_multiscale_array_group(parent, path: str, levels: list[np.ndarray], scale0, translation0,
                                 chunks=(64, 64, 64), extra_attrs: dict | None = None,
                                 fill_value: int = 0, steps=None):
    """Write ``levels`` (each a 2x downsampling of the previous one, or by the per-axis
    ``steps``) as arrays ``s0, s1, ...`` of the group ``parent/path``, with its OME-NGFF
    metadata (:func:`create_multiscale_group`)."""
    group = create_multiscale_group(parent, path, scale0, translation0, len(levels), extra_attrs,
                                    steps)
    for k, data in enumerate(levels):
        level_chunks = tuple(min(c, n) for c, n in zip(chunks, data.shape))
        group.create_array(f"s{k}", data=data, chunks=level_chunks, fill_value=fill_value)
    return group


# ---------------------------------------------------------------------------------------------
# Pyramids of a written level s0 (prediction output): 2x mean or mode, block by block
# ---------------------------------------------------------------------------------------------

# Chunks that viewers (neuroglancer, napari) fetch quickly: 64^3 voxels, about 256 KiB of uint8.
VIEW_CHUNKS = (64, 64, 64)


def pyramid_shapes(shape0, n_levels: int, steps=None) -> list[tuple[int, ...]]:
    """Shapes of a pyramid (2x, or the per-axis ``steps``): level k has ``ceil(shape_{k-1} /
    step)`` voxels per axis, so an odd side keeps its last voxel (its block is completed by
    repeating the edge)."""
    steps = steps if steps is not None else [(2, 2, 2)] * (n_levels - 1)
    shapes = [tuple(int(s) for s in shape0)]
    for step in steps[: n_levels - 1]:
        shapes.append(tuple(-(-s // f) for s, f in zip(shapes[-1], step)))
    return shapes


def auto_pyramid_levels(shape0, minimum: int = 3, coarsest_side: int = 64) -> int:
    """Levels until the largest side is at most ``coarsest_side`` voxels, never fewer than
    ``minimum``."""
    n, side = 1, max(int(s) for s in shape0)
    while side > coarsest_side:
        side, n = -(-side // 2), n + 1
    return max(minimum, n)


def _blocks(block: np.ndarray, step) -> np.ndarray:
    """``block`` as (nz, fz, ny, fy, nx, fx) blocks of ``step`` voxels per axis, the last
    plane of an axis not a multiple of its step repeated to complete its block."""
    pad = [(0, -n % f) for n, f in zip(block.shape, step)]
    b = np.pad(block, pad, mode="edge") if any(p for _, p in pad) else block
    (nz, ny, nx), (fz, fy, fx) = (n // f for n, f in zip(b.shape, step)), step
    return b.reshape(nz, fz, ny, fy, nx, fx)


def downsample_mean(block: np.ndarray, step=(2, 2, 2)) -> np.ndarray:
    """Mean downsampling by ``step`` voxels per axis (2x by default; probabilities,
    intensities); float output for float input, rounded for integers."""
    mean = _blocks(block, step).mean(axis=(1, 3, 5), dtype=np.float64)
    if np.issubdtype(block.dtype, np.integer):
        return np.rint(mean).astype(block.dtype)
    return mean.astype(block.dtype)


def downsample_mode(block: np.ndarray, step=(2, 2, 2)) -> np.ndarray:
    """Mode downsampling by ``step`` voxels per axis (2x by default; masks, label and
    instance ids): the most frequent value of each block, ties to the smaller value (so a
    half-filled block of a 0/1 mask is 0)."""
    b = _blocks(block, step)
    nz, _, ny, _, nx, _ = b.shape
    cells = b.transpose(0, 2, 4, 1, 3, 5).reshape(nz * ny * nx, -1)
    out = cells[:, 0].copy()
    mixed = np.flatnonzero((cells != out[:, None]).any(axis=1))
    if mixed.size:
        sub = np.sort(cells[mixed], axis=1)
        # Run lengths in each sorted row: the longest run is the mode, the first (smallest) wins.
        counts = (sub[:, :, None] == sub[:, None, :]).sum(axis=2, dtype=np.int16)
        out[mixed] = sub[np.arange(sub.shape[0]), np.argmax(counts, axis=1)]
    return out.reshape(nz, ny, nx)


DOWNSAMPLERS = {"mean": downsample_mean, "mode": downsample_mode}


def write_pyramid(group, n_levels: int, method: str, chunks=VIEW_CHUNKS,
                  max_block_voxels: int = 2**24, steps=None) -> None:
    """Add levels ``s1 .. s{n_levels-1}`` to a multiscale group whose ``s0`` is written, each
    the ``method`` ("mean" or "mode") downsampling of the level before, 2x or by the per-axis
    ``steps`` (:func:`pyramid_steps`), and rewrite the group's ``multiscales`` for every level
    (the other attributes are kept).

    Works block by block (blocks of whole chunks of the coarser level, at most
    ``max_block_voxels`` of it), so levels of volumes larger than memory are made too.
    """
    if method not in DOWNSAMPLERS:
        raise ValueError(f"pyramid method {method!r}: expected one of {sorted(DOWNSAMPLERS)}")
    down = DOWNSAMPLERS[method]
    steps = list(steps) if steps is not None else [(2, 2, 2)] * (n_levels - 1)
    ms = dict(group.attrs)["multiscales"][0]
    first = ms["datasets"][0]["coordinateTransformations"]
    scale0 = next(t["scale"] for t in first if t["type"] == "scale")
    translation0 = next(t["translation"] for t in first if t["type"] == "translation")
    source = group["s0"]
    shapes = pyramid_shapes(source.shape, n_levels, steps)
    for k in range(1, n_levels):
        shape, step = shapes[k], steps[k - 1]
        level_chunks = tuple(min(c, s) for c, s in zip(chunks, shape))
        target = group.create_array(f"s{k}", shape=shape, chunks=level_chunks, dtype=source.dtype,
                                    fill_value=0, overwrite=True)
        # Blocks of whole chunks along y and x, growing in z while they stay small.
        block = list(level_chunks)
        while block[0] < shape[0] and np.prod(block) * 2 <= max_block_voxels:
            block[0] = min(shape[0], block[0] * 2)
        for z in range(0, shape[0], block[0]):
            for y in range(0, shape[1], block[1]):
                for x in range(0, shape[2], block[2]):
                    lo = (z, y, x)
                    hi = tuple(min(a + b, s) for a, b, s in zip(lo, block, shape))
                    src = source[tuple(slice(f * a, f * b) for a, b, f in zip(lo, hi, step))]
                    target[tuple(slice(a, b) for a, b in zip(lo, hi))] = down(np.asarray(src), step)
        source = target
    group.attrs["multiscales"] = multiscales_attrs(ms.get("name", ""), scale0, translation0,
                                                   n_levels, steps)
