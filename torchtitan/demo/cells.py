"""The demo data's simulator: a random scene of touching cells, and its FIB-SEM image.

:func:`make_scene` draws the cells (a warped, weighted Voronoi partition with thin
extracellular gaps) and furnishes each with a nucleus, mitochondria, ER tubes and sheets,
vesicles and sometimes a lipid droplet (objects of :mod:`torchtitan.demo.scene`).
:func:`render_em` turns an atomic label field into a uint8 FIB-SEM-like image: a grey level per
atom plus texture, blurred by a PSF-like Gaussian, with shot noise, slice-to-slice brightness
drift and faint milling streaks.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.ndimage as ndi

from torchtitan.demo.scene import (
    CELL_JITTER,
    CELL_SPACING,
    CELL_WEIGHT,
    CYTO,
    ECS,
    ER_LUMEN,
    ER_MEM,
    HALF_GAP,
    HALF_GAP_VARIATION,
    LD,
    MITO_CRISTA,
    MITO_MATRIX,
    MITO_MEM,
    NE_LUMEN,
    NE_MEM,
    NUC_PERIPHERY,
    NUCLEOPLASM,
    NUM_ATOMS,
    PM,
    PM_THICKNESS,
    VES_LUMEN,
    VES_MEM,
    Ball,
    Nucleus,
    Scene,
    Sheet,
    Tube,
    WaveNoise,
    interp_axis,
)

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
        small = interp_axis(small, axis, pos)
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
