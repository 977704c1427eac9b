"""Training augmentations: geometric ones applied alike to EM and labels, intensity ones to EM
only. Every parameter is drawn from the sample's own generator.

:class:`Augmenter`, made from the config's ``[augmentation]`` section, is the one object the
datasets ask: it draws a sample's :class:`Plan`, applies the host part in the loader worker
and packs the rest into one :class:`DeviceAugmentation`, which the sample and its batch carry
(``augmentation``) until :meth:`Augmenter.device` makes it on the device. A new augmentation
is an option of the config section and code here.

Arrays here are (C, *spatial) in the sample's frame: (C, H, W) for 2D samples (whatever
plane they were cut from) and (C, D, H, W) for 3D. ``vox`` is the frame's voxel size in nm.

Geometry, in the order applied:

* rotation by up to ``rotate_deg`` about the frame's normal (2D) or about z (3D) and an
  isotropic zoom in [1 - scale, 1 + scale], both in physical units, so that anisotropic voxels
  stay correct. They resample a larger box read around the sample (see :func:`read_shape`):
  linear interpolation for EM, nearest neighbour for stored label values;
* 90 degree rotations in every plane whose two axes have equal voxel size and sample size;
* flips of every axis, then a y/x transpose (only where y and x are isotropic and square).

With ``resample_on`` "device" (the default on a GPU) the linear interpolation of EM and the
labels' flips are left to the device: the sample carries the read box and one affine map
(:func:`device_geometry`, :func:`apply_geometry`, :func:`axis_map`). Intensity changes are
always made on the device (:func:`apply_intensity`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from torchtitan.choices import same_size
from torchtitan.config.job_config import Augmentation
from torchtitan.data.sampling.resampling import resample


@dataclass
class Plan:
    """What :meth:`Augmenter.draw` draws for one sample (the noise seed aside)."""

    flip: list[bool] = field(default_factory=list)
    swap: bool = False
    rot90: list[tuple[tuple[int, int], int]] = field(default_factory=list)  # (axes, k)
    angle: float = 0.0  # radians
    zoom: float = 1.0
    contrast: float = 1.0
    gamma: float = 1.0
    blur: float = 0.0  # sigma in voxels of the finest axis


def _isotropic_pairs(shape, vox) -> list[tuple[int, int]]:
    n = len(shape)
    return [(a, b) for a in range(n) for b in range(a + 1, n)
            if shape[a] == shape[b] and same_size(vox[a], vox[b])]


# ---------------------------------------------------------------------------------------------
# Rotation and zoom by resampling
# ---------------------------------------------------------------------------------------------


def resample_matrix(plan: Plan, vox) -> np.ndarray | None:
    """The matrix that maps an output voxel offset (from the sample centre) to the input voxel
    offset it samples, or None when the plan neither rotates nor zooms.

    In physical units an output offset ``d`` reads the input at ``R d / zoom`` (R: rotation
    about the normal in 2D, about z in 3D); in voxel units that is ``V^-1 R V / zoom``.
    """
    if plan.angle == 0.0 and plan.zoom == 1.0:
        return None
    vox = np.asarray(vox, dtype=float)
    ndim = len(vox)
    a, b = ndim - 2, ndim - 1  # the rotated plane: the 2D plane, or y-x in 3D
    rot = np.eye(ndim)
    c, s = math.cos(plan.angle), math.sin(plan.angle)
    rot[a, a], rot[a, b], rot[b, a], rot[b, b] = c, -s, s, c
    return (rot / plan.zoom) * vox[None, :] / vox[:, None]


def read_shape(shape, matrix: np.ndarray) -> tuple[int, ...]:
    """Shape of the box to read, centred on the sample, that holds every input voxel the
    resampling touches (with one voxel to spare on each side for interpolation)."""
    half = (np.asarray(shape, dtype=float) - 1) / 2  # output extent, voxels from the centre
    reach = np.abs(matrix) @ half  # input extent, voxels from the centre
    return tuple(int(2 * math.ceil(r + 1e-6) + 3) for r in reach)


# ---------------------------------------------------------------------------------------------
# Rotation and zoom of EM on the device
# ---------------------------------------------------------------------------------------------
# Linear interpolation of a 128^3 EM sample costs a loader worker about as much CPU as reading
# it, and a GPU next to nothing. With ``resample_on="device"`` samples therefore carry the box
# read around them (raw, in a buffer of one fixed shape per run, so that samples batch) and
# ``geometry``: the map from each output voxel to the buffer position it reads, with the
# flips, 90 degree rotations and transposes folded in. Labels are rotated and zoomed in the
# workers (nearest neighbour, cheap) but not flipped: a 90 degree turn through z makes that
# copy hop across memory, so they carry ``label_axes`` (:func:`axis_map`) instead.
# :meth:`Augmenter.device` finishes both (:func:`apply_geometry`, :func:`apply_axis_map`).


def max_read_shape(shape, vox, params: Augmentation) -> tuple[int, ...]:
    """The largest :func:`read_shape` over every rotation and zoom ``params`` can draw for a
    sample of ``shape`` and voxel size ``vox`` (the fixed buffer shape)."""
    half = (np.asarray(shape, dtype=float) - 1) / 2
    vox = np.asarray(vox, dtype=float)
    zoom = 1 - params.scale if params.scale > 0 else 1.0
    reach = half / zoom
    theta = min(math.radians(params.rotate_deg), math.pi)
    a, b = len(shape) - 2, len(shape) - 1
    for u, v in ((a, b), (b, a)):
        # reach[u] = (|cos t| half[u] + |sin t| half[v] vox[v] / vox[u]) / zoom, |t| <= theta:
        # largest at t = atan(q / p), or at theta when theta stops short of it.
        p, q = half[u], half[v] * vox[v] / vox[u]
        top = math.hypot(p, q) if theta >= math.atan2(q, p) else p * math.cos(theta) + q * math.sin(theta)
        reach[u] = top / zoom
    return tuple(int(2 * math.ceil(r + 1e-4) + 3) for r in reach)


def flip_map(plan: Plan, shape) -> tuple[np.ndarray, np.ndarray]:
    """``(P, q)`` such that voxel ``j`` of ``apply_flips(arr, plan)`` is voxel ``P @ j + q`` of
    ``arr`` (spatial shape ``shape``). Read off :func:`apply_flips` itself, applied to
    broadcast index grids (nothing is allocated), so the two can never disagree."""
    n = len(shape)
    grids = []
    for ax, size in enumerate(shape):
        index = np.arange(size).reshape([size if d == ax else 1 for d in range(n)])
        grids.append(apply_flips(np.broadcast_to(index, tuple(shape))[None], plan)[0])
    q = np.array([g[(0,) * n] for g in grids], dtype=float)
    P = np.zeros((n, n))
    for k in range(n):
        if grids[0].shape[k] > 1:
            unit = tuple(int(d == k) for d in range(n))
            P[:, k] = np.array([g[unit] for g in grids], dtype=float) - q
    return P, q


def device_geometry(matrix: np.ndarray, plan: Plan, out_shape, in_shape, shift) -> np.ndarray:
    """``[A | b]`` (n, n + 1): output voxel ``j`` of the finished sample (resampled as
    :func:`resample` does, then :func:`apply_flips`) reads input position ``A @ j + b`` of a
    box of shape ``in_shape`` (its corner at the buffer's)."""
    centre_out = (np.asarray(out_shape, dtype=float) - 1) / 2
    centre_in = (np.asarray(in_shape, dtype=float) - 1) / 2
    P, q = flip_map(plan, out_shape)
    A = matrix @ P
    b = matrix @ (q - centre_out) + centre_in + np.asarray(shift, dtype=float)
    return np.concatenate([A, b[:, None]], axis=1)


def axis_map(plan: Plan, shape) -> np.ndarray:
    """:func:`apply_flips` as data: int64 (2, n), ``[perm, flip]``, for
    :func:`apply_axis_map`."""
    P, _ = flip_map(plan, shape)
    n = len(shape)
    perm, flip = list(range(n)), [0] * n
    for k in range(n):
        nz = np.flatnonzero(P[k])
        if len(nz):  # pre-flip axis k becomes output axis nz[0], reversed if the sign is -1
            perm[int(nz[0])] = k
            flip[int(nz[0])] = int(P[k, nz[0]] < 0)
    return np.array([perm, flip], dtype=np.int64)


def apply_axis_map(x: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """The flips, 90 degree turns and transposes of :func:`axis_map` on a batch (B, C,
    *spatial), each sample with its own ``axes`` row (B, 2, n), on ``x``'s device."""
    out = []
    for b, (perm, flip) in enumerate(axes.tolist()):
        y = x[b].permute(0, *(1 + p for p in perm))
        dims = [1 + m for m, f in enumerate(flip) if f]
        out.append(y.flip(dims) if dims else y)
    return torch.stack(out)


def host_axis_map(arr: np.ndarray, axes: np.ndarray, channels: bool = False) -> np.ndarray:
    """:func:`apply_axis_map` of one sample on the host: ``arr`` (*spatial), or (C, *spatial)
    with ``channels``, moved by ``axes`` (2, n) ``[perm, flip]``."""
    perm, flip = (list(map(int, row)) for row in np.asarray(axes))
    lead = 1 if channels else 0
    out = np.transpose(arr, tuple(range(lead)) + tuple(lead + p for p in perm))
    dims = tuple(lead + m for m, f in enumerate(flip) if f)
    return np.flip(out, dims) if dims else out


def identity_axes(n: int) -> torch.Tensor:
    """The ``label_axes`` of no move (:func:`axis_map` of a plan without flips or turns)."""
    return torch.tensor([list(range(n)), [0] * n], dtype=torch.int64)


def nearest_from_geometry(arr: np.ndarray, geometry: np.ndarray, out_shape) -> np.ndarray:
    """Nearest-neighbour version of :func:`apply_geometry` for one sample on the host
    (C, *buffer) -> (C, *out_shape); positions outside read 0."""
    n = len(out_shape)
    A, b = geometry[:, :n].astype(float), geometry[:, n].astype(float)
    centre_out = (np.asarray(out_shape, dtype=float) - 1) / 2
    centre_in = (np.asarray(arr.shape[1:], dtype=float) - 1) / 2
    return resample(arr, A, out_shape, b + A @ centre_out - centre_in, order=0, cval=0)


def apply_geometry(image: torch.Tensor, geometry: torch.Tensor, out_shape) -> torch.Tensor:
    """Resample a batch of normalised EM buffers (B, C, *buffer) onto ``out_shape`` by linear
    interpolation, sample ``i`` reading position ``A @ j + b`` for output voxel ``j``
    (``geometry[i] = [A | b]``, voxel units, axes in array order). Positions outside the
    buffer read -1 (raw 0), as :func:`resample` does for EM."""
    n = len(out_shape)
    size_in = torch.tensor(image.shape[2:], dtype=torch.float64)
    half_out = (torch.tensor(out_shape, dtype=torch.float64) - 1) / 2
    geometry = geometry.to("cpu", torch.float64)
    A, b = geometry[:, :, :n], geometry[:, :, n]
    # affine_grid works in [-1, 1] coordinates (align_corners: -1 and 1 are the edge voxels'
    # centres) with axes in x, y(, z) order: rescale, and reverse both axis orders.
    to_unit = 2 / (size_in - 1).clamp(min=1)
    theta = to_unit[:, None] * A * half_out[None, :]
    offset = to_unit * (A @ half_out + b) - 1
    affine = torch.cat([theta.flip(1, 2), offset.flip(1)[..., None]], dim=2)
    affine = affine.to(image.device, torch.float32)
    grid = F.affine_grid(affine, [image.shape[0], 1, *out_shape], align_corners=True)
    # Zero padding on image + 1, so that outside reads -1.
    out = F.grid_sample(image.float() + 1, grid, mode="bilinear", padding_mode="zeros",
                        align_corners=True)
    return out.sub_(1)


# ---------------------------------------------------------------------------------------------
# Shape-preserving geometry and intensity
# ---------------------------------------------------------------------------------------------


def apply_flips(arr: np.ndarray, plan: Plan) -> np.ndarray:
    """90 degree rotations, flips and the y/x transpose of an array (C, *spatial), as a view."""
    for (a, b), k in plan.rot90:
        if k:
            arr = np.rot90(arr, k, axes=(1 + a, 1 + b))
    for ax, f in enumerate(plan.flip):
        if f:
            arr = np.flip(arr, axis=1 + ax)
    if plan.swap:
        arr = np.swapaxes(arr, -1, -2)
    return arr  # a strided view: whoever writes it out next makes the one copy


# Intensity changes run on the device, on whole batches (:meth:`Augmenter.device`): on the
# host they cost as much CPU as reading the sample (blur, noise and gamma of a 128^3 crop take
# about 100 ms), on a GPU next to nothing. A sample's :class:`DeviceAugmentation` carries what
# was drawn for it: ``intensity`` = (gamma, contrast, noise_std, blur sigma in voxels along
# z, y, x; 0 for an axis a 2D sample does not have) and ``noise_seed``.
BLUR_TRUNCATE = 3.0  # Gaussian kernels reach this many sigmas


def intensity_params(plan: Plan, params: Augmentation, vox,
                     rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`apply_intensity` needs for one sample, drawn from its generator: the
    sample's ``intensity`` row and ``noise_seed``."""
    vox = np.asarray(vox, dtype=float)
    sigma = np.zeros(3)
    if plan.blur > 0:
        sigma[3 - len(vox):] = plan.blur * vox.min() / vox  # the same physical width on every axis
    seed = int(rng.integers(2**62)) if params.noise_std > 0 else 0
    values = [plan.gamma, plan.contrast, params.noise_std, *sigma]
    return torch.tensor(values, dtype=torch.float32), torch.tensor(seed, dtype=torch.int64)


def _gaussian_kernel(sigma: float) -> np.ndarray:
    radius = int(BLUR_TRUNCATE * sigma + 0.5)
    x = np.arange(-radius, radius + 1, dtype=np.float64)
    k = np.exp(-0.5 * (x / sigma) ** 2)
    return (k / k.sum()).astype(np.float32)


def _blur_axis(x: torch.Tensor, dim: int, sigma: float) -> torch.Tensor:
    """Gaussian blur of ``x`` along ``dim``, edges extended by their value (scipy's
    ``mode="nearest"``), as a sum of shifted copies: kernels are at most a few taps wide,
    and this is 6x faster than a convolution on the CPU and as fast on a GPU."""
    kernel = _gaussian_kernel(sigma).tolist()
    radius = len(kernel) // 2
    if radius == 0:
        return x
    n = x.shape[dim]
    edge = list(x.shape)
    edge[dim] = radius
    padded = torch.cat([x.narrow(dim, 0, 1).expand(edge), x, x.narrow(dim, n - 1, 1).expand(edge)],
                       dim)
    out = padded.narrow(dim, 0, n) * kernel[0]
    for k in range(1, len(kernel)):
        out.add_(padded.narrow(dim, k, n), alpha=kernel[k])
    return out


def apply_intensity(image: torch.Tensor, intensity: torch.Tensor,
                    noise_seed: torch.Tensor) -> torch.Tensor:
    """Gamma, contrast, blur and additive noise on a batch of normalised EM (B, C, *spatial)
    in [-1, 1], each sample with its own ``intensity`` row and ``noise_seed`` (see
    :func:`intensity_params`; both on the host, so reading them costs no device sync).

    Every sample is changed on its own, so the result does not depend on how samples are
    batched; the noise comes from a generator seeded with the sample's seed on the image's
    device (the same stream for the same seed and device type).
    """
    rows = intensity.tolist()
    seeds = noise_seed.tolist()
    spatial = image.dim() - 2
    out = []
    for b, (gamma, contrast, noise_std, *sigma) in enumerate(rows):
        x = image[b].float()
        if gamma != 1.0:  # x ** gamma as exp(gamma log x): 2.5x faster on the CPU, 0 stays 0
            x = ((x + 1) * 0.5).clamp_(0, 1).log_().mul_(gamma).exp_().mul_(2).sub_(1)
        if contrast != 1.0:
            mean = x.mean()
            x = (x - mean).mul_(contrast).add_(mean)
        for d, s in enumerate(sigma[3 - spatial:]):
            if s > 0:
                x = _blur_axis(x, 1 + d, s)
        if noise_std > 0:
            gen = torch.Generator(device=x.device)
            gen.manual_seed(int(seeds[b]))
            x = x + noise_std * torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)
        out.append(x)
    return torch.stack(out)


# ---------------------------------------------------------------------------------------------
# What a sample ships for the device
# ---------------------------------------------------------------------------------------------


@dataclass
class DeviceAugmentation:
    """The part of one sample's augmentation left to the device: one unit on
    :class:`~torchtitan.data.sampling.batch.Sample` (``augmentation``, shapes below) and, stacked
    along a new first axis by :meth:`collate`, on the ``Batch``. A field is None when nothing
    of its kind was drawn; a sample with nothing left to the device carries None instead.

    Its tensors stay on the host when the batch moves to the device: :meth:`apply` reads them
    there (``.tolist()``, the affine grid built on the CPU), so that reading them costs no
    device sync.
    """

    geometry: torch.Tensor | None = None  # (n, n + 1) float32: [A | b], EM resampling map
    label_axes: torch.Tensor | None = None  # (2, n) int64: [perm, flip] of target and valid
    intensity: torch.Tensor | None = None  # (6,) float32: gamma, contrast, noise_std, blur zyx
    noise_seed: torch.Tensor | None = None  # () int64: seed of the additive noise

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in fields(self))

    def __eq__(self, other: object) -> bool:
        """Field by field, tensors by value (``torch.equal``): a plain bool, as for the
        sample's other fields (a sample depends on its seed and index alone, tested so)."""
        if not isinstance(other, DeviceAugmentation):
            return NotImplemented
        pairs = [(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)]
        return all(a is b if a is None or b is None else torch.equal(a, b) for a, b in pairs)

    @staticmethod
    def collate(items: list[DeviceAugmentation]) -> DeviceAugmentation:
        """The payloads of a batch's samples, stacked field by field (``default_collate``:
        inside a loader worker straight into shared memory). Samples of one dataset carry the
        same fields; a mix is refused."""
        out = {}
        for f in fields(DeviceAugmentation):
            values = [getattr(a, f.name) for a in items]
            present = {v is not None for v in values}
            if len(present) > 1:
                raise ValueError(f"samples disagree on whether they carry augmentation.{f.name}")
            if present == {True}:
                out[f.name] = default_collate(values)
        return DeviceAugmentation(**out)

    def pin_memory(self) -> DeviceAugmentation:
        """Pinned like the rest of the batch (the DataLoader's pinning thread calls
        ``Batch.pin_memory``, which calls this)."""
        return replace(self, **{f.name: getattr(self, f.name).pin_memory() for f in fields(self)
                                if getattr(self, f.name) is not None})

    def apply(self, image: torch.Tensor, target: torch.Tensor | None,
              valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """This (batched) payload made on a batch already on the device: rotation and zoom of
        EM (:func:`apply_geometry`, from the buffer ``image`` to the shape of ``valid``) with
        the matching flips of ``target`` and ``valid`` (:func:`apply_axis_map`), then the
        intensity changes (:func:`apply_intensity`)."""
        if self.geometry is not None:
            n = self.geometry.shape[-2]
            image = apply_geometry(image, self.geometry, tuple(valid.shape[-n:]))
            valid = apply_axis_map(valid, self.label_axes)
            if target is not None:
                target = apply_axis_map(target, self.label_axes)
        if self.intensity is not None:
            image = apply_intensity(image, self.intensity, self.noise_seed)
        return image, target, valid


# ---------------------------------------------------------------------------------------------
# The augmenter
# ---------------------------------------------------------------------------------------------


class Augmenter:
    """A dataset's augmentation, made from the config's ``[augmentation]`` section: the one
    place that knows which augmentations exist and where each is made.

    In a loader worker it draws a sample's plan (:meth:`draw`), says which box to read for it
    (:meth:`box_to_read`), applies the host part to the box read (:meth:`host`) and packs
    what is left to the device (:meth:`payload`, a :class:`DeviceAugmentation`); on the
    device :meth:`device` makes that part on a whole batch.

    ``augment=False`` (validation streams) applies nothing. ``frames``: the (shape, voxel
    size) of every frame a sample can have, in its own axes; with rotation and zoom made on
    the device they fix the one shape of the buffer EM boxes ship in (``buffer_shape``), so
    that samples batch.
    """

    def __init__(self, params: Augmentation | None = None, augment: bool = True, frames=()):
        if not augment:
            params = Augmentation(flips=False)
        self.params = params if params is not None else Augmentation()
        p = self.params
        # Rotation or zoom: the sample is resampled from a larger box.
        self.resamples = p.rotate_deg > 0 or p.scale > 0
        where = p.resample_on
        if where == "auto":  # the device when there is a GPU (see resample_on's help)
            where = "device" if torch.cuda.is_available() else "workers"
        self.resamples_on_device = self.resamples and where == "device"
        self.resamples_on_host = self.resamples and not self.resamples_on_device
        self.changes_intensity = p.contrast > 0 or p.gamma > 0 or p.noise_std > 0 \
            or p.blur_sigma > 0
        self.buffer_shape: tuple[int, ...] | None = None
        if self.resamples_on_device and frames:
            shapes = [max_read_shape(shape, vox, p) for shape, vox in frames]
            self.buffer_shape = tuple(int(m) for m in np.max(shapes, axis=0))

    def draw(self, rng: np.random.Generator, shape, vox) -> Plan:
        """Draw one sample's plan (frame ``shape``, voxel size ``vox``). Flips come first and
        draw exactly what the earlier flips-only pipeline drew, so default settings reproduce
        its samples; the intensity changes' noise seed is drawn later, by :meth:`payload`."""
        params, ndim = self.params, len(shape)
        plan = Plan()
        if params.flips:
            plan.flip = [bool(f) for f in rng.random(ndim) < 0.5]
            swap = bool(rng.random() < 0.5)
            plan.swap = swap and (ndim - 2, ndim - 1) in _isotropic_pairs(shape, vox)
        if params.rot90:
            plan.rot90 = [(axes, int(rng.integers(4))) for axes in _isotropic_pairs(shape, vox)]
        if params.rotate_deg > 0:
            plan.angle = math.radians(float(rng.uniform(-params.rotate_deg, params.rotate_deg)))
        if params.scale > 0:
            plan.zoom = float(rng.uniform(1 - params.scale, 1 + params.scale))
        if params.contrast > 0:
            plan.contrast = float(rng.uniform(1 - params.contrast, 1 + params.contrast))
        if params.gamma > 0:
            plan.gamma = float(rng.uniform(1 - params.gamma, 1 + params.gamma))
        if params.blur_sigma > 0:
            plan.blur = float(rng.uniform(0, params.blur_sigma))
        return plan

    def _matrix(self, plan: Plan, vox) -> np.ndarray:
        matrix = resample_matrix(plan, vox)
        return np.eye(len(vox)) if matrix is None else matrix  # a draw of no rotation, no zoom

    def box_to_read(self, plan: Plan, shape, vox) -> tuple[int, ...] | None:
        """The frame shape of the box to read around a sample of ``shape`` for ``plan``
        (:func:`read_shape`), or None when the sample's own box is read (no resampling)."""
        return read_shape(shape, self._matrix(plan, vox)) if self.resamples else None

    def host(self, plan: Plan, box, shape, vox, shift=None, fills: dict | None = None):
        """``plan``'s host part applied to ``box``, a ``samples.SampleArrays`` in the sample's
        frame: the sample's own box (C, *shape), or the box of :meth:`box_to_read`, whose
        centre lies ``shift`` voxels from the sample's.

        Flips, 90 degree turns and transposes are strided views (whoever writes the arrays out
        next makes the one copy). With rotation or zoom every array but ``image`` is resampled
        by nearest neighbour (outside the box, made large enough to have no outside, label
        values would read ``fills[group]``, the rest 0) and ``image`` linearly; or, with
        resampling on the device, ``image`` is left as the box in a buffer of
        ``buffer_shape``, the rest unflipped, and the box's ``augmentation`` says how to
        finish both (float64 here, so that the host can measure with the exact map).
        """
        if not self.resamples:
            return box.map(lambda a: apply_flips(a, plan))
        fills = fills or {}
        matrix = self._matrix(plan, vox)

        def nearest(a: np.ndarray, fill: float) -> np.ndarray:
            return resample(a, matrix, shape, shift, order=0, cval=fill)

        moved = replace(box, valid=None if box.valid is None else nearest(box.valid, 0),
                        target=None if box.target is None else nearest(box.target, 0),
                        labels={g: nearest(a, fills.get(g, 0)) for g, a in box.labels.items()})
        if self.resamples_on_host:
            moved.image = resample(box.image, matrix, shape, shift, order=1, cval=-1.0)
            return moved.map(lambda a: apply_flips(a, plan))
        image = box.image
        moved.image = np.zeros((image.shape[0], *self.buffer_shape), dtype=image.dtype)
        moved.image[(slice(None), *(slice(0, n) for n in image.shape[1:]))] = image
        # The labels' flips, 90 degree turns and transposes are left to the device as well:
        # here a turn through z makes the copy of every label array hop across memory.
        geometry = device_geometry(matrix, plan, shape, image.shape[1:], shift)
        moved.augmentation = DeviceAugmentation(
            geometry=torch.from_numpy(geometry), label_axes=torch.from_numpy(axis_map(plan, shape)))
        return moved

    def payload(self, plan: Plan, vox, rng: np.random.Generator,
                left: DeviceAugmentation | None = None) -> DeviceAugmentation | None:
        """What a finished sample ships for the device: ``left`` (what :meth:`host` left
        there; its map as float32, the precision the device reads) and the intensity changes,
        whose noise seed is drawn here from ``rng``. None when nothing is left to do."""
        out = DeviceAugmentation() if left is None else replace(left)
        if out.geometry is not None:
            out.geometry = out.geometry.to(torch.float32)
        if self.changes_intensity:
            out.intensity, out.noise_seed = intensity_params(plan, self.params, vox, rng)
        return None if out.is_empty() else out

    @staticmethod
    def device(batch):
        """Make what the loader workers left to the device (``batch.augmentation``) on a
        ``Batch`` already moved there (``Batch.to``): on the host either part costs as much
        CPU as reading the sample, on a GPU next to nothing. Returns the finished batch,
        without the payload; a batch with nothing left to do is returned as it is. The
        payload carries all it needs, so callers need no augmenter: ``Augmenter.device(b)``."""
        if batch.augmentation is None:
            return batch
        image, target, valid = batch.augmentation.apply(batch.image, batch.target, batch.valid)
        return replace(batch, image=image, target=target, valid=valid, augmentation=None)
