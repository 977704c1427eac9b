"""Resampling of (C, *spatial) arrays by an affine map, on the host: linear interpolation for
EM, nearest neighbour for stored label values. ``augment.py`` rotates and zooms samples with
it; the slices dataset cuts its windows with it.

Rotation about z and isotropic zoom (the only maps the augmentation draws) keep z separate
from y and x, and are resampled by per-axis gathers (:func:`_resample_separable`), 3-4x
faster than scipy's general affine transform, which handles every other map.
"""

from __future__ import annotations

import numpy as np
import scipy.ndimage as ndi


def resample(arr: np.ndarray, matrix: np.ndarray, shape, shift, order: int,
             cval: float) -> np.ndarray:
    """Resample every channel of ``arr`` (C, *in_shape) onto ``shape``: ``order`` 1 is
    (bi/tri)linear interpolation, 0 nearest neighbour; positions outside the input read
    ``cval`` (scipy's ``mode="constant"``).

    Output voxel ``i`` reads input position ``matrix @ (i - centre_out) + centre_in + shift``
    (``shift``: the output centre minus the input centre, in input voxels). Nearest neighbour
    copies input values: integer inputs keep their dtype (and exactness); otherwise the output
    is float32.
    """
    centre_out = (np.asarray(shape, dtype=float) - 1) / 2
    centre_in = (np.asarray(arr.shape[1:], dtype=float) - 1) / 2
    offset = centre_in + np.asarray(shift, dtype=float) - matrix @ centre_out
    if _z_separable(matrix):
        return _resample_separable(arr, matrix, offset, tuple(shape), order, cval)
    exact = order == 0 and arr.dtype.kind in "uib"
    out = np.empty((arr.shape[0], *shape), dtype=arr.dtype if exact else np.float32)
    for c in range(arr.shape[0]):
        src = arr[c] if exact else arr[c].astype(np.float32, copy=False)
        ndi.affine_transform(src, matrix, offset=offset, output_shape=tuple(shape),
                             output=out[c], order=order, mode="constant", cval=cval,
                             prefilter=False)
    return out


def _z_separable(matrix: np.ndarray) -> bool:
    """2D, or 3D with z mapped on its own (rotation about z and isotropic zoom are)."""
    return matrix.shape == (2, 2) or (
        matrix.shape == (3, 3) and not matrix[0, 1:].any() and not matrix[1:, 0].any())


def _resample_separable(arr: np.ndarray, matrix: np.ndarray, offset: np.ndarray, shape,
                        order: int, cval: float) -> np.ndarray:
    """:func:`resample` for a z-separable ``matrix``, 3-4x faster than scipy's general affine
    transform: z is resampled along its own axis, then every plane by one 2D map of input
    positions, computed once and applied to all planes and channels as flat gathers.
    Trilinear interpolation is the product of the per-axis linear weights, so this is the
    same interpolation (up to float32 rounding); nearest neighbour gives identical output."""
    if matrix.shape == (2, 2):  # a 2D sample: one plane, z the identity
        vol, mz, oz, pm, po = arr[:, None], 1.0, 0.0, matrix, offset
        out_shape = (1, *shape)
    else:
        vol, mz, oz, pm, po = arr, matrix[0, 0], offset[0], matrix[1:, 1:], offset[1:]
        out_shape = shape
    n, (d, h, w), (do, ho, wo) = vol.shape[0], vol.shape[1:], out_shape
    flat = vol.reshape(n, d, h * w)
    pz = mz * np.arange(do) + oz
    ii = np.arange(ho, dtype=float)[:, None]
    jj = np.arange(wo, dtype=float)[None, :]
    py = (pm[0, 0] * ii + pm[0, 1] * jj + po[0]).ravel()
    px = (pm[1, 0] * ii + pm[1, 1] * jj + po[1]).ravel()
    z_out = (pz < 0) | (pz > d - 1)
    plane_out = (py < 0) | (py > h - 1) | (px < 0) | (px > w - 1)

    if order == 0:
        zi = np.clip(np.floor(pz + 0.5), 0, d - 1).astype(np.intp)
        fi = (np.clip(np.floor(py + 0.5), 0, h - 1).astype(np.intp) * w
              + np.clip(np.floor(px + 0.5), 0, w - 1).astype(np.intp))
        out = np.take(flat[:, zi], fi, axis=2)
        if arr.dtype.kind not in "uib":
            out = out.astype(np.float32)
    else:
        # Linear along z on whole input planes ...
        z0 = np.clip(np.floor(pz), 0, max(d - 2, 0)).astype(np.intp)
        wz = np.clip(pz - z0, 0, 1).astype(np.float32)[:, None]
        planes = flat[:, z0].astype(np.float32)
        if d > 1:
            planes *= 1 - wz
            planes += flat[:, z0 + 1] * wz
        # ... then bilinear in each plane: four gathers at the corners of each position.
        y0 = np.clip(np.floor(py), 0, max(h - 2, 0)).astype(np.intp)
        x0 = np.clip(np.floor(px), 0, max(w - 2, 0)).astype(np.intp)
        wy = np.clip(py - y0, 0, 1).astype(np.float32)
        wx = np.clip(px - x0, 0, 1).astype(np.float32)
        corner = y0 * w + x0
        dy, dx = (w if h > 1 else 0), (1 if w > 1 else 0)
        out = np.take(planes, corner, axis=2)
        out *= (1 - wy) * (1 - wx)
        for step, weight in ((dx, (1 - wy) * wx), (dy, wy * (1 - wx)), (dy + dx, wy * wx)):
            part = np.take(planes, corner + step, axis=2)
            part *= weight
            out += part
    if z_out.any():
        out[:, z_out] = cval
    if plane_out.any():
        out[:, :, plane_out] = cval
    return out.reshape(arr.shape[0], *shape)
