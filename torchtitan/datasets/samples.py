"""Training samples drawn by global sample index.

Every random choice for sample ``g`` (which crop, where, which flips) comes from a generator
seeded with ``(seed, g)``. The global index of position ``j`` of step ``s`` is
``s * global_batch + j``, so what a step sees depends only on the seed and the global batch,
never on how many ranks or loader workers share the work. That is what makes resume exact
and losses identical across parallelisms.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from torchtitan.datasets.cellmap import (
    DatasetError,
    EMSource,
    LabelCrop,
    closest_level,
    grid_origin_snapped,
    read_label_class,
    read_linear,
)


def sample_rng(seed: int, index: int) -> np.random.Generator:
    """The random generator that owns every choice made for global sample ``index``."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(index)]))


def normalize_em(img: np.ndarray) -> np.ndarray:
    """uint8 intensities to roughly zero mean, unit range."""
    return (img.astype(np.float32) / 127.5) - 1.0


def grid_shape(crop_size: list[int] | tuple[int, ...]) -> tuple[int, int, int]:
    """The 3D (z, y, x) read shape of a model crop: 2D crops are one plane thick."""
    crop_size = tuple(int(c) for c in crop_size)
    return (1, *crop_size) if len(crop_size) == 2 else crop_size  # type: ignore[return-value]


def _random_flips(rng: np.random.Generator, ndim: int, isotropic_yx: bool = True) -> dict:
    """Flip every spatial axis with p=0.5 and swap y/x with p=0.5 (the y-x plane is isotropic
    in FIB-SEM; z is not always, so it is never swapped)."""
    return {
        "flip": [bool(f) for f in rng.random(ndim) < 0.5],
        "swap_yx": bool(rng.random() < 0.5) and isotropic_yx,
    }


def _apply_flips(arr: np.ndarray, aug: dict, ndim: int) -> np.ndarray:
    """Apply the same flips to an array shaped (C, *spatial)."""
    for ax, f in enumerate(aug["flip"]):
        if f:
            arr = np.flip(arr, axis=1 + ax)
    if aug["swap_yx"]:
        arr = np.swapaxes(arr, -1, -2)
    return np.ascontiguousarray(arr)


def _to_sample(arrays: dict[str, np.ndarray], aug: dict | None, ndim: int, index: int) -> dict:
    """3D (C, D, H, W) arrays -> float32 tensors (C, *crop), augmented alike, plus the index."""
    out = {}
    for key, arr in arrays.items():
        if ndim == 2:
            arr = arr[:, 0]  # (C, 1, H, W) -> (C, H, W)
        if aug is not None:
            arr = _apply_flips(arr, aug, ndim)
        out[key] = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    out["index"] = torch.tensor(index, dtype=torch.int64)
    return out


class EMReaderMixin:
    """Reads EM on the training grid from the level that best matches the voxel size."""

    sources: list[EMSource]
    voxel_size: np.ndarray

    def _em_level(self, source: EMSource):
        return source.levels[closest_level(source.levels, self.voxel_size)]

    def read_em(self, source: EMSource, origin, shape) -> tuple[np.ndarray, np.ndarray]:
        img, inside = read_linear(self._em_level(source), origin, self.voxel_size, shape)
        return normalize_em(img), inside


class SegmentationSamples(EMReaderMixin, Dataset):
    """Random crops of EM with aligned binary targets and per-class validity masks.

    Item ``g`` is a dict: ``image`` (1, *crop), ``target`` and ``valid`` (K, *crop) float32,
    ``index`` (the global sample index).
    """

    def __init__(
        self,
        sources: list[EMSource],
        crops: list[LabelCrop],
        classes: list[str],
        voxel_size,
        crop_size,
        seed: int,
        augment: bool = True,
    ):
        self.sources = sources
        self.by_name = {s.name: s for s in sources}
        self.crops = crops
        self.classes = list(classes)
        self.voxel_size = np.asarray(voxel_size, dtype=float)
        self.ndim = len(crop_size)
        self.shape = grid_shape(crop_size)
        self.seed = seed
        self.augment = augment
        if not crops:
            raise DatasetError("no training crops left (check data.val_crops / data.val_fraction)")

    def __len__(self) -> int:
        return 2**62  # indexed by global sample index; the sampler decides what is drawn

    def _origin(self, rng: np.random.Generator, crop: LabelCrop, source: EMSource) -> np.ndarray:
        """A random sample origin (nm) inside ``crop``, centred where the crop is too small."""
        size = np.asarray(self.shape) * self.voxel_size
        lo, hi = crop.box_min, crop.box_max - size
        origin = np.where(hi >= lo, lo + rng.random(3) * np.maximum(hi - lo, 0), (lo + hi) / 2)
        return grid_origin_snapped(self._em_level(source), self.voxel_size, origin)

    def read(self, crop: LabelCrop, origin, shape) -> dict[str, np.ndarray]:
        """EM, targets and validity of one box of the training grid (3D arrays)."""
        source = self.by_name[crop.dataset]
        image, _ = self.read_em(source, origin, shape)
        target = np.zeros((len(self.classes), *shape), dtype=np.float32)
        valid = np.zeros_like(target)
        for k, cls in enumerate(self.classes):
            if cls in crop.classes:
                t, v = read_label_class(crop, cls, origin, self.voxel_size, shape)
                target[k], valid[k] = t, v
        return {"image": image[None], "target": target, "valid": valid}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = sample_rng(self.seed, index)
        crop = self.crops[int(rng.integers(len(self.crops)))]
        origin = self._origin(rng, crop, self.by_name[crop.dataset])
        arrays = self.read(crop, origin, self.shape)
        aug = _random_flips(rng, self.ndim) if self.augment else None
        return _to_sample(arrays, aug, self.ndim, index)


class MAESamples(EMReaderMixin, Dataset):
    """Random EM crops anywhere inside the EM volumes (no labels needed).

    Item ``g``: ``image`` (1, *crop), ``valid`` (1, *crop) (0 where the crop leaves the
    volume: padding, excluded from the loss), ``index``, and with ``num_patches`` > 0 the
    MAE masking ``noise`` (num_patches,), drawn from the sample's own generator.
    """

    def __init__(self, sources: list[EMSource], voxel_size, crop_size, seed: int,
                 augment: bool = True, num_patches: int = 0):
        self.sources = sources
        self.num_patches = num_patches
        self.voxel_size = np.asarray(voxel_size, dtype=float)
        self.ndim = len(crop_size)
        self.shape = grid_shape(crop_size)
        self.seed = seed
        self.augment = augment

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = sample_rng(self.seed, index)
        source = self.sources[int(rng.integers(len(self.sources)))]
        level = self._em_level(source)
        size = np.asarray(self.shape) * self.voxel_size
        lo, hi = level.box_min, level.box_max - size
        origin = np.where(hi >= lo, lo + rng.random(3) * np.maximum(hi - lo, 0), (lo + hi) / 2)
        origin = grid_origin_snapped(level, self.voxel_size, origin)
        image, inside = self.read_em(source, origin, self.shape)
        arrays = {"image": image[None], "valid": inside[None].astype(np.float32)}
        aug = _random_flips(rng, self.ndim) if self.augment else None
        out = _to_sample(arrays, aug, self.ndim, index)
        if self.num_patches:
            out["noise"] = torch.from_numpy(rng.random(self.num_patches, dtype=np.float32))
        return out


def crop_grid(crop: LabelCrop, voxel_size) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Origin (nm) and shape of the training grid that covers a whole label crop."""
    v = np.asarray(voxel_size, dtype=float)
    extent = crop.box_max - crop.box_min
    shape = tuple(int(max(1, np.floor(e / s + 1e-6))) for e, s in zip(extent, v))
    # Centre the grid on the crop so any remainder is split evenly between both sides.
    origin = crop.box_min + (extent - np.asarray(shape) * v) / 2
    return origin, shape  # type: ignore[return-value]
