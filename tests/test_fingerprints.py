"""Fingerprints of what the data floor gives, so that a change that moves code around (a fact
given one owner, a reader merged) is shown to change no sample, no validation volume and no
prediction grid: the SHA-256 of the bytes, recorded from the code before such a change.

Each case reads the demo data (``generate_demo_data(seed=0, scale=0.5)``, the ``demo_data``
fixture): training samples of the 2D and 3D debug configs (with their augmentation), the
validation crops read whole, the class-balanced foreground index, and the covering grids of
``predict.py``'s test manifests. When a change is meant to alter them, say so in the commit
and record the new values.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from torchtitan.config.manager import ConfigManager
from torchtitan.data.volume_source import build_source
from torchtitan.prediction.regions import covering_grid


def digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _source(data, config, *flags):
    cfg = ConfigManager().parse_args(["--job.config_file", config, "--data.dataset_path",
                                      str(data), *flags])
    return build_source(cfg)


def fingerprints(data) -> dict[str, str]:
    out = {}
    for name, config in (("2d", "train_configs/debug_segmentation_2d.toml"),
                         ("3d", "train_configs/debug_segmentation_3d.toml")):
        source = _source(data, config)
        ds = source.segmentation_dataset()
        samples = [ds[i] for i in range(4)]
        out[f"{name} samples"] = digest(*(a for s in samples
                                          for a in (s.image, s.target, s.valid)))
        vols = [source.read_volume(c) for c in source.val_crops]
        out[f"{name} validation volumes"] = digest(
            *(a for v in vols for a in (v.image, v.target, v.valid, v.origin,
                                        *v.instance_ids.values())))
        out[f"{name} foreground points"] = digest(ds.foreground_points(0, 0))
        grids = [covering_grid(c.box_min, c.box_max, (3.0, 5.0, 7.0)) for c in source.val_crops]
        out[f"{name} covering grids"] = digest(*(a for o, s in grids for a in (o, s)))
    return out


# Recorded at commit 64962da, before the grid facts moved to torchtitan/cellmap/grids.py.
EXPECTED = {
    "2d samples": "0638ab7fc145be46",
    "2d validation volumes": "d918ff257d6737e1",
    "2d foreground points": "8ba6499c6b744a58",
    "2d covering grids": "06ace367d60a2358",
    "3d samples": "b942ecc18b676b5a",
    "3d validation volumes": "575443f8420f30b9",
    "3d foreground points": "8ba6499c6b744a58",
    "3d covering grids": "06ace367d60a2358",
}


def test_the_data_floor_gives_the_recorded_bytes(demo_data):
    got = fingerprints(demo_data)
    assert got == EXPECTED, {k: (got.get(k), EXPECTED.get(k)) for k in got | EXPECTED
                             if got.get(k) != EXPECTED.get(k)}
