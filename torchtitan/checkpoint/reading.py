"""Reading distributed checkpoints: a run's step folders, what a checkpoint stores, and model
weights loaded from one, strictly, through prefix maps.

:mod:`torchtitan.checkpoint.manager` saves and resumes a run's full training state with these;
``predict.py``, the converters and seed loading use them to read weights alone. A key of the
checkpoint is ``model.<model key>``; a prefix map ``SOURCE=TARGET`` renames the checkpoint's
``model.SOURCE*`` to the model's ``TARGET*`` (an MAE encoder into a segmentation backbone).

Floor 4, beside :mod:`torchtitan.checkpoint.manager`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from torchtitan.errors import CheckpointError
from torchtitan.parallelisms.tensor_parallel import from_storage_layout, to_storage_layout

logger = logging.getLogger(__name__)

STEP_RE = re.compile(r"^step-(\d+)$")


def step_folder(folder: str | os.PathLike, step: int) -> Path:
    """The folder of step ``step``'s checkpoint: ``folder/step-N`` (read by :data:`STEP_RE`)."""
    return Path(folder) / f"step-{step}"


PARTIAL_STEP_RE = re.compile(r"^\.step-(\d+)\.tmp$")


def partial_folder(final: str | os.PathLike) -> Path:
    """Where a checkpoint folder ``final`` is written before its rename into place: hidden,
    beside it, ``.<name>.tmp``."""
    final = Path(final)
    return final.parent / f".{final.name}.tmp"


def partial_step_folder(folder: str | os.PathLike, step: int) -> Path:
    """Where step ``step``'s checkpoint is written before its rename to :func:`step_folder`:
    hidden, and never matched by :data:`STEP_RE`, so that a crash mid-save leaves no step
    (:data:`PARTIAL_STEP_RE` finds what a killed job left)."""
    return partial_folder(step_folder(folder, step))


def complete_steps(folder: str | os.PathLike) -> list[int]:
    """Steps with a complete checkpoint (renamed into place, with DCP metadata), ascending."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = []
    for p in folder.iterdir():
        m = STEP_RE.match(p.name)
        if m and (p / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def readable_steps(folder: str | os.PathLike) -> list[int]:
    """:func:`complete_steps` whose DCP ``.metadata`` can be read, ascending; a step whose
    metadata is corrupt (truncated, garbage) is skipped with a warning naming it."""
    steps = []
    for step in complete_steps(folder):
        path = step_folder(folder, step)
        try:
            dcp.FileSystemReader(str(path)).read_metadata()
        except Exception as e:  # unpickling garbage raises almost anything
            logger.warning("skipping checkpoint %s: its .metadata cannot be read (%s: %s); "
                           "an earlier checkpoint is used instead", path, type(e).__name__, e)
            continue
        steps.append(step)
    return steps


def checkpoint_keys(path: str | os.PathLike) -> set[str]:
    """Flattened names of everything stored in a DCP checkpoint."""
    reader = dcp.FileSystemReader(str(path))
    return set(reader.read_metadata().state_dict_metadata.keys())


def model_part(key: str) -> str:
    """The top-level part of a model key, as a prefix: ``backbone.blocks.0.x`` -> ``backbone.``."""
    head, dot, _ = key.partition(".")
    return head + dot


def shared_parts_map(path: Path, seed_keys: list[str], model_keys: list[str]) -> list[str]:
    """``initial_load_prefix_map`` entries ``P=P`` for every top-level part ``P`` that both
    the seed and the model have."""
    seed_parts = {model_part(k) for k in seed_keys}
    model_parts = {model_part(k) for k in model_keys}
    shared = sorted(seed_parts & model_parts)
    if not shared:
        raise CheckpointError(
            f"the seed checkpoint {path} holds weights under {sorted(seed_parts)}, this model "
            f"has {sorted(model_parts)}; set checkpoint.initial_load_prefix_map (e.g. "
            "encoder.=backbone. for an MAE encoder seed) or convert for the other model "
            "(pth_to_dcp.py --prefix)"
        )
    unused = sorted(seed_parts - model_parts)
    if unused:
        logger.warning("seed checkpoint %s: %s not used by this model", path, ", ".join(unused))
    return [f"{p}={p}" for p in shared]


def unused_seed_keys(seed_keys: list[str], model_keys: list[str],
                      pairs: list[tuple[str, str]]) -> list[str]:
    """Seed keys under a mapped prefix that no model key maps to."""
    mapped = set()
    for key in model_keys:
        for src, dst in pairs:
            if key.startswith(dst):
                mapped.add(src + key[len(dst):])
                break
    return sorted(k for k in seed_keys
                  if any(k.startswith(src) for src, _ in pairs) and k not in mapped)


def check_seed_shapes(model: torch.nn.Module, path: Path, pairs: list[tuple[str, str]]) -> None:
    """A seed of another backbone size, dimension or channel count has the same key names as
    the model; compare shapes so that the error says so (and what the seed was made for)."""
    wanted = {}
    for key, value in get_model_state_dict(model).items():
        for src, dst in pairs:
            if key.startswith(dst):
                wanted[f"model.{src}{key[len(dst):]}"] = (key, value)
                break
    check_stored_shapes(path, wanted, "the seed checkpoint")


def check_stored_shapes(path: Path, wanted: dict, what: str) -> None:
    """Raise :class:`CheckpointError` when a tensor that ``path`` stores under a key of
    ``wanted`` (checkpoint key -> (model key, tensor), or -> tensor) has another shape than the
    model's: a checkpoint of another backbone size, dimension or channel count has the same
    key names, and DCP would fail with a raw size mismatch."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    wrong = []
    for ckpt_key, entry in wanted.items():
        key, value = entry if isinstance(entry, tuple) else (ckpt_key, entry)
        meta = stored.get(ckpt_key)
        size = getattr(meta, "size", None)
        if size is not None and isinstance(value, torch.Tensor) \
                and tuple(size) != tuple(value.shape):
            wrong.append(f"{key} {tuple(size)} in the checkpoint, {tuple(value.shape)} in the "
                         "model")
    if not wrong:
        return
    made_for = ""
    record = path / "conversion.json"  # written by pth_to_dcp.py
    if record.is_file():
        r = json.loads(record.read_text())
        made_for = (f" It was converted for --model.backbone {r.get('backbone')} --model.ndim "
                    f"{r.get('ndim')} --model.in_chans {r.get('in_chans')} --model.patch_size "
                    f"{r.get('patch_size')}.")
    raise CheckpointError(
        f"{what} {path} does not fit this model: {len(wrong)} shape mismatches, e.g. "
        f"{'; '.join(wrong[:3])}.{made_for} Check model.backbone, model.ndim, model.in_chans "
        "and model.patch_size"
    )


def resolve_step_folder(path: str | os.PathLike) -> Path:
    """A step folder as given, or the latest complete step of a run's checkpoint folder."""
    path = Path(path)
    if not (path / ".metadata").is_file() and readable_steps(path):
        path = step_folder(path, readable_steps(path)[-1])
    return path


def parse_prefix_map(items: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        if "=" not in item:
            raise CheckpointError(
                f"checkpoint.initial_load_prefix_map entry {item!r}: expected 'SOURCE=TARGET', "
                "e.g. 'encoder.=backbone.'"
            )
        src, dst = item.split("=", 1)
        pairs.append((src, dst))
    return pairs


def load_model_weights(model: torch.nn.Module, path: str | os.PathLike,
                       prefix_map: list[str] | None = None) -> None:
    """Load model weights only from a DCP checkpoint (a seed checkpoint, another run's
    ``step-N``, or a run's checkpoint folder, whose latest step is taken), strictly.

    ``prefix_map`` entries ``SOURCE=TARGET`` rename checkpoint keys ``model.SOURCE*`` to model
    keys ``TARGET*``; with a map, only model keys under some TARGET are loaded (e.g. an MAE
    encoder into a segmentation backbone, leaving the new head as initialised); without one,
    every model key must be present. A missing key is an error, never silently skipped.
    """
    path = resolve_step_folder(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"checkpoint.initial_load_path {str(path)!r} is not a complete DCP checkpoint "
            "(no .metadata); point it at a step folder such as .../checkpoint/step-1000, or at "
            "a checkpoint folder holding step-N folders"
        )
    pairs = parse_prefix_map(prefix_map or [])
    model_sd = get_model_state_dict(model)
    wanted: dict[str, torch.Tensor] = {}
    for key, value in model_sd.items():
        if not pairs:
            wanted[f"model.{key}"] = value
            continue
        for src, dst in pairs:
            if key.startswith(dst):
                wanted[f"model.{src}{key[len(dst):]}"] = value
                break
    if not wanted:
        raise CheckpointError(
            f"checkpoint.initial_load_prefix_map {prefix_map} matches no model parameter; model "
            f"keys start with: {sorted({k.split('.')[0] + '.' for k in model_sd})}"
        )
    stored = checkpoint_keys(path)
    missing = sorted(k for k in wanted if k not in stored)
    if missing:
        raise CheckpointError(
            f"{path}: {len(missing)} model weights are missing from the checkpoint, e.g. "
            f"{missing[:5]}; the checkpoint holds e.g. {sorted(stored)[:5]}. Check model.backbone "
            "and checkpoint.initial_load_prefix_map"
        )
    check_stored_shapes(path, wanted, "the checkpoint")
    stored_layout = to_storage_layout(wanted)
    dcp.load(stored_layout, checkpoint_id=str(path))
    wanted = from_storage_layout(stored_layout, wanted)
    # Write the loaded values back through the model's own state-dict API (handles DTensors).
    inverse = {}
    for key in model_sd:
        for src, dst in pairs or [("", "")]:
            if key.startswith(dst):
                inverse[key] = wanted[f"model.{src}{key[len(dst):]}"]
                break
    set_model_state_dict(model, inverse, options=StateDictOptions(strict=False))
    logger.info("loaded %d model weights from %s", len(inverse), path)
