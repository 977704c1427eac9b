r"""Import EM (a stack of TIFF/PNG sections, one multi-page TIFF, or a 3D dataset of an HDF5 file) and its labels as a CellMap-layout dataset that training, predict.py and scoring read.

    python helpers/import_stack.py --em stack/raw --labels stack/labels --out data/mine \
        --name mine --voxel_size 50,4.6,4.6 --class pm=0,32,64,96,128 --class mito=191 \
        --class ecs=159 --background 255,223 --crop crop1=0-15 --crop crop2=16-19
    python helpers/import_stack.py --em 'more/*.tif' --out data/mine --voxel_size 50,4.6,4.6
    python helpers/import_stack.py --em sample.h5:volumes/raw \
        --labels sample.h5:volumes/labels/neuron_ids --ids cell --boundary pm \
        --out data/fly --name fly --crop crop1=0-189 --crop crop2=190-249

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

HDF5 (.h5, .hdf5, .hdf) is named FILE:DATASET and read slab by slab along z (the first axis);
the voxel size comes from the dataset's 'resolution' attribute (z, y, x nm, as in CREMI files)
unless --voxel_size is given (images carry none: give it). Labels that are object ids (neuron
or body ids: 0 = no object) need no value map: --ids CLASS stores them as that instance class,
renumbered 1..n per crop, and --boundary CLASS adds a 0/1 class of the voxels with a face
neighbour (inside the crop) of another id, widened by --boundary_width N (default 1: just those
voxels; N > 1: also every voxel within N-1 face steps of them); --unknown ids are not annotated
in any class.

Then train with --data.dataset_path <out> --data.voxel_size <the voxel size> and, e.g.,
--data.val_crops crop2 (docs/own_em.md). See torchtitan/imports/image_stack.py.
"""

import sys

from torchtitan.scripts.cli import script_parser
from torchtitan.imports.id_labels import IdLabels
from torchtitan.imports.image_stack import INSTANCE_MODES, import_stack
from torchtitan.imports.stack_labels import (
    ImageStackError,
    ValueMap,
    Values,
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


def id_labels_of(args) -> IdLabels | None:
    """The id spec of --ids/--boundary/--boundary_width/--unknown; None without --ids (the
    labels are then values of a value map)."""
    if args.ids is None:
        if args.boundary is not None:
            raise ImageStackError(
                f"--boundary {args.boundary} derives a class from the boundaries between object "
                "ids: say the labels are ids with --ids CLASS (e.g. --ids cell --boundary "
                f"{args.boundary})")
        if args.boundary_width is not None:
            raise ImageStackError("--boundary_width needs --ids CLASS and --boundary CLASS")
        return None
    given = [flag for flag, v in (("--class", args.classes), ("--value_map", args.value_map),
                                  ("--background", args.background)) if v]
    if given:
        raise ImageStackError(
            f"--ids {args.ids} reads the labels as object ids, but {' and '.join(given)} "
            f"{'says' if len(given) == 1 else 'say'} which label values make up each class: give --ids (with --boundary, "
            "--unknown) for a volume of object ids, or a value map for labels whose values "
            "are classes, not both")
    if args.boundary_width is not None and args.boundary is None:
        raise ImageStackError("--boundary_width needs --boundary CLASS (e.g. --boundary pm)")
    unknown = parse_values(args.unknown, "--unknown") if args.unknown is not None else Values()
    width = args.boundary_width if args.boundary_width is not None else 1
    return IdLabels(args.ids, args.boundary, width, unknown)


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--em", required=True,
                   help="EM sections: a folder of .tif/.tiff/.png images, a quoted glob, one "
                        "multi-page TIFF, or FILE.h5:DATASET (a 3D z,y,x dataset); 8- or 16-bit")
    p.add_argument("--labels", help="label images, one per EM section, same size (folder, glob "
                                    "or multi-page TIFF), or FILE.h5:DATASET of the EM's shape; "
                                    "without it the dataset is EM only")
    p.add_argument("--out", required=True, help="output folder (the data.dataset_path to train on)")
    p.add_argument("--name", help="dataset name (default: the EM folder's name)")
    p.add_argument("--voxel_size", help="voxel size in nm, z,y,x (e.g. 50,4.6,4.6); for HDF5 "
                                        "it defaults to the dataset's 'resolution' attribute")
    p.add_argument("--crop", dest="crops", action="append", default=[], metavar="crop<N>=A-B",
                   help="a label crop over sections A..B (from 0), repeatable "
                        "(default: crop1 over every section)")
    p.add_argument("--class", dest="classes", action="append", default=[], metavar="NAME=VALUES",
                   help="a class and its label values, e.g. mito=191 or pm=0,32,64-128; repeatable")
    p.add_argument("--value_map", help="TOML file with background, unknown and [classes]")
    p.add_argument("--background", metavar="VALUES",
                   help="label values absent for every class (e.g. 255,223)")
    p.add_argument("--unknown", metavar="VALUES",
                   help="label values (with --ids: object ids) that are not annotated "
                        "(stored as unknown)")
    p.add_argument("--ids", metavar="CLASS",
                   help="the labels are object ids (0 = no object), stored as this instance "
                        "class (e.g. cell for neurons); no value map")
    p.add_argument("--boundary", metavar="CLASS",
                   help="with --ids: a class (e.g. pm) of the voxels with a face neighbour of "
                        "another id")
    p.add_argument("--boundary_width", type=int, metavar="N",
                   help="boundary thickness in voxels (default 1: the voxels next to another "
                        "id; N: also those within N-1 face steps of them)")
    p.add_argument("--instances", choices=INSTANCE_MODES, default="3d",
                   help="object ids of instance classes: connected components in 3d (default), "
                        "per section (2d), or none (0/1 masks)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset of that name")
    args = p.parse_args(argv)
    ids = id_labels_of(args)
    summary = import_stack(args.em, args.out,
                           parse_voxel_size(args.voxel_size) if args.voxel_size else None,
                           labels=args.labels, name=args.name, crops=args.crops,
                           value_map=None if ids else value_map_of(args), instances=args.instances,
                           ids=ids, overwrite=args.overwrite, log=print)
    voxel_size = ",".join(f"{v:g}" for v in summary["voxel_size"])
    print(f"train on it with --data.dataset_path {args.out} --data.voxel_size {voxel_size}"
          + (f" --data.classes {','.join(next(iter(summary['crops'].values()))['classes'])}"
             if summary["crops"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
