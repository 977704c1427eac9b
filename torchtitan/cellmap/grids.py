"""Voxel grids placed in the world, and the scale levels of stored multiscale images.

Conventions (those of OME-NGFF and the CellMap data): axis order (z, y, x); positions and
sizes in nanometres; a grid's ``translation`` is the world position of the *centre* of its
voxel 0, so voxel ``i`` has its centre at ``translation + i * scale`` and the grid covers
``[translation - scale / 2, translation - scale / 2 + shape * scale)``.

A "training grid" is given instead by its ``origin`` (the outer corner of voxel 0), a voxel
size and a shape; :func:`voxel_positions` maps it into a level's index space.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchtitan.choices import VOXEL_RTOL, same_size

AXES = ("z", "y", "x")

# How far a float extent (nm read from metadata and configs are not exact) may miss a whole
# number of voxels and still count as that number.
SHAPE_SLACK = 1e-6
# World positions (nm) closer than this are the same place (a crop's box against its volume's,
# an ROI against the volume).
POSITION_TOL_NM = 1e-3


@dataclass(frozen=True)
class Grid:
    """A regular voxel grid placed in the world (see the module docstring)."""

    shape: tuple[int, int, int]  # voxels (z, y, x)
    scale: tuple[float, float, float]  # nm per voxel (z, y, x)
    translation: tuple[float, float, float]  # nm, centre of voxel 0

    @property
    def box_min(self) -> np.ndarray:
        """World position (nm) of the outer corner of voxel 0."""
        return np.asarray(self.translation) - np.asarray(self.scale) / 2

    @property
    def box_max(self) -> np.ndarray:
        """World position (nm) of the outer corner of the last voxel."""
        return self.box_min + np.asarray(self.shape) * np.asarray(self.scale)

    def axis(self, d: int) -> np.ndarray:
        """World coordinates of the voxel centres along axis ``d`` (float32)."""
        return (self.translation[d] + self.scale[d] * np.arange(self.shape[d])).astype(np.float32)

    def axes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.axis(0), self.axis(1), self.axis(2)


@dataclass(frozen=True)
class ScaleLevel(Grid):
    """One resolution level of a stored OME-NGFF multiscale image: its grid and its array."""

    path: str  # filesystem path of the zarr array


def closest_level(levels: list[ScaleLevel], voxel_size) -> int:
    """Index of the level whose voxel size is closest to ``voxel_size`` (log distance)."""
    v = np.asarray(voxel_size, dtype=float)
    dist = [float(np.abs(np.log(np.asarray(lv.scale) / v)).sum()) for lv in levels]
    return int(np.argmin(dist))


def label_level(levels: list[ScaleLevel], voxel_size) -> ScaleLevel:
    """The level to read labels from: the coarsest one still at least as fine as the grid
    (nearest sampling from it loses no detail), or the closest one when all are coarser."""
    v = np.asarray(voxel_size, dtype=float)
    finer = [lv for lv in levels if np.all(np.asarray(lv.scale) <= v * (1 + VOXEL_RTOL))]
    if finer:
        return max(finer, key=lambda lv: float(np.prod(lv.scale)))
    return levels[closest_level(levels, v)]


def voxel_centres(origin, voxel_size, index):
    """World positions (nm) of the centres of the voxels ``index`` (any array of voxel
    indices, or one axis's ``np.arange``) of a grid whose voxel 0 has its outer corner at
    ``origin``."""
    return origin + (index + 0.5) * voxel_size


def extent_shape(extent, voxel_size, *, cover: bool) -> tuple[int, ...]:
    """Voxels of ``voxel_size`` along each axis of ``extent`` (nm): as many as fit in it, or
    (``cover``) as many as cover it; at least one (:data:`SHAPE_SLACK` absorbs float noise)."""
    if cover:
        return tuple(int(max(1, np.ceil(e / s - SHAPE_SLACK))) for e, s in zip(extent, voxel_size))
    return tuple(int(max(1, np.floor(e / s + SHAPE_SLACK))) for e, s in zip(extent, voxel_size))


def centred_grid(box_min, box_max, voxel_size, *, cover: bool
                 ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Origin (nm, outer corner of voxel 0) and shape of the grid of ``voxel_size`` that fits
    in (or, ``cover``, covers) the box, centred on it: any remainder is split evenly between
    both sides."""
    v = np.asarray(voxel_size, dtype=float)
    extent = np.asarray(box_max, dtype=float) - np.asarray(box_min, dtype=float)
    shape = extent_shape(extent, v, cover=cover)
    origin = np.asarray(box_min, dtype=float) + (extent - np.asarray(shape) * v) / 2
    return origin, shape  # type: ignore[return-value]


def box_inside(lo, hi, outer_lo, outer_hi) -> bool:
    """Whether the box ``[lo, hi)`` lies inside ``[outer_lo, outer_hi)`` (nm, within
    :data:`POSITION_TOL_NM`)."""
    return not (np.any(np.asarray(lo) < np.asarray(outer_lo) - POSITION_TOL_NM)
                or np.any(np.asarray(hi) > np.asarray(outer_hi) + POSITION_TOL_NM))


def voxel_positions(level: Grid, origin, voxel_size, shape) -> list[np.ndarray]:
    """Per axis, the continuous voxel coordinates (in ``level``'s index space) of the centres
    of the training grid (``origin`` = outer corner of its voxel 0, nm)."""
    out = []
    for ax in range(3):
        centres = voxel_centres(origin[ax], voxel_size[ax], np.arange(shape[ax]))
        out.append((centres - level.translation[ax]) / level.scale[ax])
    return out


def grid_origin_snapped(level: Grid, voxel_size, approx_origin) -> np.ndarray:
    """Move ``approx_origin`` (nm) onto the voxel corners of ``level`` on every axis where its
    voxel size equals the training voxel size, so reading needs no interpolation."""
    origin = np.asarray(approx_origin, dtype=float).copy()
    for ax in range(3):
        if same_size(level.scale[ax], voxel_size[ax]):
            corner0 = level.translation[ax] - level.scale[ax] / 2
            k = np.round((origin[ax] - corner0) / voxel_size[ax])
            origin[ax] = corner0 + k * voxel_size[ax]
    return origin
