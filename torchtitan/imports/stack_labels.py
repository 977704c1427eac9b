"""What the label images of an image stack mean: value maps (which label values make up each
class, which are background, which unknown) and crops (ranges of whole sections), as given on
the command line of ``helpers/import_stack.py`` or in a value-map TOML, checked before
:func:`torchtitan.imports.image_stack.import_stack` writes anything.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from torchtitan.cellmap.classes import CLASS_IDS, class_name_hint
from torchtitan.cellmap.errors import DatasetError


class ImageStackError(DatasetError):
    """An image stack, value map or import option that cannot be imported as given."""


@dataclass(frozen=True)
class Values:
    """A set of label values given as numbers and inclusive ranges: ``0,32,64-128``."""

    ranges: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in self.ranges)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def table(self, size: int) -> np.ndarray:
        """Boolean lookup table over the values ``0 .. size - 1``."""
        lut = np.zeros(size, bool)
        for a, b in self.ranges:
            lut[a: b + 1] = True
        return lut


def parse_values(spec, what: str) -> Values:
    """Label values from ``"0,32,64-128"``, an int, or a list of ints and such strings."""
    items = spec if isinstance(spec, list) else [spec]
    ranges = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise ImageStackError(f"{what}: {item!r} is not a label value; give integers and "
                                  "ranges such as 0,32,64-128")
        if isinstance(item, int):
            parts = [str(item)]
        else:
            parts = [p.strip() for p in item.split(",") if p.strip()]
        for part in parts:
            m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
            if not m:
                raise ImageStackError(f"{what}: {part!r} is not a label value or range; give "
                                      "integers and ranges such as 0,32,64-128")
            a, b = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
            if b < a:
                raise ImageStackError(f"{what}: range {part!r} ends before it starts")
            ranges.append((a, b))
    if not ranges:
        raise ImageStackError(f"{what}: no label values given; e.g. 191 or 0,32,64-128")
    return Values(tuple(ranges))


@dataclass
class ValueMap:
    """Which label values make up each class, which are background, which unknown."""

    classes: dict[str, Values] = field(default_factory=dict)
    background: Values = Values()
    unknown: Values = Values()


def parse_class(spec: str) -> tuple[str, Values]:
    """``--class NAME=VALUES`` -> (name, values)."""
    name, sep, values = spec.partition("=")
    if not sep or not name.strip():
        raise ImageStackError(f"--class {spec!r}: expected NAME=VALUES, e.g. mito=191 or "
                              "pm=0,32,64-128")
    return name.strip(), parse_values(values, f"--class {name.strip()}")


def read_value_map(path: str | Path) -> ValueMap:
    """A value map TOML: ``background``, ``unknown`` and a ``[classes]`` table of
    ``name = values`` (an int, a list, or a string such as ``"0,32,64-128"``)."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ImageStackError(f"--value_map {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ImageStackError(f"--value_map {path}: not valid TOML: {e}") from None
    unknown_keys = sorted(set(doc) - {"classes", "background", "unknown"})
    if unknown_keys:
        raise ImageStackError(f"--value_map {path}: unknown key(s) {unknown_keys}; expected "
                              "'background', 'unknown' and a [classes] table")
    classes = doc.get("classes", {})
    if not isinstance(classes, dict):
        raise ImageStackError(f"--value_map {path}: 'classes' must be a table of name = values")
    vm = ValueMap({name: parse_values(v, f"--value_map {path}: classes.{name}")
                   for name, v in classes.items()})
    if "background" in doc:
        vm.background = parse_values(doc["background"], f"--value_map {path}: background")
    if "unknown" in doc:
        vm.unknown = parse_values(doc["unknown"], f"--value_map {path}: unknown")
    return vm


def parse_crop(spec: str) -> tuple[str, int, int]:
    """``--crop crop1=0-15`` -> ("crop1", 0, 15), sections inclusive (``crop3=7``: one)."""
    m = re.fullmatch(r"\s*(crop\d+)\s*=\s*(\d+)(?:\s*-\s*(\d+))?\s*", spec)
    if not m:
        raise ImageStackError(f"--crop {spec!r}: expected crop<N>=FIRST-LAST (sections, from 0), "
                              "e.g. crop1=0-15")
    a, b = int(m.group(2)), int(m.group(3) if m.group(3) is not None else m.group(2))
    if b < a:
        raise ImageStackError(f"--crop {spec!r}: the last section comes before the first")
    return m.group(1), a, b


def check_crops(crops: list[tuple[str, int, int]], n_sections: int) -> None:
    """Crops must lie inside the stack, have distinct names and not overlap."""
    names = [c[0] for c in crops]
    for name in names:
        if names.count(name) > 1:
            raise ImageStackError(f"--crop {name} is given twice; give each crop once")
    for name, a, b in crops:
        if b >= n_sections:
            raise ImageStackError(
                f"--crop {name}={a}-{b}: the stack has sections 0-{n_sections - 1} only; "
                "crops are ranges of section indices counted from 0")
    ordered = sorted(crops, key=lambda c: c[1])
    for (n1, a1, b1), (n2, a2, b2) in zip(ordered, ordered[1:]):
        if a2 <= b1:
            raise ImageStackError(
                f"--crop {n1}={a1}-{b1} and --crop {n2}={a2}-{b2} overlap (sections "
                f"{a2}-{min(b1, b2)}); every section belongs to one crop at most")


def check_value_map(vm: ValueMap, dtype: np.dtype) -> None:
    """Every class named in the table, every value inside ``dtype``'s range, and no value both
    a class's and background or unknown."""
    if not vm.classes:
        raise ImageStackError(
            "labels given without a value map: say which label values make up each class with "
            "--class NAME=VALUES (e.g. --class mito=191) or --value_map FILE.toml")
    for name in vm.classes:
        if name not in CLASS_IDS:
            raise ImageStackError(
                f"--class {name}: not a CellMap class{class_name_hint(name)} Use a name of the "
                "class table (torchtitan/cellmap/classes.py), e.g. mito, pm, ecs, nuc, er")
    top = int(np.iinfo(dtype).max)
    named = {f"--class {n}": v for n, v in vm.classes.items()}
    named.update({"--background": vm.background, "--unknown": vm.unknown})
    for what, values in named.items():
        for a, b in values.ranges:
            if b > top:
                raise ImageStackError(
                    f"{what}: value {b} is outside the range of the {dtype.name} label images "
                    f"(0-{top})")
    tables = {what: values.table(top + 1) for what, values in named.items()}
    pairs = [(f"--class {n}", other) for n in vm.classes for other in ("--background", "--unknown")]
    for what, other in pairs + [("--background", "--unknown")]:
        both = np.flatnonzero(tables[what] & tables[other])
        if both.size:
            raise ImageStackError(
                f"label value {both[0]} is in both {what} and {other}; a value is background, "
                "unknown, or part of classes (one value may belong to several classes)")
