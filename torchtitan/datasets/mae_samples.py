"""MAE samples: random EM crops anywhere inside the EM volumes (no labels needed), drawn by
global sample index like the segmentation samples of ``samples.py`` (whose machinery they
share), optionally redrawn until enough of the crop is foreground."""

from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np
import torch

from torchtitan.config_manager import Augmentation
from torchtitan.datasets.augment import nearest_from_geometry
from torchtitan.datasets.batch import Sample
from torchtitan.datasets.cellmap import EMSource
from torchtitan.cellmap.grids import grid_origin_snapped
from torchtitan.datasets.samples import SampleArrays, SampleDataset, read_em

# Foreground filter: draws per sample before the best one is kept.
FOREGROUND_DRAWS = 16

T = TypeVar("T")


def foreground_fraction(image: np.ndarray) -> float:
    """Fraction of EM voxels whose raw value is non-zero (>= 0.5 after interpolation), for
    raw uint8 or normalised EM; padding outside the volume reads as zero."""
    if image.dtype == np.uint8:
        return float(np.mean(image > 0))
    return float(np.mean(image > -1.0 + 0.5 / 127.5))


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

    Item ``g``, a :class:`~torchtitan.datasets.batch.Sample`: ``image`` (1, *crop), ``valid``
    (1, *crop) (0 where the crop leaves the volume: padding, excluded from the loss),
    ``index``, ``resampled``, with intensity
    augmentation ``intensity`` and ``noise_seed``, with rotation or zoom on the device
    ``geometry`` and ``label_axes`` (see :class:`SegmentationSamples`), and with
    ``num_patches`` > 0 the MAE masking ``noise`` (num_patches,), drawn from the sample's own
    generator. With ``foreground_threshold`` > 0 the place is redrawn (from the same generator,
    up to FOREGROUND_DRAWS times, keeping the best) until that fraction of the EM is non-zero.
    """

    def __init__(self, sources: list[EMSource], voxel_size, crop_size, seed: int,
                 augment: bool = True, num_patches: int = 0, *,
                 augmentation: Augmentation | None = None, planes: str = "z",
                 foreground_threshold: float = 0.0, max_resample: int = 10):
        super().__init__(voxel_size, crop_size, seed, augment, augmentation, planes, max_resample)
        self.sources = sources
        self.num_patches = num_patches
        self.foreground_threshold = float(foreground_threshold)
        self.em_uint8 = self._ships_raw_em(sources)

    def _read(self, source: EMSource, origin, shape) -> SampleArrays:
        image, inside = read_em(source, self.voxel_size, origin, shape, raw=self.em_uint8)
        return SampleArrays(image[None], valid=inside[None].view(np.uint8))

    def _draw_once(self, rng: np.random.Generator):
        normal = self._draw_normal(rng)
        box = self._box(normal)
        source = self.sources[int(rng.integers(len(self.sources)))]
        level = self._em_level(source)
        lo, hi = self._range(level.box_min, level.box_max, box)
        origin = grid_origin_snapped(level, self.voxel_size, lo + rng.random(3) * (hi - lo))
        return self._geometry(rng, level, origin, normal, lambda o, s: self._read(source, o, s))

    def _foreground(self, box: SampleArrays) -> float:
        """Foreground fraction of a drawn sample's EM (nearest neighbour when the EM is still
        to be resampled on the device)."""
        image = box.image
        if box.geometry is None:
            return foreground_fraction(image)
        out_shape = box.valid.shape[1:]
        raw = image if image.dtype == np.uint8 else np.rint((image + 1) * 127.5)
        return float(np.mean(nearest_from_geometry((raw > 0).view(np.uint8), box.geometry,
                                                   out_shape)))

    def _draw(self, rng: np.random.Generator) -> Sample:
        drawn = best_draw(lambda: self._draw_once(rng), lambda d: self._foreground(d[0]),
                          self.foreground_threshold)
        out = self._finish(*drawn, rng)
        if self.num_patches:
            out.noise = torch.from_numpy(rng.random(self.num_patches, dtype=np.float32))
        return out
