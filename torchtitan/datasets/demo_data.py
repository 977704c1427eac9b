"""Synthetic FIB-SEM demo data, written in the layout of the CellMap segmentation challenge.

The demo set lets every part of the system (data discovery, training, evaluation,
prediction) run without downloading anything, and it is read by exactly the same code that
reads the real challenge data. It imitates a FIB-SEM volume of a few touching cells with
their nuclei, mitochondria, ER, vesicles and lipid droplets.

How it is made
--------------
1. A *scene* of geometric objects is drawn at random in world coordinates (nanometres,
   axis order z, y, x): the cells partition space like a warped, weighted Voronoi diagram
   with thin extracellular gaps between them, and every cell gets a nucleus, mitochondria,
   ER tubes and sheets, vesicles and sometimes a lipid droplet. Every size is physical, so
   an anisotropic volume shows the same objects as an isotropic one.
2. The scene is rasterised into an *atomic* label field on any voxel grid: every voxel
   centre gets exactly one atom (cytosol, plasma membrane, mitochondrial matrix, ...). The
   same scene is rasterised on the EM grid and on each label crop's grid, so EM and labels
   agree at every resolution and offset.
3. Each class is a union of atoms (``CLASS_ATOMS``), so nested classes are consistent by
   construction: ``mito == mito_mem | mito_lum``, ``nuc``, ``mito``, ``er``, ``ves``, ``ld``
   and ``pm`` lie inside ``cell``, and ``cell`` and ``ecs`` split space between them.
4. The EM is a grey level per atom plus texture, blurred by a PSF-like Gaussian, with shot
   noise, slice-to-slice brightness drift and faint milling streaks, stored as uint8.

Layout written under ``root`` (zarr format 2, OME-NGFF 0.4 ``multiscales`` attributes):

    <root>/<ds>/<ds>.zarr/recon-1/em/fibsem-uint8/{s0,s1,s2}
    <root>/<ds>/<ds>.zarr/recon-1/labels/groundtruth/crop<N>/<class>/{s0,s1}
    <root>/.demo_complete        (written last; a partial set is detected and redone)

The set (``DEMO_DATASETS``): ``jrc_synth-1``, isotropic 8 nm voxels at the origin, and
``jrc_synth-2``, 16 x 8 x 8 nm voxels (z coarser) away from the origin, each about
1.3 x 2.6 x 2.6 um with four crops (crop1..crop8) of 0.4-1 um x 1-1.4 um x 1-1.4 um.
Crop grids are 4, 8 or 16 nm (finer and coarser than the EM), some sit half an EM voxel off
the EM grid, some annotate only a subset of the classes (a class a crop does not annotate
has no group there), and two have a slab of unknown voxels. ``scale`` shrinks volumes and
crops but not the objects; a volume narrower than a cell is centred on a cell boundary, so
that even a tiny test set shows membranes and extracellular space.

Scale levels follow the voxel-centre convention: a level's ``translation`` is the world
position of the centre of its voxel 0, so level k of a 2x pyramid has
``scale_k = scale_0 * 2**k`` and ``translation_k = translation_0 + (scale_k - scale_0) / 2``.
Label values are 0 (absent), 1 (present) and 255 (unknown), as in the challenge. The grid
type, the label encoding and the OME-NGFF writer are those of ``torchtitan.cellmap``, so the
demo set is written exactly as the readers expect it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.ndimage as ndi
import zarr

from torchtitan.cellmap.grids import Grid
from torchtitan.cellmap.labels import UNKNOWN, annotation_attrs, label_to_target
from torchtitan.cellmap.ome_ngff import read_multiscales, write_multiscale_array_group
from torchtitan.errors import UserError

# ---------------------------------------------------------------------------------------
# Atoms and classes
# ---------------------------------------------------------------------------------------

# Atoms: the finest, mutually exclusive parts of the scene. EM grey levels are set per atom
# and every class is a union of atoms. NONE marks "this object does not cover the voxel"
# while objects are painted; it never reaches the stored data.
ECS, PM, CYTO = 0, 1, 2
NE_MEM, NE_LUMEN, NUC_PERIPHERY, NUCLEOPLASM = 3, 4, 5, 6
MITO_MEM, MITO_CRISTA, MITO_MATRIX = 7, 8, 9
ER_MEM, ER_LUMEN = 10, 11
VES_MEM, VES_LUMEN = 12, 13
LD = 14
NUM_ATOMS = 15
NONE = 255

# Class name -> atoms it contains. Cristae count as mito_lum: the lumen class is everything
# inside the mitochondrial envelope. The nuclear envelope counts as nuc. ``cell`` is every
# atom except the extracellular space, so it contains pm and all organelles.
CLASS_ATOMS: dict[str, tuple[int, ...]] = {
    "ecs": (ECS,),
    "pm": (PM,),
    "cell": tuple(a for a in range(NUM_ATOMS) if a != ECS),
    "nuc": (NE_MEM, NE_LUMEN, NUC_PERIPHERY, NUCLEOPLASM),
    "mito": (MITO_MEM, MITO_CRISTA, MITO_MATRIX),
    "mito_mem": (MITO_MEM,),
    "mito_lum": (MITO_CRISTA, MITO_MATRIX),
    "er": (ER_MEM, ER_LUMEN),
    "ves": (VES_MEM, VES_LUMEN),
    "ld": (LD,),
}
DEMO_CLASSES: list[str] = list(CLASS_ATOMS)

EM_PATH = "recon-1/em/fibsem-uint8"
GROUNDTRUTH_PATH = "recon-1/labels/groundtruth"
COMPLETE_MARKER = ".demo_complete"

# ---------------------------------------------------------------------------------------
# Physical sizes (nm). Chosen after typical mammalian-cell FIB-SEM at 4-8 nm voxels.
# ---------------------------------------------------------------------------------------

CELL_SPACING = 2100.0  # mean distance between cell centres (cells 1.5-2.5 um across)
CELL_JITTER = 500.0  # random displacement of cell centres from a regular lattice
CELL_WEIGHT = 120.0  # +- additive Voronoi weight: some cells larger, faces curved
WARP_AMPLITUDE = 70.0  # domain warp that makes cell faces wavy
HALF_GAP = 14.0  # half width of the extracellular gap between two cells
HALF_GAP_VARIATION = 8.0
HALF_GAP_MIN = 5.0
POCKET_DEPTH = 100.0  # occasional wider extracellular pockets
PM_THICKNESS = 20.0
NE_MEMBRANE = 10.0  # each of the two nuclear-envelope membranes
NE_LUMEN_WIDTH = 20.0  # perinuclear space between them
HETEROCHROMATIN_WIDTH = 60.0  # dark chromatin rim just inside the envelope
MITO_MEMBRANE = 18.0  # outer + inner mitochondrial membrane, drawn as one band
CRISTA_THICKNESS = 14.0
ER_MEMBRANE = 9.0
VES_MEMBRANE = 8.0

# ---------------------------------------------------------------------------------------
# Voxel grids in world coordinates (torchtitan.cellmap.grids.Grid)
# ---------------------------------------------------------------------------------------


def _axis_slice(axis: np.ndarray, lo: float, hi: float) -> slice:
    """Indices of the sorted coordinates ``axis`` that lie in [lo, hi]."""
    return slice(int(np.searchsorted(axis, lo, "left")), int(np.searchsorted(axis, hi, "right")))


def _box_slices(axes, lo, hi) -> tuple[slice, slice, slice] | None:
    """Per-axis index slices of the voxel centres inside a world box, or None if empty."""
    slices = tuple(_axis_slice(a, l, h) for a, l, h in zip(axes, lo, hi))
    if any(s.stop <= s.start for s in slices):
        return None
    return slices


# ---------------------------------------------------------------------------------------
# Smooth random fields defined everywhere in the world
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WaveNoise:
    """A smooth random field: a sum of K plane waves with random directions and phases.

    Unlike filtered white noise it is defined at every world position, so it gives the same
    value at a point whichever grid samples it. Its variance is 1 and |value| <= bound.
    """

    k: np.ndarray  # (K, 3) angular wave vectors in rad/nm, (z, y, x) components
    phase: np.ndarray  # (K,)

    @classmethod
    def random(cls, rng: np.random.Generator, n_waves: int, wavelength_nm: tuple[float, float]):
        directions = rng.normal(size=(n_waves, 3))
        directions /= np.linalg.norm(directions, axis=1, keepdims=True)
        wavelengths = rng.uniform(*wavelength_nm, size=n_waves)
        return cls(2 * np.pi * directions / wavelengths[:, None], rng.uniform(0, 2 * np.pi, n_waves))

    @property
    def amplitude(self) -> float:
        return math.sqrt(2.0 / len(self.phase))

    @property
    def bound(self) -> float:
        return self.amplitude * len(self.phase)

    def __call__(self, z, y, x) -> np.ndarray:
        """Evaluate at broadcastable coordinate arrays (a grid's axes or point lists)."""
        out = 0.0
        for (kz, ky, kx), phase in zip(self.k, self.phase):
            out = out + np.cos(np.float32(kz) * z + np.float32(ky) * y + np.float32(kx) * x + np.float32(phase))
        return np.float32(self.amplitude) * out


# Smooth fields (the distance to cell boundaries, the nuclear surface) are defined as the
# trilinear interpolation of their values on a fixed world lattice with this spacing. That
# keeps them identical whichever grid samples them, while the expensive evaluation runs on
# far fewer points than a fine grid has voxels. The fields bend on scales of hundreds of nm,
# so interpolation moves a membrane by well under a nanometre.
LATTICE_NM = 20.0


def _interp_axis(values: np.ndarray, axis: int, pos: np.ndarray) -> np.ndarray:
    """Linear interpolation of ``values`` along ``axis`` at fractional indices ``pos``."""
    i0 = np.clip(np.floor(pos).astype(np.intp), 0, values.shape[axis] - 2)
    shape = [1] * values.ndim
    shape[axis] = -1
    w = (pos - i0).astype(np.float32).reshape(shape)
    a = np.take(values, i0, axis=axis)
    b = np.take(values, i0 + 1, axis=axis)
    # a + w * (b - a), in place: these arrays can be large.
    b -= a
    b *= w
    b += a
    return b


def lattice_field(fn, z: np.ndarray, y: np.ndarray, x: np.ndarray, block=(16, 32, 32)) -> np.ndarray:
    """Sample the world field ``fn`` on the grid with axes (z, y, x) via the world lattice.

    ``fn(z, y, x)`` takes broadcastable coordinate arrays. It is evaluated on the lattice
    points around the grid, block by block (so that ``fn`` can skip far-away objects), and
    interpolated to the voxel centres one axis at a time.
    """
    axes = (z, y, x)
    first = [math.floor(float(a.min()) / LATTICE_NM) for a in axes]
    count = [math.floor(float(a.max()) / LATTICE_NM) - f + 2 for a, f in zip(axes, first)]
    lattice = [((f + np.arange(n)) * LATTICE_NM).astype(np.float32) for f, n in zip(first, count)]
    values = np.empty(count, np.float32)
    for i in range(0, count[0], block[0]):
        for j in range(0, count[1], block[1]):
            for k in range(0, count[2], block[2]):
                values[i : i + block[0], j : j + block[1], k : k + block[2]] = fn(
                    lattice[0][i : i + block[0], None, None],
                    lattice[1][None, j : j + block[1], None],
                    lattice[2][None, None, k : k + block[2]],
                )
    # Interpolate the axis that grows the array least first... x, then y, then z.
    for axis in (2, 1, 0):
        pos = axes[axis].astype(np.float64) / LATTICE_NM - first[axis]
        values = _interp_axis(values, axis, pos)
    return values


# ---------------------------------------------------------------------------------------
# Scene objects. Each knows its bounding box (``bbox``) and paints its atoms on the grid
# axes inside that box (``rasterize``), with NONE where it is absent.
# ---------------------------------------------------------------------------------------


@dataclass
class Nucleus:
    """A wavy ellipsoid: double envelope, dark heterochromatin rim, nucleoplasm."""

    centre: np.ndarray  # (3,)
    radii: np.ndarray  # (3,) semi-axes along the rotated frame
    rotation: np.ndarray  # (3, 3) columns are the ellipsoid axes in world coordinates
    surface: WaveNoise  # surface waviness
    surface_amplitude: float
    chromatin: WaveNoise  # modulates the heterochromatin rim

    def bbox(self):
        pad = self.surface_amplitude * self.surface.bound + 10.0
        r = self.radii.max() + pad
        return self.centre - r, self.centre + r

    def signed_distance(self, z, y, x) -> np.ndarray:
        """Approximate signed distance (nm) to the surface: negative inside.

        Uses the first-order estimate f / |grad f| for f = |R^T (p - c) / r| - 1, which is
        accurate near the surface, where the envelope bands are drawn.
        """
        d = (z - self.centre[0], y - self.centre[1], x - self.centre[2])
        rot = self.rotation.astype(np.float32)
        # Local coordinates, each divided by its radius.
        u = [sum(rot[i, j] * d[i] for i in range(3)) / np.float32(self.radii[j]) for j in range(3)]
        q = np.sqrt(u[0] ** 2 + u[1] ** 2 + u[2] ** 2) + np.float32(1e-6)
        grad = np.sqrt(sum((u[j] / np.float32(self.radii[j])) ** 2 for j in range(3))) + np.float32(1e-9)
        sd = (q - 1) * q / grad
        return sd + np.float32(self.surface_amplitude) * self.surface(z, y, x)

    def periphery_distance(self, z, y, x) -> np.ndarray:
        """Signed distance shifted by the local heterochromatin rim width: the dark rim
        just inside the envelope is where this is above -(envelope width)."""
        rim = HETEROCHROMATIN_WIDTH * (1.0 + 0.8 * self.chromatin(z, y, x))
        return self.signed_distance(z, y, x) + rim

    def rasterize(self, z, y, x) -> np.ndarray:
        sd = lattice_field(self.signed_distance, z, y, x)
        rim = lattice_field(self.periphery_distance, z, y, x)
        envelope = 2 * NE_MEMBRANE + NE_LUMEN_WIDTH
        out = np.full(sd.shape, NONE, np.uint8)
        out[sd <= 0] = NUCLEOPLASM
        out[(sd <= 0) & (rim > -envelope)] = NUC_PERIPHERY
        out[(sd <= 0) & (sd > -envelope)] = NE_MEM
        out[(sd <= -NE_MEMBRANE) & (sd > -NE_MEMBRANE - NE_LUMEN_WIDTH)] = NE_LUMEN
        return out


@dataclass
class Tube:
    """A tube of constant radius around a polyline: a mitochondrion or an ER tubule.

    Mitochondria get a membrane band and cristae: thin plates across the long axis, spaced
    ``crista_period`` apart along the arc length and slightly tilted. ER tubes get a
    membrane band around a lumen.
    """

    points: np.ndarray  # (M, 3), M >= 2
    radius: float
    kind: str  # "mito" or "er"
    crista_period: float = 90.0
    crista_phase: float = 0.0
    crista_tilt: np.ndarray = field(default_factory=lambda: np.zeros(3))

    def bbox(self):
        return self.points.min(0) - self.radius, self.points.max(0) + self.radius

    def _distance_and_arclength(self, z, y, x):
        """Distance (nm) to the polyline and arc length of the closest point, on a grid.

        Each segment only touches the voxels of its own bounding box, which keeps a long
        diagonal tube cheap.
        """
        dist = np.full((len(z), len(y), len(x)), np.inf, np.float32)
        arc = np.zeros(dist.shape, np.float32)
        start_arc = 0.0
        for a, b in zip(self.points[:-1], self.points[1:]):
            length = float(np.linalg.norm(b - a))
            v = ((b - a) / max(length, 1e-6)).astype(np.float32)
            sl = _box_slices((z, y, x), np.minimum(a, b) - self.radius, np.maximum(a, b) + self.radius)
            if sl is not None:
                dz = z[sl[0], None, None] - np.float32(a[0])
                dy = y[None, sl[1], None] - np.float32(a[1])
                dx = x[None, None, sl[2]] - np.float32(a[2])
                t = np.clip(dz * v[0] + dy * v[1] + dx * v[2], 0.0, length)
                d = np.sqrt((dz - t * v[0]) ** 2 + (dy - t * v[1]) ** 2 + (dx - t * v[2]) ** 2)
                closer = d < dist[sl]
                dist[sl] = np.where(closer, d, dist[sl])
                arc[sl] = np.where(closer, t + np.float32(start_arc), arc[sl])
            start_arc += length
        return dist, arc

    def rasterize(self, z, y, x) -> np.ndarray:
        dist, arc = self._distance_and_arclength(z, y, x)
        out = np.full(dist.shape, NONE, np.uint8)
        inside = dist <= self.radius
        if self.kind == "er":
            out[inside] = ER_LUMEN
            out[inside & (dist > self.radius - ER_MEMBRANE)] = ER_MEM
            return out
        c = self.points.mean(0)
        tilt = self.crista_tilt.astype(np.float32)
        # Position along the tube, tilted a little so the cristae are not a perfect ladder.
        u = (
            arc
            + tilt[0] * (z[:, None, None] - np.float32(c[0]))
            + tilt[1] * (y[None, :, None] - np.float32(c[1]))
            + tilt[2] * (x[None, None, :] - np.float32(c[2]))
        )
        frac = np.mod(u / np.float32(self.crista_period) + np.float32(self.crista_phase), 1.0)
        crista = np.abs(frac - 0.5) * self.crista_period < CRISTA_THICKNESS / 2
        out[inside] = MITO_MATRIX
        out[inside & crista] = MITO_CRISTA
        out[inside & (dist > self.radius - MITO_MEMBRANE)] = MITO_MEM
        return out


@dataclass
class Sheet:
    """A flat ER cisterna: a thin disc with a membrane on both faces."""

    centre: np.ndarray
    normal: np.ndarray  # unit vector
    radius: float
    half_thickness: float

    def bbox(self):
        r = self.radius + self.half_thickness
        return self.centre - r, self.centre + r

    def rasterize(self, z, y, x) -> np.ndarray:
        dz = z[:, None, None] - np.float32(self.centre[0])
        dy = y[None, :, None] - np.float32(self.centre[1])
        dx = x[None, None, :] - np.float32(self.centre[2])
        n = self.normal.astype(np.float32)
        h = dz * n[0] + dy * n[1] + dx * n[2]
        rho = np.sqrt(np.maximum(dz**2 + dy**2 + dx**2 - h**2, 0.0))
        dist = np.sqrt(h**2 + np.maximum(rho - np.float32(self.radius), 0.0) ** 2)
        out = np.full(dist.shape, NONE, np.uint8)
        out[dist <= self.half_thickness] = ER_LUMEN
        out[(dist <= self.half_thickness) & (dist > self.half_thickness - ER_MEMBRANE)] = ER_MEM
        return out


@dataclass
class Ball:
    """A vesicle (membrane around a light lumen) or a lipid droplet (uniform)."""

    centre: np.ndarray
    radius: float
    kind: str  # "ves" or "ld"

    def bbox(self):
        return self.centre - self.radius, self.centre + self.radius

    def rasterize(self, z, y, x) -> np.ndarray:
        d = np.sqrt(
            (z[:, None, None] - np.float32(self.centre[0])) ** 2
            + (y[None, :, None] - np.float32(self.centre[1])) ** 2
            + (x[None, None, :] - np.float32(self.centre[2])) ** 2
        )
        out = np.full(d.shape, NONE, np.uint8)
        if self.kind == "ld":
            out[d <= self.radius] = LD
        else:
            out[d <= self.radius] = VES_LUMEN
            out[(d <= self.radius) & (d > self.radius - VES_MEMBRANE)] = VES_MEM
        return out


@dataclass
class Scene:
    """Everything in one synthetic sample, in world coordinates (nm).

    Cells: point p belongs to the cell i that minimises |warp(p) - seed_i| - weight_i; the
    distance to the cell boundary is about half the gap between the best and second-best
    value. Organelles are painted over cytosol only, in the order of ``organelles``.
    """

    seeds: np.ndarray  # (N, 3)
    weights: np.ndarray  # (N,)
    warp: tuple[WaveNoise, WaveNoise, WaveNoise]
    gap: WaveNoise
    pocket: WaveNoise
    organelles: list = field(default_factory=list)

    def cell_fields(self, z, y, x) -> tuple[np.ndarray, np.ndarray]:
        """Cell index and distance to the cell boundary (nm) at broadcastable coordinates."""
        shape = np.broadcast_shapes(np.shape(z), np.shape(y), np.shape(x))
        wz = z + np.float32(WARP_AMPLITUDE) * self.warp[0](z, y, x)
        wy = y + np.float32(WARP_AMPLITUDE) * self.warp[1](z, y, x)
        wx = x + np.float32(WARP_AMPLITUDE) * self.warp[2](z, y, x)

        # Only seeds that can be nearest or second nearest somewhere in the box matter.
        # Skipping the others changes nothing, it only saves time.
        reach = WARP_AMPLITUDE * max(w.bound for w in self.warp)
        lo = np.array([np.min(z), np.min(y), np.min(x)]) - reach
        hi = np.array([np.max(z), np.max(y), np.max(x)]) + reach
        nearest = np.linalg.norm(np.maximum(np.maximum(lo - self.seeds, self.seeds - hi), 0), axis=1)
        farthest = np.linalg.norm(np.maximum(np.abs(self.seeds - lo), np.abs(self.seeds - hi)), axis=1)
        lower, upper = nearest - self.weights, farthest - self.weights
        keep = np.flatnonzero(lower <= np.partition(upper, 1)[1])

        best = np.full(shape, np.inf, np.float32)
        second = np.full(shape, np.inf, np.float32)
        index = np.full(shape, -1, np.int16)
        for i in keep:
            s = self.seeds[i].astype(np.float32)
            d = np.sqrt((wz - s[0]) ** 2 + (wy - s[1]) ** 2 + (wx - s[2]) ** 2) - np.float32(self.weights[i])
            closer = d < best
            second = np.where(closer, best, np.minimum(second, d))
            best = np.where(closer, d, best)
            index = np.where(closer, np.int16(i), index)
        return index, 0.5 * (second - best)

    def half_gap(self, z, y, x) -> np.ndarray:
        """Half width of the extracellular space (nm): thin and wavy, with a few pockets."""
        g = np.maximum(HALF_GAP + HALF_GAP_VARIATION * self.gap(z, y, x), HALF_GAP_MIN)
        return g + POCKET_DEPTH * np.maximum(self.pocket(z, y, x) - 1.9, 0.0)

    def membrane_distance(self, z, y, x) -> np.ndarray:
        """Distance (nm) from the outer face of the plasma membrane: negative in the ECS,
        0 .. PM_THICKNESS in the membrane, larger in the cell."""
        _, boundary = self.cell_fields(z, y, x)
        return boundary - self.half_gap(z, y, x)

    def cell_atoms(self, z, y, x) -> np.ndarray:
        """ECS / PM / CYTO on the grid with axes (z, y, x)."""
        distance = lattice_field(self.membrane_distance, z, y, x)
        out = np.full(distance.shape, CYTO, np.uint8)
        out[distance < PM_THICKNESS] = PM
        out[distance < 0] = ECS
        return out


# ---------------------------------------------------------------------------------------
# Rasterising a scene
# ---------------------------------------------------------------------------------------


def render_atoms(scene: Scene, grid: Grid) -> np.ndarray:
    """The atomic label field of ``scene`` sampled at the voxel centres of ``grid``.

    Organelles are painted only on their own bounding boxes, and only over cytosol, which
    keeps them inside their cell and out of each other.
    """
    z, y, x = grid.axes()
    atoms = scene.cell_atoms(z, y, x)
    for obj in scene.organelles:
        lo, hi = obj.bbox()
        sl = _box_slices((z, y, x), lo, hi)
        if sl is None:
            continue
        painted = obj.rasterize(z[sl[0]], y[sl[1]], x[sl[2]])
        region = atoms[sl]
        write = (painted != NONE) & (region == CYTO)
        region[write] = painted[write]
    return atoms


def atoms_to_class(atoms: np.ndarray, class_name: str) -> np.ndarray:
    """Binary uint8 mask of one class."""
    return np.isin(atoms, CLASS_ATOMS[class_name]).astype(np.uint8)


# ---------------------------------------------------------------------------------------
# Drawing a random scene
# ---------------------------------------------------------------------------------------


def _random_directions(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.normal(size=(n, 3))
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    return q * np.sign(np.diag(r))


def _polyline(rng, centre, length, n_segments, max_bend_deg):
    """A gently bent polyline of total ``length`` centred on ``centre``."""
    direction = _random_directions(rng, 1)[0]
    step = length / n_segments
    points = [np.zeros(3)]
    for _ in range(n_segments):
        bend = _random_directions(rng, 1)[0]
        bend -= bend.dot(direction) * direction  # perpendicular to the current direction
        bend /= max(np.linalg.norm(bend), 1e-9)
        direction = direction + math.tan(math.radians(rng.uniform(0, max_bend_deg))) * bend
        direction /= np.linalg.norm(direction)
        points.append(points[-1] + step * direction)
    points = np.array(points)
    return points - points.mean(0) + centre


def _densify(points: np.ndarray, spacing: float) -> np.ndarray:
    """Points every ``spacing`` nm along a polyline (for overlap tests)."""
    out = [points[:1]]
    for a, b in zip(points[:-1], points[1:]):
        n = max(1, int(np.ceil(np.linalg.norm(b - a) / spacing)))
        out.append(a + (b - a) * np.linspace(0, 1, n + 1)[1:, None])
    return np.concatenate(out)


class _Placer:
    """Places organelles in the cytosol of a world region without overlaps.

    Candidate shapes are given as sample points plus a radius. All candidates of one kind
    are checked against the cells in one vectorised batch, then accepted one by one while
    they keep clear of the nucleus and of everything placed before. Obstacles are kept per
    cell: objects in different cells are always separated by membranes.
    """

    def __init__(self, scene: Scene, rng: np.random.Generator, lo: np.ndarray, hi: np.ndarray):
        self.scene, self.rng, self.lo, self.hi = scene, rng, lo, hi
        self.nuclei: dict[int, Nucleus] = {}
        self.obstacles: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def count(self, per_um3: float) -> int:
        """How many objects a density (per cubic micrometre) asks for in the region."""
        return int(round(per_um3 * float(np.prod(self.hi - self.lo)) / 1e9))

    def uniform_points(self, n: int) -> np.ndarray:
        return self.rng.uniform(self.lo, self.hi, (n, 3))

    def cells_of(self, points: np.ndarray, margins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cell index of each point and whether it is ``margin`` nm inside the cytosol
        (clear of the plasma membrane; the nucleus is checked in ``fits``)."""
        index, boundary = self.scene.cell_fields(points[:, 0], points[:, 1], points[:, 2])
        return index, boundary > MEMBRANE_CLEARANCE + margins

    def cell_of_shapes(self, shapes: list[np.ndarray], radii: np.ndarray, gap: float) -> list[int]:
        """For each shape (sample points with a radius): the cell that holds all of it at
        least ``gap`` nm inside the cytosol, or -1."""
        sizes = [len(s) for s in shapes]
        margins = np.repeat(np.asarray(radii) + gap, sizes)
        index, ok = self.cells_of(np.concatenate(shapes), margins)
        cells = []
        splits = np.cumsum(sizes)[:-1]
        for idx, good in zip(np.split(index, splits), np.split(ok, splits)):
            cells.append(int(idx[0]) if good.all() and np.all(idx == idx[0]) else -1)
        return cells

    def fits(self, cell: int, points: np.ndarray, radius: float, gap: float) -> bool:
        """Whether spheres of ``radius`` at ``points`` keep ``gap`` nm from the cell's
        nucleus and from everything already placed in the cell."""
        nucleus = self.nuclei.get(cell)
        if nucleus is not None:
            # Exact test only when the points are near the nucleus' bounding sphere.
            reach = nucleus.bbox()[1][0] - nucleus.centre[0] + radius + gap
            near = np.linalg.norm(points - nucleus.centre, axis=1) < reach
            if near.any() and np.any(nucleus.signed_distance(*points[near].T) <= radius + gap):
                return False
        centres, radii = self.obstacles.get(cell, (np.zeros((0, 3)), np.zeros(0)))
        if len(radii) == 0:
            return True
        d = np.linalg.norm(points[:, None, :] - centres[None], axis=2)
        return bool(np.all(d > radii[None] + radius + gap))

    def occupy(self, cell: int, points: np.ndarray, radius: float):
        centres, radii = self.obstacles.get(cell, (np.zeros((0, 3)), np.zeros(0)))
        radii = np.concatenate([radii, np.full(len(points), radius)])
        self.obstacles[cell] = (np.concatenate([centres, points]), radii)


# Clearance between organelles and the cell boundary: the widest usual extracellular half
# gap plus the plasma membrane.
MEMBRANE_CLEARANCE = HALF_GAP + HALF_GAP_VARIATION + PM_THICKNESS

# How much of each organelle to draw, per cubic micrometre of the furnished region. The
# cells are small next to real ones, so the cytosol is kept fairly crowded.
MITO_PER_UM3 = 5.0
LD_PER_UM3 = 0.08
ER_SHEETS_PER_UM3 = 0.4
ER_TUBES_PER_UM3 = 24.0
VESICLES_PER_UM3 = 80.0
VESICLE_CLUSTERS_PER_UM3 = 1.0
NUCLEUS_PROBABILITY = 0.8


def _add_nuclei(placer: _Placer) -> list[Nucleus]:
    """One nucleus per cell (most cells), as big as fits, near the cell centre."""
    rng, scene = placer.rng, placer.scene
    reach = 800.0  # a nucleus centred this far outside the region may still reach into it
    near = np.all((scene.seeds > placer.lo - reach) & (scene.seeds < placer.hi + reach), axis=1)
    nuclei = []
    for cell in np.flatnonzero(near):
        if rng.uniform() > NUCLEUS_PROBABILITY:
            continue
        nucleus = Nucleus(
            centre=scene.seeds[cell] + rng.normal(0, 80, 3),
            radii=rng.uniform(500, 700) * np.array([1.0, rng.uniform(0.8, 1.0), rng.uniform(0.75, 0.95)]),
            rotation=_random_rotation(rng),
            surface=WaveNoise.random(rng, 4, (500, 1200)),
            surface_amplitude=25.0,
            chromatin=WaveNoise.random(rng, 6, (200, 500)),
        )
        surface = _random_directions(rng, 300)
        for _ in range(6):  # shrink until it fits in the cell with room to spare
            world = nucleus.centre + (surface * nucleus.radii * 1.1) @ nucleus.rotation.T
            index, ok = placer.cells_of(world, np.full(len(world), 80.0))
            if ok.all() and np.all(index == cell):
                placer.nuclei[int(cell)] = nucleus
                nuclei.append(nucleus)
                break
            nucleus.radii = nucleus.radii * 0.85
    return nuclei


def _add_mitochondria(placer: _Placer) -> list[Tube]:
    """Mitochondria: capsules 150-300 nm wide, 0.4-1.2 um long, gently bent."""
    rng = placer.rng
    target = placer.count(MITO_PER_UM3)
    shapes, radii, lines = [], [], []
    for centre in placer.uniform_points(10 * target):
        length, radius = rng.uniform(400, 1200), rng.uniform(75, 150)
        n_seg = 1 if length < 600 else int(rng.integers(2, 4))
        points = _polyline(rng, centre, length - 2 * radius, n_seg, 30)
        lines.append(points)
        shapes.append(_densify(points, 40.0))
        radii.append(radius)
    placed = []
    cells = placer.cell_of_shapes(shapes, radii, 15.0)
    for cell, points, samples, radius in zip(cells, lines, shapes, radii):
        if len(placed) == target:
            break
        if cell >= 0 and placer.fits(cell, samples, radius, 20.0):
            tilt = rng.normal(0, 0.25, 3)
            placed.append(Tube(points, radius, "mito", rng.uniform(50, 80), rng.uniform(0, 1), tilt))
            placer.occupy(cell, samples, radius)
    return placed


def _add_lipid_droplets(placer: _Placer) -> list[Ball]:
    """Lipid droplets: rare, round, 300-600 nm across."""
    target = placer.count(LD_PER_UM3)
    centres = placer.uniform_points(8 * target + 2)
    radii = placer.rng.uniform(150, 300, len(centres))
    placed = []
    for cell, c, r in zip(placer.cell_of_shapes(list(centres[:, None]), radii, 40.0), centres, radii):
        if len(placed) == max(target, 1):
            break
        if cell >= 0 and placer.fits(cell, c[None], r, 40.0):
            placed.append(Ball(c, float(r), "ld"))
            placer.occupy(cell, c[None], r)
    return placed


def _disc_samples(rng, centre, normal, radius) -> np.ndarray:
    ring = _random_directions(rng, 24)
    ring -= (ring @ normal)[:, None] * normal
    ring /= np.linalg.norm(ring, axis=1, keepdims=True)
    return np.concatenate([centre[None], centre + radius * ring, centre + 0.5 * radius * ring])


def _add_er(placer: _Placer) -> list:
    """ER: sheets (most of them wrapped around nuclei) and tubules."""
    rng = placer.rng
    # Sheet candidates: a few just outside each nucleus, parallel to its surface, and some
    # anywhere in the cytosol.
    sheets = []
    for nucleus in placer.nuclei.values():
        for direction in _random_directions(rng, 6):
            centre = nucleus.centre + (nucleus.radii.max() + rng.uniform(80, 200)) * direction
            sheets.append(Sheet(centre, direction, rng.uniform(200, 400), 18.0))
    n_free = 3 * placer.count(ER_SHEETS_PER_UM3)
    for centre, direction in zip(placer.uniform_points(n_free), _random_directions(rng, n_free)):
        sheets.append(Sheet(centre, direction, rng.uniform(200, 400), 18.0))
    er: list = []
    if sheets:
        samples = [_disc_samples(rng, s.centre, s.normal, s.radius) for s in sheets]
        cells = placer.cell_of_shapes(samples, np.full(len(sheets), 20.0), 20.0)
        for cell, sheet, points in zip(cells, sheets, samples):
            if cell >= 0 and placer.fits(cell, points, 20.0, 20.0):
                er.append(sheet)
                placer.occupy(cell, points, 20.0)

    # Tubules: persistent random walks, cut where they would leave their cell's cytosol or
    # run into another organelle. All vertices are checked against the cells in one batch.
    walks = []
    for start in placer.uniform_points(placer.count(ER_TUBES_PER_UM3)):
        direction = _random_directions(rng, 1)[0]
        points = [start]
        for _ in range(int(rng.integers(5, 14))):
            direction = direction + 0.6 * rng.normal(size=3)
            direction /= np.linalg.norm(direction)
            points.append(points[-1] + rng.uniform(80, 140) * direction)
        walks.append(np.array(points))
    if not walks:
        return er
    radii = rng.uniform(20, 28, len(walks))
    margins = np.repeat(radii, [len(w) for w in walks]) + 10.0
    index, inside = placer.cells_of(np.concatenate(walks), margins)
    offset = 0
    for points, radius in zip(walks, radii):
        cells, ok = index[offset : offset + len(points)], inside[offset : offset + len(points)]
        offset += len(points)
        cell = int(cells[0])
        n_good = 0  # length of the walk's first stretch that fits
        while (
            n_good < len(points)
            and ok[n_good]
            and cells[n_good] == cell
            and placer.fits(cell, points[n_good : n_good + 1], radius, 15.0)
        ):
            n_good += 1
        if n_good >= 2:
            er.append(Tube(points[:n_good], float(radius), "er"))
    return er


def _add_vesicles(placer: _Placer) -> list[Ball]:
    """Vesicles 40-80 nm across: half scattered, half in clusters."""
    rng = placer.rng
    n = placer.count(VESICLES_PER_UM3)
    clusters = placer.uniform_points(max(1, placer.count(VESICLE_CLUSTERS_PER_UM3)))
    clustered = clusters[rng.integers(0, len(clusters), n // 2)] + rng.normal(0, 150, (n // 2, 3))
    centres = np.concatenate([placer.uniform_points(n - n // 2), clustered])
    radii = rng.uniform(20, 40, len(centres))
    placed = []
    for cell, c, r in zip(placer.cell_of_shapes(list(centres[:, None]), radii, 10.0), centres, radii):
        if cell >= 0 and placer.fits(cell, c[None], r, 10.0):
            placed.append(Ball(c, float(r), "ves"))
            placer.occupy(cell, c[None], r)
    return placed


def _put_membrane_through(scene: Scene, point: np.ndarray) -> None:
    """Shift all cells so that a cell boundary passes (close to) ``point``."""
    index, boundary = scene.cell_fields(*point.astype(np.float32)[:, None])
    nearest = scene.seeds[index[0]]
    d = np.linalg.norm(scene.seeds - point, axis=1) - scene.weights
    d[index[0]] = np.inf
    second = scene.seeds[np.argmin(d)]
    # Moving the point by ``boundary`` towards the second cell reaches the boundary; moving
    # every seed the opposite way does the same.
    towards = (second - nearest) / np.linalg.norm(second - nearest)
    scene.seeds = scene.seeds - float(boundary[0]) * towards


FURNISH_MARGIN = 300.0  # organelles are drawn this far around the volume, too


def make_scene(rng: np.random.Generator, lo_nm, hi_nm) -> Scene:
    """Draw a random scene for the world box [lo_nm, hi_nm] (nm, (z, y, x))."""
    lo_nm, hi_nm = np.asarray(lo_nm, float), np.asarray(hi_nm, float)
    # Cell seeds on a jittered lattice that reaches well beyond the box, so that cells at
    # the border of the volume are shaped like the others. The lattice is turned about z by
    # a random angle, and one of its planes passes near the middle of the box in z, so that
    # the (thin) volumes cut most nuclei.
    centre = (lo_nm + hi_nm) / 2
    half = np.max(hi_nm - lo_nm) / 2 + 2 * CELL_SPACING
    ticks = np.arange(-np.ceil(half / CELL_SPACING), np.ceil(half / CELL_SPACING) + 1) * CELL_SPACING
    n_z = np.ceil(((hi_nm - lo_nm)[0] / 2 + CELL_SPACING) / CELL_SPACING)
    z_ticks = np.arange(-n_z, n_z + 1) * CELL_SPACING
    lattice = np.stack(np.meshgrid(z_ticks, ticks, ticks, indexing="ij"), -1).reshape(-1, 3)
    angle = rng.uniform(0, np.pi / 2)
    turn = np.array([[1, 0, 0], [0, np.cos(angle), -np.sin(angle)], [0, np.sin(angle), np.cos(angle)]])
    jitter = rng.uniform(-1, 1, lattice.shape) * np.array([0.5, 1.0, 1.0]) * CELL_JITTER
    offset = rng.uniform(-0.1, 0.1, 3) * CELL_SPACING
    seeds = centre + offset + lattice @ turn.T + jitter
    scene = Scene(
        seeds=seeds,
        weights=rng.uniform(-CELL_WEIGHT, CELL_WEIGHT, len(seeds)),
        warp=tuple(WaveNoise.random(rng, 2, (1500, 3000)) for _ in range(3)),
        gap=WaveNoise.random(rng, 3, (500, 1500)),
        pocket=WaveNoise.random(rng, 3, (700, 1500)),
    )
    if np.min((hi_nm - lo_nm)[1:]) < CELL_SPACING:
        # A volume narrower than a cell would often show the inside of a single cell only
        # (no membranes, no extracellular space): centre it on a cell boundary instead.
        _put_membrane_through(scene, centre)
    # Organelles are drawn kind by kind, biggest first, and painted in the same order.
    placer = _Placer(scene, rng, lo_nm - FURNISH_MARGIN, hi_nm + FURNISH_MARGIN)
    scene.organelles += _add_nuclei(placer)
    scene.organelles += _add_mitochondria(placer)
    scene.organelles += _add_lipid_droplets(placer)
    scene.organelles += _add_er(placer)
    scene.organelles += _add_vesicles(placer)
    return scene


# ---------------------------------------------------------------------------------------
# Rendering EM
# ---------------------------------------------------------------------------------------

# Mean grey level and fine-texture amplitude per atom. Heavy-metal staining makes membranes
# and dense material dark; en-bloc FIB-SEM is shown with membranes dark on a mid-grey
# cytosol.
_ATOM_GREY = np.zeros(NUM_ATOMS, np.float32)
_ATOM_TEXTURE = np.zeros(NUM_ATOMS, np.float32)
_ATOM_CHROMATIN = np.zeros(NUM_ATOMS, np.float32)
for _atom, _grey, _texture, _chromatin in [
    (ECS, 205, 8, 0),
    (PM, 62, 6, 0),
    (CYTO, 158, 12, 10),
    (NE_MEM, 66, 6, 0),
    (NE_LUMEN, 150, 8, 0),
    (NUC_PERIPHERY, 95, 12, 15),
    (NUCLEOPLASM, 172, 10, 55),
    (MITO_MEM, 62, 6, 0),
    (MITO_CRISTA, 78, 6, 0),
    (MITO_MATRIX, 122, 8, 0),
    (ER_MEM, 60, 6, 0),
    (ER_LUMEN, 105, 6, 0),
    (VES_MEM, 70, 6, 0),
    (VES_LUMEN, 182, 6, 0),
    (LD, 98, 3, 0),
]:
    _ATOM_GREY[_atom], _ATOM_TEXTURE[_atom], _ATOM_CHROMATIN[_atom] = _grey, _texture, _chromatin

PSF_SIGMA_NM = (7.0, 5.0, 5.0)  # FIB-SEM resolves z (milling) worse than y, x


def _smooth_noise(rng: np.random.Generator, shape, voxel_nm, correlation_nm: float, factor: int):
    """Unit-variance Gaussian random texture with a correlation length in nm.

    Generated on a grid ``factor`` times coarser (where possible) and upsampled, which is
    cheap and looks the same once the correlation length spans several voxels.
    """
    factors = [max(1, min(factor, int(correlation_nm / v))) for v in voxel_nm]
    # One extra coarse voxel on each side keeps the interpolation away from the borders.
    small_shape = [math.ceil(n / f) + 2 for n, f in zip(shape, factors)]
    small = rng.standard_normal(small_shape, dtype=np.float32)
    sigma = [correlation_nm / (v * f) for v, f in zip(voxel_nm, factors)]
    small = ndi.gaussian_filter(small, sigma, mode="wrap")
    small /= small.std() + 1e-6
    # Voxel i of the output sits at coarse index 1 + (i + 0.5) / f - 0.5.
    for axis in (2, 1, 0):
        pos = 0.5 + (np.arange(shape[axis]) + 0.5) / factors[axis]
        small = _interp_axis(small, axis, pos)
    return small


def render_em(atoms: np.ndarray, voxel_nm, rng: np.random.Generator) -> np.ndarray:
    """FIB-SEM-like uint8 image of an atomic label field sampled with voxel size ``voxel_nm``."""
    fine = _smooth_noise(rng, atoms.shape, voxel_nm, correlation_nm=14.0, factor=2)
    coarse = _smooth_noise(rng, atoms.shape, voxel_nm, correlation_nm=70.0, factor=6)
    image = _ATOM_GREY[atoms]
    image += _ATOM_TEXTURE[atoms] * fine
    # Chromatin: dark clumps where the coarse texture is high, mostly in the nucleus.
    image -= _ATOM_CHROMATIN[atoms] * np.clip(coarse - 0.3, 0.0, 1.5)
    del fine, coarse

    image = ndi.gaussian_filter(image, [s / v for s, v in zip(PSF_SIGMA_NM, voxel_nm)], mode="nearest")

    # Detector shot noise grows with the signal; a little read noise on top.
    noise = rng.standard_normal(image.shape, dtype=np.float32)
    image += (np.sqrt(np.maximum(image, 1.0)) * 1.1 + 3.0) * noise
    # Slice-to-slice brightness drift, and faint milling streaks ("curtains") along y.
    image *= (1.0 + 0.015 * rng.standard_normal(atoms.shape[0]))[:, None, None].astype(np.float32)
    streaks = ndi.gaussian_filter1d(rng.standard_normal(atoms.shape[2]).astype(np.float32), 1.5)
    image += (4.0 * streaks / (streaks.std() + 1e-6))[None, None, :]
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------
# Pyramids
# ---------------------------------------------------------------------------------------


def downsample_mean(image: np.ndarray) -> np.ndarray:
    """2x mean downsampling of a uint8 volume (odd trailing voxels dropped), rounded."""
    nz, ny, nx = (n // 2 for n in image.shape)
    blocks = image[: 2 * nz, : 2 * ny, : 2 * nx].reshape(nz, 2, ny, 2, nx, 2)
    return np.rint(blocks.mean(axis=(1, 3, 5), dtype=np.float32)).astype(np.uint8)


def downsample_mode(atoms: np.ndarray) -> np.ndarray:
    """2x downsampling of a label field: the most frequent atom of each 2x2x2 block.

    Ties go to the smaller atom id, so the result is deterministic. Most blocks hold a single
    atom; only the others are counted.
    """
    nz, ny, nx = (n // 2 for n in atoms.shape)
    blocks = atoms[: 2 * nz, : 2 * ny, : 2 * nx].reshape(nz, 2, ny, 2, nx, 2)
    blocks = blocks.transpose(0, 2, 4, 1, 3, 5).reshape(-1, 8)
    best = blocks[:, 0].copy()
    mixed = np.flatnonzero((blocks != best[:, None]).any(axis=1))
    sub = blocks[mixed]
    counts = np.stack([(sub == atom).sum(axis=1) for atom in range(NUM_ATOMS)], axis=1)
    best[mixed] = np.argmax(counts, axis=1)  # argmax returns the first of equal maxima
    return best.reshape(nz, ny, nx)


def downsample_any(mask: np.ndarray) -> np.ndarray:
    """2x downsampling of a boolean mask: True where any voxel of the block is True."""
    nz, ny, nx = (n // 2 for n in mask.shape)
    return mask[: 2 * nz, : 2 * ny, : 2 * nx].reshape(nz, 2, ny, 2, nx, 2).any(axis=(1, 3, 5))


# ---------------------------------------------------------------------------------------
# The demo set
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CropSpec:
    """One annotated crop of a dataset.

    Attributes:
        voxel_nm: label voxel size (z, y, x), may differ from the EM's.
        size_nm: box size at ``scale=1`` (shrinks with the demo ``scale``).
        where: position of the box inside the EM volume, 0 (low end) .. 1 (high end), per axis.
        classes: the classes annotated in this crop (None: all of them).
        half_voxel_shift: shift the box by half an EM voxel, so that label voxel centres sit
            between EM voxel centres.
        unknown_slab: (axis, start, stop) fractions of the crop left unannotated (255).
    """

    voxel_nm: tuple[float, float, float]
    size_nm: tuple[float, float, float]
    where: tuple[float, float, float]
    classes: tuple[str, ...] | None = None
    half_voxel_shift: bool = False
    unknown_slab: tuple[int, float, float] | None = None


@dataclass(frozen=True)
class DatasetSpec:
    """One demo dataset: its EM grid (at ``scale=1``) and its annotated crops."""

    name: str
    voxel_nm: tuple[float, float, float]
    shape: tuple[int, int, int]  # EM s0 voxels at scale=1
    translation_nm: tuple[float, float, float]  # centre of EM voxel 0
    crops: tuple[CropSpec, ...]


DEMO_DATASETS: tuple[DatasetSpec, ...] = (
    DatasetSpec(
        name="jrc_synth-1",
        voxel_nm=(8.0, 8.0, 8.0),
        shape=(160, 320, 320),
        translation_nm=(0.0, 0.0, 0.0),
        crops=(
            CropSpec((8.0, 8.0, 8.0), (640, 1280, 1280), (0.5, 0.25, 0.3)),
            CropSpec((4.0, 4.0, 4.0), (400, 1000, 1000), (0.35, 0.85, 0.75)),
            CropSpec((16.0, 16.0, 16.0), (960, 1440, 1440), (0.4, 0.6, 0.1), classes=("nuc", "cell")),
            CropSpec(
                (8.0, 8.0, 8.0),
                (480, 1200, 1040),
                (0.7, 0.9, 0.95),
                classes=("mito", "mito_mem", "mito_lum"),
                half_voxel_shift=True,
                unknown_slab=(1, 0.55, 0.8),
            ),
        ),
    ),
    DatasetSpec(
        name="jrc_synth-2",
        voxel_nm=(16.0, 8.0, 8.0),
        shape=(80, 320, 320),
        translation_nm=(960.0, 480.0, 1600.0),
        crops=(
            CropSpec((8.0, 8.0, 8.0), (640, 1200, 1200), (0.5, 0.5, 0.5), unknown_slab=(0, 0.0, 0.25)),
            CropSpec(
                (16.0, 16.0, 16.0), (800, 1400, 1400), (0.2, 0.1, 0.85), classes=("mito", "mito_mem", "mito_lum")
            ),
            CropSpec((4.0, 4.0, 4.0), (400, 960, 960), (0.75, 0.9, 0.15)),
            CropSpec((16.0, 8.0, 8.0), (960, 1400, 1400), (0.3, 0.8, 0.6), half_voxel_shift=True),
        ),
    ),
)


def _em_grid(spec: DatasetSpec, scale: float) -> Grid:
    # Multiples of 4 so that s1 and s2 are exact 2x reductions.
    shape = tuple(max(16, 4 * round(n * scale / 4)) for n in spec.shape)
    return Grid(shape, spec.voxel_nm, spec.translation_nm)


def _crop_grid(crop: CropSpec, em: Grid, scale: float) -> Grid:
    """Place a crop inside the EM volume, its voxel edges on the EM voxel edges (plus half
    an EM voxel when ``half_voxel_shift``)."""
    shape, translation = [], []
    for d in range(3):
        v, s_em = crop.voxel_nm[d], em.scale[d]
        shift = s_em / 2 if crop.half_voxel_shift else 0.0
        extent = em.box_max[d] - em.box_min[d] - shift
        n = max(4, 2 * round(crop.size_nm[d] * scale / v / 2))  # even, for the s1 level
        n = min(n, 2 * int(extent // (2 * v)))
        free_voxels = int((extent - n * v) // s_em)
        edge = em.box_min[d] + shift + s_em * math.floor(crop.where[d] * free_voxels)
        shape.append(n)
        translation.append(float(edge + v / 2))
    return Grid(tuple(shape), crop.voxel_nm, tuple(translation))


def _unknown_mask(shape, slab) -> np.ndarray:
    mask = np.zeros(shape, bool)
    if slab is not None:
        axis, start, stop = slab
        index = [slice(None)] * 3
        index[axis] = slice(int(round(start * shape[axis])), int(round(stop * shape[axis])))
        mask[tuple(index)] = True
    return mask


def _write_em(path: Path, levels: list[np.ndarray], grid: Grid) -> None:
    store = zarr.open_group(str(path), mode="w", zarr_format=2)
    write_multiscale_array_group(store, EM_PATH, levels, grid.scale, grid.translation, chunks=(64, 64, 64))


def _write_crop(path: Path, crop_name: str, grid: Grid, labels: dict[str, list[np.ndarray]]) -> None:
    store = zarr.open_group(str(path), mode="r+", zarr_format=2)
    crop_group = store.require_group(f"{GROUNDTRUTH_PATH}/{crop_name}")
    for class_name, levels in labels.items():
        write_multiscale_array_group(
            crop_group,
            class_name,
            levels,
            grid.scale,
            grid.translation,
            chunks=(128, 128, 128),
            extra_attrs=annotation_attrs(class_name, levels[0]),
        )


def _crop_labels(scene: Scene, crop: CropSpec, grid: Grid) -> dict[str, list[np.ndarray]]:
    """Levels s0 and s1 of every class the crop annotates, with the unknown slab."""
    atoms0 = render_atoms(scene, grid)
    atoms1 = downsample_mode(atoms0)
    unknown0 = _unknown_mask(grid.shape, crop.unknown_slab)
    unknown1 = downsample_any(unknown0)
    labels = {}
    for class_name in crop.classes or DEMO_CLASSES:
        s0, s1 = atoms_to_class(atoms0, class_name), atoms_to_class(atoms1, class_name)
        s0[unknown0], s1[unknown1] = UNKNOWN, UNKNOWN
        labels[class_name] = [s0, s1]
    return labels


def _write_dataset(
    root: Path, index: int, spec: DatasetSpec, seed: int, scale: float, first_crop: int, submit
) -> int:
    """Render one dataset and hand its arrays to ``submit`` for writing; returns the
    number of crops. Writing runs in the background while the next part is rendered."""
    path = root / spec.name / f"{spec.name}.zarr"
    em_grid = _em_grid(spec, scale)
    scene = make_scene(np.random.default_rng([seed, index, 0]), em_grid.box_min, em_grid.box_max)

    atoms = render_atoms(scene, em_grid)
    em = render_em(atoms, em_grid.scale, np.random.default_rng([seed, index, 1]))
    del atoms
    levels = [em]
    for _ in range(2):
        levels.append(downsample_mean(levels[-1]))
    submit(_write_em, path, levels, em_grid)

    for k, crop in enumerate(spec.crops):
        grid = _crop_grid(crop, em_grid, scale)
        submit(_write_crop, path, f"crop{first_crop + k}", grid, _crop_labels(scene, crop, grid))
    return len(spec.crops)


def _marker_content(seed: int, scale: float) -> dict:
    return {"seed": int(seed), "scale": float(scale), "datasets": [d.name for d in DEMO_DATASETS]}


def demo_data_complete(root: str | os.PathLike, seed: int = 0, scale: float = 1.0) -> bool:
    """Whether ``root`` holds a complete demo set made with this ``seed`` and ``scale``."""
    marker = Path(root) / COMPLETE_MARKER
    try:
        return json.loads(marker.read_text()) == _marker_content(seed, scale)
    except (OSError, ValueError):
        return False


class DemoDataError(UserError, ValueError):
    """Demo data that cannot be made as asked (e.g. a scale out of range)."""


def generate_demo_data(root: str | os.PathLike, seed: int = 0, scale: float = 1.0) -> list[str]:
    """Write the synthetic demo datasets under ``root`` and return their names.

    Args:
        root: output folder; each dataset goes to ``root/<name>/<name>.zarr``. Existing
            demo datasets there are overwritten.
        seed: random seed; the same seed gives identical data.
        scale: shrinks the volumes and crops (every axis) while keeping physical object
            sizes, e.g. 0.4 for a small set that tests make in seconds.
    """
    if not 0.1 <= scale <= 2.0:
        raise DemoDataError(f"scale must be in [0.1, 2.0] (--scale), got {scale}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    marker = root / COMPLETE_MARKER
    marker.unlink(missing_ok=True)  # from now on the folder is "incomplete" until the end
    for spec in DEMO_DATASETS:
        shutil.rmtree(root / spec.name, ignore_errors=True)

    # One writer thread, so zarr calls stay in order; it overlaps with the rendering.
    with ThreadPoolExecutor(max_workers=1) as writer:
        pending = []

        def submit(fn, *args):
            pending.append(writer.submit(fn, *args))

        next_crop = 1  # crop numbers are unique across the whole set, as in the challenge
        for index, spec in enumerate(DEMO_DATASETS):
            next_crop += _write_dataset(root, index, spec, seed, scale, next_crop, submit)
        for job in pending:
            job.result()  # re-raises a failed write here
    marker.write_text(json.dumps(_marker_content(seed, scale)))
    return [spec.name for spec in DEMO_DATASETS]


def _scale_and_translation(group_path: Path) -> tuple[list[float], list[float]]:
    """Voxel size and voxel-0 centre (nm) of level s0 of an OME-NGFF multiscale group."""
    s0 = read_multiscales(group_path)[0]
    return list(s0.scale), list(s0.translation)


def summarize_demo_data(root: str | os.PathLike) -> str:
    """A few human-readable lines describing the demo datasets found under ``root``."""
    lines = []
    for spec in DEMO_DATASETS:
        path = Path(root) / spec.name / f"{spec.name}.zarr"
        if not path.exists():
            continue
        store = zarr.open_group(str(path), mode="r")
        em_group = store[EM_PATH]
        scale, translation = _scale_and_translation(path / EM_PATH)
        levels = sorted(em_group.array_keys())
        lines.append(
            f"{spec.name}: EM {em_group['s0'].shape} voxels of {scale} nm at {translation} nm, levels {levels}"
        )
        for crop_name, crop in sorted(store[GROUNDTRUTH_PATH].groups(), key=lambda kv: int(kv[0][4:])):
            classes = sorted(crop.group_keys(), key=DEMO_CLASSES.index)
            first = crop[classes[0]]
            crop_scale, crop_translation = _scale_and_translation(
                path / GROUNDTRUTH_PATH / crop_name / classes[0])
            unknown = first.attrs["cellmap"]["annotation"]["complement_counts"]["unknown"]
            what = "all classes" if len(classes) == len(DEMO_CLASSES) else ", ".join(classes)
            lines.append(
                f"  {crop_name}: {first['s0'].shape} voxels of {crop_scale} nm at {crop_translation} nm; "
                f"{what}" + (f"; {unknown} unknown voxels" if unknown else "")
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------
# A quick look
# ---------------------------------------------------------------------------------------

# Overlay colours, painted in this order (later wins).
_OVERLAY = [
    ("ecs", (40, 90, 255)),
    ("nuc", (170, 60, 220)),
    ("mito", (40, 200, 60)),
    ("mito_mem", (0, 110, 0)),
    ("er", (0, 220, 220)),
    ("ves", (255, 140, 0)),
    ("ld", (230, 30, 30)),
    ("pm", (255, 230, 0)),
]


def preview_png(root: str | os.PathLike, out_png: str | os.PathLike) -> None:
    """Save the central z-slice of each dataset's EM next to its label overlay.

    The overlay shows every crop that cuts the slice (outlined in white), resampled to the
    EM pixels by nearest neighbour; unknown voxels are grey.
    """
    from PIL import Image, ImageDraw

    rows = []
    for ds_dir in sorted(p for p in Path(root).iterdir() if (p / f"{p.name}.zarr").exists()):
        store_path = ds_dir / f"{ds_dir.name}.zarr"
        store = zarr.open_group(str(store_path), mode="r")
        em_group = store[EM_PATH]
        em_scale, em_trans = map(np.array, _scale_and_translation(store_path / EM_PATH))
        em = em_group["s0"]
        iz = em.shape[0] // 2
        em_slice = np.asarray(em[iz])
        world = [em_trans[d] + em_scale[d] * np.arange(em.shape[d]) for d in range(3)]
        overlay = np.repeat(em_slice[..., None], 3, axis=2).astype(np.float32)
        outlines = []
        for crop_name, crop in store[GROUNDTRUTH_PATH].groups():
            # All classes of a crop share one grid: find the label voxel nearest to each
            # EM pixel of this slice.
            classes = dict(crop.groups())
            first = store_path / GROUNDTRUTH_PATH / crop_name / next(iter(classes))
            scale, trans = map(np.array, _scale_and_translation(first))
            shape = next(iter(classes.values()))["s0"].shape
            idx = [np.floor((world[d] - (trans[d] - scale[d] / 2)) / scale[d]).astype(int) for d in range(3)]
            cz = int(idx[0][iz])
            ys = np.flatnonzero((idx[1] >= 0) & (idx[1] < shape[1]))
            xs = np.flatnonzero((idx[2] >= 0) & (idx[2] < shape[2]))
            if not 0 <= cz < shape[0] or len(ys) == 0 or len(xs) == 0:
                continue
            view = overlay[ys[0] : ys[-1] + 1, xs[0] : xs[-1] + 1]
            unknown = None
            for class_name, colour in _OVERLAY:
                if class_name in classes:
                    plane = np.asarray(classes[class_name]["s0"][cz])[np.ix_(idx[1][ys], idx[2][xs])]
                    present, valid = label_to_target(plane)
                    view[present] = 0.5 * view[present] + 0.5 * np.array(colour, np.float32)
                    unknown = ~valid
            if unknown is None:  # a crop with none of the coloured classes (e.g. only "cell")
                any_class = next(iter(classes.values()))["s0"]
                unknown = ~label_to_target(np.asarray(any_class[cz])[np.ix_(idx[1][ys], idx[2][xs])])[1]
            view[unknown] = 0.4 * view[unknown] + 0.6 * 128
            outlines.append((xs[0], ys[0], xs[-1], ys[-1], crop_name))
        left = Image.fromarray(em_slice).convert("RGB")
        right = Image.fromarray(np.clip(overlay, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(right)
        for x0, y0, x1, y1, crop_name in outlines:
            draw.rectangle([x0, y0, x1, y1], outline=(255, 255, 255))
            draw.text((x0 + 2, y0 + 2), crop_name, fill=(255, 255, 255))
        row = Image.new("RGB", (left.width + right.width + 8, max(left.height, right.height) + 14), (0, 0, 0))
        row.paste(left, (0, 14))
        row.paste(right, (left.width + 8, 14))
        title = f"{ds_dir.name}  z={iz}  voxel={em_scale.tolist()} nm"
        ImageDraw.Draw(row).text((2, 1), title, fill=(255, 255, 255))
        rows.append(row)
    if not rows:
        raise FileNotFoundError(f"no demo datasets under {root}")
    sheet = Image.new("RGB", (max(r.width for r in rows), sum(r.height for r in rows)), (0, 0, 0))
    y = 0
    for row in rows:
        sheet.paste(row, (0, y))
        y += row.height
    sheet.save(out_png)
