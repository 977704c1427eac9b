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

from torchtitan.config.manager import flag_type
from torchtitan.data.io.stores import StoreContext
from torchtitan.errors import run_cli
from torchtitan.scripts.cli import add_gif_args, parse_classes, parse_voxel_size, script_parser, write_gif
from torchtitan.scripts.label_crops import (
    canonical_order,
    find_crop,
    load_sources,
    prediction_classes,
    read_crop_volume,
    read_prediction,
)
from torchtitan.pictures.visualization import comparison_frames

SCALE = (lambda v: 1 <= v <= 32, "must be an integer zoom in [1, 32]")


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
    source, crop = find_crop(load_sources(StoreContext(), args.zarr), args.crop)
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
