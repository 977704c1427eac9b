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


def voxel_positions(level: Grid, origin, voxel_size, shape) -> list[np.ndarray]:
    """Per axis, the continuous voxel coordinates (in ``level``'s index space) of the centres
    of the training grid (``origin`` = outer corner of its voxel 0, nm)."""
    out = []
    for ax in range(3):
        centres = origin[ax] + (np.arange(shape[ax]) + 0.5) * voxel_size[ax]
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
