"""Where zarr data is read from: local folders and remote stores (S3, GCS, HTTP), one interface.

A location is a string: a local path, or a URL ``s3://bucket/prefix``, ``gs://bucket/prefix``,
``http(s)://host/path``. The module functions join and split locations (pure string work). A
:class:`StoreContext` does the reading: it reads metadata documents, lists the sub-folders of a
location, and opens arrays, those of the usual local layout with ``zarr_chunks.ChunkedArray``,
the rest (remote stores, sharded or otherwise unusual zarr, N5) with TensorStore. Every array it
returns slices like ``ChunkedArray`` (``arr[z0:z1, y0:y1, x0:x1]``, ``shape``, ``dtype``,
``chunks``), so nothing downstream cares where the bytes come from.

Who makes a context: training makes one from its config (``StoreContext.from_config``, in
``crops.load_em_sources``); the datasets and label crops discovered with it keep it and read
through it, so every reader of a run shares one chunk cache. Tools without a training config
make their own ``StoreContext()``. A context holds its :class:`StoreSettings` and what a
process opens under them: the TensorStore context (chunk cache, request retries), the
key-value stores of remote folders, the listings of remote trees and a bounded cache of open
array handles. Pickled (to a spawned loader worker) it carries its settings only; each
process opens its own handles (after a fork too: a context checks ``os.getpid()``), so
loader workers need no set-up of their own.

Memory: a context's TensorStore chunk cache holds at most ``data.cache_mb`` MiB of decoded
chunks, shared by every array read through it; a loader worker has its own.

Network errors: every request is retried :data:`NETWORK_RETRIES` times with exponential
backoff (TensorStore's request retries); a read that still fails raises, and the caller
(``cellmap._read_region``) turns it into a ``ChunkReadError``: counted, the sample redrawn,
like a corrupt chunk.

Credentials (S3): from the usual environment only (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``~/.aws/credentials``);
without any, requests are anonymous (public buckets). ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` points at an S3-compatible server, ``AWS_REGION`` /
``AWS_DEFAULT_REGION`` sets the region. Nothing of this is ever logged.

Listing folders: a local folder is listed by the file system. A remote location cannot always
be listed (plain HTTP has no listing, and S3 lists keys, not folders: below a CellMap root that
is every chunk), so remote discovery reads an index, :data:`INDEX_NAME`, from the location or
the nearest folder above it: the relative paths of the folders and zarr nodes below that folder
(never the chunks), written by :func:`write_index` for a local copy of the tree before it is
uploaded. S3 and GCS locations without an index are listed key by key below the location.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchtitan.cellmap.errors import DatasetError
from torchtitan.data.io.zarr_chunks import open_fast, unit_box

logger = logging.getLogger(__name__)

REMOTE_SCHEMES = ("s3", "gs", "http", "https")
INDEX_NAME = "cellmap-index.json"
# zarr 2 / zarr 3 / N5 metadata documents: a folder holding one of them is a node.
METADATA_FILES = (".zgroup", ".zarray", ".zattrs", "zarr.json", "attributes.json")
NETWORK_RETRIES = 3  # retries of one request after the first attempt (exponential backoff)


# ---------------------------------------------------------------------------------------------
# Locations
# ---------------------------------------------------------------------------------------------


def is_url(location) -> bool:
    """Whether ``location`` is a URL (``scheme://...``) rather than a local path."""
    return "://" in str(location)


def _split_url(url: str) -> tuple[str, str, str]:
    """``scheme://authority/key/path`` -> (scheme, authority, key path without slashes)."""
    scheme, _, rest = str(url).partition("://")
    authority, _, key = rest.partition("/")
    return scheme.lower(), authority, key.strip("/")


def check_location(location: str, what: str) -> None:
    """A DatasetError for a URL of a scheme this reader does not know."""
    if is_url(location):
        scheme, authority, _ = _split_url(location)
        if scheme not in REMOTE_SCHEMES or not authority:
            raise DatasetError(
                f"{what} {location!r}: unsupported URL; use s3://bucket/path, gs://bucket/path, "
                "http(s)://host/path or a local folder"
            )


def join(location, *names: str) -> str:
    """``location/name/...`` for a local path or a URL."""
    location = str(location)
    if is_url(location):
        return "/".join([location.rstrip("/"), *(n.strip("/") for n in names)])
    return str(Path(location, *names))


def name_of(location) -> str:
    """The last component of a location (``.../crop3`` -> ``crop3``)."""
    location = str(location)
    return posixpath.basename(location.rstrip("/")) if is_url(location) else Path(location).name


def parent_of(location) -> str:
    """The location one folder up."""
    location = str(location)
    if is_url(location):
        return location.rstrip("/").rsplit("/", 1)[0]
    return str(Path(location).parent)


def _s3_credentials() -> dict:
    """``default`` (environment, profile, ~/.aws) when the environment names credentials,
    else ``anonymous`` (public buckets; no lookup of instance metadata)."""
    keys = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
    if any(os.environ.get(k) for k in keys):
        return {"type": "default"}
    aws = Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", Path.home() / ".aws" / "credentials"))
    return {"type": "default"} if aws.is_file() else {"type": "anonymous"}


def kvstore_spec(location: str) -> dict:
    """The TensorStore key-value store of a local folder or URL (its keys: paths below it)."""
    if not is_url(location):
        return {"driver": "file", "path": str(Path(location).absolute()) + "/"}
    scheme, authority, key = _split_url(location)
    path = key + "/" if key else ""
    if scheme == "s3":
        spec = {"driver": "s3", "bucket": authority, "path": path,
                "aws_credentials": _s3_credentials()}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint
            region = region or "us-east-1"
        if region:
            spec["aws_region"] = region
        return spec
    if scheme == "gs":
        return {"driver": "gcs", "bucket": authority, "path": path}
    if scheme in ("http", "https"):
        return {"driver": "http", "base_url": f"{scheme}://{authority}", "path": "/" + path}
    raise DatasetError(f"{location!r}: unsupported URL scheme {scheme!r}")


# ---------------------------------------------------------------------------------------------
# Listings of remote folders, and the index that stands in for one
# ---------------------------------------------------------------------------------------------


@dataclass
class _Tree:
    """Folders below ``root`` (relative paths), from an index or a listing."""

    root: str
    folders: set[str]

    def children(self, location: str) -> list[str] | None:
        rel = location.rstrip("/")[len(self.root.rstrip("/")):].strip("/")
        if rel and rel not in self.folders:
            return None
        prefix = rel + "/" if rel else ""
        return sorted({f[len(prefix):].split("/")[0] for f in self.folders
                       if f.startswith(prefix) and len(f) > len(prefix)})


def _folders_of(paths) -> set[str]:
    """Every folder of relative ``paths`` (and its parents)."""
    out = set()
    for p in paths:
        parts = p.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            out.add("/".join(parts[:i]))
    out.discard("")
    return out


def write_index(root: str | os.PathLike) -> Path:
    """Write :data:`INDEX_NAME` into local folder ``root``: every folder below it down to the
    zarr nodes (not into arrays: their chunks are not listed). Upload it with the data."""
    root = Path(root)
    folders = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel != ".":
            folders.append(rel.replace(os.sep, "/"))
        if ".zarray" in filenames or ("attributes.json" in filenames and _is_n5_array(dirpath)):
            dirnames[:] = []  # an array: chunk folders are not listed
        elif "zarr.json" in filenames:
            meta = json.loads(Path(dirpath, "zarr.json").read_text())
            if meta.get("node_type") == "array":
                dirnames[:] = []
        dirnames.sort()
    out = root / INDEX_NAME
    out.write_text(json.dumps({"folders": sorted(folders)}, indent=0) + "\n")
    return out


def _is_n5_array(folder: str) -> bool:
    try:
        return "dimensions" in json.loads(Path(folder, "attributes.json").read_text())
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# Settings, and what a process has started
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreSettings:
    """What shapes reading: the TensorStore chunk cache of a context (bytes, per process) and
    how many open array handles it keeps."""

    cache_bytes: int = 256 << 20
    # A handle holds only metadata (chunk data is cached by TensorStore's cache alone), but a
    # dataset may have tens of thousands of label arrays, hence the bound.
    array_handles: int = 256


# Process ids that have started TensorStore's threads. A fact of the process, not of one
# context (any context of the process may have started them), so a module-level set.
_USED_IN: set[int] = set()


def tensorstore_used() -> bool:
    """Whether this process has started TensorStore's threads; a forked child would abort, so
    loader workers must then start with ``spawn``."""
    return os.getpid() in _USED_IN


# ---------------------------------------------------------------------------------------------
# The store context: reading documents, listing folders, opening arrays
# ---------------------------------------------------------------------------------------------


class StoreContext:
    """The settings of reading and the handles a process opens under them (module docstring).

    Pickling keeps the settings only; the handles belong to the process that opened them and
    are reopened on demand in another (a spawned or forked loader worker). ``pickle`` keeps
    shared references shared, so datasets whose sources and crops all hold one context
    unpickle, in a worker, to one context again: one chunk cache per process.
    """

    def __init__(self, settings: StoreSettings | None = None):
        self.settings = settings if settings is not None else StoreSettings()
        self._trees: dict[str, _Tree | None] = {}  # listings of remote folders (plain data)
        self._drop_handles()

    @classmethod
    def from_config(cls, data) -> "StoreContext":
        """The context of a run's ``[data]`` section: a chunk cache of ``data.cache_mb`` MiB."""
        return cls(StoreSettings(cache_bytes=int(data.cache_mb) << 20))

    def __repr__(self) -> str:
        return f"StoreContext({self.settings})"

    def __getstate__(self) -> dict:
        return {"settings": self.settings}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["settings"])

    def _drop_handles(self) -> None:
        self._pid = os.getpid()
        self._ts_context = None
        self._kvstores: dict[str, object] = {}
        # Open arrays by path, least recently used first.
        self._arrays: OrderedDict[str, object] = OrderedDict()

    def _own_handles(self) -> None:
        """Forget handles opened by another process: a forked child inherits its parent's
        context, whose TensorStore objects and file handles it must not use."""
        if self._pid != os.getpid():
            self._drop_handles()

    def ts_context(self):
        """The TensorStore context of this process: the chunk cache and the request retries."""
        import tensorstore as ts

        self._own_handles()
        if self._ts_context is None:
            retries = {"max_retries": NETWORK_RETRIES + 1, "initial_delay": "0.2s",
                       "max_delay": "2s"}
            spec = {"cache_pool": {"total_bytes_limit": int(self.settings.cache_bytes)}}
            for name in ("http_request_retries", "s3_request_retries", "gcs_request_retries"):
                spec[name] = retries
            self._ts_context = ts.Context(spec)
        _USED_IN.add(os.getpid())
        return self._ts_context

    def _kvstore(self, folder: str):
        import tensorstore as ts

        context = self.ts_context()
        kv = self._kvstores.get(folder)
        if kv is None:
            kv = ts.KvStore.open(kvstore_spec(folder), context=context).result()
            self._kvstores[folder] = kv
        return kv

    def read_bytes(self, location: str) -> bytes | None:
        """The bytes of the file or object at ``location``; None when it does not exist. A
        remote location that cannot be reached is a DatasetError naming it."""
        location = str(location)
        if not is_url(location):
            try:
                return Path(location).read_bytes()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return None
        try:
            result = self._kvstore(parent_of(location)).read(name_of(location)).result()
        except Exception as e:  # noqa: BLE001 - TensorStore raises ValueError for every failure
            raise DatasetError(
                f"cannot read {location}: {e}. Check the URL, the network and, for S3, the "
                "AWS_ENDPOINT_URL / AWS_REGION environment (credentials come from AWS_* "
                "variables or ~/.aws; none: anonymous)"
            ) from e
        return bytes(result.value) if result.state == "value" else None

    def read_json(self, location: str) -> dict | None:
        """A JSON metadata document (``.zattrs``, ``zarr.json``, ...); None when absent."""
        data = self.read_bytes(location)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as e:
            raise DatasetError(f"{location}: not valid JSON ({e}); re-write that metadata "
                               "file") from e

    def _index_tree(self, location: str) -> _Tree | None:
        """The tree of the nearest index at or above ``location`` (kept per folder)."""
        scheme, authority, key = _split_url(location)
        parts = key.split("/") if key else []
        for n in range(len(parts), -1, -1):
            folder = f"{scheme}://{authority}" + ("/" + "/".join(parts[:n]) if n else "")
            if folder not in self._trees:
                doc = self.read_json(join(folder, INDEX_NAME))
                self._trees[folder] = (None if doc is None else
                                       _Tree(folder, _folders_of(doc.get("folders", []))))
            if self._trees[folder] is not None:
                return self._trees[folder]
        return None

    def _listed_tree(self, location: str) -> _Tree:
        """S3 / GCS: the folders below ``location`` that hold metadata, from a key listing."""
        if self._trees.get(location) is None:
            try:
                keys = self._kvstore(location).list().result()
            except Exception as e:  # noqa: BLE001
                raise DatasetError(f"cannot list {location}: {e}") from e
            nodes = [k.decode().rsplit("/", 1)[0] for k in keys
                     if k.decode().rsplit("/", 1)[-1] in METADATA_FILES and "/" in k.decode()]
            self._trees[location] = _Tree(location, _folders_of(nodes))
        return self._trees[location]  # type: ignore[return-value]

    def list_dirs(self, location) -> list[str]:
        """Names of the sub-folders of ``location`` (sorted); [] when it has none."""
        location = str(location)
        if not is_url(location):
            p = Path(location)
            return sorted(c.name for c in p.iterdir() if c.is_dir()) if p.is_dir() else []
        tree = self._index_tree(location)
        if tree is None:
            scheme = _split_url(location)[0]
            if scheme not in ("s3", "gs"):
                raise DatasetError(
                    f"{location}: an HTTP location cannot be listed and no {INDEX_NAME} was "
                    "found there or in a folder above it; write one with "
                    "torchtitan.data.io.stores.write_index(<local copy of the root>) before "
                    "uploading, or name the stores and crops with their classes in a split list"
                )
            covering = [t for t in self._trees.values() if t is not None and t.root != location
                        and location.startswith(t.root.rstrip("/") + "/")]
            tree = covering[0] if covering else self._listed_tree(location)
        return tree.children(location) or []

    def is_dir(self, location) -> bool:
        """Whether ``location`` is a folder (locally) or a zarr node / indexed folder (remote)."""
        location = str(location)
        if not is_url(location):
            return Path(location).is_dir()
        if any(self.read_bytes(join(location, m)) is not None
               for m in (".zattrs", ".zgroup", "zarr.json")):
            return True
        tree = self._index_tree(location)
        if tree is not None:
            return tree.children(location) is not None
        return False

    def array_driver(self, location: str) -> str | None:
        """The TensorStore driver of the array at ``location`` from its metadata: ``zarr``
        (format 2), ``zarr3`` or ``n5``; None when it holds no array metadata."""
        if self.read_bytes(join(location, ".zarray")) is not None:
            return "zarr"
        meta = self.read_json(join(location, "zarr.json"))
        if meta is not None and meta.get("node_type") == "array":
            return "zarr3"
        meta = self.read_json(join(location, "attributes.json"))
        if meta is not None and "dimensions" in meta:
            return "n5"
        return None

    def open_tensorstore(self, location: str) -> "TensorStoreArray":
        """The array at ``location`` (local or URL; zarr 2, zarr 3 with any codecs, N5)."""
        driver = self.array_driver(location)
        if driver is None:
            raise DatasetError(
                f"{location}: not an array (no .zarray, zarr.json of an array, or N5 "
                "attributes.json); check the path"
            )
        return TensorStoreArray(location, driver, self)

    def open_array(self, path: str):
        """The zarr array at ``path`` for reading, reusing a handle this process opened
        recently. Local arrays of the usual layout are read by ``zarr_chunks``, which decodes
        chunk files directly at the least CPU cost (docs/benchmarks/data_loader.md); the rest
        (remote stores, sharding, checksums, N5, ...) by TensorStore, and by zarr-python a
        local array TensorStore cannot open."""
        self._own_handles()
        path = str(path)
        arr = self._arrays.get(path)
        if arr is not None:
            self._arrays.move_to_end(path)
            return arr
        arr = open_fast(path)
        if arr is None and is_url(path):
            arr = self.open_tensorstore(path)
        if arr is None:
            try:
                arr = self.open_tensorstore(path)
            except DatasetError as ts_error:
                import zarr

                try:
                    arr = zarr.open_array(path, mode="r")
                except Exception as e:  # noqa: BLE001 - re-raised with the path
                    raise DatasetError(f"cannot open zarr array {path}: {e} ({ts_error})") from e
        self._arrays[path] = arr
        while len(self._arrays) > self.settings.array_handles:
            self._arrays.popitem(last=False)
        return arr

    def open_paths(self) -> list[str]:
        """The paths of the array handles open in this process, least recently used first."""
        self._own_handles()
        return list(self._arrays)


# ---------------------------------------------------------------------------------------------
# Arrays read with TensorStore
# ---------------------------------------------------------------------------------------------


class TensorStoreArray:
    """An array read with TensorStore, sliced like ``zarr_chunks.ChunkedArray``.

    Reads go through the chunk cache of the context that opened it; a read that fails after
    the request retries raises (``cellmap._read_region`` makes it a ``ChunkReadError``). The
    handle is reopened after unpickling (a spawned loader worker), under the unpickled
    context.
    """

    def __init__(self, path: str, driver: str, stores: StoreContext):
        self.path = str(path)
        self.driver = driver
        self.stores = stores
        self._open()

    def _open(self) -> None:
        import tensorstore as ts

        spec = {"driver": self.driver, "kvstore": kvstore_spec(self.path),
                "recheck_cached_data": "open", "recheck_cached_metadata": "open"}
        try:
            self._ts = ts.open(spec, read=True, context=self.stores.ts_context()).result()
        except Exception as e:  # noqa: BLE001 - re-raised with the path
            raise DatasetError(f"cannot open array {self.path} ({self.driver}): {e}") from e
        self.shape = tuple(int(n) for n in self._ts.shape)
        self.ndim = len(self.shape)
        self.dtype = np.dtype(self._ts.dtype.numpy_dtype)
        self.chunks = tuple(int(c) for c in self._ts.chunk_layout.read_chunk.shape)

    def __getstate__(self) -> dict:
        return {"path": self.path, "driver": self.driver, "stores": self.stores}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __repr__(self) -> str:
        return f"TensorStoreArray({self.path!r}, {self.driver}, shape={self.shape}, dtype={self.dtype})"

    def __getitem__(self, selection) -> np.ndarray:
        box = tuple(slice(a, b) for a, b in unit_box(self.path, self.shape, selection))
        return np.asarray(self._ts[box].read().result())
