"""The direct chunk reader (torchtitan/data/io/zarr_chunks.py) against zarr-python.

Every layout the reader claims is written with zarr-python and read back both ways over
boxes that start and end inside chunks, cover edge chunks, and cross missing chunks; layouts
it leaves to zarr-python must make ``open_fast`` return None.
"""

from __future__ import annotations

import numpy as np
import numcodecs
import pytest
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, TransposeCodec, ZstdCodec

from torchtitan.data.io.stores import StoreContext, TensorStoreArray
from torchtitan.data.io.zarr_chunks import ChunkedArray, open_fast

SHAPE = (21, 34, 19)  # not a multiple of the chunks: edge chunks are partial
CHUNKS = (8, 16, 7)


def _data(dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return rng.normal(size=SHAPE).astype(dtype)
    if dtype.kind == "b":
        return rng.random(SHAPE) < 0.3
    info = np.iinfo(dtype)
    # Smooth-ish values so compressors and delta filters have something to do.
    base = np.cumsum(rng.integers(0, 3, size=SHAPE), axis=2)
    return (base % min(int(info.max), 1000) + max(int(info.min), 0)).astype(dtype)


def _boxes(rng, n=25):
    out = [tuple(slice(0, s) for s in SHAPE), (slice(3, 4), slice(15, 17), slice(6, 8))]
    for _ in range(n):
        box = []
        for s in SHAPE:
            a = int(rng.integers(0, s))
            b = int(rng.integers(a + 1, s + 1))
            box.append(slice(a, b))
        out.append(tuple(box))
    return out


def _check_same(path, expect: np.ndarray):
    fast = open_fast(path)
    assert isinstance(fast, ChunkedArray), f"{path} should be read directly"
    ref = zarr.open_array(path, mode="r")
    assert fast.shape == ref.shape == expect.shape
    for box in _boxes(np.random.default_rng(1)):
        got = fast[box]
        np.testing.assert_array_equal(got, ref[box])
        np.testing.assert_array_equal(got, expect[box])
        assert got.dtype == expect.dtype.newbyteorder("=")
        assert got.flags.writeable
    np.testing.assert_array_equal(fast[...], expect)


V2_CASES = {
    "blosc-zstd-u8": dict(dtype="u1", compressor=numcodecs.Blosc("zstd", 5, numcodecs.Blosc.SHUFFLE)),
    "blosc-lz4-bitshuffle-u16": dict(dtype="<u2", compressor=numcodecs.Blosc("lz4", 3, numcodecs.Blosc.BITSHUFFLE)),
    "zstd-bigendian-i32": dict(dtype=">i4", compressor=numcodecs.Zstd(3)),
    "gzip-f32": dict(dtype="<f4", compressor=numcodecs.GZip(4)),
    "uncompressed-u64": dict(dtype="<u8", compressor=None),
    "delta-filter-i16": dict(dtype="<i2", compressor=numcodecs.Zstd(1), filters=[numcodecs.Delta("<i2")]),
    "fortran-order-u16": dict(dtype="<u2", compressor=numcodecs.Blosc("zstd", 5), order="F"),
    "slash-separator-u8": dict(dtype="u1", compressor=numcodecs.Zstd(1), dimension_separator="/"),
    "bool": dict(dtype="bool", compressor=numcodecs.Zstd(1)),
}


@pytest.mark.parametrize("case", sorted(V2_CASES))
def test_zarr_v2_layouts_read_like_zarr(tmp_path, case):
    kw = dict(V2_CASES[case])
    data = _data(kw.pop("dtype"))
    path = str(tmp_path / "a.zarr")
    store = zarr.storage.LocalStore(path)
    arr = zarr.create(shape=SHAPE, chunks=CHUNKS, dtype=data.dtype, store=store, zarr_format=2,
                      fill_value=0, **kw)
    arr[...] = data
    _check_same(path, data)


V3_CASES = {
    "default-zstd-u8": dict(dtype="uint8", compressors=[ZstdCodec(level=3)]),
    "blosc-u16-bigendian": dict(dtype="uint16", compressors=[BloscCodec(cname="lz4", clevel=5)],
                                serializer=BytesCodec(endian="big")),
    "gzip-f64": dict(dtype="float64", compressors=[GzipCodec(level=3)]),
    "uncompressed-i8": dict(dtype="int8", compressors=None),
    "v2-key-encoding-u32": dict(dtype="uint32", compressors=[ZstdCodec(level=1)],
                                chunk_key_encoding={"name": "v2", "separator": "."}),
    "dot-separator-u8": dict(dtype="uint8", compressors=[ZstdCodec(level=1)],
                             chunk_key_encoding={"name": "default", "separator": "."}),
}


@pytest.mark.parametrize("case", sorted(V3_CASES))
def test_zarr_v3_layouts_read_like_zarr(tmp_path, case):
    kw = dict(V3_CASES[case])
    data = _data(kw.pop("dtype"))
    path = str(tmp_path / "a.zarr")
    arr = zarr.create_array(path, shape=SHAPE, chunks=CHUNKS, dtype=data.dtype, zarr_format=3,
                            fill_value=0, **kw)
    arr[...] = data
    _check_same(path, data)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_missing_chunks_read_as_the_fill_value(tmp_path, zarr_format):
    path = str(tmp_path / "a.zarr")
    arr = zarr.create_array(path, shape=SHAPE, chunks=CHUNKS, dtype="uint8", zarr_format=zarr_format,
                            fill_value=7)
    data = np.full(SHAPE, 7, np.uint8)
    data[8:16, :16, 7:14] = 3  # one chunk written; every other chunk file is absent
    arr[8:16, :16, 7:14] = 3
    _check_same(path, data)


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_float_nan_fill_value(tmp_path, zarr_format):
    path = str(tmp_path / "a.zarr")
    zarr.create_array(path, shape=SHAPE, chunks=CHUNKS, dtype="float32", zarr_format=zarr_format,
                      fill_value=float("nan"))
    assert np.isnan(open_fast(path)[0:3, 0:3, 0:3]).all()


def test_layouts_left_to_tensorstore(tmp_path):
    kinds = {
        "sharded": dict(shards=(16, 32, 14)),
        "crc32c": dict(compressors=[ZstdCodec(level=1), Crc32cCodec()]),
        "transpose": dict(filters=[TransposeCodec(order=(2, 1, 0))]),
    }
    for name, kw in kinds.items():
        path = str(tmp_path / f"{name}.zarr")
        arr = zarr.create_array(path, shape=SHAPE, chunks=CHUNKS, dtype="uint8", zarr_format=3, **kw)
        arr[...] = _data("u1")
        assert open_fast(path) is None, name
        # ... and a store context opens them with TensorStore.
        arr = StoreContext().open_array(path)
        assert isinstance(arr, TensorStoreArray), name
        np.testing.assert_array_equal(arr[2:9, 3:20, 0:19], _data("u1")[2:9, 3:20, 0:19])
    assert open_fast(tmp_path / "missing.zarr") is None
    assert open_fast("s3://bucket/a.zarr") is None


def test_short_chunk_names_the_file(tmp_path):
    path = tmp_path / "a.zarr"
    arr = zarr.create(shape=SHAPE, chunks=CHUNKS, dtype="u1", store=zarr.storage.LocalStore(str(path)),
                      zarr_format=2, compressor=numcodecs.Zstd(1))
    arr[...] = _data("u1")
    (path / "0.0.0").write_bytes(numcodecs.Zstd(1).encode(np.zeros(10, np.uint8).tobytes()))
    fast = open_fast(path)
    with pytest.raises(ValueError, match=r"0\.0\.0 decodes to 10 bytes, expected 896"):
        fast[0:2, 0:2, 0:2]
    np.testing.assert_array_equal(fast[8:10, 0:2, 0:2], _data("u1")[8:10, 0:2, 0:2])

