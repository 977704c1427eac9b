"""Where the volumes come from, as one type: a :class:`VolumeSource` gives a task its training
samples (segmentation or MAE), its validation crops and each crop's whole volume on the training
grid (:meth:`VolumeSource.read_volume`, one :class:`CropVolume`).

One implementation per kind of source, chosen in one place (:func:`build_source`):

* :class:`CellMapSource`: CellMap-layout zarr stores (``data.dataset_path``: a folder or a
  split list, local or remote; imported image stacks are such stores too);
* :class:`SliceSource`: a Hugging Face dataset of 2D slices (``data.dataset_name``), whose
  held-out crops are stacked back from their slices.

A task takes a source and never asks which kind it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from torchtitan.cellmap.classes import INSTANCE_CLASSES
from torchtitan.cellmap.errors import DatasetError
from torchtitan.data.crops.reader import (READ_ERRORS, CropArrays, CropReader, annotates,
                                          crop_grid, read_instance_ids)
from torchtitan.data.crops.selection import (DataSettings, held_out_crops, load_em_sources,
                                             load_segmentation_data)
from torchtitan.data.sampling.mae_samples import build_mae_samples
from torchtitan.data.sampling.samples import build_segmentation_samples
from torchtitan.data.slices.samples import (
    SliceReader,
    build_slice_mae_samples,
    build_slice_samples,
    load_mae_slices,
    load_slice_data,
)

__all__ = ["READ_ERRORS", "CropVolume", "DataSettings", "VolumeSource", "build_source"]

logger = logging.getLogger(__name__)


@dataclass
class CropVolume:
    """One whole label crop on the training grid, as a volume source reads it and validation
    predicts and scores it."""

    image: torch.Tensor  # (C, D, H, W) float32 EM, normalised
    target: torch.Tensor  # (K, D, H, W) bool: present, per class
    valid: torch.Tensor  # (K, D, H, W) bool: annotated and not unknown, per class
    origin: np.ndarray  # nm, corner of voxel 0 of the grid
    voxel_size: tuple[float, ...]  # nm, the grid's spacing (data.voxel_size)
    classes: list[str]  # the class of each channel of target and valid (data.classes)
    annotated: list[str]  # the classes the crop annotates (the only ones scored)
    name: str  # the crop's full name (dataset/crop), as logs and pictures show it
    # Instance classes stored with object ids, scored against those ids (touching instances
    # stay apart), as the scoring command does: class name -> (D, H, W) ids.
    instance_ids: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.image.shape[1:])


class VolumeSource(Protocol):
    """The data of a run, whatever holds it. Built with ``labels=False`` (MAE) a source has
    no training crops: only :meth:`mae_dataset` serves, and ``val_crops`` are the crops whose
    EM it holds out."""

    val_crops: list  # the held-out label crops (LabelCrop or SliceCrop), in a fixed order

    def segmentation_dataset(self) -> Dataset:
        """The segmentation training samples (of the training crops), by global index."""

    def mae_dataset(self, seed_offset: int = 0, num_patches: int = 0,
                    augment: bool = True, validation: bool = False) -> Dataset:
        """The MAE samples of the EM outside the held-out crops; with ``validation`` (and
        ``augment=False``, a ``seed_offset``) the fixed validation stream, inside them."""

    def grid(self, crop) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Origin (nm) and shape of the training grid that covers the whole crop."""

    def read_volume(self, crop) -> CropVolume:
        """The whole crop on :meth:`grid`: EM, targets, validity and instance ids."""


def _volume(settings: DataSettings, crop, origin, arrays: CropArrays,
            instance_ids: dict) -> CropVolume:
    classes = list(settings.data.classes)
    return CropVolume(
        torch.from_numpy(arrays.image), torch.from_numpy(arrays.target > 0),
        torch.from_numpy(arrays.valid > 0), origin,
        voxel_size=tuple(float(v) for v in settings.data.voxel_size), classes=classes,
        annotated=[c for c in classes if annotates(crop, c)], name=crop.full_name,
        instance_ids=instance_ids)


class CellMapSource:
    """CellMap-layout zarr stores (``data.dataset_path``)."""

    def __init__(self, settings: DataSettings, labels: bool = True):
        self.settings = settings
        d = settings.data
        if labels:
            self.ems, self.train_crops, self.val_crops = load_segmentation_data(settings)
            logger.info("segmentation data: %d datasets, %d training crops, %d validation crops "
                        "(%s)", len(self.ems), len(self.train_crops), len(self.val_crops),
                        ", ".join(c.full_name for c in self.val_crops) or "none")
        else:
            self.ems, self.train_crops = load_em_sources(settings), []
            # MAE: the EM of the validation crops is held out of pretraining.
            self.val_crops = held_out_crops(settings, self.ems)
            logger.info("MAE data: %d EM volumes (%s); held out for validation: %s",
                        len(self.ems), ", ".join(s.name for s in self.ems),
                        ", ".join(c.full_name for c in self.val_crops)
                        or "none (validation draws its own crops of all the EM)")
        self.reader = CropReader(self.ems, d.classes, d.voxel_size) if labels else None

    def segmentation_dataset(self) -> Dataset:
        return build_segmentation_samples(self.settings, self.ems, self.train_crops)

    def mae_dataset(self, seed_offset: int = 0, num_patches: int = 0,
                    augment: bool = True, validation: bool = False) -> Dataset:
        return build_mae_samples(self.settings, self.ems, seed_offset, num_patches=num_patches,
                                 augment=augment, held_out=self.val_crops, validation=validation)

    def grid(self, crop) -> tuple[np.ndarray, tuple[int, int, int]]:
        return crop_grid(crop, self.settings.data.voxel_size)

    def read_volume(self, crop) -> CropVolume:
        """Instance classes stored with object ids keep them, so that touching instances are
        scored apart (as the scoring command does); 0/1 groups stay binary masks."""
        origin, shape = self.grid(crop)
        vox = self.settings.data.voxel_size
        ids = {}
        for name in self.settings.data.classes:
            if name in INSTANCE_CLASSES:
                stored = read_instance_ids(crop, name, origin, vox, shape)
                if stored is not None and stored.max(initial=0) > 1:
                    ids[name] = stored
        return _volume(self.settings, crop, origin, self.reader.read(crop, origin, shape), ids)


class SliceSource:
    """A Hugging Face dataset of 2D slices (``data.dataset_name``); it logs what it holds."""

    def __init__(self, settings: DataSettings, labels: bool = True):
        self.settings = settings
        if labels and settings.affinities.classes:
            raise DatasetError(
                f"affinities.classes = {list(settings.affinities.classes)}: a slices dataset "
                f"(data.dataset_name = {settings.data.dataset_name!r}) holds binary masks, not "
                "the object ids affinities are made of; train on zarr stores with instance ids "
                "(data.dataset_path), or leave affinities.classes empty")
        if labels:
            self.index, self.train_crops, self.val_crops = load_slice_data(settings)
            self.reader = SliceReader(self.index, settings.data.classes)
        else:
            if settings.data.val_crops:
                raise DatasetError(
                    f"data.val_crops = {settings.data.val_crops}: MAE on a slices dataset "
                    f"(data.dataset_name = {settings.data.dataset_name!r}) holds out no crops; "
                    "leave data.val_crops empty (validation draws its own slices)")
            self.mae_slices, self.train_crops, self.val_crops = load_mae_slices(settings), [], []

    def segmentation_dataset(self) -> Dataset:
        return build_slice_samples(self.settings, self.index, self.train_crops)

    def mae_dataset(self, seed_offset: int = 0, num_patches: int = 0,
                    augment: bool = True, validation: bool = False) -> Dataset:
        return build_slice_mae_samples(self.settings, self.mae_slices, seed_offset,
                                       num_patches=num_patches, augment=augment)

    def grid(self, crop) -> tuple[np.ndarray, tuple[int, int, int]]:
        return crop_grid(crop, self.settings.data.voxel_size)

    def read_volume(self, crop) -> CropVolume:
        """Stacked from the crop's slices; slices hold no instance ids (binary masks only)."""
        origin, shape = self.grid(crop)
        return _volume(self.settings, crop, origin, self.reader.read(crop, shape), {})


def build_source(cfg, labels: bool = True) -> VolumeSource:
    """The source a JobConfig names: ``data.dataset_name`` (slices) or else the zarr stores of
    ``data.dataset_path``. ``labels=False`` (MAE) opens the EM alone. Every problem with the
    data is a DatasetError, raised here, before any process group exists. What the data reads
    of the config is read here, once (:class:`DataSettings`)."""
    settings = DataSettings.from_config(cfg)
    if settings.data.dataset_name:
        return SliceSource(settings, labels)
    return CellMapSource(settings, labels)
