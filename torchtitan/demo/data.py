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

Steps 1-3 live in :mod:`torchtitan.demo.scene` (atoms, classes, objects, rasterising)
and :mod:`torchtitan.demo.cells` (the random cell scene, the EM rendering); this module
holds the set itself, its pyramids, the writer, a summary and a preview picture. It is a
product: the core (training, data loading, evaluation) never imports it.

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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zarr

from torchtitan.cellmap.grids import Grid
from torchtitan.cellmap.labels import UNKNOWN, annotation_attrs, label_to_target
from torchtitan.cellmap.ome_ngff import read_multiscales, write_multiscale_array_group
from torchtitan.data.crops.layout import EM_GROUP as EM_PATH
from torchtitan.data.crops.layout import GT_GROUP as GROUNDTRUTH_PATH
from torchtitan.errors import UserError
from torchtitan.demo.cells import make_scene, render_em
from torchtitan.demo.scene import DEMO_CLASSES, NUM_ATOMS, Scene, atoms_to_class, render_atoms

COMPLETE_MARKER = ".demo_complete"

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
