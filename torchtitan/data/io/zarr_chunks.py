"""Direct chunk reads of zarr arrays on a local (POSIX) file system.

zarr-python 3 reads every chunk through its asyncio codec pipeline: a box of 128^3 voxels
from 64^3-chunked arrays costs it 4-5x the CPU time of opening the chunk files and decoding
them with the same numcodecs codecs (``bench/data_loader.py``). For the layout EM data and
CellMap labels use (regular chunks, no sharding, a compressor such as Blosc, Zstd or GZip, C
or F order, any numeric dtype), :class:`ChunkedArray` does exactly that. :func:`open_fast`
returns None for anything else (sharding, checksums, transposes, non-local stores, exotic
dtypes), and the caller uses TensorStore (``stores.py``; docs/benchmarks/data_loader.md).

Semantics follow zarr: a chunk file that does not exist reads as the array's fill value; a
chunk that exists but does not decode to the chunk's size raises, naming the file.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import numpy as np

# zarr v3 bytes-to-bytes codecs this reader decodes, by name -> numcodecs codec id.
_V3_COMPRESSORS = {"blosc": "blosc", "zstd": "zstd", "gzip": "gzip"}


def _fill(value, dtype: np.dtype):
    """A zarr fill value (JSON) as a scalar of ``dtype``; None means 0."""
    if value is None:
        return dtype.type(0)
    if isinstance(value, str):  # "NaN", "Infinity", "-Infinity" for floats
        value = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(value, value)
    if isinstance(value, (bool, int, float)):
        return dtype.type(value)
    raise ValueError(f"fill value {value!r}")


def unit_box(path: str, shape, selection) -> list[tuple[int, int]]:
    """``arr[...]`` or a unit-step slice per dimension -> [(start, stop), ...] within ``shape``;
    anything else is an IndexError naming ``path``."""
    if selection is Ellipsis:
        return [(0, n) for n in shape]
    if not isinstance(selection, tuple):
        selection = (selection,)
    if len(selection) != len(shape) or not all(isinstance(s, slice) for s in selection):
        raise IndexError(f"{path}: only a slice per dimension is supported, got {selection!r}")
    box = []
    for s, n in zip(selection, shape):
        a, b, step = s.indices(n)
        if step != 1:
            raise IndexError(f"{path}: only unit steps are supported, got {s!r}")
        box.append((a, max(a, b)))
    return box


class ChunkedArray:
    """Read-only view of a regularly chunked zarr array, read chunk file by chunk file.

    Supports ``arr[z0:z1, y0:y1, x0:x1]`` (unit steps, any number of dimensions) and
    ``arr[...]``, like zarr's basic selection, plus ``shape``, ``dtype`` and ``chunks``.
    """

    def __init__(self, path: str, shape, chunks, dtype, fill_value, order: str,
                 key_prefix: str, separator: str, codecs: list):
        self.path = path
        self.shape = tuple(int(s) for s in shape)
        self.chunks = tuple(int(c) for c in chunks)
        self.stored_dtype = np.dtype(dtype)
        self.dtype = self.stored_dtype.newbyteorder("=")  # reads come back in native order
        self.fill_value = fill_value
        self.order = order
        self.ndim = len(self.shape)
        self._prefix = key_prefix
        self._sep = separator
        self._codecs = codecs  # decoded last to first
        self._chunk_bytes = math.prod(self.chunks) * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"ChunkedArray({self.path!r}, shape={self.shape}, chunks={self.chunks}, dtype={self.dtype})"

    def chunk_path(self, index) -> str:
        return os.path.join(self.path, self._prefix + self._sep.join(str(i) for i in index))

    def read_chunk(self, index) -> np.ndarray | None:
        """The decoded chunk at grid ``index``, or None when its file does not exist."""
        fn = self.chunk_path(index)
        try:
            with open(fn, "rb") as f:
                buf = f.read()
        except FileNotFoundError:
            return None
        for codec in reversed(self._codecs):
            buf = codec.decode(buf)
        if isinstance(buf, np.ndarray):  # some filters decode to arrays
            data = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
        else:
            data = np.frombuffer(buf, dtype=np.uint8)
        if data.nbytes != self._chunk_bytes:
            raise ValueError(
                f"chunk file {fn} decodes to {data.nbytes} bytes, expected {self._chunk_bytes} "
                f"(chunk shape {list(self.chunks)}, dtype {self.stored_dtype})"
            )
        data = data.view(self.stored_dtype)
        if self.order == "F":
            return data.reshape(self.chunks[::-1]).T
        return data.reshape(self.chunks)

    def _box(self, selection) -> list[tuple[int, int]]:
        return unit_box(self.path, self.shape, selection)

    def __getitem__(self, selection) -> np.ndarray:
        box = self._box(selection)
        out_shape = [b - a for a, b in box]
        if 0 in out_shape:
            return np.empty(out_shape, dtype=self.dtype)
        grid = [range(a // c, (b - 1) // c + 1) for (a, b), c in zip(box, self.chunks)]
        out = np.empty(out_shape, dtype=self.dtype)
        for index in itertools.product(*grid):
            src, dst = [], []
            for i, c, (a, b) in zip(index, self.chunks, box):
                lo, hi = max(a, i * c), min(b, (i + 1) * c)
                src.append(slice(lo - i * c, hi - i * c))
                dst.append(slice(lo - a, hi - a))
            chunk = self.read_chunk(index)
            out[tuple(dst)] = self.fill_value if chunk is None else chunk[tuple(src)]
        return out


def _open_v2(path: Path, meta: dict) -> ChunkedArray | None:
    import numcodecs

    dtype = meta.get("dtype")
    if not isinstance(dtype, str):
        return None  # structured dtypes
    dtype = np.dtype(dtype)
    if dtype.kind not in "biuf":
        return None
    order = meta.get("order", "C")
    if order not in ("C", "F"):
        return None
    codecs = [numcodecs.get_codec(dict(f)) for f in (meta.get("filters") or [])]
    if meta.get("compressor") is not None:
        codecs.append(numcodecs.get_codec(dict(meta["compressor"])))
    # Filters apply before the compressor when writing; decoding runs the list backwards.
    return ChunkedArray(
        str(path), meta["shape"], meta["chunks"], dtype, _fill(meta.get("fill_value"), dtype),
        order, "", meta.get("dimension_separator", "."), codecs,
    )


def _open_v3(path: Path, meta: dict) -> ChunkedArray | None:
    import numcodecs

    if meta.get("node_type") != "array" or not isinstance(meta.get("data_type"), str):
        return None
    try:
        dtype = np.dtype(meta["data_type"])
    except TypeError:
        return None
    if dtype.kind not in "biuf":
        return None
    grid = meta.get("chunk_grid", {})
    if grid.get("name") != "regular":
        return None
    chunks = grid["configuration"]["chunk_shape"]
    enc = meta.get("chunk_key_encoding", {"name": "default"})
    conf = enc.get("configuration") or {}
    if enc.get("name") == "default":
        sep = conf.get("separator", "/")
        prefix = "c" + sep
    elif enc.get("name") == "v2":
        sep, prefix = conf.get("separator", "."), ""
    else:
        return None
    codecs = list(meta.get("codecs") or [])
    if not codecs or codecs[0].get("name") != "bytes":
        return None  # array-to-array codecs (transpose), sharding, ...
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    if dtype.itemsize > 1:
        dtype = dtype.newbyteorder("<" if endian == "little" else ">")
    compressors = []
    for c in codecs[1:]:
        cid = _V3_COMPRESSORS.get(c.get("name"))
        if cid is None:
            return None  # crc32c and anything else: zarr-python reads it
        compressors.append(numcodecs.get_codec({"id": cid}))  # frames describe themselves
    return ChunkedArray(
        str(path), meta["shape"], chunks, dtype, _fill(meta.get("fill_value"), dtype), "C",
        prefix, sep, compressors,
    )


def open_fast(path: str | os.PathLike) -> ChunkedArray | None:
    """A :class:`ChunkedArray` for the zarr array at local ``path``, or None when it is not
    local or uses a feature this reader leaves to TensorStore."""
    p = Path(path)
    if "://" in str(path) or not p.is_dir():
        return None
    try:
        if (p / ".zarray").is_file():
            return _open_v2(p, json.loads((p / ".zarray").read_text()))
        if (p / "zarr.json").is_file():
            return _open_v3(p, json.loads((p / "zarr.json").read_text()))
    except (ValueError, KeyError, TypeError, OSError):
        return None  # TensorStore (or zarr-python) gives the proper error for bad metadata
    return None
