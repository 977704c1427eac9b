"""Split lists: EM volumes and label crops named one by one, each crop marked train or val
(``data.dataset_path`` pointing at a ``.csv`` or ``.toml`` file instead of a folder). This
module reads a list into :class:`SplitEntry` rows; ``cellmap.read_split_list`` opens what they
name.
"""

from __future__ import annotations

import csv
import tomllib
from dataclasses import dataclass
from pathlib import Path

from torchtitan.cellmap.errors import DatasetError
from torchtitan.data.io import stores

# CSV, as cellmap-data / the CellMap challenge write it (no header; one crop per row):
#     "train","/data/jrc_x/jrc_x.zarr","recon-1/em/fibsem-uint8",
#         "/data/jrc_x/jrc_x.zarr","recon-1/labels/groundtruth/crop1/[mito,nuc]"   (one line)
#     "validate",...
#   columns: split (train | validate), EM store, EM group inside it, label store, crop group
#   inside it with the classes to use in brackets (no brackets: every class of the crop).
#   A row of only the first three columns adds an EM volume without labels (MAE).
# TOML:
#     root = "/data"                      # optional: base of relative paths (default: the
#                                         # TOML's folder)
#     [[train]]
#     em = "jrc_x/jrc_x.zarr/recon-1/em/fibsem-uint8"
#     crops = ["jrc_x/jrc_x.zarr/recon-1/labels/groundtruth/crop1"]   # or crop = "..."
#     classes = ["mito", "nuc"]           # optional: default every class of each crop
#     name = "jrc_x"                      # optional: default the .zarr store's name
#     [[val]]
#     ...
# Relative CSV paths are relative to the CSV's folder. Any path may be a URL (s3://, gs://,
# http(s)://; see stores.py); a TOML root may be one too.

SPLIT_NAMES = {"train": "train", "val": "val", "validate": "val", "validation": "val"}


@dataclass(frozen=True)
class SplitEntry:
    """One EM volume and (optionally) one of its label crops, as a split list names them."""

    where: str  # "<file> line 3" / "<file> [[train]] entry 2", for messages
    split: str  # "train" | "val"
    em: str  # the EM multiscale group (local path or URL)
    crop: str | None  # the label crop group (holding one multiscale group per class)
    classes: tuple[str, ...] | None  # classes to use from the crop; None: every class
    name: str | None = None  # dataset name; None: the name of the enclosing .zarr store


def _split_name(text: str, where: str) -> str:
    split = SPLIT_NAMES.get(text.strip().lower())
    if split is None:
        raise DatasetError(f"{where}: split {text!r} is neither 'train' nor 'validate' (or 'val')")
    return split


def _location(text: str, base: str, where: str) -> str:
    """A path of the list: a URL (``s3://``, ``gs://``, ``http(s)://``) as it is, a local
    path made absolute against ``base`` (which may itself be a URL)."""
    text = text.strip()
    if stores.is_url(text):
        stores.check_location(text, where)
        return text.rstrip("/")
    if stores.is_url(base):
        return stores.join(base, text)
    p = Path(text).expanduser()
    return str(p if p.is_absolute() else Path(base) / p)


def _crop_and_classes(text: str) -> tuple[str, tuple[str, ...] | None]:
    """``recon-1/labels/groundtruth/crop1/[mito,nuc]`` -> (``.../crop1``, ("mito", "nuc"))."""
    text = text.strip()
    if text.endswith("]") and "[" in text:
        head, _, names = text[:-1].rpartition("[")
        classes = tuple(c.strip() for c in names.split(",") if c.strip())
        return head.rstrip("/"), classes
    return text.rstrip("/"), None


def _read_split_csv(path: Path) -> list[SplitEntry]:
    entries = []
    with open(path, newline="") as f:
        for lineno, row in enumerate(csv.reader(f), start=1):
            row = [c.strip() for c in row]
            if not any(row) or row[0].startswith("#"):
                continue
            where = f"{path} line {lineno}"
            if len(row) not in (3, 5):
                raise DatasetError(
                    f"{where}: expected 5 columns \"train|validate\",\"<EM store>\",\"<EM group>\","
                    "\"<label store>\",\"<crop group>/[class,...]\" (or the first 3 for an EM "
                    f"volume without labels), got {len(row)}: {row}"
                )
            split = _split_name(row[0], where)
            em = stores.join(_location(row[1], str(path.parent), where), row[2])
            crop, classes = None, None
            if len(row) == 5:
                crop_group, classes = _crop_and_classes(row[4])
                crop = stores.join(_location(row[3], str(path.parent), where), crop_group)
            entries.append(SplitEntry(where, split, em, crop, classes))
    return entries


TOML_ENTRY_KEYS = {"em", "crop", "crops", "classes", "name"}


def _read_split_toml(path: Path) -> list[SplitEntry]:
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise DatasetError(f"{path}: not valid TOML: {e}") from e
    unknown = set(doc) - {"root", *SPLIT_NAMES}
    if unknown:
        raise DatasetError(
            f"{path}: unknown keys {sorted(unknown)}; a split list has an optional 'root' and "
            "[[train]] / [[val]] entries"
        )
    base = _location(str(doc.get("root", ".")), str(path.parent), str(path))
    entries = []
    for key in SPLIT_NAMES:
        tables = doc.get(key, [])
        if not isinstance(tables, list):
            raise DatasetError(f"{path}: '{key}' must be a list of tables, written [[{key}]]")
        for i, t in enumerate(tables, start=1):
            where = f"{path} [[{key}]] entry {i}"
            bad = set(t) - TOML_ENTRY_KEYS
            if bad or "em" not in t:
                raise DatasetError(
                    f"{where}: needs 'em' (the EM multiscale group) and may have 'crop' / "
                    f"'crops', 'classes' and 'name'; got keys {sorted(t)}"
                )
            crops = t.get("crops", t.get("crop", []))
            crops = [crops] if isinstance(crops, str) else list(crops)
            classes = tuple(t["classes"]) if "classes" in t else None
            em = _location(t["em"], base, where)
            split = _split_name(key, where)
            name = t.get("name")
            if not crops:
                entries.append(SplitEntry(where, split, em, None, None, name))
            for c in crops:
                entries.append(SplitEntry(where, split, em, _location(c, base, where),
                                          classes, name))
    return entries


def read_split_entries(path: Path) -> list[SplitEntry]:
    """The rows of a split list (.csv or .toml); a DatasetError for any other file or an empty
    list."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        entries = _read_split_csv(path)
    elif suffix == ".toml":
        entries = _read_split_toml(path)
    else:
        raise DatasetError(
            f"data.dataset_path {str(path)!r} is a file but not a split list; give a folder of "
            "<dataset>/<dataset>.zarr stores, a .csv (cellmap-data datasplit format) or a .toml "
            "split list"
        )
    if not entries:
        raise DatasetError(f"split list {path} names no EM volume; add train / val entries")
    return entries
