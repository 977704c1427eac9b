"""The prediction store ``predict.py`` writes: whose it is and which regions are finished.

predict.py writes only into stores it created: the root and every region and class group it
creates carry :data:`OWNER_ATTR` before anything is written into them, and a finished
region's group gets :data:`COMPLETE_ATTR`. :func:`check_output_store` refuses, before any
work, an output that is a file, lies inside another zarr store, or is a folder or store (or
holds groups) that predict.py did not write; see :mod:`torchtitan.tools.predictor`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torchtitan.errors import ConfigError

COMPLETE_ATTR = "prediction_complete"
# Set on the root and on every group predict.py creates (region and class groups) before
# anything is written into them: predict.py writes only where it finds it (or, for stores of
# earlier versions, the completion marker and the class groups' prediction attributes).
OWNER_ATTR = "torchtitan_prediction"
_CLASS_GROUP_ATTRS = ("multiscales", "voxel_size", "translation")  # what the predictor sets


def _zarr_attrs(path: Path) -> dict | None:
    """The attributes of the zarr group or array at ``path`` (format 2 or 3), or None when
    ``path`` is no zarr node."""
    try:
        if (path / "zarr.json").is_file():
            return json.loads((path / "zarr.json").read_text()).get("attributes", {}) or {}
        if (path / ".zgroup").is_file() or (path / ".zarray").is_file():
            attrs = path / ".zattrs"
            return json.loads(attrs.read_text()) if attrs.is_file() else {}
    except (OSError, ValueError):
        return {}
    return None


def _is_array(path: Path) -> bool:
    if (path / ".zarray").is_file():
        return True
    try:
        return json.loads((path / "zarr.json").read_text()).get("node_type") == "array"
    except (OSError, ValueError):
        return False


def region_finished(out: str, name: str) -> bool:
    """Whether ``out/<name>`` holds a finished prediction (its completion marker is set)."""
    return bool((_zarr_attrs(Path(out) / name) or {}).get(COMPLETE_ATTR))


def _inside_store(path: Path) -> Path | None:
    """The zarr group or array that ``path`` would be written into, if any of its parents is
    one."""
    for parent in path.resolve().parents:
        if _zarr_attrs(parent) is not None:
            return parent
    return None


def _not_ours(path: Path, flag: str, why: str) -> ConfigError:
    return ConfigError(
        f"{flag} {path}: {why}; predict.py writes only into stores it created, and never into "
        "another (not with --overwrite either): choose a new path")


def check_output_store(out: str, regions: list[str], flag: str = "--out",
                       owner: str = OWNER_ATTR) -> None:
    """Refuse to write ``out`` unless it is new, an empty folder, or a store predict.py made:
    an existing file, a path inside another zarr store (a dataset's ``em/`` or ``labels/``
    groups), a folder or zarr store predict.py did not write, and, inside its own store, a
    region or class group without the prediction attributes (or holding anything else) are
    errors naming them. Read-only: checked on every rank before any work."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {out} is an existing file, not a zarr store; give a new path "
                          f"(a folder, e.g. {path.with_suffix('.zarr')})")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK):
        raise ConfigError(f"{flag} {out}: {existing} is not writable; choose a path in a folder "
                          "you can write")
    store = _inside_store(path)
    if store is not None:
        inner = path.resolve().relative_to(store).parts
        named = [p for p in (store.name, *inner) if p in ("em", "labels")]
        what = f" (inside its {named[0]}/ group: a dataset's data)" if named else ""
        raise _not_ours(path, flag, f"lies inside the zarr store {store}{what}")
    if not path.exists() or not any(path.iterdir()):
        return
    attrs = _zarr_attrs(path)
    if attrs is None:
        raise _not_ours(path, flag, "is a folder that is not a zarr store and not empty")
    children = [c for c in path.iterdir() if c.is_dir()]
    legacy = owner == OWNER_ATTR and children and all(
        COMPLETE_ATTR in (_zarr_attrs(c) or {}) for c in children)
    if not attrs.get(owner) and not legacy:
        raise _not_ours(path, flag, f"is a zarr store that predict.py did not write (no "
                                    f"'{owner}' attribute)")
    if owner != OWNER_ATTR:
        return
    for name in regions:
        group = path / name
        if not group.exists():
            continue
        g_attrs = _zarr_attrs(group)
        if g_attrs is None or _is_array(group) or not (OWNER_ATTR in g_attrs
                                                       or COMPLETE_ATTR in g_attrs):
            raise _not_ours(group, flag, "was not written by predict.py (no prediction "
                                         "attributes)")
        for child in sorted(group.iterdir()):
            if child.name.startswith(".") or child.name == "zarr.json":
                continue
            c_attrs = _zarr_attrs(child)
            if c_attrs is None or _is_array(child) or not (
                    OWNER_ATTR in c_attrs or all(k in c_attrs for k in _CLASS_GROUP_ATTRS)):
                raise _not_ours(child, flag, "holds data predict.py did not write (no "
                                             "prediction attributes)")
