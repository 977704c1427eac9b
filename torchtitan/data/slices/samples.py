"""2D training samples from a Hugging Face dataset of EM slices (``data.dataset_name``).

Opening the dataset, its schemas and the table of its rows are ``slice_index.py``; the
original torchtitan-segmentation's schema (CellMap class ids, no geometry) is adapted by
``slices_original.py``. MAE reads only ``image``, so it also takes the original's EM-only sets
(e.g. ``eminorhan/openorganelle-2d``) or any dataset with an ``image`` column
(:class:`SliceMAESamples`).

Training draws samples like :class:`~torchtitan.data.sampling.samples.SegmentationSamples`: item
``g`` is decided by ``sample_rng(seed, g)`` alone (which slice, where in it, the augmentation
plan of ``augment.py``), so the global batch sampler, exact resume and parallelism-independent
losses carry over. Slices are drawn uniformly (``data.class_balanced`` is not supported), from
the planes ``data.planes`` allows.

Validation needs no zarr either: the slices of a held-out crop along one axis are the planes
of its whole grid, so stacking them (:class:`SliceReader`) gives back the volume that
validation on the zarr stores reads (``crop_grid`` + ``crops.reader.CropReader.read``), and
the held-out crops are predicted and scored the same way (``volume_source.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from torchtitan.choices import same_voxel_size
from torchtitan.config.job_config import Augmentation
from torchtitan.data.slices import original as slices_original
from torchtitan.data.sampling.augment import Augmenter, apply_flips, read_shape, resample_matrix
from torchtitan.data.sampling.batch import Sample
from torchtitan.cellmap.errors import DatasetError
from torchtitan.cellmap.grids import AXES
from torchtitan.data.crops.selection import DataSettings, split_crops
from torchtitan.data.sampling.mae_samples import best_draw, foreground_fraction
from torchtitan.data.sampling.resampling import resample
from torchtitan.data.crops.reader import CropArrays, em_to_model_input
from torchtitan.data.sampling.samples import sample_rng
from torchtitan.data.slices.index import (
    OURS,
    MaskColumns,
    SliceCrop,
    SliceIndex,
    dataset_classes,
    gray_image,
    open_slices,
)

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Windows of a slice
# ---------------------------------------------------------------------------------------------


def _window(arr: np.ndarray, start, size, fill) -> np.ndarray:
    """The (..., *size) window of a (..., h, w) array whose first voxel is at ``start`` (may
    lie outside the array: what falls outside is ``fill``)."""
    out = np.full((*arr.shape[:-2], *size), fill, dtype=arr.dtype)
    src, dst = [], []
    for n, s, o in zip(arr.shape[-2:], size, start):
        a, b = max(o, 0), min(o + s, n)
        if a >= b:
            return out
        src.append(slice(a, b))
        dst.append(slice(a - o, b - o))
    out[(..., *dst)] = arr[(..., *src)]
    return out


def _place(rng: np.random.Generator, hw, crop_size) -> np.ndarray:
    """First voxel of a window placed uniformly inside a slice of ``hw``; centred along an
    axis where the slice is smaller (the rest is padding)."""
    return np.asarray([int(rng.integers(n - s + 1)) if n >= s else -((s - n) // 2)
                       for n, s in zip(hw, crop_size)])


def _cut(arrays: dict[str, np.ndarray], start, crop_size, plan, vox,
         fills: dict[str, float]) -> dict[str, np.ndarray]:
    """The window at ``start`` of every (C, h, w) array with ``plan`` applied (rotation and
    zoom resample a larger window around the same centre: EM linearly, the rest by nearest
    neighbour; then flips). What falls outside the slice reads ``fills[key]``."""
    matrix = resample_matrix(plan, vox)
    if matrix is None:
        out = {k: _window(a, start, crop_size, fills[k]) for k, a in arrays.items()}
    else:
        size = np.asarray(crop_size)
        big = np.asarray(read_shape(crop_size, matrix))
        centre = start + size / 2
        big_start = np.floor(centre - big / 2).astype(int)
        shift = centre - (big_start + big / 2)
        out = {}
        for k, a in arrays.items():
            window = _window(a.astype(np.float32), big_start, tuple(big), float(fills[k]))
            out[k] = resample(window, matrix, crop_size, shift, 1 if k == "image" else 0,
                              float(fills[k]))
    return {k: apply_flips(a, plan) for k, a in out.items()}


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _sample(arrays: dict[str, np.ndarray], index: int, augmenter: Augmenter, plan, vox,
            rng: np.random.Generator) -> Sample:
    """The :class:`Sample` of a cut window (float32 arrays); with intensity augmentation also
    what was drawn for it (made on the device by ``augment.Augmenter.device``)."""
    target = arrays.get("target")
    return Sample(image=_tensor(arrays["image"]), valid=_tensor(arrays["valid"]),
                  target=None if target is None else _tensor(target), index=int(index),
                  augmentation=augmenter.payload(plan, vox, rng))


class SliceReader:
    """EM, targets and validity of slices: rows decoded into arrays, and whole crops stacked
    from their slices for validation (built once by the task; no training dataset needed)."""

    def __init__(self, index: SliceIndex, classes: list[str]):
        self.index = index
        self.classes = list(classes)
        labels = MaskColumns if index.schema == OURS else slices_original.CellMapIdLabels
        self.labels = labels(self.classes)
        # Decode only what a sample needs (a row of our schema holds every class it has).
        self.columns = index.ds.select_columns(["image", *self.labels.columns])

    def arrays(self, rows) -> dict[str, np.ndarray]:
        """EM (N, 1, h, w) float32 (normalized) and targets / validity (N, K, h, w) bool."""
        rows = [int(r) for r in rows]
        batch = self.columns[rows]
        images, targets, valids = [], [], []
        for i, row in enumerate(rows):
            image = gray_image(batch["image"][i])
            target, valid = self.labels(batch, i)
            if target.shape[1:] != image.shape:
                raise DatasetError(
                    f"data.dataset_name: row {row} ({self.index.row_crop[row]}, "
                    f"{self.index.row_axis[row]} {self.index.row_index[row]}) has a label of "
                    f"{list(target.shape[1:])} pixels for an image of {list(image.shape)}"
                )
            images.append(image)
            targets.append(target)
            valids.append(valid)
        return {"image": em_to_model_input(np.stack(images)[:, None]), "target": np.stack(targets),
                "valid": np.stack(valids)}

    def read(self, crop: SliceCrop, shape) -> CropArrays:
        """A whole crop on its grid, stacked from its slices: ``image`` (1, D, H, W) and
        ``target`` / ``valid`` (K, D, H, W) float32, as ``CropReader.read`` gives for
        ``crop_grid(crop)``; ``shape`` must be the crop's."""
        if tuple(int(s) for s in shape) != crop.shape:
            raise DatasetError(
                f"{crop.full_name}: a slices dataset holds it on a {list(crop.shape)} grid, "
                f"not {list(shape)}; data.voxel_size must be the dataset's {list(crop.voxel_size)}"
            )
        ax, rows = self.index.volume_rows(crop)
        arrays = self.arrays(rows)  # (N, C, a, b): planes first
        image, target, valid = (np.moveaxis(arrays[k], 0, 1 + ax).astype(np.float32)
                                for k in ("image", "target", "valid"))
        return CropArrays(image, target, valid)


# ---------------------------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------------------------


class SliceSamples(Dataset):
    """Random 2D crops of the slices of the training crops, with binary targets and
    per-class validity masks: the item contract of ``SegmentationSamples``.

    Item ``g`` is a :class:`~torchtitan.data.sampling.batch.Sample`: ``image`` (1, H, W),
    ``target`` and ``valid`` (K, H, W) float32, ``index`` (the global sample index) and
    ``resampled`` (always 0: nothing here fails to read). A window is placed uniformly inside
    the slice; along an axis where the slice is smaller it is centred, and the padding is invalid for every class (EM reads 0 there, as
    outside an EM volume).
    """

    FILLS = {"image": -1.0, "target": False, "valid": False}  # -1: EM 0, normalized

    def __init__(self, index: SliceIndex, crops: list[SliceCrop], classes: list[str], crop_size,
                 seed: int, augment: bool = True, *, augmentation: Augmentation | None = None,
                 axes=("z",)):
        if len(crop_size) != 2:
            raise DatasetError(
                f"a slices dataset (data.dataset_name) trains 2D models; model.crop_size "
                f"{list(crop_size)} is not 2D"
            )
        self.index = index
        self.classes = list(classes)
        self.crop_size = tuple(int(c) for c in crop_size)
        self.seed = seed
        # Rotation and zoom are always resampled here (_cut): only the intensity changes are
        # left to the device.
        self.augmenter = Augmenter(augmentation, augment)
        self.train_rows = index.rows(crops, axes)
        if len(self.train_rows) == 0:
            raise DatasetError(
                f"no training slices normal to data.planes axes {list(axes)} in the training crops "
                f"({', '.join(c.full_name for c in crops) or 'none'}); make the dataset with "
                "--axes covering them, or change data.planes"
            )
        self.reader = SliceReader(index, self.classes)

    def __len__(self) -> int:
        return 2**62  # indexed by global sample index; the sampler decides what is drawn

    def _plane_voxel_size(self, row: int) -> np.ndarray:
        """nm per voxel along the two image axes of a row's slice."""
        crop = self.index.crops[self.index.row_crop[row]]
        normal = AXES.index(self.index.row_axis[row])
        return np.asarray([v for a, v in enumerate(crop.voxel_size) if a != normal], dtype=float)

    def __getitem__(self, index: int) -> Sample:
        rng = sample_rng(self.seed, index)
        row = int(self.train_rows[int(rng.integers(len(self.train_rows)))])
        arrays = {k: v[0] for k, v in self.reader.arrays([row]).items()}  # (C, h, w)
        start = _place(rng, arrays["image"].shape[-2:], self.crop_size)
        vox = self._plane_voxel_size(row)
        plan = self.augmenter.draw(rng, self.crop_size, vox)
        arrays = _cut(arrays, start, self.crop_size, plan, vox, self.FILLS)
        return _sample(arrays, index, self.augmenter, plan, vox, rng)


class SliceMAESamples(Dataset):
    """Random 2D EM crops of the slices of a dataset, for MAE: the item contract of
    :class:`~torchtitan.data.sampling.mae_samples.MAESamples` (a ``Sample``: ``image`` and ``valid``
    (1, H, W), 0 in the padding where a slice is smaller than the crop; ``noise`` for the
    masking; ``index``, ``resampled``), decided by ``sample_rng(seed, g)`` alone. Every row is an
    independent image at ``voxel_size``; with ``foreground_threshold`` > 0 the row and place
    are redrawn (``mae_samples.best_draw``) as ``MAESamples`` does."""

    FILLS = {"image": -1.0, "valid": 0.0}

    def __init__(self, ds, rows: np.ndarray, row_axis: np.ndarray | None, crop_size, voxel_size,
                 seed: int, augment: bool = True, num_patches: int = 0, *,
                 augmentation: Augmentation | None = None, foreground_threshold: float = 0.0):
        if len(crop_size) != 2:
            raise DatasetError(
                f"a slices dataset (data.dataset_name) trains 2D models; model.crop_size "
                f"{list(crop_size)} is not 2D"
            )
        self.images = ds.select_columns(["image"])
        self.rows = np.asarray(rows, dtype=np.int64)
        self.row_axis = row_axis
        self.crop_size = tuple(int(c) for c in crop_size)
        self.voxel_size = np.asarray(voxel_size, dtype=float)
        self.seed = seed
        self.augmenter = Augmenter(augmentation, augment)  # resampling here too, as above
        self.num_patches = num_patches
        self.foreground_threshold = float(foreground_threshold)

    def __len__(self) -> int:
        return 2**62

    def _plane_voxel_size(self, row: int) -> np.ndarray:
        normal = 0 if self.row_axis is None else AXES.index(self.row_axis[row])
        return np.delete(self.voxel_size, normal)

    def _draw_once(self, rng: np.random.Generator):
        row = int(self.rows[int(rng.integers(len(self.rows)))])
        image = em_to_model_input(gray_image(self.images[row]["image"])[None])
        start = _place(rng, image.shape[-2:], self.crop_size)
        vox = self._plane_voxel_size(row)
        plan = self.augmenter.draw(rng, self.crop_size, vox)
        arrays = {"image": image, "valid": np.ones_like(image)}
        return _cut(arrays, start, self.crop_size, plan, vox, self.FILLS), plan, vox

    def __getitem__(self, index: int) -> Sample:
        rng = sample_rng(self.seed, index)
        arrays, plan, vox = best_draw(lambda: self._draw_once(rng),
                                      lambda d: foreground_fraction(d[0]["image"]),
                                      self.foreground_threshold)
        sample = _sample(arrays, index, self.augmenter, plan, vox, rng)
        if self.num_patches:
            sample.noise = torch.from_numpy(rng.random(self.num_patches, dtype=np.float32))
        return sample


# ---------------------------------------------------------------------------------------------
# From the config
# ---------------------------------------------------------------------------------------------


def _check_min_fraction(index: SliceIndex, crops: list[SliceCrop], axes, crop_size,
                        min_fraction: float) -> None:
    """Like the zarr path: some training slice must hold ``min_fraction`` of a model crop."""
    best, where = 0.0, "-"
    for c in crops:
        for axis in axes:
            ax = AXES.index(axis)
            plane = [s for i, s in enumerate(c.shape) if i != ax]
            frac = float(np.prod([min(p, s) / s for p, s in zip(plane, crop_size)]))
            if frac > best:
                best, where = frac, f"{c.full_name} ({axis} slices of {plane[0]}x{plane[1]})"
    if best + 1e-6 < min_fraction:
        raise DatasetError(
            f"model.crop_size {list(crop_size)} is larger than every training slice (the largest "
            f"fraction that fits is {best:.2f}, in {where}, below data.min_label_fraction="
            f"{min_fraction}); use a smaller model.crop_size or a lower data.min_label_fraction"
        )


def _check_voxel_sizes(name: str, sizes, voxel_size) -> None:
    """The voxel sizes a dataset of this project's schema was cut at must be data.voxel_size."""
    sizes = sorted({tuple(s) for s in sizes})
    if any(not same_voxel_size(s, voxel_size) for s in sizes):
        raise DatasetError(
            f"the slices dataset {name!r} was cut at voxel size "
            f"{' / '.join(str(list(s)) for s in sizes)} nm, but data.voxel_size is "
            f"{list(voxel_size)}; set data.voxel_size to match or remake it with --voxel_size"
        )


def _check_2d(settings: DataSettings, what: str) -> None:
    if settings.ndim != 2:
        raise DatasetError(
            f"data.dataset_name {settings.data.dataset_name!r} is a dataset of 2D slices, but "
            f"model.ndim = {settings.ndim}; train 3D {what} from the zarr stores "
            "(data.dataset_path, with data.dataset_name empty)"
        )


def _check_ours(index: SliceIndex, settings: DataSettings, train: list[SliceCrop],
                val: list[SliceCrop]) -> None:
    """What this project's schema records, checked against the config."""
    d = settings.data
    for cls in d.classes:
        if not any(cls in c.classes for c in train):
            raise DatasetError(
                f"data.classes: class {cls!r} is annotated by no training crop of "
                f"{d.dataset_name!r} (check data.val_crops / data.val_fraction)"
            )
    _check_min_fraction(index, train, tuple(d.planes), settings.crop_size, d.min_label_fraction)
    for c in val:
        index.volume_rows(c)  # fail now, not at the first validation


def load_slice_data(settings: DataSettings) -> tuple[SliceIndex, list[SliceCrop], list[SliceCrop]]:
    """Open ``data.dataset_name``, check it against the config and split its crops into
    (train, val) by crop name, as ``load_segmentation_data`` does for zarr stores. Every
    problem is a DatasetError, raised before any process group exists."""
    d = settings.data
    _check_2d(settings, "models")
    if d.class_balanced:
        raise DatasetError(
            "data.class_balanced is not supported with data.dataset_name (slices are drawn "
            "uniformly); set data.class_balanced = false, or train from the zarr stores"
        )
    ds, schema = open_slices(d.dataset_name)
    if schema == OURS:
        have = dataset_classes(ds)
        missing = [c for c in d.classes if c not in have]
        if missing:
            raise DatasetError(
                f"data.classes {missing} are not in the slices dataset {d.dataset_name!r}, which "
                f"holds {', '.join(have) or '(none)'}; pick among those or remake it with --classes"
            )
    else:
        slices_original.check_classes(d.dataset_name, d.classes)
    index = SliceIndex(ds, schema, d.classes, d.voxel_size)
    # In discover()'s order (dataset, then crop folder name), so that the split picks the same
    # validation crops as it does from the zarr stores.
    crops = sorted(index.crops.values(), key=lambda c: (c.dataset, c.name))
    if not crops:
        raise DatasetError(f"data.dataset_name {d.dataset_name!r} holds no slices")
    if schema == OURS:
        _check_voxel_sizes(d.dataset_name, [c.voxel_size for c in crops], d.voxel_size)
    train, val = split_crops(crops, d.classes, d.val_crops, d.val_fraction, settings.seed)
    if schema == OURS:
        _check_ours(index, settings, train, val)
    else:
        val = slices_original.stack_held_out(index, d.dataset_name, val, d.voxel_size)
    axes = tuple(d.planes)  # "z" or "zyx"
    logger.info("slices dataset %s: %d slices of %d crops; %d training slices (%s planes) of %d "
                "crops, %d validation crops (%s)", d.dataset_name, len(index.ds), len(crops),
                len(index.rows(train, axes)), ",".join(axes), len(train), len(val),
                ", ".join(c.full_name for c in val) or "none")
    return index, train, val


def build_slice_samples(settings: DataSettings, index: SliceIndex | None = None,
                        train_crops: list[SliceCrop] | None = None) -> SliceSamples:
    """The training samples of ``data.dataset_name`` (opened and split here unless given)."""
    if index is None or train_crops is None:
        index, train_crops, _ = load_slice_data(settings)
    return SliceSamples(index, train_crops, settings.data.classes, settings.crop_size,
                        settings.seed,
                        augmentation=settings.augmentation,
                        axes=tuple(settings.data.planes))


@dataclass(frozen=True)
class MAESlices:
    """The rows of a slices dataset that MAE draws from."""

    ds: object
    rows: np.ndarray
    row_axis: np.ndarray | None  # "z" / "y" / "x" per row, None without an axis column


def load_mae_slices(settings: DataSettings) -> MAESlices:
    """The EM slices of ``data.dataset_name`` for MAE: the rows normal to ``data.planes``
    (every row when the dataset has no ``axis`` column). DatasetErrors before any process
    group exists."""
    d = settings.data
    _check_2d(settings, "MAE")
    ds, schema = open_slices(d.dataset_name, need="image")
    if schema == OURS:
        _check_voxel_sizes(d.dataset_name, ds.select_columns(["voxel_size"]).to_dict()[
            "voxel_size"], d.voxel_size)
    axes = tuple(d.planes)
    if "axis" in ds.column_names:
        row_axis = np.asarray(ds.select_columns(["axis"]).to_dict()["axis"], dtype=object)
        rows = np.flatnonzero(np.isin(row_axis.astype(str), list(axes)))
        which = f"{len(rows)} of its {len(ds)} slices ({','.join(axes)} planes)"
    else:
        row_axis, rows = None, np.arange(len(ds))
        which = f"all {len(ds)} images (no axis column: data.planes does not apply)"
    if len(rows) == 0:
        raise DatasetError(
            f"data.dataset_name {d.dataset_name!r} has no slices normal to data.planes axes "
            f"{list(axes)}; change data.planes"
        )
    logger.info("MAE data: slices dataset %s (%s schema): %s, each an independent 2D image at "
                "data.voxel_size %s nm", d.dataset_name, schema, which, list(d.voxel_size))
    return MAESlices(ds, rows, row_axis)


def build_slice_mae_samples(settings: DataSettings, data: MAESlices, seed_offset: int = 0,
                            num_patches: int = 0,
                            augment: bool = True) -> SliceMAESamples:
    """MAE samples of a slices dataset; ``augment=False`` for the held-out validation
    stream (``seed_offset``), as ``mae_samples.build_mae_samples``."""
    return SliceMAESamples(data.ds, data.rows, data.row_axis, settings.crop_size,
                           settings.data.voxel_size, settings.seed + seed_offset, augment=augment,
                           num_patches=num_patches,
                           augmentation=settings.augmentation,
                           foreground_threshold=settings.data.foreground_threshold)
