"""2D segmentation samples from a slices dataset (``helpers/create_slice_dataset.py``).

A slices dataset is a Hugging Face ``datasets`` table with one row per plane of each label
crop, cut on the crop's grid: EM, and per class a label and a validity mask, plus where the
plane lies (dataset, crop, axis, index, voxel size, crop grid). ``data.dataset_name`` names
it: a ``save_to_disk`` folder, or a Hub dataset (its ``train`` split).

Training draws samples like :class:`~torchtitan.datasets.samples.SegmentationSamples`: item
``g`` is decided by ``sample_rng(seed, g)`` alone (which slice, where in it, the augmentation
plan of ``augment.py``), so the global batch sampler, exact resume and parallelism-independent
losses carry over. Slices are drawn uniformly (``data.class_balanced`` is not supported), from
the planes ``data.planes`` allows.

Validation needs no zarr either: the slices of a held-out crop along one axis are the planes
of its whole grid, so stacking them gives back the volume that validation on the zarr
stores reads (``crop_grid`` + ``SegmentationSamples.read``), and the held-out crops are
predicted and scored the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from torchtitan.datasets.augment import (
    NO_AUGMENTATION,
    AugmentParams,
    apply_flips,
    intensity_params,
    draw_plan,
    read_shape,
    resample,
    resample_matrix,
)
from torchtitan.datasets.cellmap import AXES, DatasetError
from torchtitan.datasets.loader import split_crops
from torchtitan.datasets.samples import normalize_em, sample_rng

logger = logging.getLogger(__name__)

META_COLUMNS = ("annotated", "dataset", "crop", "axis", "index", "voxel_size", "origin", "shape")


@dataclass(frozen=True)
class SliceCrop:
    """A label crop as a slices dataset describes it: enough for the train/val split
    (``split_crops``), ``crop_grid`` and scoring, like a :class:`LabelCrop`."""

    name: str
    dataset: str
    classes: tuple[str, ...]  # the classes (of those in the dataset) the crop annotates
    origin: tuple[float, float, float]  # nm, corner of voxel 0 of the crop grid
    shape: tuple[int, int, int]
    voxel_size: tuple[float, float, float]

    @property
    def full_name(self) -> str:
        return f"{self.dataset}/{self.name}"

    @property
    def box_min(self) -> np.ndarray:
        return np.asarray(self.origin, dtype=float)

    @property
    def box_max(self) -> np.ndarray:
        return self.box_min + np.asarray(self.shape) * np.asarray(self.voxel_size, dtype=float)


# ---------------------------------------------------------------------------------------------
# Opening and indexing
# ---------------------------------------------------------------------------------------------


def open_slices(name: str):
    """The ``datasets.Dataset`` named by ``data.dataset_name``: a ``save_to_disk`` folder, or
    else a Hugging Face Hub dataset (its ``train`` split)."""
    import datasets

    path = Path(name).expanduser()
    if path.exists():
        try:
            ds = datasets.load_from_disk(str(path))
        except FileNotFoundError as e:
            raise DatasetError(
                f"data.dataset_name {name!r} is a folder but not a saved dataset ({e}); make one "
                "with `python helpers/create_slice_dataset.py --zarr DATA --out FOLDER`"
            ) from e
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DatasetError(f"data.dataset_name {name!r} has splits {list(ds)}, no 'train'")
            ds = ds["train"]
    elif name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise DatasetError(
            f"data.dataset_name {name!r}: no such folder; make one with `python "
            "helpers/create_slice_dataset.py --zarr DATA --out FOLDER`, or give a Hub name "
            "(user/dataset)"
        )
    else:
        try:
            ds = datasets.load_dataset(name, split="train")
        except Exception as e:  # noqa: BLE001 - any Hub failure becomes one clear message
            raise DatasetError(
                f"data.dataset_name {name!r}: no such folder here, and loading it from the "
                f"Hugging Face Hub failed: {type(e).__name__}: {e}"
            ) from e
    missing = [c for c in ("image", *META_COLUMNS) if c not in ds.column_names]
    if missing:
        raise DatasetError(
            f"data.dataset_name {name!r} lacks the columns {missing} of a slices dataset; make "
            "it with helpers/create_slice_dataset.py"
        )
    return ds


def dataset_classes(ds) -> list[str]:
    """The classes a slices dataset holds (its ``label_<class>`` columns)."""
    return [c[len("label_"):] for c in ds.column_names if c.startswith("label_")]


class SliceIndex:
    """A slices dataset plus a table of its rows: which crop, axis and plane each one is."""

    def __init__(self, ds):
        self.ds = ds
        meta = ds.select_columns(list(META_COLUMNS)).to_dict()
        self.crops: dict[str, SliceCrop] = {}
        names = []
        for i in range(len(ds)):
            full = f"{meta['dataset'][i]}/{meta['crop'][i]}"
            names.append(full)
            if full not in self.crops:
                self.crops[full] = SliceCrop(
                    meta["crop"][i], meta["dataset"][i], tuple(meta["annotated"][i]),
                    tuple(meta["origin"][i]), tuple(meta["shape"][i]), tuple(meta["voxel_size"][i]))
        self.row_crop = np.asarray(names, dtype=object)
        self.row_axis = np.asarray(meta["axis"], dtype=object)
        self.row_index = np.asarray(meta["index"], dtype=np.int64)

    def rows(self, crops: list[SliceCrop], axes) -> np.ndarray:
        """Row numbers of the slices of ``crops`` normal to any of ``axes``."""
        names = {c.full_name for c in crops}
        keep = np.array([n in names for n in self.row_crop], dtype=bool)
        keep &= np.isin(self.row_axis.astype(str), list(axes))
        return np.flatnonzero(keep)

    def volume_rows(self, crop: SliceCrop) -> tuple[int, np.ndarray]:
        """(axis, rows in plane order) of one complete stack of ``crop``'s planes, preferring
        z; a DatasetError if no axis has them all."""
        for ax, axis in enumerate(AXES):
            rows = self.rows([crop], axis)
            planes = self.row_index[rows]
            if sorted(planes.tolist()) == list(range(crop.shape[ax])):
                return ax, rows[np.argsort(planes)]
        raise DatasetError(
            f"data.dataset_name: crop {crop.full_name} has no complete set of slices along any "
            f"axis (grid {list(crop.shape)}), so it cannot be validated; remake the dataset"
        )


# ---------------------------------------------------------------------------------------------
# Samples
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


class SliceSamples(Dataset):
    """Random 2D crops of the slices of the training crops, with binary targets and
    per-class validity masks: the item contract of ``SegmentationSamples``.

    Item ``g`` is a dict: ``image`` (1, H, W), ``target`` and ``valid`` (K, H, W) float32,
    ``index`` (the global sample index) and ``resampled`` (always 0: nothing here fails to
    read). A window is placed uniformly inside the slice; along an axis where the slice is
    smaller it is centred, and the padding is invalid for every class (EM reads 0 there, as
    outside an EM volume).
    """

    def __init__(self, index: SliceIndex, crops: list[SliceCrop], classes: list[str], crop_size,
                 seed: int, augment: bool = True, *, augmentation: AugmentParams | None = None,
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
        self.aug = (augmentation or AugmentParams()) if augment else NO_AUGMENTATION
        self.train_rows = index.rows(crops, axes)
        if len(self.train_rows) == 0:
            raise DatasetError(
                f"no training slices normal to data.planes axes {list(axes)} in the training crops "
                f"({', '.join(c.full_name for c in crops) or 'none'}); make the dataset with "
                "--axes covering them, or change data.planes"
            )
        # Decode only what a sample needs (a row holds every class of the dataset).
        columns = ["image"] + [f"{kind}_{c}" for c in self.classes for kind in ("label", "valid")]
        self.columns = index.ds.select_columns(columns)

    def __len__(self) -> int:
        return 2**62  # indexed by global sample index; the sampler decides what is drawn

    def _arrays(self, rows) -> dict[str, np.ndarray]:
        """EM (N, 1, h, w) float32 (normalized) and targets / validity (N, K, h, w) bool."""
        batch = self.columns[[int(r) for r in rows]]
        image = np.stack([np.asarray(im, dtype=np.uint8) for im in batch["image"]])
        target = np.stack([np.stack([np.asarray(m, dtype=bool) for m in batch[f"label_{c}"]])
                           for c in self.classes], axis=1)
        valid = np.stack([np.stack([np.asarray(m, dtype=bool) for m in batch[f"valid_{c}"]])
                          for c in self.classes], axis=1)
        return {"image": normalize_em(image[:, None]), "target": target, "valid": valid}

    def _plane_voxel_size(self, row: int) -> np.ndarray:
        """nm per voxel along the two image axes of a row's slice."""
        crop = self.index.crops[self.index.row_crop[row]]
        normal = AXES.index(self.index.row_axis[row])
        return np.asarray([v for a, v in enumerate(crop.voxel_size) if a != normal], dtype=float)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = sample_rng(self.seed, index)
        row = int(self.train_rows[int(rng.integers(len(self.train_rows)))])
        arrays = {k: v[0] for k, v in self._arrays([row]).items()}  # (C, h, w)
        hw = arrays["image"].shape[-2:]
        size = np.asarray(self.crop_size)
        # A random window inside the slice; a centred one along an axis where it is too small.
        start = np.asarray([int(rng.integers(n - s + 1)) if n >= s else -((s - n) // 2)
                            for n, s in zip(hw, size)])
        vox = self._plane_voxel_size(row)
        plan = draw_plan(rng, self.aug, self.crop_size, vox)
        matrix = resample_matrix(plan, vox)
        fills = {"image": -1.0, "target": False, "valid": False}  # -1: EM 0, normalized
        if matrix is None:
            out = {k: _window(a, start, self.crop_size, fills[k]) for k, a in arrays.items()}
        else:  # rotate / zoom: resample a larger window around the same centre
            big = np.asarray(read_shape(self.crop_size, matrix))
            centre = start + size / 2
            big_start = np.floor(centre - big / 2).astype(int)
            shift = centre - (big_start + big / 2)
            out = {}
            for k, a in arrays.items():
                order = 1 if k == "image" else 0
                window = _window(a.astype(np.float32), big_start, tuple(big), float(fills[k]))
                out[k] = resample(window, matrix, self.crop_size, shift, order, float(fills[k]))
        out = {k: apply_flips(a, plan) for k, a in out.items()}
        sample = {k: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
                  for k, a in out.items()}
        if self.aug.intensity:  # applied on the device by loader.batch_to_device
            sample.update(intensity_params(plan, self.aug, vox, rng))
        sample["index"] = torch.tensor(index, dtype=torch.int64)
        sample["resampled"] = torch.tensor(0, dtype=torch.int64)
        return sample

    def read(self, crop: SliceCrop, origin, shape) -> dict[str, np.ndarray]:
        """A whole crop on its grid, stacked from its slices: ``image`` (1, D, H, W) and
        ``target`` / ``valid`` (K, D, H, W) float32, as ``SegmentationSamples.read`` gives
        for ``crop_grid(crop)``. ``origin`` is ignored; ``shape`` must be the crop's."""
        if tuple(int(s) for s in shape) != crop.shape:
            raise DatasetError(
                f"{crop.full_name}: a slices dataset holds it on a {list(crop.shape)} grid, "
                f"not {list(shape)}; data.voxel_size must be the dataset's {list(crop.voxel_size)}"
            )
        ax, rows = self.index.volume_rows(crop)
        arrays = self._arrays(rows)  # (N, C, a, b): planes first
        return {k: np.moveaxis(v, 0, 1 + ax).astype(np.float32) for k, v in arrays.items()}


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


def load_slice_data(cfg) -> tuple[SliceIndex, list[SliceCrop], list[SliceCrop]]:
    """Open ``data.dataset_name``, check it against the config and split its crops into
    (train, val) by crop name, as ``load_segmentation_data`` does for zarr stores. Every
    problem is a DatasetError, raised before any process group exists."""
    d = cfg.data
    if cfg.model.ndim != 2:
        raise DatasetError(
            f"data.dataset_name {d.dataset_name!r} is a dataset of 2D slices, but model.ndim = "
            f"{cfg.model.ndim}; train 3D models from the zarr stores (data.dataset_path, with "
            "data.dataset_name empty)"
        )
    if d.class_balanced:
        raise DatasetError(
            "data.class_balanced is not supported with data.dataset_name (slices are drawn "
            "uniformly); set data.class_balanced = false, or train from the zarr stores"
        )
    index = SliceIndex(open_slices(d.dataset_name))
    have = dataset_classes(index.ds)
    missing = [c for c in d.classes if c not in have]
    if missing:
        raise DatasetError(
            f"data.classes {missing} are not in the slices dataset {d.dataset_name!r}, which holds "
            f"{', '.join(have) or '(none)'}; pick among those or remake it with --classes"
        )
    # In discover()'s order (dataset, then crop folder name), so that the split picks the same
    # validation crops as it does from the zarr stores.
    crops = sorted(index.crops.values(), key=lambda c: (c.dataset, c.name))
    if not crops:
        raise DatasetError(f"data.dataset_name {d.dataset_name!r} holds no slices")
    sizes = sorted({c.voxel_size for c in crops})
    if any(not np.allclose(s, d.voxel_size, rtol=1e-6) for s in sizes):
        raise DatasetError(
            f"the slices dataset {d.dataset_name!r} was cut at voxel size "
            f"{' / '.join(str(list(s)) for s in sizes)} nm, but data.voxel_size is "
            f"{list(d.voxel_size)}; set data.voxel_size to match or remake it with --voxel_size"
        )
    train, val = split_crops(crops, d.classes, d.val_crops, d.val_fraction, cfg.training.seed)
    for cls in d.classes:
        if not any(cls in c.classes for c in train):
            raise DatasetError(
                f"data.classes: class {cls!r} is annotated by no training crop of "
                f"{d.dataset_name!r} (check data.val_crops / data.val_fraction)"
            )
    axes = tuple(d.planes)  # "z" or "zyx"
    _check_min_fraction(index, train, axes, cfg.model.crop_size, d.min_label_fraction)
    for c in val:
        index.volume_rows(c)  # fail now, not at the first validation
    logger.info("slices dataset %s: %d slices of %d crops; %d training slices (%s planes) of %d "
                "crops, %d validation crops (%s)", d.dataset_name, len(index.ds), len(crops),
                len(index.rows(train, axes)), ",".join(axes), len(train), len(val),
                ", ".join(c.full_name for c in val) or "none")
    return index, train, val


def build_slice_samples(cfg, index: SliceIndex | None = None,
                        train_crops: list[SliceCrop] | None = None) -> SliceSamples:
    """The training samples of ``data.dataset_name`` (opened and split here unless given)."""
    if index is None or train_crops is None:
        index, train_crops, _ = load_slice_data(cfg)
    return SliceSamples(index, train_crops, cfg.data.classes, cfg.model.crop_size,
                        cfg.training.seed,
                        augmentation=AugmentParams.from_config(cfg.augmentation),
                        axes=tuple(cfg.data.planes))
