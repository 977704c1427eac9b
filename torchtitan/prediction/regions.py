"""What ``predict.py`` predicts: regions of the model's voxel grid inside EM volumes.

A region is a label crop (``--crops``), a dataset's whole EM volume or a box of it in nm
(``--dataset``, ``--roi``), or a crop of a manifest (``--manifest``: our own CSV of boxes, or the
challenge's test-crop manifest).

Crop manifest (``--manifest FILE``): the boxes to predict where no labels exist (e.g. the
challenge's test crops). A CSV file with a header line and these columns (any order; other
columns are ignored)::

    crop_name,dataset,origin_z,origin_y,origin_x,shape_z,shape_y,shape_x,voxel_size_z,voxel_size_y,voxel_size_x
    crop123,jrc_hela-2,1000.0,2000.0,3000.0,100,200,200,4.0,4.0,4.0

The challenge's own test-crop manifest (columns ``crop_name,dataset,class_label,voxel_size,
translation,shape``, one row per crop and class; :mod:`torchtitan.cellmap.challenge`) is read
too: each crop becomes the box its classes cover.

``crop_name`` is ``crop<N>`` or ``<N>``; ``dataset`` names an EM dataset under the data
root; ``origin_*`` is the world position (nm) of the outer corner of the crop's voxel 0 (not
its centre), ``shape_*`` its size in voxels and ``voxel_size_*`` its voxel size (nm), so
the crop spans ``[origin, origin + shape * voxel_size)``. Each row is predicted as region
``crop<N>`` on the model's grid (``data.voxel_size``): the smallest whole number of voxels
covering the box, centred on it. Rows repeating a crop with the same box are merged.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchtitan.cellmap.challenge import ChallengeCrop, is_test_manifest, read_test_manifest
from torchtitan.cellmap.grids import POSITION_TOL_NM, box_inside, centred_grid, extent_shape
from torchtitan.data.crops.layout import DatasetError, EMSource
from torchtitan.data.crops.reader import crop_grid
from torchtitan.errors import ConfigError


@dataclass
class Region:
    """A box of the model's voxel grid inside one EM volume."""

    name: str
    source: EMSource
    origin: np.ndarray  # nm, corner of voxel 0
    shape: tuple[int, int, int]
    voxel_size: np.ndarray  # nm, the model's grid (data.voxel_size)


def parse_roi(roi: str) -> tuple[np.ndarray, np.ndarray]:
    """``"z0:z1,y0:y1,x0:x1"`` in nm -> (min corner, max corner)."""
    try:
        parts = [tuple(float(v) for v in axis.split(":")) for axis in roi.split(",")]
        lo, hi = np.array([p[0] for p in parts]), np.array([p[1] for p in parts])
        assert len(parts) == 3 and np.all(hi > lo)
    except (ValueError, AssertionError, IndexError):
        raise ConfigError(f"--roi {roi!r}: expected 'z0:z1,y0:y1,x0:x1' in nm with z1 > z0 etc.")
    return lo, hi


def regions(sources: list[EMSource], voxel_size, dataset: str | None, roi: str | None,
            crops: str | None) -> list[Region]:
    """What to predict: label crops (``crops`` = names or 'all'), or one dataset's EM volume
    (optionally restricted to ``roi``)."""
    v = np.asarray(voxel_size, dtype=float)
    if crops:
        wanted = None if crops == "all" else set(crops.split(","))
        out = []
        for s in sources:
            for c in s.crops:
                if wanted is None or c.name in wanted or c.full_name in wanted:
                    origin, shape = crop_grid(c, v)
                    out.append(Region(c.name, s, origin, shape, v))
        if not out:
            raise DatasetError(f"--crops {crops!r} matches no label crop; available: "
                               + ", ".join(c.full_name for s in sources for c in s.crops))
        return out
    by_name = {s.name: s for s in sources}
    if dataset is None:
        if len(sources) != 1:
            raise ConfigError(f"--dataset is needed: the data holds {', '.join(by_name)}")
        dataset = sources[0].name
    if dataset not in by_name:
        raise DatasetError(f"--dataset {dataset!r} not found; available: {', '.join(by_name)}")
    source = by_name[dataset]
    lo, hi = source.levels[0].box_min, source.levels[0].box_max
    if roi:
        rlo, rhi = parse_roi(roi)
        if not box_inside(rlo, rhi, lo, hi):
            raise DatasetError(f"--roi {roi} leaves the volume of {dataset} "
                               f"({lo.tolist()}..{hi.tolist()} nm)")
        lo, hi = rlo, rhi
    shape = extent_shape(np.asarray(hi) - np.asarray(lo), v, cover=False)
    return [Region(dataset, source, lo, shape, v)]  # type: ignore[arg-type]


MANIFEST_COLUMNS = ("crop_name", "dataset", "origin_z", "origin_y", "origin_x", "shape_z",
                    "shape_y", "shape_x", "voxel_size_z", "voxel_size_y", "voxel_size_x")


@dataclass
class ManifestCrop:
    """One row of a crop manifest: a box in world coordinates (nm)."""

    name: str  # crop<N>
    dataset: str
    box_min: np.ndarray  # outer corner of voxel 0
    box_max: np.ndarray
    voxel_size: np.ndarray | None = None  # the crop's own voxel size (nm), when the row gives it


def read_manifest(path: str) -> list[ManifestCrop]:
    """The crops of a manifest CSV (format: module docstring), duplicates merged."""
    if not Path(path).is_file():
        raise ConfigError(f"--manifest {path!r} does not exist")
    challenge = test_manifest_crops(path)
    if challenge is not None:
        return [ManifestCrop(c.name, c.dataset, c.box_min, c.box_max) for c in challenge.values()]
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in MANIFEST_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(f"--manifest {path}: missing columns {missing}; expected "
                              + ",".join(MANIFEST_COLUMNS))
        crops: dict[str, ManifestCrop] = {}
        for line, row in enumerate(reader, start=2):
            try:
                number = row["crop_name"].strip().removeprefix("crop")
                if not number.isdigit():
                    raise ValueError(f"crop_name {row['crop_name']!r} is not crop<N> or <N>")
                origin = np.array([float(row[f"origin_{a}"]) for a in "zyx"])
                shape = np.array([int(row[f"shape_{a}"]) for a in "zyx"])
                voxel = np.array([float(row[f"voxel_size_{a}"]) for a in "zyx"])
                if np.any(shape < 1) or np.any(voxel <= 0):
                    raise ValueError("shape must be >= 1 and voxel_size > 0")
                dataset = row["dataset"].strip()
            except (ValueError, TypeError, AttributeError) as e:
                raise ConfigError(f"--manifest {path}, line {line}: {e}") from None
            crop = ManifestCrop(f"crop{int(number)}", dataset, origin, origin + shape * voxel, voxel)
            seen = crops.get(crop.name)
            if seen is None:
                crops[crop.name] = crop
            elif (seen.dataset != crop.dataset or not np.allclose(seen.box_min, crop.box_min, atol=POSITION_TOL_NM)
                  or not np.allclose(seen.box_max, crop.box_max, atol=POSITION_TOL_NM)):
                raise ConfigError(f"--manifest {path}, line {line}: {crop.name} appears again "
                                  "with another dataset or box")
    if not crops:
        raise ConfigError(f"--manifest {path} lists no crop")
    return list(crops.values())


def test_manifest_crops(path: str) -> dict[str, ChallengeCrop] | None:
    """The crops of the challenge's test-crop manifest at ``path``, or None when the CSV is in
    our own manifest format."""
    with open(path, newline="") as f:
        if not is_test_manifest(csv.DictReader(f).fieldnames):
            return None
    try:
        return read_test_manifest(path)
    except DatasetError as e:
        raise ConfigError(f"--manifest {e}") from None


def covering_grid(box_min, box_max, voxel_size) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Origin (nm, outer corner of voxel 0) and shape of the smallest grid of ``voxel_size``
    that covers the box, centred on it."""
    return centred_grid(box_min, box_max, voxel_size, cover=True)


def manifest_regions(sources: list[EMSource], voxel_size, path: str) -> list[Region]:
    """One region ``crop<N>`` per crop of the manifest, on the model's grid."""
    by_name = {s.name: s for s in sources}
    out = []
    for crop in read_manifest(path):
        if crop.dataset not in by_name:
            raise DatasetError(f"--manifest: {crop.name} is in dataset {crop.dataset!r}, which is "
                               f"not under the data root; available: {', '.join(by_name)}")
        origin, shape = covering_grid(crop.box_min, crop.box_max, voxel_size)
        out.append(Region(crop.name, by_name[crop.dataset], origin, shape,
                          np.asarray(voxel_size, dtype=float)))
    return out


def requested_regions(args, sources: list[EMSource], voxel_size) -> list[Region]:
    """The regions the arguments name: a manifest's crops, or label crops, a dataset or an ROI."""
    if args.manifest:
        if args.crops or args.dataset or args.roi:
            raise ConfigError("--manifest predicts the crops it lists; leave out --crops, "
                              "--dataset and --roi")
        return manifest_regions(sources, voxel_size, args.manifest)
    return regions(sources, voxel_size, args.dataset, args.roi, args.crops)
