"""MAE samples: random EM crops anywhere inside the EM volumes (no labels needed), drawn by
global sample index like the segmentation samples of ``samples.py`` (whose machinery they
share), optionally redrawn until enough of the crop is foreground.

Held-out crops (``data.val_crops``) split the EM in two: training samples never overlap them,
validation samples lie inside them, so the validation loss is measured on EM the model never
saw (and a segmentation run validating on the same crops has not seen them either).
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import numpy as np
import torch

from torchtitan.choices import VOXEL_RTOL
from torchtitan.config.job_config import Augmentation
from torchtitan.data.sampling.augment import nearest_from_geometry
from torchtitan.data.sampling.batch import Sample
from torchtitan.data.crops.selection import DataSettings
from torchtitan.data.crops.layout import DatasetError, EMSource, LabelCrop
from torchtitan.cellmap.grids import grid_origin_snapped
from torchtitan.data.sampling.samples import SampleArrays, SampleDataset, samples_kwargs
from torchtitan.data.crops.reader import model_input_of, model_input_to_uint8, read_em

# Foreground filter: draws per sample before the best one is kept.
FOREGROUND_DRAWS = 16
# Draws of a training sample's place before giving up on finding one outside the held-out crops.
PLACE_DRAWS = 1000

T = TypeVar("T")


def foreground_fraction(image: np.ndarray) -> float:
    """Fraction of EM voxels whose raw value is non-zero (>= 0.5 after interpolation), for
    raw uint8 or normalised EM; padding outside the volume reads as zero."""
    if image.dtype == np.uint8:
        return float(np.mean(image > 0))
    return float(np.mean(image > model_input_of(0.5)))


def best_draw(draw_once: Callable[[], T], fraction: Callable[[T], float],
              threshold: float) -> T:
    """``draw_once()``, redrawn (up to FOREGROUND_DRAWS draws in all, stopping once one reaches
    ``threshold``) while its foreground ``fraction`` is below ``threshold``; the draw with
    the largest fraction is kept. ``threshold`` 0 draws once."""
    drawn = draw_once()
    if threshold <= 0:
        return drawn
    best, best_fraction = drawn, fraction(drawn)
    for _ in range(FOREGROUND_DRAWS - 1):
        if best_fraction >= threshold:
            break
        drawn = draw_once()
        drawn_fraction = fraction(drawn)
        if drawn_fraction > best_fraction:
            best, best_fraction = drawn, drawn_fraction
    return best


class MAESamples(SampleDataset):
    """Random EM crops anywhere inside the EM volumes (no labels needed).

    Item ``g``, a :class:`~torchtitan.data.sampling.batch.Sample`: ``image`` (1, *crop), ``valid``
    (1, *crop) (0 where the crop leaves the volume: padding, excluded from the loss),
    ``index``, ``resampled``, with intensity augmentation or rotation and zoom on the device
    ``augmentation`` (see :class:`SegmentationSamples`), and with
    ``num_patches`` > 0 the MAE masking ``noise`` (num_patches,), drawn from the sample's own
    generator. With ``foreground_threshold`` > 0 the place is redrawn (from the same generator,
    up to FOREGROUND_DRAWS times, keeping the best) until that fraction of the EM is non-zero.

    ``held_out`` crops: a sample box never overlaps one (its place is redrawn, up to
    PLACE_DRAWS times); with ``validation`` every sample lies inside one of them instead (a
    crop drawn uniformly, then a place in it; on an axis where the crop is thinner than the
    sample, centred on it), or anywhere when there are none.
    """

    def __init__(self, sources: list[EMSource], voxel_size, crop_size, seed: int,
                 augment: bool = True, num_patches: int = 0, *,
                 augmentation: Augmentation | None = None, planes: str = "z",
                 foreground_threshold: float = 0.0, max_resample: int = 10,
                 held_out: Sequence[LabelCrop] = (), validation: bool = False):
        super().__init__(voxel_size, crop_size, seed, augment, augmentation, planes, max_resample)
        self.sources = sources
        self.by_name = {s.name: s for s in sources}
        self.num_patches = num_patches
        self.foreground_threshold = float(foreground_threshold)
        self.em_uint8 = self._ships_raw_em(sources)
        self.held_out = list(held_out)
        self.validation = validation
        if self.held_out and not validation:
            self._place(np.random.default_rng(seed), self._box(0))  # fails now, not mid-run

    def _read(self, source: EMSource, origin, shape) -> SampleArrays:
        image, inside = read_em(source, self.voxel_size, origin, shape, raw=self.em_uint8)
        return SampleArrays(image[None], valid=inside[None].view(np.uint8))

    def _draw_once(self, rng: np.random.Generator):
        normal = self._draw_normal(rng)
        box = self._box(normal)
        if self.validation and self.held_out:
            source, level, origin = self._place_held_out(rng, box)
        else:
            source, level, origin = self._place(rng, box)
        return self._geometry(rng, level, origin, normal, lambda o, s: self._read(source, o, s))

    def _origin_in(self, rng: np.random.Generator, level, box_min, box_max, box) -> np.ndarray:
        """A place (snapped to the EM level's grid) for a box of ``box`` voxels in
        [box_min, box_max] (nm)."""
        lo, hi = self._range(box_min, box_max, box)
        return grid_origin_snapped(level, self.voxel_size, lo + rng.random(3) * (hi - lo))

    def _place(self, rng: np.random.Generator, box):
        """A source, its EM level and a place in it whose box overlaps no held-out crop."""
        for _ in range(PLACE_DRAWS):
            source = self.sources[int(rng.integers(len(self.sources)))]
            level = self._em_level(source)
            origin = self._origin_in(rng, level, level.box_min, level.box_max, box)
            if not self._overlaps_held_out(source.name, origin, box):
                return source, level, origin
        names = ", ".join(c.full_name for c in self.held_out)
        raise DatasetError(
            f"MAE: {PLACE_DRAWS} draws of a {list(self.crop_size)} crop all overlapped the "
            f"held-out crops ({names}, data.val_crops); the EM outside them is too small for "
            "the crop: hold out less, or use a smaller model.crop_size")

    def _place_held_out(self, rng: np.random.Generator, box):
        """A held-out crop (uniformly), its source and EM level, and a place in it."""
        crop = self.held_out[int(rng.integers(len(self.held_out)))]
        source = self.by_name[crop.dataset]
        level = self._em_level(source)
        return source, level, self._origin_in(rng, level, crop.box_min, crop.box_max, box)

    def _overlaps_held_out(self, dataset: str, origin, box) -> bool:
        end = np.asarray(origin) + np.asarray(box) * self.voxel_size
        tol = VOXEL_RTOL * self.voxel_size
        return any(np.all(origin < c.box_max - tol) and np.all(end > c.box_min + tol)
                   for c in self.held_out if c.dataset == dataset)

    def _foreground(self, box: SampleArrays) -> float:
        """Foreground fraction of a drawn sample's EM (nearest neighbour when the EM is still
        to be resampled on the device)."""
        image = box.image
        if not box.in_buffer:
            return foreground_fraction(image)
        out_shape = box.valid.shape[1:]
        raw = image if image.dtype == np.uint8 else np.rint(model_input_to_uint8(image))
        return float(np.mean(nearest_from_geometry((raw > 0).view(np.uint8),
                                                   box.augmentation.geometry.numpy(), out_shape)))

    def _draw(self, rng: np.random.Generator) -> Sample:
        drawn = best_draw(lambda: self._draw_once(rng), lambda d: self._foreground(d[0]),
                          self.foreground_threshold)
        out = self._finish(*drawn, rng)
        if self.num_patches:
            out.noise = torch.from_numpy(rng.random(self.num_patches, dtype=np.float32))
        return out


def build_mae_samples(settings: DataSettings, sources, seed_offset: int = 0, num_patches: int = 0,
                      augment: bool = True, held_out: list[LabelCrop] = (),
                      validation: bool = False) -> MAESamples:
    """MAE samples outside the ``held_out`` crops, or with ``validation`` inside them (and
    ``augment=False``, a ``seed_offset``: the fixed validation stream)."""
    return MAESamples(sources, settings.data.voxel_size, settings.crop_size,
                      settings.seed + seed_offset, augment=augment, num_patches=num_patches,
                      held_out=held_out, validation=validation, **samples_kwargs(settings, "mae"))
