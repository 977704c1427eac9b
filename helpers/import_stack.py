"""Import a stack of 2D EM images (TIFF/PNG sections or one multi-page TIFF) and its label images as a CellMap-layout dataset that training, predict.py and scoring read.

    python helpers/import_stack.py --em stack/raw --labels stack/labels --out data/mine \
        --name mine --voxel_size 50,4.6,4.6 --class pm=0,32,64,96,128 --class mito=191 \
        --class ecs=159 --background 255,223 --crop crop1=0-15 --crop crop2=16-19
    python helpers/import_stack.py --em 'more/*.tif' --out data/mine --voxel_size 50,4.6,4.6

Writes <out>/<name>/<name>.zarr: the EM as an OME-NGFF pyramid (recon-1/em/fibsem-uint8, or
fibsem-uint16 for 16-bit EM) and, with --labels, one label crop per --crop (a range of
sections, counted from 0; default: crop1 over all of them) holding one group per class
(recon-1/labels/groundtruth/crop<N>/<class>). Sections are sorted by name, numbers by value.
Every label value must belong to a class, to --background or to --unknown. Instance classes
(mito, nuc, ...) get object ids (--instances 3d: connected across sections; 2d: per section).
A value map file holds the same as the flags (flags add to it and win):

    background = [255, 223]
    [classes]
    pm = "0,32,64,96,128"
    mito = 191

Then train with --data.dataset_path <out> --data.voxel_size <the voxel size> and, e.g.,
--data.val_crops crop2 (README: "Your own EM"). See torchtitan/datasets/image_stack.py.
"""

import sys

from torchtitan.tools.cli import script_parser
from torchtitan.datasets.image_stack import INSTANCE_MODES, import_stack
from torchtitan.datasets.stack_labels import (
    ImageStackError,
    ValueMap,
    parse_class,
    parse_values,
    read_value_map,
)
from torchtitan.errors import run_cli


def parse_voxel_size(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 3 or min(values) <= 0:
        raise ImageStackError(f"--voxel_size {text!r}: expected three sizes in nm, z,y,x, "
                              "each > 0 (e.g. 50,4.6,4.6)")
    return values


def value_map_of(args) -> ValueMap:
    vm = read_value_map(args.value_map) if args.value_map else ValueMap()
    for spec in args.classes:
        name, values = parse_class(spec)
        vm.classes[name] = values
    if args.background is not None:
        vm.background = parse_values(args.background, "--background")
    if args.unknown is not None:
        vm.unknown = parse_values(args.unknown, "--unknown")
    return vm


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--em", required=True,
                   help="EM sections: a folder of .tif/.tiff/.png images, a quoted glob, or one "
                        "multi-page TIFF (8- or 16-bit greyscale)")
    p.add_argument("--labels", help="label images, one per EM section, same size (folder, glob "
                                    "or multi-page TIFF); without it the dataset is EM only")
    p.add_argument("--out", required=True, help="output folder (the data.dataset_path to train on)")
    p.add_argument("--name", help="dataset name (default: the EM folder's name)")
    p.add_argument("--voxel_size", required=True, help="voxel size in nm, z,y,x (e.g. 50,4.6,4.6)")
    p.add_argument("--crop", dest="crops", action="append", default=[], metavar="crop<N>=A-B",
                   help="a label crop over sections A..B (from 0), repeatable "
                        "(default: crop1 over every section)")
    p.add_argument("--class", dest="classes", action="append", default=[], metavar="NAME=VALUES",
                   help="a class and its label values, e.g. mito=191 or pm=0,32,64-128; repeatable")
    p.add_argument("--value_map", help="TOML file with background, unknown and [classes]")
    p.add_argument("--background", metavar="VALUES",
                   help="label values absent for every class (e.g. 255,223)")
    p.add_argument("--unknown", metavar="VALUES",
                   help="label values that are not annotated (stored as unknown)")
    p.add_argument("--instances", choices=INSTANCE_MODES, default="3d",
                   help="object ids of instance classes: connected components in 3d (default), "
                        "per section (2d), or none (0/1 masks)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset of that name")
    args = p.parse_args(argv)
    summary = import_stack(args.em, args.out, parse_voxel_size(args.voxel_size), labels=args.labels,
                           name=args.name, crops=args.crops, value_map=value_map_of(args),
                           instances=args.instances, overwrite=args.overwrite, log=print)
    print(f"train on it with --data.dataset_path {args.out} --data.voxel_size {args.voxel_size}"
          + (f" --data.classes {','.join(next(iter(summary['crops'].values()))['classes'])}"
             if summary["crops"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
