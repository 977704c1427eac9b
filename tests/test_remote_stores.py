"""Remote stores: the demo data served by a real local HTTP server and a real S3-compatible
server (moto in server mode) is discovered and read like the same data on disk, trains with the
same losses, survives network errors (retried; a read that keeps failing is counted and the
sample redrawn, like a corrupt chunk), and a wrong URL stops with a message naming it."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from conftest import debug_run, read_jsonl, train_losses

SEG2D = "train_configs/debug_segmentation_2d.toml"
BUCKET = "cellmap-demo"
SECRET = "remote-stores-test-secret-0123456789"  # must never show up in output or files
EM_S0 = "jrc_synth-1/jrc_synth-1.zarr/recon-1/em/fibsem-uint8/s0"
LABEL_S0 = "jrc_synth-1/jrc_synth-1.zarr/recon-1/labels/groundtruth/crop1/mito/s0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FlakyHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; a request whose path contains a key of ``server.failures`` gets a 500
    while that key's count is not zero (-1: always). Requests are counted per path."""

    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):  # noqa: N802 - http.server's name
        server = self.server
        with server.lock:
            server.requests[self.path] = server.requests.get(self.path, 0) + 1
            for key, left in server.failures.items():
                if key in self.path and left != 0:
                    server.failures[key] = left - 1 if left > 0 else left
                    server.failed += 1
                    self.send_error(500, "injected failure")
                    return
        super().do_GET()


@pytest.fixture(scope="module")
def local_copy(demo_data, tmp_path_factory) -> Path:
    """A copy of the demo data with its listing index (what gets uploaded)."""
    from torchtitan.data.io.stores import write_index

    root = tmp_path_factory.mktemp("remote") / "data"
    shutil.copytree(demo_data, root)
    write_index(root)
    return root


@pytest.fixture(scope="module")
def http_root(local_copy):
    """``http://127.0.0.1:<port>`` serving the copy; ``.server`` injects failures."""
    handler = functools.partial(FlakyHandler, directory=str(local_copy))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", _free_port()), handler)
    server.lock, server.requests, server.failures, server.failed = threading.Lock(), {}, {}, 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()


@pytest.fixture(scope="module")
def s3_root(local_copy):
    """``s3://cellmap-demo/data`` on a moto server (with the index) and ``s3://cellmap-demo/
    bare`` (without: listed key by key); the endpoint is set the way users set it."""
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    for dirpath, _, files in os.walk(local_copy):
        for f in files:
            full = Path(dirpath) / f
            rel = full.relative_to(local_copy).as_posix()
            client.upload_file(str(full), BUCKET, f"data/{rel}")
            if f != "cellmap-index.json":
                client.upload_file(str(full), BUCKET, f"bare/{rel}")
    yield f"s3://{BUCKET}"
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


def _summary(sources):
    return [(s.name, [lv.shape for lv in s.levels], [lv.scale for lv in s.levels],
             [(c.name, sorted(c.classes), {k: [lv.shape for lv in v] for k, v in c.classes.items()})
              for c in s.crops]) for s in sources]


# -- 0. the store context -------------------------------------------------------------------------


class _ContextProbe:
    """A map-style dataset reporting what a loader worker finds in the store context its
    sources read through (module level: a spawned worker unpickles it by name)."""

    def __init__(self, sources):
        self.sources = sources

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> dict:
        source = self.sources[0]
        context = source.stores
        opened_before = context.open_paths()
        context.open_array(source.levels[0].path)[0:2, 0:8, 0:8]
        return {"pid": os.getpid(), "settings": context.settings, "opened_before": opened_before,
                "cache_pool": context.ts_context()["cache_pool"].to_json(),
                "one_context": all(x.stores is context for s in self.sources for x in [s, *s.crops])}


def test_a_pickled_context_carries_its_settings_only(local_copy):
    """Sources and crops pickled together (a dataset sent to a worker) share one context
    again, with the settings of the original and none of its handles."""
    import pickle

    from torchtitan.data.crops import layout, reader
    from torchtitan.data.io.stores import StoreContext, StoreSettings

    context = StoreContext(StoreSettings(cache_bytes=5 << 20, array_handles=9))
    sources = layout.discover(context, local_copy)
    context.open_array(sources[0].levels[0].path)
    again = pickle.loads(pickle.dumps(sources))
    copy = again[0].stores
    assert copy is not context and copy.settings == context.settings
    assert copy.open_paths() == [] and context.open_paths() == [sources[0].levels[0].path]
    assert all(x.stores is copy for s in again for x in [s, *s.crops])


def test_a_context_reopens_its_handles_in_another_process(local_copy, monkeypatch):
    """A forked child inherits its parent's context, but not the use of its handles
    (TensorStore objects, open files): in another process the context opens its own."""
    from torchtitan.data.io.stores import StoreContext

    context = StoreContext()
    path = str(local_copy / EM_S0)
    first = context.open_array(path)
    assert context.open_paths() == [path] and context.open_array(path) is first
    parent = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: parent + 1)  # what a forked child sees
    assert context.open_paths() == []
    assert context.open_array(path) is not first and context.open_paths() == [path]


def test_spawned_loader_worker_reads_with_the_parent_settings(http_root):
    """A spawned loader worker has no set-up step: the context its dataset carries brings the
    parent's settings (the chunk cache size reaches TensorStore), none of the parent's
    handles, and stays one context for every source and crop."""
    from torch.utils.data import DataLoader

    from torchtitan.data.crops import layout, reader
    from torchtitan.data.io.stores import StoreContext, StoreSettings

    url, _ = http_root
    settings = StoreSettings(cache_bytes=3 << 20, array_handles=7)
    context = StoreContext(settings)
    sources = layout.discover(context, url)
    context.open_array(sources[0].levels[0].path)  # a handle of the parent's
    loader = DataLoader(_ContextProbe(sources), batch_size=None, num_workers=1,
                        multiprocessing_context="spawn")
    (seen,) = list(loader)
    assert seen["pid"] != os.getpid()
    assert seen["settings"] == settings
    assert seen["cache_pool"] == {"total_bytes_limit": 3 << 20}
    assert seen["opened_before"] == []
    assert seen["one_context"]


# -- 1. reader level ------------------------------------------------------------------------------


def test_same_boxes_and_layout_from_disk_http_and_s3(local_copy, http_root, s3_root):
    from torchtitan.data.crops import layout, reader
    from torchtitan.data.io import stores
    from torchtitan.data.io import zarr_chunks

    context = stores.StoreContext()
    url, _ = http_root
    roots = [str(local_copy), url, f"{s3_root}/data", f"{s3_root}/bare"]
    found = [_summary(layout.discover(context, r)) for r in roots]
    assert found[0] and all(f == found[0] for f in found[1:])
    for rel in (EM_S0, LABEL_S0):
        local = context.open_array(str(local_copy / rel))
        assert isinstance(local, zarr_chunks.ChunkedArray)  # the local fast path stays
        want = local[...]
        boxes = [tuple(slice(a, a + n) for a, n in zip(o, (3, 37, 45))) for o in
                 ((0, 0, 0), (7, 20, 11), tuple(s - n for s, n in zip(local.shape, (3, 37, 45))))]
        for root in roots[1:3]:
            remote = context.open_array(stores.join(root, rel))
            assert isinstance(remote, stores.TensorStoreArray)
            assert (remote.shape, remote.dtype) == (local.shape, local.dtype)
            for box in boxes:
                np.testing.assert_array_equal(remote[box], want[box])
            np.testing.assert_array_equal(remote[...], want)


def test_split_list_with_urls(local_copy, http_root, tmp_path):
    """A split list names remote stores and crops (with and without class lists)."""
    from torchtitan.data.crops import layout, reader
    from torchtitan.data.io.stores import StoreContext

    context = StoreContext()
    url, _ = http_root
    store = f"{url}/jrc_synth-1/jrc_synth-1.zarr"
    csv = tmp_path / "split.csv"
    csv.write_text(
        f'"train","{store}","recon-1/em/fibsem-uint8","{store}","recon-1/labels/groundtruth/crop1/[mito,nuc]"\n'
        f'"validate","{store}","recon-1/em/fibsem-uint8","{store}","recon-1/labels/groundtruth/crop3"\n'
    )
    (source,) = layout.discover(context, csv)
    assert source.name == "jrc_synth-1" and source.store == store
    crops = {c.name: (c.split, sorted(c.classes)) for c in source.crops}
    (local,) = [s for s in layout.discover(context, local_copy) if s.name == "jrc_synth-1"]
    crop3 = next(c for c in local.crops if c.name == "crop3")
    assert crops == {"crop1": ("train", ["mito", "nuc"]), "crop3": ("val", sorted(crop3.classes))}


def test_n5_and_sharded_zarr_read_with_tensorstore(tmp_path):
    """What the chunk reader leaves aside (N5, zarr 3 sharding) is read by TensorStore."""
    import tensorstore as ts
    import zarr

    from torchtitan.data.io import stores

    data = np.arange(20 * 30 * 40, dtype=np.uint16).reshape(20, 30, 40)
    n5 = tmp_path / "a.n5"
    ts.open({"driver": "n5", "kvstore": {"driver": "file", "path": str(n5)}, "create": True,
             "metadata": {"dimensions": [20, 30, 40], "blockSize": [8, 8, 8], "dataType": "uint16",
                          "compression": {"type": "gzip"}}}).result()[...].write(data).result()
    sharded = tmp_path / "b.zarr"
    zarr.create_array(str(sharded), shape=data.shape, chunks=(4, 8, 8), shards=(8, 16, 16),
                      dtype="uint16")[...] = data
    for path in (n5, sharded):
        arr = stores.StoreContext().open_array(str(path))
        assert isinstance(arr, stores.TensorStoreArray), path
        np.testing.assert_array_equal(arr[3:17, 5:29, 1:40], data[3:17, 5:29, 1:40])


# -- 3. network errors ---------------------------------------------------------------------------


def test_transient_server_errors_are_retried(local_copy, http_root):
    from torchtitan.data.io import stores

    context = stores.StoreContext()
    url, server = http_root
    want = context.open_array(str(local_copy / EM_S0))[...]
    arr = context.open_array(f"{url}/{EM_S0}")
    chunk = f"/{EM_S0}/1.1.1"
    failed, asked = server.failed, server.requests.get(chunk, 0)
    server.failures[chunk] = stores.NETWORK_RETRIES  # fails that often, then serves
    try:
        np.testing.assert_array_equal(arr[64:80, 64:128, 64:128], want[64:80, 64:128, 64:128])
    finally:
        server.failures.pop(chunk)
    assert server.failed - failed == stores.NETWORK_RETRIES
    assert server.requests[chunk] - asked == stores.NETWORK_RETRIES + 1


def test_persistent_network_error_is_counted_like_a_corrupt_chunk(local_copy, http_root):
    """A chunk the server keeps refusing: ChunkReadError after the retries, and a training
    sample that needs it is redrawn and counted in ``resampled``."""
    from torchtitan.data.crops import layout, reader
    from torchtitan.data.sampling.samples import SegmentationSamples
    from torchtitan.data.io.stores import StoreContext

    context = StoreContext()
    url, server = http_root
    sources = [s for s in layout.discover(context, url) if s.name == "jrc_synth-1"]
    level = sources[0].levels[0]
    server.failures[f"/{EM_S0}/"] = -1  # every EM s0 chunk of jrc_synth-1
    try:
        with pytest.raises(reader.ChunkReadError, match=EM_S0):
            reader._read_region(context, level, [0, 0, 0], [1, 8, 8], 0)
        crops = sources[0].crops
        ds = SegmentationSamples(sources, crops, ["mito"], [8.0, 8.0, 8.0], [32, 32], seed=0,
                                 augment=False, max_resample=3)
        with pytest.raises(layout.DatasetError, match="resampl|read|chunk"):
            ds[0]  # every replacement needs the same EM: gives up after max_resample
        server.failures[f"/{EM_S0}/"] = 0
        server.failures[f"/{EM_S0}/0.0.0"] = -1  # one chunk only
        drawn = [ds[i] for i in range(12)]
    finally:
        server.failures.clear()
    assert sum(int(s.resampled) for s in drawn) > 0
    assert all(np.isfinite(s.image.numpy()).all() for s in drawn)


# -- 4. bad URLs ---------------------------------------------------------------------------------


def test_unreachable_or_misspelled_url_is_named(http_root, s3_root):
    from torchtitan.data.crops import layout, reader
    from torchtitan.data.io.stores import StoreContext

    url, _ = http_root
    closed = f"http://127.0.0.1:{_free_port()}/data"
    with pytest.raises(layout.DatasetError, match=f"cannot read {closed}"):
        layout.discover(StoreContext(), closed)
    for wrong in (f"{url}/no_such_folder", f"{s3_root}/no_such_prefix"):
        with pytest.raises(layout.DatasetError, match=f"data.dataset_path '{wrong}' does not exist"):
            layout.discover(StoreContext(), wrong)
    with pytest.raises(layout.DatasetError, match="unsupported URL"):
        layout.discover(StoreContext(), "ftp://example.org/data")


# -- 2. training from remote stores --------------------------------------------------------------

TRAIN = ("--training.steps", "20", "--training.batch_size", "2", "--metrics.log_freq", "1",
         "--checkpoint.enable_checkpoint", "false", "--data.val_crops", "crop3")


@pytest.fixture(scope="module")
def disk_losses(local_copy, tmp_path_factory):
    dump = tmp_path_factory.mktemp("disk") / "run"
    debug_run("train_segmentation.py", SEG2D, local_copy, dump, *TRAIN, nproc=1)
    losses = train_losses(dump)
    assert sorted(losses) == list(range(1, 21))
    return losses


def _no_secret(result, dump: Path) -> None:
    assert SECRET not in result.stdout + result.stderr
    for f in dump.rglob("*"):
        if f.is_file() and f.suffix in (".toml", ".jsonl", ".json", ".txt", ".log"):
            assert SECRET not in f.read_text(errors="replace"), f


@pytest.mark.distributed
def test_training_from_http_matches_disk(disk_losses, http_root, tmp_path):
    """20 steps from the HTTP server, with a 500 injected now and then (retried): the losses of
    the same data on disk, step for step."""
    url, server = http_root
    failed = server.failed
    server.failures["/0.0.0"] = 3  # the first three requests of such chunks fail
    dump = tmp_path / "http"
    try:
        debug_run("train_segmentation.py", SEG2D, url, dump, *TRAIN, nproc=1)
    finally:
        server.failures.clear()
    assert server.failed - failed == 3
    assert train_losses(dump) == disk_losses
    resampled = [r.get("data/resampled", 0) for r in read_jsonl(dump / "logs" / "metrics.jsonl")]
    assert sum(resampled) == 0  # retried, not redrawn


@pytest.mark.slow
@pytest.mark.distributed
def test_training_from_s3_matches_disk(disk_losses, s3_root, tmp_path):
    dump = tmp_path / "s3"
    r = debug_run("train_segmentation.py", SEG2D, f"{s3_root}/data", dump, *TRAIN, nproc=1)
    assert train_losses(dump) == disk_losses
    _no_secret(r, dump)
