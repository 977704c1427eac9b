"""Plot several label crops (EM with class masks) as one GIF: a grid of tiles that step
through depth together.

    python helpers/plot_volumes_grid.py --data data/demo --out crops.gif
    python helpers/plot_volumes_grid.py --data data/demo --crops crop1,crop2,jrc_synth-2/crop7 \\
        --classes mito,nuc,er --cols 3 --out some_crops.gif

Crops differ in depth, so frame t of n shows every crop at the same relative depth
(t + 0.5) / n. Each crop is read on a grid of ``--voxel_size`` nm (default: its dataset's EM
voxel size) and zoomed to fit a tile. Classes a crop does not annotate are simply absent
from its tile; its unannotated voxels are hatched.
"""

import argparse
import sys

from torchtitan.data.crops.layout import DatasetError
from torchtitan.data.io.stores import StoreContext
from torchtitan.config.manager import flag_type
from torchtitan.errors import run_cli
from torchtitan.scripts.cli import (
    add_gif_args,
    parse_classes,
    parse_list,
    parse_voxel_size,
    script_parser,
    write_gif,
)
from torchtitan.scripts.label_crops import all_crops, canonical_order, find_crop, load_sources, read_crop_volume
from torchtitan.pictures.visualization import grid_frames


def parse_args(argv=None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--data", required=True, help="folder of <ds>/<ds>.zarr stores, or one <ds>.zarr")
    parser.add_argument("--crops", default=None,
                        help="comma-separated crops, e.g. crop1,jrc_synth-2/crop7 (default: all)")
    parser.add_argument("--classes", default=None, help="comma-separated classes (default: all annotated)")
    parser.add_argument("--voxel_size", default=None, type=parse_voxel_size,
                        help="nm, 'z,y,x' or one number (default: each EM's)")
    parser.add_argument("--cols", type=flag_type(type=int, check=(lambda v: 1 <= v <= 64, "must be in [1, 64]")),
                        default=4, help="tiles per row (default: 4)")
    parser.add_argument("--tile_px", type=flag_type(type=int, check=(lambda v: 16 <= v <= 4096, "must be in [16, 4096]")),
                        default=256, help="tile size in pixels, 16-4096 (default: 256)")
    add_gif_args(parser)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    sources = load_sources(StoreContext(), args.data)
    names = parse_list(args.crops)
    pairs = all_crops(sources) if names is None else [find_crop(sources, n) for n in names]
    if not pairs:
        raise DatasetError(f"no label crops under {args.data}")
    classes = parse_classes(args.classes, [crop for _, crop in pairs]) or canonical_order(c for _, crop in pairs for c in crop.classes)
    voxel_size = parse_voxel_size(args.voxel_size)

    tiles = []
    for source, crop in pairs:
        vol = read_crop_volume(source, crop, classes, voxel_size)
        size = "x".join(f"{v:g}" for v in vol["voxel_size"])
        tiles.append({"em": vol["em"], "masks": vol["truth"], "valid": vol["valid"],
                      "title": f"{crop.full_name} ({size} nm)"})
    frames = grid_frames(tiles, classes, cols=args.cols, max_frames=args.max_frames, tile_px=args.tile_px,
                         title=f"{len(tiles)} crops of {args.data}")
    write_gif(frames, args, f"{len(tiles)} crops")


if __name__ == "__main__":
    sys.exit(run_cli(main))
