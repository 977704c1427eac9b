"""A finished run read back: its config and its weights, as ``predict.py`` and the model
export both load them (a run's checkpoint folder or step, a ``.pth`` of the full model, or an
exported model's folder)."""

from __future__ import annotations

from pathlib import Path

import torch

from torchtitan.checkpoint.convert import load_pth_state_dict
from torchtitan.checkpoint.reading import complete_steps, load_model_weights
from torchtitan.config.manager import ConfigManager
from torchtitan.errors import CheckpointError, ConfigError
from torchtitan.prediction import exported


def load_run_config(checkpoint: str, config: str | None):
    """The run's JobConfig: ``config``, the ``config.toml`` of the checkpoint's run, or the one
    an exported model (``predict.py --model``) holds."""
    path = Path(config) if config else None
    if path is None and exported.is_export(checkpoint):
        path = exported.open_export(checkpoint).config
    if path is None:
        ckpt = Path(checkpoint)
        for parent in (ckpt.parent, ckpt.parent.parent, ckpt.parent.parent.parent):
            if (parent / "config.toml").is_file():
                path = parent / "config.toml"
                break
    if path is None or not path.is_file():
        raise ConfigError(
            f"no config.toml found for checkpoint {checkpoint!r}; pass --config "
            "<dump_folder>/config.toml of the run that trained it"
        )
    return ConfigManager().parse_args(["--job.config_file", str(path)])


def load_weights(model: torch.nn.Module, checkpoint: str) -> None:
    """Weights from an exported ``.pth`` (full model) or a DCP checkpoint, strictly."""
    path = Path(checkpoint)
    exported.refuse_as_checkpoint(path)
    if path.suffix == ".pth":
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} does not exist")
        state = load_pth_state_dict(path, "--checkpoint")  # a clear error for a corrupt file
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise CheckpointError(
                f"{path} does not match the model of its config: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}; export the full model with "
                "helpers/dcp_to_pth.py --what full"
            )
        return
    if not (path / ".metadata").is_file() and not complete_steps(path):
        raise CheckpointError(
            f"checkpoint {path} is neither a .pth file, a DCP step folder nor a checkpoint "
            "folder with step-N folders"
        )
    load_model_weights(model, path)
