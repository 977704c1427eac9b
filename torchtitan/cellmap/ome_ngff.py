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

import numpy as np

from torchtitan.cellmap.errors import DatasetError
from torchtitan.cellmap.grids import AXES, ScaleLevel

UNIT = "nanometer"

# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_attrs(group_path: Path) -> dict:
    """Attributes of a zarr group, format 2 (.zattrs) or 3 (zarr.json); {} when it has none."""
    v2 = group_path / ".zattrs"
    if v2.is_file():
        return json.loads(v2.read_text())
    v3 = group_path / "zarr.json"
    if v3.is_file():
        return json.loads(v3.read_text()).get("attributes", {})
    return {}


def array_shape(array_path: Path) -> tuple[int, ...]:
    """Shape of a zarr array (format 2 or 3), from its metadata alone."""
    v2 = array_path / ".zarray"
    if v2.is_file():
        return tuple(json.loads(v2.read_text())["shape"])
    v3 = array_path / "zarr.json"
    if v3.is_file():
        meta = json.loads(v3.read_text())
        if meta.get("node_type") == "array":
            return tuple(meta["shape"])
    raise DatasetError(f"{array_path}: not a zarr array (no .zarray or zarr.json)")


def is_multiscale_group(attrs: dict) -> bool:
    """Whether group attributes carry OME-NGFF metadata (0.4 or 0.5)."""
    return "multiscales" in attrs or "ome" in attrs


def read_multiscales(group_path: str | os.PathLike) -> list[ScaleLevel]:
    """Read the OME-NGFF ``multiscales`` of a group (0.4 in zarr format 2 ``.zattrs``, or 0.5
    under ``ome`` in a zarr format 3 ``zarr.json``): one ScaleLevel per dataset path."""
    group_path = Path(group_path)
    attrs = read_attrs(group_path)
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
        path = group_path / ds["path"]
        shape = array_shape(path)
        if len(shape) != 3:
            raise DatasetError(f"{path}: expected a 3D (z, y, x) array, got shape {shape}")
        if min(scale) <= 0:
            raise DatasetError(f"{path}: scale {list(scale)} must be positive (nm per voxel)")
        levels.append(ScaleLevel(shape=shape, scale=scale, translation=translation, path=str(path)))
    return levels


def stored_intensity_range(group_path: str | os.PathLike) -> tuple[float, float] | None:
    """The intensity window an image group stores (OME-NGFF ``omero`` channel 0, 0.4 or under
    ``ome``): ``start``/``end``, else ``min``/``max``; None when it stores none."""
    attrs = read_attrs(Path(group_path))
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
