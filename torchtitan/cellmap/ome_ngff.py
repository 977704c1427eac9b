"""OME-NGFF ``multiscales`` groups: reading their levels, writing them (one writer).

Reading accepts OME-NGFF 0.4 (``.zattrs`` of zarr format 2) and 0.5 (under ``ome`` in the
``zarr.json`` of zarr format 3). Writing produces 0.4 in zarr format 2, the layout of the
CellMap challenge data: demo data and prediction output are both written by
:func:`create_multiscale_group`, so they carry the same metadata.

A 2x pyramid follows the voxel-centre convention of :mod:`.grids`: level k has
``scale_k = scale_0 * 2**k`` and ``translation_k = translation_0 + (scale_k - scale_0) / 2``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from torchtitan.cellmap.errors import DatasetError
from torchtitan.cellmap.grids import AXES, ScaleLevel

UNIT = "nanometer"

# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


# A metadata reader: the parsed JSON document at a location (local path or URL), None when
# absent. The default reads local files; ``torchtitan.datasets.stores.read_json`` also reads
# remote stores (S3, GCS, HTTP), so the functions below work on either.
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


def multiscales_attrs(name: str, scale0, translation0, n_levels: int) -> list[dict]:
    """OME-NGFF 0.4 ``multiscales`` metadata of a 2x pyramid ``s0 .. s{n_levels-1}``.

    Translations follow the voxel-centre convention: level k's voxel 0 is centred at
    ``translation0 + (scale_k - scale0) / 2``.
    """
    datasets = []
    for k in range(n_levels):
        scale = [float(s) * 2**k for s in scale0]
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
                            extra_attrs: dict | None = None):
    """The zarr group ``parent/path`` with OME-NGFF 0.4 ``multiscales`` metadata of a 2x
    pyramid of ``n_levels`` levels (plus ``extra_attrs``); its arrays ``s0 ..`` are the
    caller's to write. An existing group keeps its arrays and gets the new metadata."""
    head, _, name = path.rpartition("/")
    attrs = {"multiscales": multiscales_attrs(name, scale0, translation0, n_levels)}
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
                                 fill_value: int = 0):
    """Write ``levels`` (each a 2x downsampling of the previous one) as arrays ``s0, s1, ...``
    of the group ``parent/path``, with its OME-NGFF metadata (:func:`create_multiscale_group`)."""
    group = create_multiscale_group(parent, path, scale0, translation0, len(levels), extra_attrs)
    for k, data in enumerate(levels):
        level_chunks = tuple(min(c, n) for c, n in zip(chunks, data.shape))
        group.create_array(f"s{k}", data=data, chunks=level_chunks, fill_value=fill_value)
    return group


# ---------------------------------------------------------------------------------------------
# Pyramids of a written level s0 (prediction output): 2x mean or mode, block by block
# ---------------------------------------------------------------------------------------------

# Chunks that viewers (neuroglancer, napari) fetch quickly: 64^3 voxels, about 256 KiB of uint8.
VIEW_CHUNKS = (64, 64, 64)


def pyramid_shapes(shape0, n_levels: int) -> list[tuple[int, ...]]:
    """Shapes of a 2x pyramid: level k has ``ceil(shape_{k-1} / 2)`` voxels per axis, so an
    odd side keeps its last voxel (its block is completed by repeating the edge)."""
    shapes = [tuple(int(s) for s in shape0)]
    for _ in range(1, n_levels):
        shapes.append(tuple(-(-s // 2) for s in shapes[-1]))
    return shapes


def auto_pyramid_levels(shape0, minimum: int = 3, coarsest_side: int = 64) -> int:
    """Levels until the largest side is at most ``coarsest_side`` voxels, never fewer than
    ``minimum``."""
    n, side = 1, max(int(s) for s in shape0)
    while side > coarsest_side:
        side, n = -(-side // 2), n + 1
    return max(minimum, n)


def _pad_even(block: np.ndarray) -> np.ndarray:
    """Repeat the last plane of every odd-sized axis, so 2x2x2 blocks tile the array."""
    pad = [(0, s % 2) for s in block.shape]
    return np.pad(block, pad, mode="edge") if any(p for _, p in pad) else block


def downsample_mean(block: np.ndarray) -> np.ndarray:
    """2x mean downsampling (probabilities, intensities); float output for float input,
    rounded for integers."""
    b = _pad_even(block)
    nz, ny, nx = (s // 2 for s in b.shape)
    mean = b.reshape(nz, 2, ny, 2, nx, 2).mean(axis=(1, 3, 5), dtype=np.float64)
    if np.issubdtype(block.dtype, np.integer):
        return np.rint(mean).astype(block.dtype)
    return mean.astype(block.dtype)


def downsample_mode(block: np.ndarray) -> np.ndarray:
    """2x mode downsampling (masks, label and instance ids): the most frequent value of each
    2x2x2 block, ties to the smaller value (so a half-filled block of a 0/1 mask is 0)."""
    b = _pad_even(block)
    nz, ny, nx = (s // 2 for s in b.shape)
    cells = b.reshape(nz, 2, ny, 2, nx, 2).transpose(0, 2, 4, 1, 3, 5).reshape(-1, 8)
    out = cells[:, 0].copy()
    mixed = np.flatnonzero((cells != out[:, None]).any(axis=1))
    if mixed.size:
        sub = np.sort(cells[mixed], axis=1)
        # Run lengths in each sorted row: the longest run is the mode, the first (smallest) wins.
        counts = (sub[:, :, None] == sub[:, None, :]).sum(axis=2)
        out[mixed] = sub[np.arange(sub.shape[0]), np.argmax(counts, axis=1)]
    return out.reshape(nz, ny, nx)


DOWNSAMPLERS = {"mean": downsample_mean, "mode": downsample_mode}


def write_pyramid(group, n_levels: int, method: str, chunks=VIEW_CHUNKS,
                  max_block_voxels: int = 2**24) -> None:
    """Add levels ``s1 .. s{n_levels-1}`` to a multiscale group whose ``s0`` is written, each
    the 2x ``method`` ("mean" or "mode") downsampling of the level before, and rewrite the
    group's ``multiscales`` for every level (the other attributes are kept).

    Works block by block (blocks of whole chunks of the coarser level, at most
    ``max_block_voxels`` of it), so levels of volumes larger than memory are made too.
    """
    if method not in DOWNSAMPLERS:
        raise ValueError(f"pyramid method {method!r}: expected one of {sorted(DOWNSAMPLERS)}")
    down = DOWNSAMPLERS[method]
    ms = dict(group.attrs)["multiscales"][0]
    first = ms["datasets"][0]["coordinateTransformations"]
    scale0 = next(t["scale"] for t in first if t["type"] == "scale")
    translation0 = next(t["translation"] for t in first if t["type"] == "translation")
    source = group["s0"]
    shapes = pyramid_shapes(source.shape, n_levels)
    for k in range(1, n_levels):
        shape = shapes[k]
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
                    src = source[tuple(slice(2 * a, 2 * b) for a, b in zip(lo, hi))]
                    target[tuple(slice(a, b) for a, b in zip(lo, hi))] = down(np.asarray(src))
        source = target
    group.attrs["multiscales"] = multiscales_attrs(ms.get("name", ""), scale0, translation0, n_levels)
