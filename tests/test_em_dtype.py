"""EM that is not uint8: uint16 and float32 EM are mapped onto the uint8 scale from their stored
range (OME-NGFF omero window), the dtype's range or data.em_range, never clipped silently, and
NaN in EM is a clear DatasetError naming the array.

Each test copies the demo data and rewrites its EM arrays on disk (real zarr stores), then
compares the samples drawn from the copy with those of the uint8 original.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from torchtitan.config.manager import ConfigManager
from torchtitan.data.crops import layout, reader
from torchtitan.data.crops.layout import DatasetError
from torchtitan.data.sampling.samples import build_segmentation_samples
from torchtitan.data.crops.selection import DataSettings, load_segmentation_data
from torchtitan.data.crops.reader import em_to_model_input
from torchtitan.data.io.stores import StoreContext

EM = "recon-1/em/fibsem-uint8"
CONFIG = "train_configs/debug_segmentation_2d.toml"
SAMPLES = range(6)


def convert_em(root: Path, convert, omero_window: dict | None = None,
               group: str = EM) -> None:
    """Rewrite every EM level of every store under ``root`` as ``convert(uint8 array)``,
    moving the EM group to ``group``; ``omero_window`` is stored as its omero window."""
    for store in sorted(root.glob("*/*.zarr")):
        g = zarr.open_group(str(store / EM), mode="r")
        attrs = dict(g.attrs)
        levels = {name: (a[:], a.chunks) for name, a in g.arrays()}
        shutil.rmtree(store / EM)
        out = zarr.open_group(str(store / group), mode="w", zarr_format=2)
        for name, (data, chunks) in levels.items():
            out.create_array(name, data=convert(data), chunks=chunks)
        if omero_window is not None:
            attrs["omero"] = {"channels": [{"window": omero_window}]}
        out.attrs.update(attrs)


def copy_data(demo_data: Path, tmp_path: Path, name: str) -> Path:
    dest = tmp_path / name
    shutil.copytree(demo_data, dest)
    return dest


def config(data: Path, *extra: str):
    return ConfigManager().parse_args(["--job.config_file", CONFIG, "--data.dataset_path",
                                       str(data), "--data.num_workers", "0", *extra])


def images(data: Path, *extra: str) -> list[np.ndarray]:
    """Normalised EM of the first training samples (float32)."""
    cfg = config(data, *extra)
    sources, train, _ = load_segmentation_data(DataSettings.from_config(cfg))
    samples = build_segmentation_samples(DataSettings.from_config(cfg), sources, train)
    out = []
    for i in SAMPLES:
        img = samples[i].image.numpy()
        out.append(em_to_model_input(img) if img.dtype == np.uint8 else img)
    return out


@pytest.fixture(scope="module")
def reference(demo_data) -> list[np.ndarray]:
    return images(demo_data)


def test_uint16_em_from_the_dtype_range_equals_uint8(demo_data, tmp_path, reference, caplog):
    data = copy_data(demo_data, tmp_path, "u16")
    # v * 257 spans uint16 exactly as v spans uint8; stored as CellMap does for uint16 EM.
    convert_em(data, lambda a: a.astype(np.uint16) * 257, group="recon-1/em/fibsem-uint16")
    with caplog.at_level(logging.WARNING):
        got = images(data)
    assert "normalising from the dtype's range [0, 65535]" in caplog.text
    for a, b in zip(got, reference):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_uint16_em_from_the_omero_window_equals_uint8(demo_data, tmp_path, reference):
    data = copy_data(demo_data, tmp_path, "u16w")
    # Data in [1000, 1000 + 255 * 10]: only the stored window maps it back onto 0..255.
    convert_em(data, lambda a: a.astype(np.uint16) * 10 + 1000,
               omero_window={"start": 1000, "end": 1000 + 2550, "min": 0, "max": 65535})
    for a, b in zip(images(data), reference):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_float_em_needs_a_range_and_then_equals_uint8(demo_data, tmp_path, reference):
    data = copy_data(demo_data, tmp_path, "f32")
    convert_em(data, lambda a: a.astype(np.float32) / 255.0)
    with pytest.raises(DatasetError, match=r"float32 and its group stores no intensity range.*"
                                           r"data\.em_range"):
        images(data)
    for a, b in zip(images(data, "--data.em_range", "0,1"), reference):
        np.testing.assert_allclose(a, b, atol=1e-5)  # up to float rounding


def test_em_outside_the_range_is_clipped_with_one_warning(demo_data, tmp_path, reference, caplog):
    data = copy_data(demo_data, tmp_path, "clip")
    convert_em(data, lambda a: a.astype(np.uint16) * 257)
    reader._WARNED_OUT_OF_RANGE.clear()
    with caplog.at_level(logging.WARNING):
        got = images(data, "--data.em_range", "0,32896")  # 128 * 257: the upper half clips
    warned = [r for r in caplog.records if "are clipped" in r.getMessage()]
    assert 1 <= len(warned) <= len({r.getMessage().split(":")[0] for r in warned})  # once per dataset
    for a, b in zip(got, reference):
        np.testing.assert_allclose(a, np.minimum(2 * (b + 1) - 1, 1.0), atol=2e-2)


def test_nan_in_float_em_is_an_error_naming_the_array(demo_data, tmp_path):
    data = copy_data(demo_data, tmp_path, "nan")

    def with_nan(a):
        out = a.astype(np.float32)
        out[tuple(n // 2 for n in out.shape)] = np.nan  # inside the startup check's box
        return out

    convert_em(data, with_nan, omero_window={"start": 0, "end": 255})
    with pytest.raises(DatasetError, match=r"EM array .*fibsem-uint8/s0 holds NaN"):
        images(data)


def test_nan_in_a_sample_read_is_an_error(tmp_path):
    """A NaN away from the startup box is caught by the read of a sample that covers it."""
    source_dir = tmp_path / "one" / "one.zarr"
    em = np.full((16, 64, 64), 0.5, np.float32)
    em[3, 1, 1] = np.nan
    g = zarr.open_group(str(source_dir / EM), mode="w", zarr_format=2)
    g.create_array("s0", data=em, chunks=(8, 32, 32))
    g.attrs["multiscales"] = [{"version": "0.4", "axes": [
        {"name": a, "type": "space", "unit": "nanometer"} for a in "zyx"], "datasets": [
        {"path": "s0", "coordinateTransformations": [{"type": "scale", "scale": [8.0, 8.0, 8.0]},
                                                     {"type": "translation",
                                                      "translation": [4.0, 4.0, 4.0]}]}]}]
    source = layout.discover(StoreContext(), tmp_path)[0]
    reader.set_em_ranges([source], [0.0, 1.0])  # the central box is clean
    img, inside = reader.read_linear(source.stores, source.levels[0], np.zeros(3), (8.0, 8.0, 8.0),
                                      (8, 8, 8))
    with pytest.raises(DatasetError, match=r"one\.zarr/recon-1/em/fibsem-uint8/s0 holds NaN"):
        reader.em_to_uint8_scale(img, source, source.levels[0].path, inside)
