"""Print a neuroglancer link and a napari command showing EM, ground truth and prediction of a crop.

    python helpers/view_crop.py --data data/demo --crop crop1 --predictions pred.zarr
    python helpers/view_crop.py --data data/demo --crop jrc_synth-1/crop1 --classes mito,nuc \
        --predictions pred.zarr --serve_root . --url_base http://localhost:8000

Neuroglancer reads the stores over HTTP: serve ``--serve_root`` (default: the current
folder, which must hold the data and the predictions) with a server that allows
cross-origin requests, e.g. ``npx http-server . --cors -p 8000``, then open the link. The
napari command opens the same OME-NGFF groups from disk (``pip install napari
napari-ome-zarr``). See torchtitan/pictures/viewer.py.
"""

import sys

from torchtitan.scripts.cli import script_parser
from torchtitan.errors import UserError
from torchtitan.pictures.viewer import crop_view


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--data", required=True, help="CellMap-layout data folder (or split list)")
    p.add_argument("--crop", required=True, help="crop name: crop1 or dataset/crop1")
    p.add_argument("--predictions", help="prediction store PRED.zarr/crop<N>/<class> (optional)")
    p.add_argument("--classes", help="comma-separated classes (default: every class of the crop)")
    p.add_argument("--serve_root", default=".", help="folder the HTTP server serves (default: .)")
    p.add_argument("--url_base", default="http://localhost:8000",
                   help="address of that server (default http://localhost:8000)")
    args = p.parse_args(argv)
    try:
        view = crop_view(args.data, args.crop, args.predictions,
                         args.classes.split(",") if args.classes else None,
                         args.serve_root, args.url_base)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("neuroglancer (serve --serve_root with CORS, e.g. `npx http-server "
          f"{args.serve_root} --cors -p 8000`):")
    print(view["url"])
    print("napari:")
    print(view["napari"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
