"""The demo data's scene model: atoms, classes, physical sizes, smooth random fields, the
geometric objects of a cell (nucleus, tubes, sheets, balls) and their rasterisation.

A *scene* is a set of objects in world coordinates (nanometres, axis order z, y, x).
:func:`render_atoms` rasterises it into an *atomic* label field on any voxel grid: every
voxel centre gets exactly one atom (cytosol, plasma membrane, mitochondrial matrix, ...), and
each class is a union of atoms (``CLASS_ATOMS``), so nested classes are consistent by
construction. How a random scene of cells is drawn is :mod:`torchtitan.demo.cells`;
how the set is written, :mod:`torchtitan.demo.data`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from torchtitan.cellmap.grids import Grid

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


def interp_axis(values: np.ndarray, axis: int, pos: np.ndarray) -> np.ndarray:
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
        values = interp_axis(values, axis, pos)
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
