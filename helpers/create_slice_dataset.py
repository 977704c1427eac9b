"""Write every 2D slice of the label crops of CellMap-layout zarr data as a Hugging Face dataset.

    python helpers/create_slice_dataset.py --zarr data/demo --out data/demo_slices
    python helpers/create_slice_dataset.py --zarr data/demo --out data/demo_slices_zyx \\
        --axes z,y,x --classes nuc,mito,er,cell --voxel_size 8 --force
    HF_TOKEN=hf_... python helpers/create_slice_dataset.py --zarr data/demo \\
        --out data/demo_slices --push_to_hub my-user/em-slices --private

Each label crop is read as training and validation read it from the zarr stores (the grid of
``--voxel_size`` nm that covers it, ``crop_grid``, read by ``crops.reader.CropReader``: EM
by linear, labels by nearest sampling, composite classes from their parts) and cut into its
planes normal to each of ``--axes``. One row per slice:

    image              EM, 8-bit greyscale image
    label_<class>      1-bit image: the class is present
    valid_<class>      1-bit image: the voxel is annotated for the class (0 where the crop
                       does not annotate the class, where it is marked unknown, and outside it)
    annotated          classes (of those written) that the crop annotates, itself or by parts
    dataset, crop      e.g. "jrc_synth-1", "crop3"
    axis, index        the slice is plane ``index`` normal to ``axis`` ("z", "y" or "x") of
                       the crop grid; its image axes are the other two, in (z, y, x) order
    voxel_size         nm (z, y, x) of the grid
    origin, shape      the crop grid: corner of voxel 0 (nm, z, y, x) and its shape in voxels

The dataset is written with ``save_to_disk(--out)``; train from it with
``--data.dataset_name OUT``. ``--push_to_hub REPO`` also uploads it, and needs a token (the
HF_TOKEN environment variable or a ``hf auth login``): without one the script stops at once,
before reading anything, with exit code 2.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from torchtitan.cellmap.errors import DatasetError
from torchtitan.cellmap.grids import AXES
from torchtitan.data.crops.reader import CropReader, annotates, crop_grid, model_input_to_uint8
from torchtitan.data.io.stores import StoreContext
from torchtitan.config.manager import flag_type
from torchtitan.errors import USER_ERROR_EXIT, redact_secrets, run_cli
from torchtitan.scripts.cli import parse_classes, parse_voxel_size, script_parser
from torchtitan.scripts.label_crops import all_crops, find_crop, load_sources

NO_TOKEN_EXIT = 2


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------


def slice_features(classes: list[str]):
    """The dataset's columns (see the module docstring)."""
    from datasets import Features, Image, List, Value

    columns = {"image": Image()}
    for cls in classes:
        columns[f"label_{cls}"] = Image()
        columns[f"valid_{cls}"] = Image()
    columns.update({
        "annotated": List(Value("string")),
        "dataset": Value("string"),
        "crop": Value("string"),
        "axis": Value("string"),
        "index": Value("int32"),
        "voxel_size": List(Value("float64"), length=3),
        "origin": List(Value("float64"), length=3),
        "shape": List(Value("int32"), length=3),
    })
    return Features(columns)


def _mask_image(mask: np.ndarray):
    from PIL import Image

    return Image.fromarray(np.ascontiguousarray(mask, dtype=bool))  # mode "1": 1 bit per pixel


def read_crop_slices(source, crop, classes: list[str], voxel_size) -> dict:
    """A whole crop on its grid as training reads it (``crop_grid`` + ``CropReader.read``, the
    reading validation uses): ``em`` (D, H, W) uint8, ``truth`` and ``valid`` (K, D, H, W)
    bool, the grid's ``origin`` and ``shape``, and the ``annotated`` classes."""
    origin, shape = crop_grid(crop, voxel_size)
    arrays = CropReader([source], classes, voxel_size).read(crop, origin, shape)
    em = np.clip(np.rint(model_input_to_uint8(arrays.image[0])), 0, 255).astype(np.uint8)
    return {"em": em, "truth": arrays.target > 0, "valid": arrays.valid > 0,
            "origin": origin, "shape": shape,
            "annotated": [c for c in classes if annotates(crop, c)]}


def slice_rows(zarr_root: str, crops: list[str], classes: tuple, voxel_size: tuple, axes: tuple):
    """Yield the rows of every slice of ``crops`` (``dataset/crop`` names).

    Runs inside ``Dataset.from_generator``, which hands each worker a share of ``crops`` (the
    only list argument); the others are tuples so that they are not split.
    """
    from PIL import Image

    sources = load_sources(StoreContext(), zarr_root)  # one per generator worker
    classes = list(classes)
    for full_name in crops:
        source, crop = find_crop(sources, full_name)
        vol = read_crop_slices(source, crop, classes, voxel_size)
        meta = {
            "annotated": vol["annotated"],
            "dataset": crop.dataset,
            "crop": crop.name,
            "voxel_size": [float(v) for v in voxel_size],
            "origin": [float(v) for v in vol["origin"]],
            "shape": [int(s) for s in vol["shape"]],
        }
        for axis in axes:
            ax = AXES.index(axis)
            for i in range(vol["shape"][ax]):
                row = {"image": Image.fromarray(np.take(vol["em"], i, axis=ax))}
                for k, cls in enumerate(classes):
                    row[f"label_{cls}"] = _mask_image(np.take(vol["truth"][k], i, axis=ax))
                    row[f"valid_{cls}"] = _mask_image(np.take(vol["valid"][k], i, axis=ax))
                yield {**row, **meta, "axis": axis, "index": i}


# ---------------------------------------------------------------------------------------------
# Hub
# ---------------------------------------------------------------------------------------------


def hub_token() -> str | None:
    """The Hugging Face token: HF_TOKEN, else the one a ``hf auth login`` stored."""
    token = os.environ.get("HF_TOKEN", "").strip()
    if token:
        return token
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    return get_token() or None


def no_token_message(repo: str) -> str:
    return (
        f"--push_to_hub {repo}: no Hugging Face token found, so nothing was pushed (and nothing "
        "was written). Set the HF_TOKEN environment variable to a token with write access, or "
        "log in once with `hf auth login`, then run this again; or drop --push_to_hub to only "
        "write the dataset with --out."
    )


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_axes(text: str) -> tuple[str, ...]:
    axes = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [a for a in axes if a not in AXES]
    if not axes or bad or len(set(axes)) != len(axes):
        raise argparse.ArgumentTypeError(f"--axes: give distinct axes out of z,y,x, got {text!r}")
    return axes


def parse_args(argv=None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("--zarr", required=True, help="a folder of <ds>/<ds>.zarr stores, or one <ds>.zarr")
    parser.add_argument("--out", required=True, help="output folder (Dataset.save_to_disk)")
    parser.add_argument("--voxel_size", default="8", type=parse_voxel_size,
                        help="nm of the slice grid, 'z,y,x' or one number (default: 8, as data.voxel_size)")
    parser.add_argument("--axes", default="z", type=parse_axes,
                        help="slice planes normal to these axes, e.g. z or z,y,x (default: z)")
    parser.add_argument("--classes", default=None, help="comma-separated classes (default: every annotated one)")
    parser.add_argument("--num_proc", type=flag_type(type=int, min=1), default=1, help="worker processes, each a share of the crops (default: 1)")
    parser.add_argument("--push_to_hub", default=None, metavar="REPO", help="also upload to this Hub dataset repo")
    parser.add_argument("--private", action="store_true", help="with --push_to_hub: make the repo private")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    return parser.parse_args(argv)


def _folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    token = None
    if args.push_to_hub:
        token = hub_token()
        if token is None:  # fail before the (long) reading, not after it
            print(f"error: {no_token_message(args.push_to_hub)}", file=sys.stderr)
            return NO_TOKEN_EXIT
    if out.exists() and any(out.iterdir()) and not args.force:
        print(f"error: {out} exists and is not empty; use --force to replace it", file=sys.stderr)
        return USER_ERROR_EXIT

    import datasets

    start = time.perf_counter()
    try:
        pairs = all_crops(load_sources(StoreContext(), args.zarr))
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    if not pairs:
        print(f"error: {args.zarr}: no label crops (<ds>.zarr/recon-1/labels/groundtruth/crop<N>)",
              file=sys.stderr)
        return USER_ERROR_EXIT
    classes = parse_classes(args.classes, [crop for _, crop in pairs]) or sorted({c for _, crop in pairs for c in crop.classes})
    unknown = [c for c in classes if not any(annotates(crop, c) for _, crop in pairs)]
    if unknown:
        print(f"error: --classes {unknown} are annotated by no crop", file=sys.stderr)
        return USER_ERROR_EXIT
    crops = [crop.full_name for _, crop in pairs]
    print(f"{len(crops)} crops, classes {', '.join(classes)}, axes {','.join(args.axes)}, "
          f"voxel size {'x'.join(f'{v:g}' for v in args.voxel_size)} nm")

    # The generator writes Arrow files into a private cache that dies with this run, so a
    # stale cache of an earlier run can never be picked up.
    work = Path(tempfile.mkdtemp(prefix=".slices-", dir=out.parent if out.parent.is_dir() else None))
    try:
        ds = datasets.Dataset.from_generator(
            slice_rows, features=slice_features(classes), cache_dir=str(work),
            gen_kwargs={"zarr_root": str(Path(args.zarr).resolve()), "crops": crops,
                        "classes": tuple(classes), "voxel_size": tuple(args.voxel_size),
                        "axes": args.axes},
            num_proc=args.num_proc if args.num_proc > 1 else None,
        )
        if out.exists():
            shutil.rmtree(out)
        ds.save_to_disk(str(out))
        n = len(ds)
        del ds
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {n} slices of {len(crops)} crops to {out} ({_folder_mb(out):.1f} MB) in "
          f"{time.perf_counter() - start:.1f} s; train with --data.dataset_name {out}")

    if args.push_to_hub:
        try:
            datasets.load_from_disk(str(out)).push_to_hub(args.push_to_hub, private=args.private,
                                                          token=token)
        except Exception as e:  # noqa: BLE001 - any Hub failure: one message, token redacted
            print(f"error: pushing {out} to the Hugging Face Hub as {args.push_to_hub} failed: "
                  f"{type(e).__name__}: {redact_secrets(str(e))} (the dataset is written to "
                  f"{out}; push it again later)", file=sys.stderr)
            return USER_ERROR_EXIT
        print(f"pushed to the Hugging Face Hub as {args.push_to_hub}; train with "
              f"--data.dataset_name {args.push_to_hub}")
    return 0



if __name__ == "__main__":
    sys.exit(run_cli(main))
