"""Which volumes and label crops a run reads: what the data reads of a run's config
(:class:`DataSettings`), discovery through one store context, the checks that stop a bad
dataset before any process group exists, the train/validation split of the label crops and
the label budget (``data.train_label_fraction``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from torchtitan.cellmap.affinities import AffinitySpec
from torchtitan.cellmap.classes import check_class_names
from torchtitan.config.job_config import Augmentation, Data
from torchtitan.data.crops.layout import (DatasetError, EMSource, LabelCrop, check_crop_inside,
                                          check_voxel_size, discover, label_slab)
from torchtitan.data.crops.reader import annotates, grid_shape, set_em_ranges
from torchtitan.data.io.stores import StoreContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataSettings:
    """What the data floor reads of a run's config, read once (``from_config``): the ``[data]``
    and ``[augmentation]`` sections, the model's crop size (its dimensionality with it), the
    seed of every draw and the affinity targets (``[affinities]``, resolved on the grid)."""

    data: Data
    augmentation: Augmentation
    crop_size: tuple[int, ...]  # model.crop_size: (y, x) in 2D, (z, y, x) in 3D
    seed: int  # training.seed
    affinities: AffinitySpec

    @classmethod
    def from_config(cls, cfg) -> DataSettings:
        return cls(cfg.data, cfg.augmentation, tuple(int(c) for c in cfg.model.crop_size),
                   int(cfg.training.seed), AffinitySpec.from_config(cfg))

    @property
    def ndim(self) -> int:
        """The model's dimensionality (2 or 3), that of its crops."""
        return len(self.crop_size)


def _matches(crop: LabelCrop, name: str) -> bool:
    return name == crop.name or name == crop.full_name


def split_crops(crops: list[LabelCrop], classes: list[str], val_crops: list[str],
                val_fraction: float, seed: int) -> tuple[list[LabelCrop], list[LabelCrop]]:
    """Split crops into (train, val), never overlapping.

    ``val_crops`` names crops explicitly (``crop2`` or ``dataset/crop2``). Otherwise
    ``val_fraction`` of the crops (at least one when there are two or more) is held out,
    chosen reproducibly from ``seed``, preferring crops that annotate every requested class so
    that validation scores every class.
    """
    if val_crops:
        unknown = [n for n in val_crops if not any(_matches(c, n) for c in crops)]
        if unknown:
            names = ", ".join(c.full_name for c in crops)
            raise DatasetError(f"data.val_crops names unknown crops {unknown}; available: {names}")
        val = [c for c in crops if any(_matches(c, n) for n in val_crops)]
    elif val_fraction > 0 and len(crops) >= 2:
        n_val = min(len(crops) - 1, max(1, int(round(val_fraction * len(crops)))))
        order = np.random.default_rng(seed).permutation(len(crops))
        complete = [i for i in order if all(annotates(crops[i], k) for k in classes)]
        partial = [i for i in order if i not in complete]
        picked = set((complete + partial)[:n_val])
        val = [c for i, c in enumerate(crops) if i in picked]
    else:
        val = []
    train = [c for c in crops if c not in val]
    return train, val


def _check_classes(crops: list[LabelCrop], classes: list[str], where: str) -> None:
    annotated = sorted({k for c in crops for k in c.classes})
    for cls in classes:
        if not any(annotates(c, cls) for c in crops):
            raise DatasetError(
                f"data.classes: class {cls!r} is annotated by no {where} crop, neither itself "
                f"nor through all of its CellMap parts; classes annotated there: "
                f"{', '.join(annotated) or '(none)'}"
            )


def _check_crop_size(crops: list[LabelCrop], voxel_size, crop_size, min_fraction: float) -> None:
    """At least one crop must be able to hold ``min_fraction`` of a model crop."""
    size = np.asarray(grid_shape(crop_size)) * np.asarray(voxel_size, dtype=float)
    best, best_crop = 0.0, None
    for c in crops:
        frac = float(np.prod(np.minimum(c.box_max - c.box_min, size) / size))
        if frac > best:
            best, best_crop = frac, c
    if best + 1e-6 < min_fraction:
        ext = (best_crop.box_max - best_crop.box_min).round(1).tolist() if best_crop else None
        raise DatasetError(
            f"model.crop_size {list(crop_size)} at data.voxel_size {list(voxel_size)} nm spans "
            f"{size.round(1).tolist()} nm, larger than every training label crop (the largest "
            f"fraction that fits is {best:.2f}, in {best_crop.full_name if best_crop else '-'} of "
            f"extent {ext} nm, below data.min_label_fraction={min_fraction}); use a smaller "
            "model.crop_size, a larger data.voxel_size or a lower data.min_label_fraction"
        )


def _check_class_names(classes: list[str], crops: list[LabelCrop]) -> None:
    """Each class must be a CellMap class or one some crop annotates (a typo check)."""
    check_class_names(classes, extra=sorted({k for c in crops for k in c.classes}))


def load_em_sources(settings: DataSettings) -> list[EMSource]:
    """The EM volumes of ``data.dataset_path`` (folder or split list), each able to serve
    ``data.voxel_size``; for tasks that need no labels (MAE). They read through one store
    context made from the config (``data.cache_mb``)."""
    sources = discover(StoreContext.from_config(settings.data), settings.data.dataset_path)
    for s in sources:
        check_voxel_size(s, settings.data.voxel_size)
    set_em_ranges(sources, settings.data.em_range)
    return sources


def load_segmentation_data(settings: DataSettings
                           ) -> tuple[list[EMSource], list[LabelCrop], list[LabelCrop]]:
    """Discover the datasets and split crops; every problem is a DatasetError, raised before
    any process group exists.

    When ``data.dataset_path`` is a split list with validation entries, those are the
    validation crops (``data.val_crops`` / ``data.val_fraction`` are then ignored); a split list
    without any is split like a folder.
    """
    if not settings.data.classes:
        raise DatasetError("data.classes is empty; name the classes to segment (e.g. mito,nuc)")
    sources = load_em_sources(settings)
    crops = [c for s in sources for c in s.crops]
    if not crops:
        raise DatasetError(
            f"data.dataset_path {settings.data.dataset_path!r}: no label crops found under "
            "<ds>.zarr/recon-1/labels/groundtruth/crop*/<class>; segmentation needs annotations"
        )
    _check_class_names(settings.data.classes, crops)
    for s in sources:
        for c in s.crops:
            check_crop_inside(s, c)
    _check_classes(crops, settings.data.classes, "")
    if any(c.split == "val" for c in crops):
        if settings.data.val_crops:
            logger.warning("data.val_crops is ignored: the split list %s names the validation "
                           "crops", settings.data.dataset_path)
        train = [c for c in crops if c.split != "val"]
        val = [c for c in crops if c.split == "val"]
    else:
        train, val = split_crops(crops, settings.data.classes, settings.data.val_crops,
                                 settings.data.val_fraction, settings.seed)
    _check_classes(train, settings.data.classes, "training")
    d = settings.data
    _check_crop_size(train, d.voxel_size, settings.crop_size, d.min_label_fraction)
    train = [label_slab(c, d.train_label_fraction, d.voxel_size) for c in train]
    if d.train_label_fraction < 1:
        logger.info("data.train_label_fraction %g: labels of %s", d.train_label_fraction,
                    ", ".join(f"{c.full_name} z {c.box_min[0]:g}-{c.box_max[0]:g} nm"
                              for c in train))
    return sources, train, val


def held_out_crops(settings: DataSettings, sources: list[EMSource]) -> list[LabelCrop]:
    """The crops ``data.val_crops`` names (none when it is empty): MAE pretraining holds
    their EM out and validates on it."""
    if not settings.data.val_crops:
        return []
    crops = [c for s in sources for c in s.crops]
    return split_crops(crops, [], settings.data.val_crops, 0.0, settings.seed)[1]
