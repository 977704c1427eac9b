"""Plot one label crop (EM with its class masks) as a GIF that steps through z.

    python helpers/plot_volumes_single.py --zarr data/demo --crop crop3 --out crop3.gif
    python helpers/plot_volumes_single.py --zarr data/demo/jrc_synth-1/jrc_synth-1.zarr \\
        --crop crop1 --classes mito,nuc --voxel_size 8,8,8 --out crop1.gif
    python helpers/plot_volumes_single.py --zarr data/demo --crop crop1 \\
        --predictions predictions.zarr --out crop1_vs_prediction.gif

``--zarr`` is one CellMap-layout dataset store (``<ds>.zarr``) or a folder of them
(``<root>/<ds>/<ds>.zarr``). The EM is read on a grid of ``--voxel_size`` nm (default: the
EM's own voxel size) covering the label crop, with the labels sampled onto the same grid.

``--predictions`` adds a prediction panel from a zarr in the CellMap submission layout:
``PRED.zarr/crop<N>/<class>`` arrays whose ``voxel_size`` and ``translation`` attributes
give the voxel size and the position of the centre of voxel 0 in nm (z, y, x), as OME-NGFF
does. Values above 0.5 count as present (binary masks, probabilities or instance ids).
"""

import argparse
import sys
from pathlib import Path

import numpy as np

from helpers import add_gif_args, script_parser, write_gif
from torchtitan.cellmap.grids import closest_level
from torchtitan.cellmap.ome_ngff import read_multiscales
from torchtitan.datasets.cellmap import (
    EM_GROUP,
    GT_GROUP,
    DatasetError,
    EMSource,
    LabelCrop,
    read_crop,
    discover,
    read_linear,
    read_nearest,
)
from torchtitan.datasets.samples import crop_grid
from torchtitan.datasets.targets import annotates, read_target
from torchtitan.cellmap.classes import check_class_names
from torchtitan.config_manager import flag_type
from torchtitan.errors import run_cli
from torchtitan.tools.scoring import prediction_level
from torchtitan.tools.visualization import CLASS_COLORS, comparison_frames

# ---------------------------------------------------------------------------------------------
# Finding and reading crops (shared with plot_volumes_grid.py)
# ---------------------------------------------------------------------------------------------


def load_sources(path) -> list[EMSource]:
    """The datasets at ``path``: a folder of ``<ds>/<ds>.zarr`` stores, or one store."""
    path = Path(path)
    if not (path / EM_GROUP).is_dir():
        return discover(path)
    levels = read_multiscales(path / EM_GROUP)
    name = path.name[: -len(".zarr")] if path.name.endswith(".zarr") else path.name
    crops = []
    gt = path / GT_GROUP
    if gt.is_dir():
        for crop_dir in sorted(p for p in gt.iterdir() if p.is_dir()):
            crop = read_crop(crop_dir, name)
            if crop is not None:
                crops.append(crop)
    return [EMSource(name, str(path), levels, crops)]


def all_crops(sources: list[EMSource]) -> list[tuple[EMSource, LabelCrop]]:
    """Every (dataset, crop) pair, in crop-number order."""
    pairs = [(s, c) for s in sources for c in s.crops]
    return sorted(pairs, key=lambda sc: (_crop_number(sc[1].name), sc[1].full_name))


def _crop_number(name: str) -> int:
    digits = "".join(ch for ch in name if ch.isdigit())
    return int(digits) if digits else 0


def find_crop(sources: list[EMSource], name: str | None) -> tuple[EMSource, LabelCrop]:
    """The crop called ``name`` (``crop3`` or ``jrc_hela-2/crop3``); the first one if None."""
    pairs = all_crops(sources)
    if not pairs:
        raise DatasetError("no label crops found (expected <ds>.zarr/recon-1/labels/groundtruth/crop<N>)")
    if name is None:
        return pairs[0]
    matches = [(s, c) for s, c in pairs if name in (c.name, c.full_name)]
    if not matches:
        known = ", ".join(c.full_name for _, c in pairs)
        raise DatasetError(f"no crop {name!r}; available: {known}")
    if len(matches) > 1:
        names = ", ".join(c.full_name for _, c in matches)
        raise DatasetError(f"crop name {name!r} is ambiguous ({names}); use <dataset>/<crop>")
    return matches[0]


def canonical_order(classes) -> list[str]:
    """Classes in the usual CellMap order (that of CLASS_COLORS), unknown names last."""
    order = {c: i for i, c in enumerate(CLASS_COLORS)}
    return sorted(set(classes), key=lambda c: (order.get(c, len(order)), c))


def parse_list(text: str | None) -> list[str] | None:
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


_VOXEL_SIZE = flag_type(type=list[float], check=(lambda v: len(v) in (1, 3) and min(v) > 0,
                                                  "must be one or three numbers > 0, nm (z,y,x)"))
SCALE = (lambda v: 1 <= v <= 32, "must be an integer zoom in [1, 32]")


def parse_voxel_size(text):
    """"8" or "8,8,8" (nm, z, y, x) -> three floats; None (and a parsed tuple) stays as it is.
    An argparse ``type``: a bad value (no numbers, nan, <= 0) is one argparse error."""
    if text is None or isinstance(text, tuple):
        return text
    values = _VOXEL_SIZE(text)
    return tuple(values * 3 if len(values) == 1 else values)


def parse_classes(text: str | None, crops) -> list[str] | None:
    """``--classes`` as a list, each a CellMap class or one a crop of ``crops`` annotates (else
    the error that training gives, with the closest name)."""
    classes = parse_list(text)
    if classes:
        check_class_names(classes, {c for crop in crops for c in crop.classes}, "--classes")
    return classes


def read_crop_volume(source: EMSource, crop: LabelCrop, classes: list[str], voxel_size=None) -> dict:
    """EM, masks and validity of a whole crop on a grid of ``voxel_size`` nm.

    Returns ``em`` (D, H, W) uint8, ``truth`` and ``valid`` (K, D, H, W) bool (a class the crop
    does not annotate, itself or through all its parts, is all invalid), and the grid's
    ``origin``, ``shape`` and ``voxel_size``. The truth is the training target
    (``datasets.targets.read_target``), so the picture shows what the model learns from.
    """
    voxel_size = np.asarray(voxel_size if voxel_size is not None else source.levels[0].scale, float)
    origin, shape = crop_grid(crop, voxel_size)
    level = source.levels[closest_level(source.levels, voxel_size)]
    em, _ = read_linear(level, origin, voxel_size, shape)
    truth = np.zeros((len(classes), *shape), bool)
    valid = np.zeros_like(truth)
    for k, cls in enumerate(classes):
        if annotates(crop, cls):
            truth[k], valid[k] = read_target(crop, cls, origin, voxel_size, shape)
    return {"em": np.clip(em, 0, 255).round().astype(np.uint8), "truth": truth, "valid": valid,
            "origin": origin, "shape": shape, "voxel_size": voxel_size}


def read_prediction(pred_root, crop: LabelCrop, classes: list[str], origin, voxel_size, shape) -> np.ndarray:
    """(K, D, H, W) bool predictions of ``crop`` from a submission-layout zarr, resampled
    (nearest) onto the crop's grid. A class without a prediction array is all False."""
    crop_dir = Path(pred_root) / crop.name
    if not crop_dir.is_dir():
        raise DatasetError(f"{pred_root}: no predictions for {crop.name} (expected {crop_dir})")
    pred = np.zeros((len(classes), *shape), bool)
    for k, cls in enumerate(classes):
        path = crop_dir / cls
        if not path.exists():
            print(f"note: no prediction for class {cls!r} in {crop_dir}")
            continue
        level = prediction_level(path)
        pred[k] = read_nearest(level, origin, voxel_size, shape, fill=0).astype(np.float32) > 0.5
    return pred


def prediction_classes(pred_root, crop: LabelCrop) -> list[str]:
    crop_dir = Path(pred_root) / crop.name
    return [p.name for p in crop_dir.iterdir() if p.is_dir()] if crop_dir.is_dir() else []


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--zarr", required=True, help="a <ds>.zarr store, or a folder of <ds>/<ds>.zarr stores")
    parser.add_argument("--crop", default=None, help="crop name, e.g. crop3 or jrc_synth-1/crop3 (default: the first)")
    parser.add_argument("--classes", default=None,
                        help="comma-separated classes (default: those predicted, else all the crop annotates)")
    parser.add_argument("--voxel_size", default=None, type=parse_voxel_size,
                        help="nm, 'z,y,x' or one number (default: the EM's)")
    parser.add_argument("--predictions", default=None, help="prediction zarr in the submission layout")
    parser.add_argument("--scale", type=flag_type(type=int, check=SCALE), default=None,
                        help="integer zoom, 1-32 (default: ~256 px per panel)")
    add_gif_args(parser)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    source, crop = find_crop(load_sources(args.zarr), args.crop)
    classes = parse_classes(args.classes, [crop])
    if classes is None:  # what was predicted, else everything the crop annotates
        predicted = prediction_classes(args.predictions, crop) if args.predictions else []
        classes = canonical_order(predicted or crop.classes)
    vol = read_crop_volume(source, crop, classes, parse_voxel_size(args.voxel_size))
    pred = None
    if args.predictions:
        pred = read_prediction(args.predictions, crop, classes, vol["origin"], vol["voxel_size"], vol["shape"])
    size = "x".join(f"{v:g}" for v in vol["voxel_size"])
    title = f"{crop.full_name}   {'x'.join(map(str, vol['shape']))} voxels of {size} nm"
    frames = comparison_frames(vol["em"], vol["truth"], pred, classes, valid=vol["valid"],
                               max_frames=args.max_frames, scale=args.scale, title=title)
    write_gif(frames, args, f"classes: {', '.join(classes)}")



if __name__ == "__main__":
    sys.exit(run_cli(main))
