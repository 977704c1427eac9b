"""Distributed, resumable data loading and the train/validation split of label crops.

The loader is a plain ``torch.utils.data.DataLoader`` over a dataset indexed by global sample
index, driven by :class:`GlobalBatchSampler`, which hands each data-parallel rank its slice of
every global batch. Its only state is the next step, so resuming is exact for any number of
worker processes: restart the sampler at the checkpointed step and the same samples follow.
Items are :class:`~torchtitan.data.batch.Sample` objects, collated into a
:class:`~torchtitan.data.batch.Batch` (``batch.collate``).
"""

from __future__ import annotations

import logging

import numpy as np
from torch.utils.data import DataLoader, Sampler

from torchtitan.data.batch import collate
from torchtitan.data.sources.cellmap import (
    DatasetError,
    EMSource,
    LabelCrop,
    check_crop_inside,
    check_voxel_size,
    discover,
    label_slab,
    set_em_ranges,
)
from torchtitan.cellmap.classes import check_class_names
from torchtitan.data.sampling.mae_samples import MAESamples
from torchtitan.data.sampling.samples import SegmentationSamples, grid_shape, samples_kwargs
from torchtitan.data.io.stores import StoreContext, tensorstore_used
from torchtitan.data.sampling.targets import annotates

logger = logging.getLogger(__name__)


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields, for each step from ``start_step`` on, this rank's share of the global batch.

    Global sample indices of step ``s`` are ``s * global_batch + j`` for ``j`` in
    ``[0, global_batch)``; rank ``r`` of ``dp_degree`` takes the contiguous block
    ``[r * local, (r + 1) * local)``.
    """

    def __init__(self, global_batch: int, dp_rank: int, dp_degree: int, start_step: int = 0):
        if global_batch % dp_degree != 0:
            raise ValueError(
                f"training.batch_size={global_batch} is not divisible by the data-parallel degree "
                f"{dp_degree}; choose a multiple of {dp_degree}"
            )
        self.global_batch = global_batch
        self.local = global_batch // dp_degree
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.step = start_step

    def __iter__(self):
        while True:
            base = self.step * self.global_batch + self.dp_rank * self.local
            self.step += 1
            yield list(range(base, base + self.local))

    def __len__(self) -> int:  # infinite; DataLoader only needs it for len(loader)
        return 2**62


def build_loader(dataset, global_batch: int, dp_rank: int, dp_degree: int, start_step: int,
                 num_workers: int, pin_memory: bool = False,
                 multiprocessing_context: str | None = None) -> DataLoader:
    """A DataLoader that yields this rank's :class:`~torchtitan.data.batch.Batch` of each
    step ``start_step, start_step + 1, ...``.

    Samples depend only on their global index, so the loader can be rebuilt at any step and
    the batches do not depend on ``num_workers``. Workers are persistent and keep
    ``prefetch_factor`` batches each in flight; ``pin_memory`` (set on CUDA; ``Batch.pin_memory``)
    lets the copy to the GPU overlap with compute. Workers start with the platform's default method (fork on
    Linux: 0.2 s, against 3-4 s for forkserver or spawn, which re-import torch); the dataset
    also pickles, for ``multiprocessing_context="spawn"``. Workers need no set-up: every
    sample owns its generator (keyed by its global index), and the store context the dataset
    reads through carries its settings into a spawned worker and opens its own handles in
    each process (``stores.StoreContext``).
    """
    sampler = GlobalBatchSampler(global_batch, dp_rank, dp_degree, start_step)
    workers = num_workers > 0
    if workers and tensorstore_used() and multiprocessing_context in (None, "fork"):
        # TensorStore's threads do not survive fork(): its children abort.
        logger.info("loader workers start with 'spawn' (TensorStore is in use in this process)")
        multiprocessing_context = "spawn"
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=workers,
        prefetch_factor=2 if workers else None,
        multiprocessing_context=multiprocessing_context if workers else None,
    )


# ---------------------------------------------------------------------------------------------
# Crops: discovery checks and the train / validation split
# ---------------------------------------------------------------------------------------------


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


def load_em_sources(cfg) -> list[EMSource]:
    """The EM volumes of ``data.dataset_path`` (folder or split list), each able to serve
    ``data.voxel_size``; for tasks that need no labels (MAE). They read through one store
    context made from the config (``data.cache_mb``)."""
    sources = discover(StoreContext.from_config(cfg), cfg.data.dataset_path)
    for s in sources:
        check_voxel_size(s, cfg.data.voxel_size)
    set_em_ranges(sources, cfg.data.em_range)
    return sources


def load_segmentation_data(cfg) -> tuple[list[EMSource], list[LabelCrop], list[LabelCrop]]:
    """Discover the datasets and split crops; every problem is a DatasetError, raised before
    any process group exists.

    When ``data.dataset_path`` is a split list with validation entries, those are the
    validation crops (``data.val_crops`` / ``data.val_fraction`` are then ignored); a split list
    without any is split like a folder.
    """
    if not cfg.data.classes:
        raise DatasetError("data.classes is empty; name the classes to segment (e.g. mito,nuc)")
    sources = load_em_sources(cfg)
    crops = [c for s in sources for c in s.crops]
    if not crops:
        raise DatasetError(
            f"data.dataset_path {cfg.data.dataset_path!r}: no label crops found under "
            "<ds>.zarr/recon-1/labels/groundtruth/crop*/<class>; segmentation needs annotations"
        )
    _check_class_names(cfg.data.classes, crops)
    for s in sources:
        for c in s.crops:
            check_crop_inside(s, c)
    _check_classes(crops, cfg.data.classes, "")
    if any(c.split == "val" for c in crops):
        if cfg.data.val_crops:
            logger.warning("data.val_crops is ignored: the split list %s names the validation "
                           "crops", cfg.data.dataset_path)
        train = [c for c in crops if c.split != "val"]
        val = [c for c in crops if c.split == "val"]
    else:
        train, val = split_crops(crops, cfg.data.classes, cfg.data.val_crops,
                                 cfg.data.val_fraction, cfg.training.seed)
    _check_classes(train, cfg.data.classes, "training")
    _check_crop_size(train, cfg.data.voxel_size, cfg.model.crop_size, cfg.data.min_label_fraction)
    train = [label_slab(c, cfg.data.train_label_fraction, cfg.data.voxel_size) for c in train]
    if cfg.data.train_label_fraction < 1:
        logger.info("data.train_label_fraction %g: labels of %s", cfg.data.train_label_fraction,
                    ", ".join(f"{c.full_name} z {c.box_min[0]:g}-{c.box_max[0]:g} nm"
                              for c in train))
    return sources, train, val


def held_out_crops(cfg, sources: list[EMSource]) -> list[LabelCrop]:
    """The crops ``data.val_crops`` names (none when it is empty): MAE pretraining holds
    their EM out and validates on it."""
    if not cfg.data.val_crops:
        return []
    crops = [c for s in sources for c in s.crops]
    return split_crops(crops, [], cfg.data.val_crops, 0.0, cfg.training.seed)[1]


def build_segmentation_samples(cfg, sources, train_crops) -> SegmentationSamples:
    return SegmentationSamples(sources, train_crops, cfg.data.classes, cfg.data.voxel_size,
                               cfg.model.crop_size, cfg.training.seed,
                               **samples_kwargs(cfg, "segmentation"))


def build_mae_samples(cfg, sources, seed_offset: int = 0, num_patches: int = 0,
                      augment: bool = True, held_out: list[LabelCrop] = (),
                      validation: bool = False) -> MAESamples:
    """MAE samples outside the ``held_out`` crops, or with ``validation`` inside them (and
    ``augment=False``, a ``seed_offset``: the fixed validation stream)."""
    return MAESamples(sources, cfg.data.voxel_size, cfg.model.crop_size,
                      cfg.training.seed + seed_offset, augment=augment, num_patches=num_patches,
                      held_out=held_out, validation=validation, **samples_kwargs(cfg, "mae"))

