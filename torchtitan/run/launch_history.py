"""A run's launch history in its dump folder, and the check that a resumed run still builds
the model its checkpoints hold.

Each launch of a run keeps its resolved config beside the checkpoints: ``config.toml`` for
the first, ``config.launch-2.toml``, ``config.launch-3.toml``, ... for later ones. Before a
launch resumes, its model-shaping keys are compared with the latest launch's, so that loading
checkpoints of another model fails with one message instead of a traceback inside DCP.

Floor 4, beside :mod:`torchtitan.checkpoint.manager`; reads and writes configs through the config floor.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from torchtitan.config.parsing import config_to_dict, format_value, read_toml, save_config
from torchtitan.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan.config.job_config import JobConfig

# Keys that decide the model's parameters (their names and shapes) or what its output channels
# mean: a run's checkpoints only fit a model built with the same values. Per task; others
# (lr, steps, crop_size, loss, augmentation, ...) may change between launches of one run.
MODEL_SHAPING_KEYS: dict[str, tuple[str, ...]] = {
    "segmentation": ("model.backbone", "model.ndim", "model.in_chans", "model.patch_size",
                     "data.classes", "model.head", "model.head_channels",
                     "model.head_min_channels", "model.head_image_levels", "model.backbone_out_layers",
                     "affinities.boundary"),
    "mae": ("model.backbone", "model.ndim", "model.in_chans", "model.patch_size",
            "model.decoder_dim", "model.decoder_depth", "model.decoder_num_heads"),
}

FIRST_LAUNCH_CONFIG = "config.toml"  # the first launch's resolved config, never overwritten


def launch_configs(dump_folder: str | os.PathLike) -> list[str]:
    """The resolved configs of a run's launches, oldest first: ``config.toml`` (launch 1),
    then ``config.launch-2.toml``, ``config.launch-3.toml``, ... beside it."""
    first = os.path.join(dump_folder, FIRST_LAUNCH_CONFIG)
    if not os.path.isfile(first):
        return []
    later = []
    for name in os.listdir(dump_folder):
        number = name[len("config.launch-"):-len(".toml")]
        if name.startswith("config.launch-") and name.endswith(".toml") and number.isdigit():
            later.append((int(number), os.path.join(dump_folder, name)))
    return [first] + [path for _, path in sorted(later)]


def save_launch_config(config: JobConfig, dump_folder: str | os.PathLike) -> str:
    """Keep this launch's resolved config beside the earlier ones (see :func:`launch_configs`)
    and return its path; an earlier launch's file is never overwritten."""
    previous = launch_configs(dump_folder)
    name = FIRST_LAUNCH_CONFIG if not previous else f"config.launch-{len(previous) + 1}.toml"
    path = os.path.join(dump_folder, name)
    save_config(config, path)
    return path


_MISSING = object()


def _dotted(values: dict[str, dict[str, Any]], key: str) -> Any:
    section, name = key.split(".", 1)
    return values.get(section, {}).get(name, _MISSING)


def check_resume_compatible(config: JobConfig, dump_folder: str | os.PathLike,
                            task: str) -> None:
    """Raise one :class:`ConfigError` naming every model-shaping key (see
    :data:`MODEL_SHAPING_KEYS`) whose value differs from the latest launch of the run in
    ``dump_folder``, whose checkpoints this launch is about to resume. No-op without a
    previous launch config."""
    history = launch_configs(dump_folder)
    if not history:
        return
    previous = history[-1]
    old = read_toml(previous)
    new = config_to_dict(config)
    changed = []
    for key in MODEL_SHAPING_KEYS.get(task, ()):
        before, after = _dotted(old, key), _dotted(new, key)
        if before is not _MISSING and before != after:  # a key older configs lack: not compared
            changed.append(f"{key}: {format_value(before)} -> {format_value(after)}")
    if changed:
        raise ConfigError(
            f"cannot resume the run in {dump_folder}: its checkpoints hold a different model. "
            f"Changed since {previous}: " + "; ".join(changed) + ". Put these values back to "
            "resume, or start a new job.dump_folder (with checkpoint.initial_load_path pointing "
            "at this run's checkpoint folder to warm-start from its weights)"
        )
