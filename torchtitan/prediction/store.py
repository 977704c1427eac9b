"""The prediction store ``predict.py`` writes: whose it is, and how far each region is.

predict.py writes only into stores it created: the root and every region and class group it
creates carry :data:`OWNER_ATTR` before anything is written into them, and a finished
region's group gets :data:`COMPLETE_ATTR`. :func:`check_output_store` refuses, before any
work, an output that is a file, lies inside another zarr store, or is a folder or store (or
holds groups) that predict.py did not write; see :mod:`torchtitan.prediction.predictor`.

Progress below the region: the region's group records the plan its blocks are predicted
with (:data:`PLAN_ATTR`: geometry, block grid, dtype, classes, model and inference settings),
and each written block gets an empty marker file ``<region>/_blocks/<k>`` (``k`` its raster
index), made after every class of the block is written. A job (or shard) that finds the
same plan resumes at the blocks without markers; another plan restarts the region. The last
step of a store (post-processing, pyramids, completion markers, the submission) is claimed by
one job at a time with a file ``.finishing`` in the store's root (:func:`claim_finishing`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from torchtitan.cellmap.affinities import STORED_DTYPE
from torchtitan.postprocess.blockwise import WORK
from torchtitan.postprocess.blockwise_labels import Blocks
from torchtitan.cellmap.ome_ngff import create_multiscale_group
from torchtitan.errors import ConfigError
from torchtitan.prediction.regions import Region

logger = logging.getLogger(__name__)

COMPLETE_ATTR = "prediction_complete"
PLAN_ATTR = "prediction_plan"
BLOCKS = "_blocks"  # <region>/_blocks/<k>: block k is written
SCRATCH = (BLOCKS, WORK)  # a region's working folders, removed when it is finished
FINISHING = ".finishing"  # <store>/.finishing: a job is running the last step
LOCK = ".lock"  # <store>/.lock: held while a job creates or resets regions
# Set on the root and on every group predict.py creates (region and class groups) before
# anything is written into them: predict.py writes only where it finds it (or, for stores of
# earlier versions, the completion marker and the class groups' prediction attributes).
OWNER_ATTR = "torchtitan_prediction"
_CLASS_GROUP_ATTRS = ("multiscales", "voxel_size", "translation")  # what the predictor sets


def _zarr_attrs(path: Path) -> dict | None:
    """The attributes of the zarr group or array at ``path`` (format 2 or 3), or None when
    ``path`` is no zarr node."""
    try:
        if (path / "zarr.json").is_file():
            return json.loads((path / "zarr.json").read_text()).get("attributes", {}) or {}
        if (path / ".zgroup").is_file() or (path / ".zarray").is_file():
            attrs = path / ".zattrs"
            return json.loads(attrs.read_text()) if attrs.is_file() else {}
    except (OSError, ValueError):
        return {}
    return None


def _is_array(path: Path) -> bool:
    if (path / ".zarray").is_file():
        return True
    try:
        return json.loads((path / "zarr.json").read_text()).get("node_type") == "array"
    except (OSError, ValueError):
        return False


def region_finished(out: str, name: str) -> bool:
    """Whether ``out/<name>`` holds a finished prediction (its completion marker is set)."""
    return bool((_zarr_attrs(Path(out) / name) or {}).get(COMPLETE_ATTR))


def _inside_store(path: Path) -> Path | None:
    """The zarr group or array that ``path`` would be written into, if any of its parents is
    one."""
    for parent in path.resolve().parents:
        if _zarr_attrs(parent) is not None:
            return parent
    return None


def _not_ours(path: Path, flag: str, why: str) -> ConfigError:
    return ConfigError(
        f"{flag} {path}: {why}; predict.py writes only into stores it created, and never into "
        "another (not with --overwrite either): choose a new path")


def check_output_store(out: str, regions: list[str], flag: str = "--out",
                       owner: str = OWNER_ATTR) -> None:
    """Refuse to write ``out`` unless it is new, an empty folder, or a store predict.py made:
    an existing file, a path inside another zarr store (a dataset's ``em/`` or ``labels/``
    groups), a folder or zarr store predict.py did not write, and, inside its own store, a
    region or class group without the prediction attributes (or holding anything else) are
    errors naming them. Read-only: checked on every rank before any work."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {out} is an existing file, not a zarr store; give a new path "
                          f"(a folder, e.g. {path.with_suffix('.zarr')})")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not os.access(existing, os.W_OK):
        raise ConfigError(f"{flag} {out}: {existing} is not writable; choose a path in a folder "
                          "you can write")
    store = _inside_store(path)
    if store is not None:
        inner = path.resolve().relative_to(store).parts
        named = [p for p in (store.name, *inner) if p in ("em", "labels")]
        what = f" (inside its {named[0]}/ group: a dataset's data)" if named else ""
        raise _not_ours(path, flag, f"lies inside the zarr store {store}{what}")
    if not path.exists() or not any(path.iterdir()):
        return
    attrs = _zarr_attrs(path)
    if attrs is None:
        raise _not_ours(path, flag, "is a folder that is not a zarr store and not empty")
    children = [c for c in path.iterdir() if c.is_dir()]
    legacy = owner == OWNER_ATTR and children and all(
        COMPLETE_ATTR in (_zarr_attrs(c) or {}) for c in children)
    if not attrs.get(owner) and not legacy:
        raise _not_ours(path, flag, f"is a zarr store that predict.py did not write (no "
                                    f"'{owner}' attribute)")
    if owner != OWNER_ATTR:
        return
    for name in regions:
        group = path / name
        if not group.exists():
            continue
        g_attrs = _zarr_attrs(group)
        if g_attrs is None or _is_array(group) or not (OWNER_ATTR in g_attrs
                                                       or COMPLETE_ATTR in g_attrs):
            raise _not_ours(group, flag, "was not written by predict.py (no prediction "
                                         "attributes)")
        for child in sorted(group.iterdir()):
            if child.name.startswith(".") or child.name in ("zarr.json", *SCRATCH):
                continue
            c_attrs = _zarr_attrs(child)
            if c_attrs is None or _is_array(child) or not (
                    OWNER_ATTR in c_attrs or all(k in c_attrs for k in _CLASS_GROUP_ATTRS)):
                raise _not_ours(child, flag, "holds data predict.py did not write (no "
                                             "prediction attributes)")


# ---------------------------------------------------------------------------------------------
# Progress of a region: its plan and its written blocks
# ---------------------------------------------------------------------------------------------


def stored_plan(out: str, name: str) -> dict | None:
    """The plan ``out/<name>`` was (or is being) predicted with, or None."""
    return (_zarr_attrs(Path(out) / name) or {}).get(PLAN_ATTR)


def done_blocks(out: str, name: str) -> set[int]:
    """The raster indices of the blocks of ``out/<name>`` that are written."""
    folder = Path(out) / name / BLOCKS
    if not folder.is_dir():
        return set()
    return {int(f) for f in os.listdir(folder) if f.isdigit()}


def mark_block(out: str, name: str, k: int) -> None:
    """Record that block ``k`` of ``out/<name>`` is written (every class of it)."""
    (Path(out) / name / BLOCKS / str(k)).touch()


def reset_progress(out: str, name: str) -> None:
    """Forget the written blocks and the working data of ``out/<name>``."""
    for folder in SCRATCH:
        shutil.rmtree(Path(out) / name / folder, ignore_errors=True)
    (Path(out) / name / BLOCKS).mkdir(parents=True, exist_ok=True)


def remove_scratch(out: str, name: str) -> None:
    """Remove the working folders of a finished region."""
    for folder in SCRATCH:
        shutil.rmtree(Path(out) / name / folder, ignore_errors=True)


@contextmanager
def store_lock(out: str):
    """Hold the store's lock (an advisory ``lockf`` lock, which NFS honours too, on
    ``<out>/.lock``) while regions are created or reset, so that shards started together create
    each region once. The file is removed on release (zarr takes any file in a store for a
    broken node): a job that locked a file removed meanwhile locks the new one instead."""
    path = Path(out) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a")
        fcntl.lockf(f, fcntl.LOCK_EX)
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        fcntl.lockf(f, fcntl.LOCK_UN)
        f.close()


# ---------------------------------------------------------------------------------------------
# Which regions a job works on, and how it starts them
# ---------------------------------------------------------------------------------------------


# The plan's keys that only cut the region into blocks: a finished region's content does not
# depend on them (blockwise prediction and post-processing give the same result for any block).
GRID_KEYS = ("block", "chunks")


def select_regions(requested: list[Region], plans: dict, out: str,
                   overwrite: bool) -> tuple[list[Region], set[str]]:
    """(the regions to work on, those of them to predict again from the start): every
    unfinished region (resumed), and the finished ones with ``overwrite``. A finished region
    is kept otherwise, and is an error when it was predicted with other settings."""
    todo, redo = [], set()
    for region in requested:
        if not region_finished(out, region.name):
            todo.append(region)
        elif overwrite:
            todo.append(region)
            redo.add(region.name)
        else:
            stored = stored_plan(out, region.name)
            changed = plan_changes(stored, plans[region.name], GRID_KEYS) if stored else []
            if changed:
                raise ConfigError(
                    f"--out {out} holds {region.name} finished, predicted with other settings "
                    f"({'; '.join(changed)}); pass --overwrite to predict it again with these, "
                    "or choose another --out")
            logger.info("%s/%s is finished: kept (--overwrite predicts it again)", out,
                        region.name)
    return todo, redo


def plan_changes(stored: dict, plan: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """What differs between two plans, as ``key: stored -> now`` (but the keys ``ignore``)."""
    out = []
    for key in sorted((set(stored) | set(plan)) - set(ignore)):
        a, b = stored.get(key), plan.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{c}" for c in plan_changes(a, b)]
        elif a != b:
            out.append(f"{key}: {a} -> {b}")
    return out


def prepare_region(root, out: str, region: Region, plan: dict, redo: bool,
                   finish_only: bool) -> None:
    """Keep a region whose stored plan has this plan's content (its block grid is kept too,
    so that jobs with another ``--max_block_mb`` resume it), or start it from the beginning:
    arrays created empty, written blocks forgotten, the plan stored last."""
    stored = stored_plan(out, region.name)
    changed = plan_changes(stored, plan, GRID_KEYS) if stored else None
    if changed == [] and not redo:
        (Path(out) / region.name / BLOCKS).mkdir(exist_ok=True)
        done = len(done_blocks(out, region.name))
        if done:
            logger.info("%s/%s: resuming, %d of %d blocks are written", out, region.name, done,
                        len(Blocks(stored["shape"], stored["block"])))
        return
    exists = (Path(out) / region.name).exists()
    why = ("finished (--overwrite)" if redo else "not predicted yet" if not exists
           else "without a plan (cut short)" if stored is None
           else f"predicted with other settings ({'; '.join(changed)})")
    if finish_only:
        raise ConfigError(f"--finish: {out}/{region.name} is {why}; run the shards with the "
                          "same arguments first")
    if exists:
        logger.info("%s/%s is %s: predicting it again from its start", out, region.name, why)
    group = root.require_group(region.name)
    group.attrs.update({OWNER_ATTR: True, COMPLETE_ATTR: False, PLAN_ATTR: None})
    reset_progress(out, region.name)
    for cls in plan["classes"]:
        _write_group(root, region, cls, region.voxel_size, plan["dtype"], tuple(plan["chunks"]))
    stored = plan["dtype"] if plan["dtype"] == "float32" else np.dtype(STORED_DTYPE).name
    for channel in plan.get("affinities", []):
        _write_group(root, region, channel, region.voxel_size, stored, tuple(plan["chunks"]))
    group.attrs[PLAN_ATTR] = plan  # last: a region cut short before has no plan


def _write_group(root, region: Region, cls: str, voxel_size, dtype, chunks):
    """Create ``<region>/<class>`` with OME-NGFF metadata (plus the submission format's plain
    ``voxel_size`` and ``translation``) and an empty ``s0``."""
    translation = (region.origin + np.asarray(voxel_size) / 2).tolist()
    submission = {"voxel_size": list(map(float, voxel_size)), "translation": translation,
                  OWNER_ATTR: True}
    group = create_multiscale_group(root, f"{region.name}/{cls}", voxel_size, translation, 1,
                                    extra_attrs=submission)
    return group.create_array("s0", shape=region.shape, chunks=chunks, dtype=dtype,
                              fill_value=0, overwrite=True)


# ---------------------------------------------------------------------------------------------
# The last step of a store: one job at a time
# ---------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True


def claim_finishing(out: str, take_over: bool = False) -> dict | None:
    """Claim the last step of ``out`` for this process: None when claimed, else the claim of
    the job that holds it (``{"host", "pid", "time"}``). A claim of a process that no longer
    runs on this host is taken over, as is any claim with ``take_over`` (``--finish``)."""
    path = Path(out) / FINISHING
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    unreadable = 0
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                held = json.loads(path.read_text())
            except (OSError, ValueError):  # being written or removed meanwhile: look again,
                unreadable += 1            # then take it as a claim of an unknown job
                held = {} if unreadable > 20 else None
                time.sleep(0.1)
            if held is None:
                continue
            stale = held.get("host") == mine["host"] and not _alive(int(held.get("pid", -1)))
            if not (take_over or stale):
                return held
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        return None


def release_finishing(out: str) -> None:
    (Path(out) / FINISHING).unlink(missing_ok=True)
