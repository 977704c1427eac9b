"""Image stacks (a folder of 2D TIFF or PNG sections, or one multi-page TIFF) as CellMap stores.

Most EM starts as a folder of 2D images, one per section, with a matching folder of label
images whose pixel values stand for classes (191 = mitochondrion, 0-128 = membrane, ...).
:func:`import_stack` turns such a stack into an ordinary dataset of the CellMap layout
(``data/crops/layout.py``), so training, validation, ``predict.py`` and scoring read it like any
other:

    <out>/<name>/<name>.zarr/recon-1/em/fibsem-uint8/s0, s1, ...       (uint16 EM: fibsem-uint16)
    <out>/<name>/<name>.zarr/recon-1/labels/groundtruth/crop<N>/<class>/s0

* **Sections** are the images of a folder (``.tif``, ``.tiff``, ``.png``) or of a glob, in
  natural order (``2.tif`` before ``10.tif``), or the pages of one multi-page TIFF. They must
  all have one size and one type: 8-bit (``L``) or 16-bit (``I;16``) greyscale. Or they are
  the z sections of a 3D dataset of an HDF5 file, ``FILE.h5:volumes/raw``
  (``volume_files``), read slab by slab; its ``resolution`` attribute gives the voxel size.
* **EM** becomes an OME-NGFF multiscale pyramid of the given voxel size (z, y, x nm; voxel 0
  centred at the origin). Isotropic volumes halve every axis per level. Anisotropic stacks (thin sections) are halved in plane only until
  their pixels approach the section thickness (``ome_ngff.pyramid_steps``). uint16 EM is stored
  with its intensity range (OME-NGFF ``omero`` window), which the loader maps onto 0..255.
* **Labels** (one image per EM section) become label crops, each a range of whole sections
  (``crop1`` = sections 0-15, ``crop2`` = 16-19; by default one crop of every section). A
  value map says which label values make up each class; every class becomes one group per
  crop: 0 absent, 1 present, and the unknown value where the map's ``unknown`` values are.
  Instance classes of the challenge (``mito``, ``nuc``, ...) store object ids instead of 1:
  connected components in 3D, or per section (``instances="2d"``). Every label value found
  must belong to a class, to ``background`` (absent for every class) or to ``unknown``.
  Labels that are object ids (neurons, bodies) need no value map: ``ids`` stores them as one
  instance class and may derive a boundary class from them (``id_labels``).
* A stack without labels becomes EM only (for MAE pretraining and prediction).

What label values mean (value maps) and the crops are :mod:`torchtitan.imports.stack_labels`.
Everything is checked before anything is written; the store is written beside its final
place and renamed into it at the end, so a failed import leaves no half-written dataset.
"""

from __future__ import annotations

import glob
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from torchtitan.cellmap.classes import is_instance_class
from torchtitan.cellmap.labels import ABSENT, PRESENT, UNKNOWN, LabelEncoding, annotation_attrs
from torchtitan.cellmap.ome_ngff import (
    create_multiscale_group,
    pyramid_steps,
    write_multiscale_array_group,
    write_pyramid,
)
from torchtitan.data.crops.layout import EM_GROUP, EM_GROUP_UINT16, GT_GROUP
from torchtitan.imports.id_labels import IdLabels, check_id_options, check_id_volume, id_classes
from torchtitan.imports.stack_labels import (
    ImageStackError,
    ValueMap,
    check_crops,
    check_value_map,
    parse_crop,
)
from torchtitan.imports.volume_files import (
    HDF5Volume,
    open_hdf5,
    resolve_voxel_size,
    slabs,
    split_hdf5,
)

IMAGE_SUFFIXES = (".tif", ".tiff", ".png")
INSTANCE_MODES = ("3d", "2d", "none")
# Pillow image modes -> the dtype of their pixels ("I" holds 16-bit PNGs of some writers).
_MODES = {"L": np.uint8, "P": np.uint8, "1": np.uint8, "I;16": np.uint16, "I;16L": np.uint16,
          "I;16B": np.uint16, "I;16N": np.uint16, "I": np.uint16}
# About 128 KiB of uint8 per chunk: 64^3 for isotropic voxels, 8 x 128 x 128 for 50 x 4.6 x 4.6 nm.
CHUNK_VOXELS = 2**17


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


def natural_key(path: Path) -> list:
    """Sort key that orders numbers by value: ``s2.tif`` before ``s10.tif``."""
    return [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", path.name)]


def list_images(source: str | Path, what: str) -> list[Path]:
    """The image files of ``source`` (a folder, a glob pattern or one file) in natural order."""
    text = str(source)
    path = Path(text)
    if path.is_dir():
        files = [p for p in path.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
        if not files:
            raise ImageStackError(
                f"{what} {text}: the folder holds no {'/'.join(IMAGE_SUFFIXES)} images; point "
                f"{what} at the folder of section images, a glob ('sections/*.tif') or one "
                "multi-page TIFF")
    elif path.is_file():
        files = [path]
    elif glob.has_magic(text):
        files = [Path(p) for p in glob.glob(text) if Path(p).is_file()]
        if not files:
            raise ImageStackError(f"{what} {text}: the pattern matches no file")
    else:
        raise ImageStackError(f"{what} {text}: no such file or folder")
    return sorted(files, key=natural_key)


@dataclass(frozen=True)
class Section:
    """One 2D section: a file, and the page of a multi-page TIFF."""

    file: Path
    page: int = 0

    def __str__(self) -> str:
        return f"{self.file} (page {self.page})" if self.page else str(self.file)


@dataclass
class ImageStack:
    """The sections of a stack, all of one size and pixel type (checked from the headers)."""

    what: str  # the option that named it, for messages: "--em", "--labels"
    sections: list[Section]
    shape: tuple[int, int]  # (y, x) pixels
    dtype: np.dtype

    @property
    def name(self) -> str:
        """The stack for messages: its folder, or its file (one multi-page TIFF)."""
        files = {s.file for s in self.sections}
        return str(self.sections[0].file if len(files) == 1 else self.sections[0].file.parent)

    def where(self, index: int) -> str:
        return str(self.sections[index])

    def __len__(self) -> int:
        return len(self.sections)

    def read(self, index: int) -> np.ndarray:
        """Section ``index`` as a 2D array of the stack's dtype."""
        from PIL import Image

        section = self.sections[index]
        try:
            with Image.open(section.file) as image:
                image.seek(section.page)
                data = np.asarray(image)
                mode = image.mode
        except (OSError, ValueError) as e:  # truncated or corrupt pixel data
            raise ImageStackError(f"{self.what}: cannot read the pixels of {section}: {e}; "
                                  "re-export or replace that image") from e
        if mode == "I":  # 32-bit integers holding 16-bit pixels
            if data.size and (data.min() < 0 or data.max() > 65535):
                raise ImageStackError(
                    f"{self.what}: {section} holds 32-bit values outside 0..65535 (min "
                    f"{data.min()}, max {data.max()}); save the sections as 8- or 16-bit "
                    "greyscale images")
        return data.astype(self.dtype, copy=False)

    def read_range(self, start: int, stop: int) -> np.ndarray:
        """Sections ``start .. stop - 1`` as one (z, y, x) array."""
        out = np.empty((stop - start, *self.shape), self.dtype)
        for i in range(start, stop):
            out[i - start] = self.read(i)
        return out


def _mode_problem(mode: str, what: str) -> str | None:
    """Why sections of Pillow ``mode`` cannot be ``what`` ("--em" or "--labels"); None if they can."""
    grey = "e.g. with Pillow: Image.open(f).convert('L').save(f)"
    if mode in _MODES and (what != "--em" or mode not in ("P", "1")):
        return None
    if what == "--em" and mode in ("P", "1"):
        kind = "palette" if mode == "P" else "bilevel"
        return f"{kind} image (mode {mode}); EM must be greyscale: convert the sections, {grey}"
    if mode in ("RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "LAB", "HSV", "LA", "PA"):
        if what == "--em":
            return f"colour image (mode {mode}); EM must be greyscale: convert the sections, {grey}"
        return (f"colour image (mode {mode}); label images must hold one value per pixel "
                "(8- or 16-bit greyscale or a palette image): save each label as a single "
                "channel of label values")
    return f"unsupported image mode {mode}; use 8-bit (L) or 16-bit (I;16) greyscale images"


def open_stack(source: str | Path, what: str) -> ImageStack:
    """Scan the sections of ``source`` (see :func:`list_images`; a multi-page TIFF gives one
    section per page) and check from their headers that they share one size and pixel type."""
    from PIL import Image, UnidentifiedImageError

    sections: list[Section] = []
    first: tuple[Section, tuple[int, int], str] | None = None
    for file in list_images(source, what):
        try:
            with Image.open(file) as image:
                pages = getattr(image, "n_frames", 1)
                for page in range(pages):
                    image.seek(page)
                    section = Section(file, page)
                    mode, shape = image.mode, (image.height, image.width)
                    problem = _mode_problem(mode, what)
                    if problem:
                        raise ImageStackError(f"{what}: {section}: {problem}")
                    if first is None:
                        first = (section, shape, mode)
                    elif shape != first[1]:
                        raise ImageStackError(
                            f"{what}: {section} is {shape[1]} x {shape[0]} pixels (x, y) but "
                            f"{first[0]} is {first[1][1]} x {first[1][0]}; every section of a stack "
                            "must have the same size: crop or pad them to one size")
                    elif _MODES[mode] != _MODES[first[2]]:
                        raise ImageStackError(
                            f"{what}: {section} is {np.dtype(_MODES[mode]).name} (mode {mode}) but "
                            f"{first[0]} is {np.dtype(_MODES[first[2]]).name} (mode {first[2]}); "
                            "every section of a stack must have one pixel type: save them all "
                            "as 8-bit or all as 16-bit")
                    sections.append(section)
        except (UnidentifiedImageError, OSError) as e:
            raise ImageStackError(f"{what}: cannot read {file} as an image: {e}") from e
    assert first is not None
    return ImageStack(what, sections, first[1], np.dtype(_MODES[first[2]]))


def open_volume(source: str | Path, what: str) -> ImageStack | HDF5Volume:
    """Sections to import: a dataset of an HDF5 file (``FILE.h5:DATASET``, see
    ``volume_files``) or an image stack (:func:`open_stack`); both read alike."""
    if split_hdf5(source) is not None:
        return open_hdf5(source, what)
    return open_stack(source, what)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def stack_chunks(scale, shape, voxels: int = CHUNK_VOXELS) -> tuple[int, int, int]:
    """Chunk sides that make a cube in nm (power-of-two sides inversely proportional to the
    voxel size), about ``voxels`` voxels in all, at most ``shape``."""
    inv = [min(scale) / float(s) for s in scale]
    side = (voxels / math.prod(inv)) ** (1 / 3)
    return tuple(max(1, min(int(n), 2 ** round(math.log2(max(side * i, 1.0)))))
                 for i, n in zip(inv, shape))


def _write_em(store, stack: ImageStack | HDF5Volume, scale, log) -> dict:
    shape = (len(stack), *stack.shape)
    steps = pyramid_steps(scale, shape)
    chunks = stack_chunks(scale, shape)
    path = EM_GROUP if stack.dtype == np.uint8 else EM_GROUP_UINT16
    group = create_multiscale_group(store, path, scale, (0.0, 0.0, 0.0), 1)
    s0 = group.create_array("s0", shape=shape, chunks=chunks, dtype=stack.dtype, fill_value=0)
    lo, hi = np.inf, -np.inf
    for z in range(0, shape[0], chunks[0]):
        slab = stack.read_range(z, min(z + chunks[0], shape[0]))
        s0[z: z + len(slab)] = slab
        lo, hi = min(lo, int(slab.min())), max(hi, int(slab.max()))
    write_pyramid(group, len(steps) + 1, "mean", chunks=chunks, steps=steps)
    if stack.dtype != np.uint8 and lo < hi:
        # The loader maps this window onto 0..255 (OME-NGFF omero, as CellMap stores uint16 EM).
        group.attrs["omero"] = {"channels": [{"window": {"start": lo, "end": hi,
                                                           "min": lo, "max": hi}}]}
    log(f"EM: {shape[0]} sections of {shape[1]} x {shape[2]} {stack.dtype.name} -> {path}, "
        f"{len(steps) + 1} levels, chunks {chunks}")
    return {"group": path, "shape": list(shape), "levels": len(steps) + 1, "dtype": stack.dtype.name}


def _instance_ids(mask: np.ndarray, mode: str) -> tuple[np.ndarray, int]:
    """Object ids of a boolean (z, y, x) mask: connected components in 3D or per section."""
    from scipy import ndimage

    if mode == "3d":
        ids, n = ndimage.label(mask)
        return ids, int(n)
    ids = np.zeros(mask.shape, np.int64)
    n = 0
    for z in range(mask.shape[0]):
        plane, k = ndimage.label(mask[z])
        ids[z] = np.where(plane > 0, plane + n, 0)
        n += int(k)
    return ids, n


def _class_array(labels: np.ndarray, lut: np.ndarray, unknown: np.ndarray, instances: str,
                 name: str) -> tuple[np.ndarray, LabelEncoding, int | None]:
    """One class group's values for a crop's labels: 0/1 (and 255 unknown), or object ids
    with the unknown value at the top of the dtype."""
    present = lut[labels]
    if is_instance_class(name) and instances != "none":
        ids, n = _instance_ids(present, instances)
        dtype = np.uint16 if n < np.iinfo(np.uint16).max else np.uint32
        enc = LabelEncoding(ABSENT, PRESENT, int(np.iinfo(dtype).max))
        out = ids.astype(dtype)
        out[unknown] = enc.unknown
        return out, enc, n
    out = present.astype(np.uint8)
    out[unknown] = UNKNOWN
    return out, LabelEncoding(), None


def _value_map_classes(data: np.ndarray, vm: ValueMap, instances: str):
    """``(class, values, encoding, object count or None)`` of each class of a value map,
    for one crop's labels."""
    size = int(np.iinfo(data.dtype).max) + 1
    unknown = vm.unknown.table(size)[data] if vm.unknown else np.zeros(data.shape, bool)
    for cls, values in vm.classes.items():
        yield (cls, *_class_array(data, values.table(size), unknown, instances, cls))


def _unclaimed_values(labels, crops, claimed: np.ndarray) -> dict[int, list[int]]:
    """Label values no class, background or unknown claims -> the sections holding them."""
    found: dict[int, list[int]] = {}
    size = claimed.size
    for _, a, b in crops:
        for z0, slab in slabs(labels, a, b + 1):
            for z, section in enumerate(slab, z0):
                counts = np.bincount(section.ravel(), minlength=size)
                for v in np.flatnonzero((counts > 0) & ~claimed):
                    found.setdefault(int(v), []).append(z)
    return found


def _sections_text(sections: list[int]) -> str:
    runs, start = [], sections[0]
    for prev, cur in zip(sections, sections[1:] + [None]):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(runs)


def _write_crop(store, labels, name: str, a: int, b: int, scale, classes, log) -> dict:
    """Label crop ``name`` (sections ``a`` to ``b``): one group per class that ``classes``
    (labels -> class arrays: :func:`_value_map_classes` or ``id_labels.id_classes``) makes."""
    data = labels.read_range(a, b + 1)
    translation = (a * float(scale[0]), 0.0, 0.0)
    chunks = stack_chunks(scale, data.shape)
    crop = store.require_group(f"{GT_GROUP}/{name}")
    summary = {"sections": [a, b], "shape": list(data.shape), "classes": {}}
    for cls, arr, enc, n in classes(data):
        write_multiscale_array_group(crop, cls, [arr], scale, translation, chunks=chunks,
                                     extra_attrs=annotation_attrs(cls, arr, enc, n is not None))
        target = (arr != enc.absent) & (arr != enc.unknown)
        valid = np.count_nonzero(arr != enc.unknown)
        info = {"fraction": float(np.count_nonzero(target) / max(valid, 1))}
        if n is not None:
            info["instances"] = n
        summary["classes"][cls] = info
    fractions = ", ".join(f"{c} {i['fraction']:.3f}" + (f" ({i['instances']} objects)"
                                                        if "instances" in i else "")
                          for c, i in summary["classes"].items())
    log(f"{name}: sections {a}-{b} ({data.shape[0]} x {data.shape[1]} x {data.shape[2]}): {fractions}")
    return summary


def _check_crop_names_free(out: Path, name: str, crops: list[str]) -> None:
    """Crop names must be unique across the datasets of one folder: scoring and
    ``data.val_crops`` name crops alone."""
    for store in sorted(out.glob("*/*.zarr")):
        other = store.parent.name
        if other == name or store.name != f"{other}.zarr":
            continue
        for crop in crops:
            if (store / GT_GROUP / crop).is_dir():
                taken = sorted((p.name for p in (store / GT_GROUP).iterdir() if p.is_dir()),
                               key=lambda c: int(c[4:]) if c[4:].isdigit() else -1)
                raise ImageStackError(
                    f"--crop {crop}: dataset {other} in {out} has a {crop} already (its crops: "
                    f"{', '.join(taken)}); crop names must be unique across the datasets of a "
                    "folder (scoring and --data.val_crops name crops alone): number this stack's "
                    "crops after them with --crop")


DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def default_name(em: str | Path) -> str:
    """The dataset name a stack gets by default: its folder's name (a file's: its stem)."""
    hdf5 = split_hdf5(em)
    if hdf5 is not None:
        return hdf5[0].stem
    path = Path(str(em))
    if glob.has_magic(str(em)):
        path = Path(str(em)).parent
        while glob.has_magic(str(path)):
            path = path.parent
        return path.resolve().name
    return path.resolve().name if path.is_dir() else path.stem


def _check_same_shape(labels, em) -> None:
    """Labels cover the EM voxel for voxel: as many sections, each of the same size."""
    if isinstance(labels, ImageStack) and isinstance(em, ImageStack):
        if len(labels) != len(em):
            raise ImageStackError(
                f"--labels has {len(labels)} images but --em has {len(em)} sections (first "
                f"label {labels.where(0)}, first EM {em.where(0)}); give one label image per EM "
                "section, in the same order")
        if labels.shape != em.shape:
            raise ImageStackError(
                f"--labels: {labels.where(0)} is {labels.shape[1]} x {labels.shape[0]} pixels "
                f"(x, y) but the EM sections ({em.where(0)}) are {em.shape[1]} x {em.shape[0]}; "
                "labels must cover the EM pixel for pixel")
    elif (len(labels), *labels.shape) != (len(em), *em.shape):
        raise ImageStackError(
            f"--labels {labels.name} is {len(labels)} x {labels.shape[0]} x {labels.shape[1]} "
            f"(z, y, x) but --em {em.name} is {len(em)} x {em.shape[0]} x {em.shape[1]}; labels "
            "must cover the EM voxel for voxel: give the labels of this EM volume, or cut both "
            "to the region they share")


def _check_value_labels(labels, crop_list, value_map: ValueMap) -> None:
    """Every label value of the crops belongs to a class, to background or to unknown."""
    if labels.dtype not in (np.uint8, np.uint16):
        raise ImageStackError(
            f"--labels {labels.name} is {labels.dtype.name}: a value map (--class, --value_map) "
            "needs 8- or 16-bit unsigned labels; for a volume of object ids (neurons, bodies) "
            "give --ids CLASS (e.g. --ids cell) instead")
    check_value_map(value_map, labels.dtype)
    size = int(np.iinfo(labels.dtype).max) + 1
    claimed = value_map.background.table(size) | value_map.unknown.table(size)
    for values in value_map.classes.values():
        claimed |= values.table(size)
    unclaimed = _unclaimed_values(labels, crop_list, claimed)
    if unclaimed:
        listing = "; ".join(f"value {v} in sections {_sections_text(s)}"
                            for v, s in sorted(unclaimed.items()))
        v = min(unclaimed)
        raise ImageStackError(
            f"--labels: label values that no class claims: {listing}. Add each to a class "
            f"(--class NAME={v}), to --background {v} (absent for every class) or to "
            f"--unknown {v} (not annotated)")


def _open_labels(labels, em, crops: list[str] | None, value_map: ValueMap, ids: IdLabels | None,
                 out: Path, name: str) -> tuple[ImageStack | HDF5Volume, list[tuple[str, int, int]]]:
    """The label volume and its crops, checked against the EM, the value map or id spec, and
    the crops already in ``out``."""
    volume = open_volume(labels, "--labels")
    _check_same_shape(volume, em)
    crop_list = [parse_crop(c) for c in crops] if crops else [("crop1", 0, len(em) - 1)]
    check_crops(crop_list, len(em))
    _check_crop_names_free(out, name, [c[0] for c in crop_list])
    if ids is not None:
        check_id_volume(volume, crop_list, ids)
    else:
        _check_value_labels(volume, crop_list, value_map)
    return volume, crop_list


def _check_voxel_size(given) -> tuple[float, float, float] | None:
    if given is None:
        return None
    voxel_size = tuple(float(v) for v in given)
    if len(voxel_size) != 3 or min(voxel_size) <= 0:
        raise ImageStackError(f"--voxel_size {list(voxel_size)}: expected 3 sizes in nm (z, y, x), "
                              "each > 0, e.g. 50,4.6,4.6")
    return voxel_size


def _check_label_options(labels, crops, value_map: ValueMap, ids: IdLabels | None) -> None:
    """Labels are either values of a value map or object ids, and either needs --labels."""
    if ids is not None:
        check_id_options(ids)
        if value_map.classes or value_map.background:
            raise ImageStackError(
                f"--ids {ids.cls} reads the labels as object ids, but --class, --value_map or "
                "--background say which label values make up each class: give --ids (and "
                "--boundary, --unknown) for a volume of object ids, or a value map for labels "
                "whose values are classes, not both")
        if labels is None:
            raise ImageStackError(f"--ids {ids.cls} needs the volume of object ids: give it with "
                                  "--labels (e.g. --labels FILE.h5:volumes/labels/neuron_ids)")
    elif labels is None and (value_map.classes or value_map.background or value_map.unknown or crops):
        raise ImageStackError("a value map (--class, --value_map, --background, --unknown) and "
                              "--crop need label images: give them with --labels")


def _write_store(out: Path, name: str, em, labels, crop_list, voxel_size, classes, log) -> dict:
    """Write the store beside its place (``.<name>.partial``) and rename it into
    ``out/<name>`` at the end, replacing what was there only then."""
    import zarr

    final = out / name
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    store_path = partial / f"{name}.zarr"
    try:
        store = zarr.open_group(str(store_path), mode="w", zarr_format=2)
        summary = {"store": str(final / f"{name}.zarr"), "voxel_size": list(voxel_size),
                   "em": _write_em(store, em, voxel_size, log), "crops": {}}
        for crop_name, a, b in crop_list:
            summary["crops"][crop_name] = _write_crop(store, labels, crop_name, a, b,
                                                      voxel_size, classes, log)
        if final.exists():
            old = out / f".{name}.replaced"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            partial.rename(final)
            shutil.rmtree(old)
        else:
            partial.rename(final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    log(f"wrote {summary['store']}")
    return summary


def import_stack(em: str | Path, out: str | Path, voxel_size=None, labels: str | Path | None = None,
                 name: str | None = None, crops: list[str] | None = None,
                 value_map: ValueMap | None = None, instances: str = "3d",
                 ids: IdLabels | None = None, overwrite: bool = False,
                 log: Callable[[str], None] | None = None) -> dict:
    """Write the stack or HDF5 volume ``em`` (and its ``labels``) as ``out/<name>/<name>.zarr``
    (see the module docstring) and return a summary: the store, the voxel size, its EM levels
    and, per crop, the fraction of annotated voxels each class covers (and its object count).

    ``voxel_size``: z, y, x nm; None takes the HDF5 ``resolution`` attribute;
    ``crops``: ``"crop1=0-15"`` strings (default: ``crop1`` over every section);
    ``value_map``: the classes' label values, the background and unknown values;
    ``instances``: ``"3d"`` (connected components across sections), ``"2d"`` (per section) or
    ``"none"`` (instance classes stored as 0/1 masks);
    ``ids``: the labels are object ids instead (``id_labels``), with no value map.
    """
    log = log or (lambda _msg: None)
    name = name or default_name(em)
    if not DATASET_NAME.fullmatch(name):
        raise ImageStackError(f"--name {name!r}: use letters, digits, '_', '-' and '.' (not first)")
    given = _check_voxel_size(voxel_size)
    if instances not in INSTANCE_MODES:
        raise ImageStackError(f"--instances {instances!r}: expected one of {INSTANCE_MODES}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ImageStackError(f"--out {out} is a file; give the folder to write the dataset into")
    if (out / name).exists() and not overwrite:
        raise ImageStackError(f"{out / name} exists already; choose another --name or --out, or "
                              "pass --overwrite to replace it")
    value_map = value_map or ValueMap()
    _check_label_options(labels, crops, value_map, ids)

    em_volume = open_volume(em, "--em")
    label_volume, crop_list = None, []
    if labels is not None:
        label_volume, crop_list = _open_labels(labels, em_volume, crops, value_map, ids, out, name)
    voxel_size = resolve_voxel_size(given, em_volume, label_volume, log)
    if ids is not None:
        def classes(data):
            return id_classes(data, ids)
    else:
        def classes(data):
            return _value_map_classes(data, value_map, instances)
    return _write_store(out, name, em_volume, label_volume, crop_list, voxel_size, classes, log)
