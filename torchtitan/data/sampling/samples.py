"""Training samples drawn by global sample index.

Every random choice for sample ``g`` (plane, class, crop, place, augmentation) comes from a
generator seeded with ``(seed, g)``. The global index of position ``j`` of step ``s`` is
``s * global_batch + j``, so what a step sees depends only on the seed and the global batch,
never on how many ranks or loader workers share the work. That is what makes resume exact
and losses identical across parallelisms.

One sample is made in four steps:

1. *Where*: for 2D models with ``planes='zyx'`` a plane normal (z, y or x); then a crop and a
   box in it. With ``class_balanced`` a class is drawn first, then a crop that annotates it,
   then a box around one of that class's foreground voxels (from a small per-crop index).
   With ``min_label_fraction`` < 1 the box may leave the label crop as long as that fraction
   of it stays inside (EM context is real; labels outside the crop are invalid).
2. *Augmentation plan*, drawn next by the dataset's ``augment.Augmenter``.
3. *Read*: EM and the stored label values of the box, or of a larger box around it when the
   plan rotates or zooms (the augmenter says which), which is then resampled onto the sample
   grid.
4. The augmenter's host part (flips, 90 degree rotations, transposes, resampling); then
   targets and validity (``targets.py``) from the moved label values. What is left to the
   device travels as the sample's one ``augmentation`` payload: the intensity changes (EM
   only, their noise seed drawn last) and, with ``augmentation.resample_on`` "device", the
   interpolation of rotated and zoomed EM and the flips of the labels.

MAE samples (``mae_samples.py``) are made the same way, without labels.

Items are :class:`~torchtitan.data.sampling.batch.Sample` objects, arrays (C, *spatial). While a
sample is made its arrays travel as a :class:`SampleArrays` (numpy, on the host).

A sample whose read fails on a corrupt chunk is replaced by one drawn from the generator of
``(seed, g, attempt)``; the sample's ``resampled`` field counts the replacements.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from torchtitan.cellmap.affinities import AffinitySpec
from torchtitan.cellmap.classes import check_class_names
from torchtitan.cellmap.errors import DatasetError
from torchtitan.cellmap.grids import (ScaleLevel, extent_shape, grid_origin_snapped,
                                      voxel_centres)
from torchtitan.choices import PLANES, same_voxel_size
from torchtitan.config.job_config import Augmentation
from torchtitan.data.crops.selection import DataSettings
from torchtitan.data.crops.layout import EMSource, LabelCrop
from torchtitan.data.crops.reader import (READ_ERRORS, CropReader, annotates, em_level,
                                          grid_shape, groups_to_read, has_ids, read_target,
                                          unknown_value)
from torchtitan.data.sampling.augment import (Augmenter, DeviceAugmentation, host_axis_map,
                                             identity_axes)
from torchtitan.data.sampling.batch import Sample

logger = logging.getLogger(__name__)

# Class-balanced sampling: each (crop, class) gets a foreground index on a grid this many
# times coarser than the training grid, of at most FG_POINTS points; at most FG_CACHE of them
# are kept per process (about FG_CACHE * FG_POINTS * 12 bytes; recomputed when evicted).
FG_COARSENING = 2
FG_POINTS = 2048
FG_CACHE = 256

def sample_rng(seed: int, index: int, attempt: int = 0) -> np.random.Generator:
    """The random generator that owns every choice made for global sample ``index`` (and for
    its ``attempt``-th replacement when reading it failed)."""
    key = [int(seed), int(index)] + ([int(attempt)] if attempt else [])
    return np.random.default_rng(np.random.SeedSequence(key))


def plane_box(crop_size, normal: int) -> tuple[int, int, int]:
    """The 3D read shape of a model crop; a 2D crop lies in the plane normal to ``normal``
    (0: z, a y-x plane; 1: y, a z-x plane; 2: x, a z-y plane)."""
    crop_size = tuple(int(c) for c in crop_size)
    if len(crop_size) == 3:
        return crop_size  # type: ignore[return-value]
    box = list(crop_size)
    box.insert(normal, 1)
    return tuple(box)  # type: ignore[return-value]


def origin_range(box_min, box_max, size, min_fraction: float = 1.0,
                 thin=None) -> tuple[np.ndarray, np.ndarray]:
    """Lowest and highest origin (nm) of a box of ``size`` nm placed in [box_min, box_max].

    On an axis where the box does not fit it is centred. With ``min_fraction`` < 1 each other
    axis (except ``thin`` ones, e.g. the normal of a 2D plane) may stick out by the same share,
    chosen so that ``min_fraction`` of the box volume stays inside.
    """
    box_min, box_max = np.asarray(box_min, float), np.asarray(box_max, float)
    size = np.asarray(size, float)
    lo, hi = box_min, box_max - size
    fits = hi >= lo
    centre = (lo + hi) / 2
    lo, hi = np.where(fits, lo, centre), np.where(fits, hi, centre)
    if min_fraction < 1:
        free = fits & ~(np.zeros(3, bool) if thin is None else np.asarray(thin, bool))
        inside = float(np.prod(np.where(fits, 1.0, (box_max - box_min) / size)))
        rest = min_fraction / inside  # the share the free axes must keep inside
        if free.any() and rest < 1:
            keep = rest ** (1 / int(free.sum()))
            lo = np.where(free, box_min - (1 - keep) * size, lo)
            hi = np.where(free, box_max - keep * size, hi)
    return lo, hi


def _tensor(a: np.ndarray | None) -> torch.Tensor | None:
    """uint8 arrays (raw EM, masks) stay uint8 (a quarter of the bytes to ship from loader
    workers), int64 stays int64; everything else becomes float32."""
    if a is None:
        return None
    if a.dtype == np.bool_:
        a = a.view(np.uint8)
    dtype = a.dtype if a.dtype in (np.uint8, np.int64) else np.float32
    return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))


@dataclass
class SampleArrays:
    """The arrays of one box on the host while a sample is made, (C, *spatial) each.

    ``image`` is EM (interpolated linearly when rotated or zoomed); everything else is moved
    by nearest neighbour: ``valid`` (MAE: 1 inside the EM volume) and, for segmentation, the
    stored label values of each label group in ``labels`` (by group name; turned into
    ``target`` and ``valid`` once moved, see :meth:`SegmentationSamples._compose`). With EM left to
    the device to resample, ``augmentation`` says how to finish it (see ``augment.py``).
    """

    image: np.ndarray
    valid: np.ndarray | None = None
    target: np.ndarray | None = None
    labels: dict[str, np.ndarray] = field(default_factory=dict)
    augmentation: DeviceAugmentation | None = None

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> "SampleArrays":
        """``fn`` applied to every array (EM, masks, label values)."""
        return SampleArrays(fn(self.image), None if self.valid is None else fn(self.valid),
                            None if self.target is None else fn(self.target),
                            {g: fn(a) for g, a in self.labels.items()}, self.augmentation)

    @property
    def in_buffer(self) -> bool:
        """Whether ``image`` is still the box read around the sample, for the device to
        resample (the other arrays are on the sample's grid)."""
        return self.augmentation is not None and self.augmentation.geometry is not None


class SampleDataset(Dataset):
    """What both sample kinds (:class:`SegmentationSamples` here, ``mae_samples.MAESamples``)
    share: EM reading, planes, geometry and the resample loop."""

    sources: list[EMSource]

    def __init__(self, voxel_size, crop_size, seed: int, augment: bool,
                 augmentation: Augmentation | None, planes: str, max_resample: int):
        self.voxel_size = np.asarray(voxel_size, dtype=float)
        self.crop_size = tuple(int(c) for c in crop_size)
        self.ndim = len(crop_size)
        self.shape = grid_shape(crop_size)
        self.seed = seed
        self.augment = augment
        if planes not in PLANES:
            raise DatasetError(f"data.planes must be 'z' or 'zyx', got {planes!r}")
        self.planes = planes
        self.max_resample = int(max_resample)
        self.em_uint8 = False  # set by subclasses once their EM sources are known
        normals = (0, 1, 2) if self.ndim == 2 and planes == "zyx" else (0,)
        frames = [(tuple(self._box(n)[a] for a in self._frame(n)),
                   self.voxel_size[list(self._frame(n))]) for n in normals]
        self.augmenter = Augmenter(augmentation, augment, frames)

    def _ships_raw_em(self, sources: list[EMSource]) -> bool:
        """Whether samples can carry EM as raw uint8 (normalised on the device): every EM level
        read lies on the training grid, and no rotation or zoom interpolates it here (on the
        device, like the intensity changes, they come after normalisation)."""
        if self.augmenter.resamples_on_host:
            return False
        if any(s.em_range is not None for s in sources):
            return False  # non-uint8 EM keeps its precision: mapped and normalised here
        return all(same_voxel_size(self._em_level(s).scale, self.voxel_size)
                   for s in sources)

    def __len__(self) -> int:
        return 2**62  # indexed by global sample index; the sampler decides what is drawn

    # -- reading ----------------------------------------------------------------------------------

    def _em_level(self, source: EMSource) -> ScaleLevel:
        return em_level(source, self.voxel_size)

    # -- where ------------------------------------------------------------------------------------

    def _draw_normal(self, rng: np.random.Generator) -> int:
        return int(rng.integers(3)) if self.ndim == 2 and self.planes == "zyx" else 0

    def _box(self, normal: int) -> tuple[int, int, int]:
        return plane_box(self.crop_size, normal)

    def _range(self, box_min, box_max, box, min_fraction: float = 1.0):
        size = np.asarray(box) * self.voxel_size
        thin = np.asarray(box) == 1 if self.ndim == 2 else None
        return origin_range(box_min, box_max, size, min_fraction, thin)

    # -- geometry ---------------------------------------------------------------------------------

    def _frame(self, normal: int) -> tuple[int, ...]:
        """The 3D axes a sample keeps: all three in 3D, the plane's two in 2D."""
        return tuple(a for a in range(3) if self.ndim == 3 or a != normal)

    def _geometry(self, rng: np.random.Generator, level: ScaleLevel, origin, normal: int,
                  reader: Callable[[np.ndarray, tuple], SampleArrays],
                  fills: dict[str, float] | None = None):
        """Draw the augmentation plan and read the box at ``origin`` with its host part
        applied (:meth:`augment.Augmenter.host`: the box in the sample's frame (C, *crop_size),
        possibly as strided views; with EM left to the device to resample, the box read
        around the sample in a buffer, see :attr:`SampleArrays.in_buffer`).

        ``reader(origin, shape)`` returns a :class:`SampleArrays` of 3D arrays (C, D, H, W);
        ``fills``: what each label group reads outside the box. Returns the box, the plan and
        the frame's voxel size. With rotation or zoom on, the augmenter asks for a larger box
        around the sample; its origin is snapped to the EM level's grid here, and the rest of
        the centre's offset handed on as ``shift``.
        """
        box = self._box(normal)
        keep = list(self._frame(normal))
        vox = self.voxel_size[keep]
        out_shape = tuple(box[a] for a in keep)
        plan = self.augmenter.draw(rng, out_shape, vox)
        read_shape = self.augmenter.box_to_read(plan, out_shape, vox)

        def to_frame(arr: np.ndarray) -> np.ndarray:
            return np.take(arr, 0, axis=1 + normal) if self.ndim == 2 else arr

        if read_shape is None:  # the sample's own box
            read = reader(origin, box).map(to_frame)
            return self.augmenter.host(plan, read, out_shape, vox), plan, vox
        big = np.asarray(box)
        big[keep] = read_shape
        centre = np.asarray(origin, float) + np.asarray(box) * self.voxel_size / 2
        read_origin = grid_origin_snapped(level, self.voxel_size,
                                          centre - big * self.voxel_size / 2)
        shift = (centre - (read_origin + big * self.voxel_size / 2)) / self.voxel_size
        read = reader(read_origin, tuple(int(b) for b in big)).map(to_frame)
        return self.augmenter.host(plan, read, out_shape, vox, shift[keep], fills), plan, vox

    def _finish(self, box: SampleArrays, plan, vox, rng) -> Sample:
        """The sample of a finished box, with what is left to the device
        (:meth:`augment.Augmenter.payload`, which draws the intensity noise seed last)."""
        return Sample(image=_tensor(box.image), valid=_tensor(box.valid),
                      target=_tensor(box.target),
                      augmentation=self.augmenter.payload(plan, vox, rng, box.augmentation))

    # -- items ------------------------------------------------------------------------------------

    def _draw(self, rng: np.random.Generator) -> Sample:
        raise NotImplementedError

    def __getitem__(self, index: int) -> Sample:
        error: BaseException | None = None
        for attempt in range(self.max_resample + 1):
            try:
                out = self._draw(sample_rng(self.seed, index, attempt))
            except READ_ERRORS as e:
                error = e
                logger.warning("sample %d, draw %d of %d: %s; drawing a replacement", index,
                               attempt + 1, self.max_resample + 1, e)
                continue
            out.index, out.resampled = int(index), attempt
            return out
        raise DatasetError(
            f"sample {index}: {self.max_resample + 1} draws in a row failed to read (raise "
            f"data.max_resample or repair the data); the last error: {error}"
        ) from error


class SegmentationSamples(SampleDataset):
    """Random crops of EM with aligned binary targets and per-class validity masks.

    Item ``g`` is a :class:`~torchtitan.data.sampling.batch.Sample`: ``image`` (1, *crop)
    (float32, or raw uint8 when ``em_uint8``), ``target`` and ``valid`` (K, *crop) uint8,
    ``index`` (the global sample index) and ``resampled`` (replacements after read errors);
    with intensity augmentation or rotation and zoom made on the device also
    ``augmentation``, what is left to the device. In the latter case ``image`` is the box
    read around the sample, in a buffer (1, *augmenter.buffer_shape), and ``target`` and
    ``valid`` are not yet flipped. ``Batch.to`` makes a batch float32 model inputs and
    ``augment.Augmenter.device`` makes what was left to the device.
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
        *,
        augmentation: Augmentation | None = None,
        planes: str = "z",
        min_label_fraction: float = 1.0,
        class_balanced: bool = False,
        max_resample: int = 10,
        affinities: AffinitySpec | None = None,
    ):
        super().__init__(voxel_size, crop_size, seed, augment, augmentation, planes, max_resample)
        self.sources = sources
        self.by_name = {s.name: s for s in sources}
        self.reader = CropReader(sources, classes, voxel_size, affinities)
        self.crops = crops
        self.classes = list(classes)
        self.min_label_fraction = float(min_label_fraction)
        self.class_balanced = bool(class_balanced)
        if not crops:
            raise DatasetError("no training crops left (check data.val_crops / data.val_fraction)")
        check_class_names(self.classes, {k for s in sources for c in s.crops for k in c.classes}
                          | {k for c in crops for k in c.classes})
        for cls in (affinities.classes if affinities is not None else ()):
            if not any(has_ids(c, cls) for c in crops):
                raise DatasetError(
                    f"affinities.classes names {cls!r}, but no training crop stores {cls!r} with "
                    "object ids (a label group of that name whose attributes say "
                    "'instance_segmentation'; e.g. helpers/import_stack.py --ids "
                    f"{cls}): affinities need ids to tell objects apart. Import the labels "
                    "with ids, or remove the class from affinities.classes")
        # Training crops that annotate each class (itself or through its parts).
        self._crops_with = [[i for i, c in enumerate(crops) if annotates(c, cls)]
                            for cls in self.classes]
        self.em_uint8 = self._ships_raw_em([self.by_name[c.dataset] for c in crops])
        self._fg_cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fg_cache"] = OrderedDict()  # workers rebuild what they need
        return state

    # -- where ------------------------------------------------------------------------------------

    def _uniform_origin(self, rng: np.random.Generator, crop: LabelCrop, box) -> np.ndarray:
        lo, hi = self._range(crop.box_min, crop.box_max, box, self.min_label_fraction)
        return lo + rng.random(3) * (hi - lo)

    def foreground_points(self, crop_index: int, k: int) -> np.ndarray:
        """World positions (nm, float32 (N, 3)) of up to FG_POINTS voxels where class ``k`` is
        present in training crop ``crop_index``, on a grid FG_COARSENING times coarser than
        the training grid. Computed on first use and kept in a small per-process cache; the
        result depends only on the data, so eviction never changes a sample."""
        key = (crop_index, k)
        points = self._fg_cache.get(key)
        if points is not None:
            self._fg_cache.move_to_end(key)
            return points
        crop = self.crops[crop_index]
        step = self.voxel_size * FG_COARSENING
        shape = extent_shape(crop.box_max - crop.box_min, step, cover=True)
        try:
            target, valid = read_target(crop, self.classes[k], crop.box_min, step, shape)
            idx = np.argwhere(target & valid)
        except READ_ERRORS as e:  # this crop is not used for class k; the run goes on
            logger.warning("foreground index of %s for class %s: %s; the crop is left out of "
                           "class-balanced draws of that class", crop.full_name,
                           self.classes[k], e)
            idx = np.zeros((0, 3), np.int64)
        if len(idx) > FG_POINTS:  # evenly spread, deterministic
            idx = idx[np.linspace(0, len(idx) - 1, FG_POINTS).astype(np.int64)]
        points = voxel_centres(crop.box_min, step, idx).astype(np.float32)
        self._fg_cache[key] = points
        if len(self._fg_cache) > FG_CACHE:
            self._fg_cache.popitem(last=False)
        return points

    def _balanced_location(self, rng: np.random.Generator, box) -> tuple[LabelCrop, np.ndarray]:
        """A class uniformly, a training crop that annotates it and holds some of it, and a box
        in that crop around one of its voxels."""
        k = int(rng.integers(len(self.classes)))
        candidates = self._crops_with[k]
        if not candidates:  # annotated by no training crop (the loader refuses this)
            crop = self.crops[int(rng.integers(len(self.crops)))]
            return crop, self._uniform_origin(rng, crop, box)
        order = rng.permutation(len(candidates))
        points = np.zeros((0, 3), np.float32)
        for j in order:
            points = self.foreground_points(candidates[j], k)
            if len(points):
                crop = self.crops[candidates[j]]
                break
        else:  # the class is absent from every crop that annotates it
            crop = self.crops[candidates[order[0]]]
            return crop, self._uniform_origin(rng, crop, box)
        p = points[int(rng.integers(len(points)))].astype(float)
        size = np.asarray(box) * self.voxel_size
        # p anywhere in the box; a plane (thin axis) goes through p.
        u = np.where(np.asarray(box) == 1, 0.5, rng.random(3))
        lo, hi = self._range(crop.box_min, crop.box_max, box, self.min_label_fraction)
        return crop, np.clip(p - u * size, lo, hi)

    # -- items ------------------------------------------------------------------------------------

    def _draw(self, rng: np.random.Generator) -> Sample:
        normal = self._draw_normal(rng)
        box = self._box(normal)
        if self.class_balanced:
            crop, origin = self._balanced_location(rng, box)
        else:
            crop = self.crops[int(rng.integers(len(self.crops)))]
            origin = self._uniform_origin(rng, crop, box)
        level = self._em_level(self.by_name[crop.dataset])
        origin = grid_origin_snapped(level, self.voxel_size, origin)
        # Labels are read, resampled and flipped as stored values, and turned into targets
        # afterwards: nearest-neighbour moves commute with that voxel-wise function, and the
        # targets are then written once, contiguously, from the moved (strided) values.
        groups = groups_to_read(crop, self.classes)
        fills = {g: unknown_value(crop, g) for g in groups}
        box, plan, vox = self._geometry(rng, level, origin, normal,
                                        lambda o, s: self._read(crop, groups, o, s), fills)
        # An image still to be resampled on the device comes in a larger buffer.
        shape = self.crop_size if box.in_buffer else box.image.shape[1:]
        return self._finish(self._compose(crop, box, shape), plan, vox, rng)

    def _read(self, crop: LabelCrop, groups: list[str], origin, shape) -> SampleArrays:
        image, labels = self.reader.read_stored(crop, groups, origin, shape, self.em_uint8)
        return SampleArrays(image, labels=labels)

    def _compose(self, crop: LabelCrop, box: SampleArrays, shape) -> SampleArrays:
        """The moved box with its label values replaced by the targets and validity of the
        classes (and affinities), on spatial ``shape``."""
        labels, augmentation = box.labels, box.augmentation
        if self.reader.affinities is not None and augmentation is not None \
                and augmentation.label_axes is not None:
            # Label flips left to the device would move a voxel's affinity onto the wrong pair:
            # the label values are moved here, and the device's map is the identity.
            axes = augmentation.label_axes.numpy()
            labels = {g: host_axis_map(a[0], axes)[None] for g, a in labels.items()}
            augmentation = replace(augmentation, label_axes=identity_axes(len(shape)))
        target, valid = self.reader.compose(crop, labels, shape)
        return SampleArrays(box.image, valid, target, {}, augmentation)


def samples_kwargs(settings: DataSettings, kind: str = "segmentation") -> dict:
    """Constructor keywords of :class:`SegmentationSamples` (``kind='segmentation'``) or
    ``mae_samples.MAESamples`` (``kind='mae'``) from the run's data settings."""
    kwargs = {
        "augmentation": settings.augmentation,
        "planes": settings.data.planes,
        "max_resample": settings.data.max_resample,
    }
    if kind == "segmentation":
        kwargs.update(min_label_fraction=settings.data.min_label_fraction,
                      class_balanced=settings.data.class_balanced,
                      affinities=settings.affinities)
    elif kind == "mae":
        kwargs.update(foreground_threshold=settings.data.foreground_threshold)
    else:
        raise ValueError(f"kind must be 'segmentation' or 'mae', got {kind!r}")
    return kwargs


def build_segmentation_samples(settings: DataSettings, sources,
                               train_crops) -> SegmentationSamples:
    """The segmentation samples of a run over ``train_crops``."""
    d = settings.data
    return SegmentationSamples(sources, train_crops, d.classes, d.voxel_size, settings.crop_size,
                               settings.seed, **samples_kwargs(settings, "segmentation"))
