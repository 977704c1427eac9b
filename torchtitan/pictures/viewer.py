"""Links that show a crop in a viewer: a neuroglancer URL and a napari command.

Used by ``helpers/view_crop.py``. Neuroglancer keeps its whole state (dimensions, position,
layers) as JSON in the URL fragment, so a printed link is the view: the EM as an image
layer, each ground-truth class and each predicted class as a segmentation layer (masks and
instance ids alike), all read by neuroglancer from their OME-NGFF multiscale groups (our
predictions carry pyramids, so large volumes open at a coarse level first). Dimensions are
the crop's voxel size in metres and the position is the crop's centre, so the view opens on
the crop at its own resolution.

Browsers read data over HTTP: serve the folder that holds the stores with a static server
that allows cross-origin requests (e.g. ``npx http-server DIR --cors -p 8000``) and pass its
address as ``url_base``.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from urllib.parse import quote

import numpy as np

from torchtitan.cellmap.challenge import ALL_LABELS_GROUP
from torchtitan.cellmap.errors import DatasetError
from torchtitan.data.crops.layout import EM_GROUP, discover
from torchtitan.data.io.stores import StoreContext

NEUROGLANCER = "https://neuroglancer-demo.appspot.com/"


def _url(path: Path, serve_root: Path, url_base: str) -> str:
    rel = os.path.relpath(Path(path).resolve(), Path(serve_root).resolve())
    if rel.startswith(".."):
        raise DatasetError(f"{path} is not under the served folder {serve_root}; pass --serve_root "
                           "a folder that holds both the data and the predictions")
    return "zarr://" + url_base.rstrip("/") + "/" + quote(Path(rel).as_posix())


def find_crop(data, crop: str):
    """(source, crop) of ``crop`` (``crop3`` or ``dataset/crop3``) under ``data``."""
    dataset, _, name = crop.rpartition("/")
    for source in discover(StoreContext(), data):
        for c in source.crops:
            if c.name == name and dataset in ("", source.name):
                return source, c
    raise DatasetError(f"crop {crop!r} not found under {data}")


def crop_view(data, crop: str, predictions=None, classes=None, serve_root=".",
              url_base: str = "http://localhost:8000") -> dict:
    """Neuroglancer state, URL and napari command for one label crop (EM, its ground truth
    classes and, when given, the predicted classes of ``predictions/<crop>/``)."""
    source, c = find_crop(data, crop)
    names = [n for n in (classes or c.classes) if n != ALL_LABELS_GROUP]
    missing = [n for n in names if n not in c.classes]
    if missing:
        raise DatasetError(f"{c.full_name} does not annotate {missing}; it has {sorted(c.classes)}")
    level = c.classes[names[0]][0]
    voxel = np.asarray(level.scale, dtype=float)
    centre = (c.box_min + c.box_max) / 2
    em_path = Path(source.store) / EM_GROUP
    paths = [("EM", "image", em_path)]
    paths += [(f"gt {n}", "segmentation", Path(c.classes[n][0].path).parent) for n in names]
    if predictions is not None:
        for n in names:
            node = Path(predictions) / c.name / n
            if node.exists():
                paths.append((f"prediction {n}", "segmentation", node))
    state = {
        "dimensions": {a: [float(s) * 1e-9, "m"] for a, s in zip("zyx", voxel)},
        "position": [float(p) for p in centre / voxel],
        "crossSectionScale": 1.0,
        "layers": [{"type": kind, "name": name, "source": _url(path, serve_root, url_base)}
                   for name, kind, path in paths],
        "selectedLayer": {"layer": paths[-1][0]},
        "layout": "4panel",
    }
    url = NEUROGLANCER + "#!" + quote(json.dumps(state, separators=(",", ":")), safe="")
    napari = "napari --plugin napari-ome-zarr " + " ".join(shlex.quote(str(p)) for _, _, p in paths)
    return {"state": state, "url": url, "napari": napari,
            "paths": {name: str(path) for name, _, path in paths}}
