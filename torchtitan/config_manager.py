"""Job configuration: documented dataclasses, TOML files and command-line overrides.

Every option of a run is one field of a small dataclass, one dataclass per TOML section
(``[training]``, ``[optimizer]``, ...), all gathered in :class:`JobConfig`. Each field is
declared with :func:`opt`, which records its default, a one-line doc, and optionally the
allowed choices or a range check. That single declaration drives everything else: the
``--help`` text, type conversion of TOML and command-line values, and the error messages.

Values are resolved in three layers, each later one winning::

    defaults (this file)  <  TOML file (--job.config_file)  <  command line (--section.key)

Usage::

    config = ConfigManager().parse_args()          # reads sys.argv
    config = ConfigManager().parse_args(["--job.config_file", "train_configs/x.toml",
                                         "--training.steps", "20", "--no-training.compile"])

Every problem a user can cause (an unknown key, a value of the wrong type, a missing file,
inconsistent options) raises :class:`ConfigError` with a message that names the file or the
command line, the full ``section.key``, the offending value and what was expected, so that
a bad config fails before any process group is started.

This module sits on the lowest floor: it imports only the standard library and ``tomli_w``.
"""

import dataclasses
import difflib
import logging
import math
import os
import sys
import tempfile
import textwrap
import tomllib
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import tomli_w

__all__ = [
    "ConfigError",
    "ConfigManager",
    "JobConfig",
    "config_to_dict",
    "config_to_toml",
    "help_text",
    "opt",
    "save_config",
    "validate",
]

COMMAND_LINE = "the command line"

# Spellings accepted for booleans on the command line (compared case-insensitively).
_TRUE_WORDS = ("true", "1", "yes")
_FALSE_WORDS = ("false", "0", "no")

# Field types a config option may have. Keeping the set small keeps parsing, help and
# TOML round trips simple and predictable.
_SCALAR_TYPES = (bool, int, float, str)
_LIST_TYPES = (list[str], list[int], list[float])


class UserError(Exception):
    """Base of every error a user's input can cause (config, data, checkpoint path, command
    line): entry points print its message once, without a traceback, and exit with status 2.
    Defined here, on the lowest floor, and re-exported by :mod:`torchtitan.errors`."""


class ConfigError(UserError, ValueError):
    """A user-facing configuration problem; the message says what to change."""


# ---------------------------------------------------------------------------------------
# Declaring options
# ---------------------------------------------------------------------------------------


def opt(
    default: Any,
    help: str,
    *,
    choices: tuple | None = None,
    min: int | float | None = None,
    check: tuple[Callable[[Any], bool], str] | None = None,
) -> Any:
    """Declare one documented config field.

    Args:
        default: the default value; a list default is copied for every instance.
        help: a one-line description shown by ``--help``.
        choices: if given, the value must be one of these.
        min: if given, the value (each element, for a list) must be ``>= min``.
        check: ``(predicate, description)``; the value is valid when ``predicate(value)``
            is true, and ``description`` (e.g. ``"must be > 0"``) explains the rule.
    """
    metadata = {"help": help, "choices": choices, "min": min, "check": check}
    if isinstance(default, list):
        # Dataclasses forbid mutable defaults; give every instance its own copy.
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _positive(value: float) -> bool:
    return value > 0


def _fraction_below_one(value: float) -> bool:
    return 0 <= value < 1


def _fraction(value: float) -> bool:
    return 0 <= value <= 1


def _op_or_positive_int(value: str) -> bool:
    return value == "op" or (value.isdigit() and int(value) >= 1)


def _prefix_pairs(value: list[str]) -> bool:
    return all("=" in entry for entry in value)


def _unique(value: list) -> bool:
    return len(set(value)) == len(value)


def _zyx_positive(value: list[float]) -> bool:
    return len(value) == 3 and all(v > 0 for v in value)


def _minus_one_or_positive(value: int) -> bool:
    return value == -1 or value >= 1


def _empty_or_increasing_pair(value: list[float]) -> bool:
    return value == [] or (len(value) == 2 and value[0] < value[1])


# ---------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------


@dataclass
class Job:
    """Where the run writes its outputs and how it was configured."""

    config_file: str = opt("", "TOML file the configuration was loaded from ('' = none).")
    dump_folder: str = opt(
        "./outputs", "Folder for checkpoints, logs, visuals and the resolved config.toml."
    )
    description: str = opt("", "Free-text description of the run.")
    print_config: bool = opt(False, "Print the resolved configuration at startup.")


@dataclass
class Training:
    """The training loop: length, batch, seeding, parallelism and precision."""

    steps: int = opt(100, "Number of optimizer steps to train for.", min=1)
    batch_size: int = opt(
        8, "Global batch size, split evenly across the data-parallel ranks.", min=1
    )
    seed: int = opt(0, "Random seed for model init, sampling and augmentation.")
    deterministic: bool = opt(
        False, "Use deterministic algorithms (slower; for bitwise-reproducible runs)."
    )
    warmup_steps: int = opt(10, "Steps of linear LR warmup from 0 to optimizer.lr.", min=0)
    max_norm: float = opt(1.0, "Max gradient norm for clipping; <= 0 disables clipping.")
    data_parallel_shard_degree: int = opt(
        -1,
        "FSDP shard degree; -1 uses the rest of the world size.",
        check=(_minus_one_or_positive, "must be -1 or >= 1"),
    )
    data_parallel_replicate_degree: int = opt(
        1, "Data-parallel replicate degree (HSDP when > 1 with sharding, else DDP).", min=1
    )
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree.", min=1)
    compile: bool = opt(False, "Compile each transformer block with torch.compile.")
    mixed_precision_param: str = opt(
        "bfloat16",
        "Dtype of parameters in forward/backward (FSDP mixed precision).",
        choices=("bfloat16", "float32"),
    )
    mixed_precision_reduce: str = opt(
        "float32",
        "Dtype of the gradient reduction (FSDP mixed precision).",
        choices=("float32", "bfloat16"),
    )
    gc_freq: int = opt(50, "Run Python garbage collection every N steps.", min=1)
    preemption_signals: list[str] = opt(
        ["SIGTERM", "SIGUSR1"],
        "Signals that make the run save a checkpoint at the next step boundary and exit with "
        "the requeue code 3 (torchtitan.preemption.REQUEUE_EXIT_CODE); [] keeps the default "
        "actions. Under torchrun add SIGUSR1 to --signals_to_handle (helpers/slurm_launch.sh).",
        check=(lambda v: all(s in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
                             for s in v),
               "entries must be SIGTERM, SIGUSR1, SIGUSR2, SIGINT or SIGHUP"),
    )
    time_limit: str = opt(
        "", "Wall-clock limit 'HH:MM:SS' from launch (env TORCHTITAN_LAUNCH_TIME, else process "
        "start): when reached, save and exit with the requeue code as on a preemption signal; "
        "'' = none.",
        check=(lambda v: v == "" or (len(v.split(":")) == 3
                                     and all(x.isdigit() for x in v.split(":"))),
               "must be 'HH:MM:SS' or ''"),
    )
    max_skipped_steps: int = opt(
        5, "Stop the run after this many non-finite (NaN/Inf loss or gradient norm) steps in a "
        "row; each such step is skipped (no update).", min=1)


@dataclass
class Optimizer:
    """The optimizer and its hyperparameters."""

    name: str = opt("AdamW", "Optimizer.", choices=("AdamW", "Adam"))
    lr: float = opt(1e-3, "Peak learning rate (after warmup).", check=(_positive, "must be > 0"))
    weight_decay: float = opt(0.05, "Weight decay.", min=0)
    beta1: float = opt(
        0.9, "Adam beta1 (first-moment decay).", check=(_fraction_below_one, "must be in [0, 1)")
    )
    beta2: float = opt(
        0.95, "Adam beta2 (second-moment decay).", check=(_fraction_below_one, "must be in [0, 1)")
    )
    eps: float = opt(1e-8, "Adam epsilon.", check=(_positive, "must be > 0"))


@dataclass
class LRScheduler:
    """The learning-rate schedule after warmup."""

    decay_type: str = opt(
        "cosine", "Shape of the decay after warmup.", choices=("cosine", "linear", "constant")
    )
    min_lr_factor: float = opt(
        0.0, "Final LR as a fraction of optimizer.lr.", check=(_fraction, "must be in [0, 1]")
    )


@dataclass
class Checkpoint:
    """Saving, resuming and seeding from distributed checkpoints."""

    enable_checkpoint: bool = opt(True, "Save checkpoints and resume from the latest one.")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to job.dump_folder.")
    interval: int = opt(100, "Save a checkpoint every N steps (and at the last step).", min=1)
    keep_latest_k: int = opt(2, "Keep only the latest K checkpoints; 0 keeps all.", min=0)
    load_step: int = opt(-1, "Step to resume from; -1 resumes from the latest checkpoint.")
    initial_load_path: str = opt(
        "",
        "Seed checkpoint step folder, loaded only when the run has no checkpoint of its own.",
    )
    initial_load_model_only: bool = opt(
        True, "Load only the model weights from the seed checkpoint."
    )
    initial_load_prefix_map: list[str] = opt(
        [],
        "Key prefix renames for the seed checkpoint, 'old=new' (e.g. 'encoder.=backbone.').",
        check=(_prefix_pairs, "each entry must have the form 'old_prefix=new_prefix'"),
    )
    async_mode: str = opt(
        "disabled", "Save checkpoints in the background.", choices=("disabled", "async")
    )
    exclude_from_loading: list[str] = opt(
        [],
        "Parts of the initial_load_path checkpoint not restored when it is loaded whole "
        "(initial_load_model_only = false): model, optimizer, lr_scheduler, train_state, e.g. "
        "to restart the schedule from another run's weights. The run's own checkpoints are "
        "always resumed whole.",
        check=(lambda v: set(v) <= {"model", "optimizer", "lr_scheduler", "train_state"},
               "entries must be model, optimizer, lr_scheduler or train_state"),
    )
    last_save_model_only: bool = opt(
        False, "The final checkpoint holds only the model weights (in export_dtype)."
    )
    export_dtype: str = opt(
        "float32", "Weight dtype of a model-only final checkpoint.",
        choices=("float32", "bfloat16"),
    )
    create_seed_checkpoint: bool = opt(
        False,
        "Only initialise the model from training.seed, save it as checkpoint/step-0 and exit "
        "(run on one process; other runs then load it with initial_load_path).",
    )


@dataclass
class ActivationCheckpoint:
    """Activation checkpointing (recompute activations in backward to save memory)."""

    mode: str = opt("none", "Which blocks to checkpoint.", choices=("none", "full", "selective"))
    selective_ac_option: str = opt(
        "op",
        "Selective AC: an integer N checkpoints every N-th block; 'op' saves chosen ops.",
        check=(_op_or_positive_int, "must be 'op' or an integer >= 1"),
    )


@dataclass
class Metrics:
    """Logging and evaluation cadence."""

    log_freq: int = opt(10, "Log training metrics every N steps.", min=1)
    eval_freq: int = opt(
        100, "Evaluate every N steps; 0 disables periodic eval (the final eval still runs).",
        min=0,
    )
    enable_tensorboard: bool = opt(True, "Write TensorBoard event files.")
    save_tb_folder: str = opt("logs", "Log folder, relative to job.dump_folder.")
    progress_bar: bool = opt(
        True, "Show a progress bar on rank 0 when stderr is a terminal (else log lines)."
    )


@dataclass
class Data:
    """The dataset: where it is, which classes, how crops are sampled and split."""

    dataset_path: str = opt(
        "./data/demo",
        "Folder of <ds>/<ds>.zarr stores, or a split list: a .csv in cellmap-data's datasplit "
        "format or a .toml of [[train]] / [[val]] entries.",
    )
    classes: list[str] = opt(
        ["nuc", "mito", "er", "cell"],
        "Label classes to segment, one output channel each.",
        check=(_unique, "each class may appear only once"),
    )
    voxel_size: list[float] = opt(
        [8.0, 8.0, 8.0],
        "Voxel size to train at, (z, y, x) in nm.",
        check=(_zyx_positive, "must have 3 entries (z, y, x), each > 0"),
    )
    num_workers: int = opt(0, "Data loader worker processes per rank.", min=0)
    val_crops: list[str] = opt(
        [], "Validation crops, e.g. 'crop2' or 'jrc_synth-1/crop2' (empty: use val_fraction)."
    )
    val_fraction: float = opt(
        0.2,
        "Fraction of crops held out for validation when val_crops is empty.",
        check=(_fraction_below_one, "must be in [0, 1)"),
    )
    min_label_fraction: float = opt(
        1.0,
        "Fraction of each sample that must lie inside its label crop; below 1 samples may "
        "extend past the crop (EM context is read, labels there are invalid). A crop smaller "
        "than the sample is centred on it.",
        check=(_fraction, "must be in [0, 1]"),
    )
    foreground_threshold: float = opt(
        0.0,
        "MAE: redraw a sample's place (from its own generator, up to 16 times, keeping the "
        "best) until this fraction of its EM voxels is non-zero; 0 disables.",
        check=(_fraction, "must be in [0, 1]"),
    )
    class_balanced: bool = opt(
        False,
        "Segmentation: pick each sample's class uniformly first, then a training crop that "
        "annotates it (itself or all its parts) and a place around one of its voxels, so rare "
        "classes are seen as often as common ones.",
    )
    planes: str = opt(
        "z",
        "2D models: sample planes normal to z only ('z') or to z, y and x at random ('zyx'; "
        "needs an isotropic data.voxel_size).",
        choices=("z", "zyx"),
    )
    dataset_name: str = opt(
        "",
        "2D segmentation or MAE from a slices dataset (helpers/create_slice_dataset.py's, or the "
        "original project's, e.g. eminorhan/cellmap-2d; MAE: any with an image column): a "
        "save_to_disk folder or a Hugging Face Hub name; empty = read the zarr stores.",
    )
    max_resample: int = opt(
        10, "Replacement draws when reading a sample fails on a corrupt chunk (each logged "
        "with the array path and counted in the batch's 'resampled'); 0 = fail at once.",
        min=0,
    )
    em_range: list[float] = opt(
        [],
        "EM intensity range [min, max] mapped to the uint8 scale (min -> 0, max -> 255) for "
        "non-uint8 EM; empty = the range stored with the array (OME-NGFF 'omero' window), else "
        "the dtype's range for integer EM (float EM then needs this). Values outside are "
        "clipped, with one warning per dataset.",
        check=(_empty_or_increasing_pair, "must be empty or two numbers [min, max] with min < max"),
    )


@dataclass
class Augmentation:
    """Training augmentations, drawn per sample from its own generator and applied alike to
    EM, targets and validity masks (intensity changes touch EM only)."""

    flips: bool = opt(
        True, "Random flips of every axis and y/x transposes (where y and x have equal voxel "
        "and crop sizes)."
    )
    rot90: bool = opt(
        False, "Random multiples of 90 degrees in every plane whose two axes have equal voxel "
        "and crop sizes."
    )
    rotate_deg: float = opt(
        0.0, "Random rotation about z (2D: in the sample's plane) of up to this many degrees, "
        "by resampling a larger box: linear for EM, nearest for labels (0 disables).", min=0
    )
    scale: float = opt(
        0.0, "Random isotropic zoom in [1 - scale, 1 + scale] (in nm, so anisotropic voxels "
        "stay right), by resampling like rotate_deg (0 disables).",
        check=(_fraction_below_one, "must be in [0, 1)"),
    )
    contrast: float = opt(
        0.0, "Random contrast factor in [1 - contrast, 1 + contrast] (0 disables).",
        check=(_fraction_below_one, "must be in [0, 1)"),
    )
    gamma: float = opt(
        0.0, "Random gamma in [1 - gamma, 1 + gamma] (0 disables).",
        check=(_fraction_below_one, "must be in [0, 1)"),
    )
    noise_std: float = opt(0.0, "Std of additive Gaussian noise on normalised EM.", min=0)
    blur_sigma: float = opt(
        0.0, "Random Gaussian blur of EM with sigma up to this many voxels of the finest axis "
        "(the same width in nm on every axis; 0 disables).", min=0
    )
    resample_on: str = opt(
        "auto", "Where EM is interpolated for rotate_deg and scale: 'device' (the loader "
        "workers read the larger box, the GPU resamples it; far cheaper for the workers), "
        "'workers' (on the host, which on a CPU-only machine is faster than torch's CPU "
        "grid_sample), or 'auto' (device when training on a GPU). Labels are always moved in "
        "the workers; the slices dataset always resamples there.",
        choices=("auto", "device", "workers"),
    )


@dataclass
class Model:
    """The network: backbone, input geometry, MAE decoder and segmentation head."""

    backbone: str = opt("vit_tiny", "Backbone name in the model registry.")
    ndim: int = opt(2, "Spatial dimensions of the model input.", choices=(2, 3))
    in_chans: int = opt(1, "Input channels.", min=1)
    crop_size: list[int] = opt(
        [64, 64], "Input crop size in voxels, (z,) y, x order: 2 entries in 2D, 3 in 3D.", min=1
    )
    patch_size: int = opt(16, "Patch size of the ViT in voxels (same along every axis).", min=1)
    mask_ratio: float = opt(
        0.75, "MAE: fraction of patches masked.", check=(_fraction_below_one, "must be in [0, 1)")
    )
    decoder_dim: int = opt(256, "MAE: decoder embedding width.", min=1)
    decoder_depth: int = opt(2, "MAE: decoder transformer blocks.", min=1)
    decoder_num_heads: int = opt(8, "MAE: decoder attention heads.", min=1)
    norm_pix_loss: bool = opt(False, "MAE: normalize each target patch (per-patch mean/std).")
    head: str = opt(
        "linear",
        "Segmentation head: 'linear' (1x1 conv on patch features, logits resized), 'upconv' "
        "(x2 upsampling stages with a skip from the input, for thin structures) or "
        "'multiscale' (upconv with the input also encoded at 1/2 and 1/4 resolution and fused "
        "at those scales, UNETR-style).",
        choices=("linear", "upconv", "multiscale"),
    )
    head_channels: int = opt(
        64, "Segmentation 'upconv' and 'multiscale' heads: channels of the first stage.", min=1)
    loss: str = opt(
        "bce",
        "Segmentation loss: per-class 'bce', soft 'dice', 'bce_dice' (multi-label, per-class "
        "validity masks) or 'ce' (mutually exclusive classes, invalid voxels ignored).",
        choices=("bce", "dice", "bce_dice", "ce"),
    )
    class_weights: list[float] = opt(
        [], "Per-class loss weights in data.classes order; empty = all 1.", min=0
    )
    freeze_backbone: bool = opt(False, "Segmentation: train only the head (backbone frozen).")
    backbone_out_layers: str = opt(
        "four_even_intervals",
        "Backbone blocks whose outputs feed the segmentation head.",
        choices=("last", "four_last", "four_even_intervals"),
    )
    attention: str = opt(
        "sdpa", "Attention kernel ('auto' picks fa4 when available).",
        choices=("sdpa", "fa4", "auto"),
    )


@dataclass
class Inference:
    """Sliding-window prediction (validation during training and predict.py)."""

    overlap: float = opt(
        0.25, "Overlap of neighbouring windows, as a fraction of the window.",
        check=(_fraction_below_one, "must be in [0, 1)"),
    )
    blend: str = opt(
        "gaussian", "Blending of overlapping windows.", choices=("gaussian", "constant")
    )
    batch_size: int = opt(8, "Windows per forward pass (per rank).", min=1)
    threshold: float = opt(0.5, "Probability above which a voxel is foreground.",
                           check=(_fraction, "must be in [0, 1]"))
    tta_flips: bool = opt(
        False, "Test-time augmentation: average each window's probabilities over every "
        "combination of flips of its spatial axes (2D: 4, 3D: 8 forwards' worth of work, in "
        "one forward of a batch that many times larger).")
    planes: str = opt(
        "z", "2D models on 3D volumes: 'z' predicts yx planes along z; 'zyx' also predicts zx "
        "and zy planes and averages the three (isotropic data.voxel_size only; 3D models "
        "ignore it).", choices=("z", "zyx"))


@dataclass
class Comm:
    """Timeouts of the distributed process group."""

    init_timeout_seconds: int = opt(
        300, "Timeout for process-group setup and the first collectives.", min=1
    )
    train_timeout_seconds: int = opt(
        600, "Timeout for collectives once training runs.", min=1
    )


@dataclass
class JobConfig:
    """The whole configuration of a run: one attribute per TOML section."""

    job: Job = field(default_factory=Job)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    metrics: Metrics = field(default_factory=Metrics)
    data: Data = field(default_factory=Data)
    augmentation: Augmentation = field(default_factory=Augmentation)
    model: Model = field(default_factory=Model)
    inference: Inference = field(default_factory=Inference)
    comm: Comm = field(default_factory=Comm)


# ---------------------------------------------------------------------------------------
# Introspection of the dataclasses
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Option:
    """Everything known about one field, gathered from its declaration."""

    section: str
    name: str
    type: Any
    default: Any
    help: str
    choices: tuple | None
    min: int | float | None
    check: tuple[Callable[[Any], bool], str] | None

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


def _sections(config_cls: type) -> dict[str, type]:
    """Section name -> section dataclass, in declaration order."""
    hints = typing.get_type_hints(config_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_cls)}


def _options(section: str, section_cls: type) -> dict[str, _Option]:
    """Field name -> :class:`_Option` for one section, in declaration order."""
    hints = typing.get_type_hints(section_cls)
    options = {}
    for f in dataclasses.fields(section_cls):
        typ = hints[f.name]
        if typ not in _SCALAR_TYPES and typ not in _LIST_TYPES:
            raise TypeError(f"unsupported config field type {typ!r} for '{section}.{f.name}'")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        meta = f.metadata
        options[f.name] = _Option(
            section=section,
            name=f.name,
            type=typ,
            default=default,
            help=meta.get("help", ""),
            choices=meta.get("choices"),
            min=meta.get("min"),
            check=meta.get("check"),
        )
    return options


def _all_options(config_cls: type) -> dict[str, dict[str, _Option]]:
    """Section -> field -> :class:`_Option` for a whole config class."""
    return {name: _options(name, cls) for name, cls in _sections(config_cls).items()}


def _type_name(typ: Any) -> str:
    """Human name of a field type: 'int', 'list of str', ..."""
    if typ in _LIST_TYPES:
        return f"list of {_element_type(typ).__name__}"
    return typ.__name__


def _element_type(typ: Any) -> type:
    return typing.get_args(typ)[0]


def _location(where: str) -> str:
    """'in FILE' or 'on the command line', to finish a sentence."""
    return f"on {where}" if where == COMMAND_LINE else f"in {where}"


# ---------------------------------------------------------------------------------------
# Errors for unknown names
# ---------------------------------------------------------------------------------------


def _suggest(word: str, candidates: list[str]) -> str | None:
    matches = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None


def _unknown_section_error(
    section: str, options: dict[str, dict[str, _Option]], where: str
) -> ConfigError:
    message = f"unknown section '{section}' {_location(where)}"
    match = _suggest(section, list(options))
    if match:
        message += f"; did you mean '{match}'?"
    message += f" Valid sections: {', '.join(options)}."
    return ConfigError(message)


def _unknown_key_error(
    section: str, key: str, options: dict[str, dict[str, _Option]], where: str
) -> ConfigError:
    message = f"unknown key '{section}.{key}' {_location(where)}"
    match = _suggest(key, list(options[section]))
    if match:
        message += f"; did you mean '{section}.{match}'?"
    else:
        # A correctly spelled key in the wrong section (e.g. training.lr) is a common slip.
        homes = [s for s, fields in options.items() if key in fields]
        if homes:
            message += f"; did you mean '{homes[0]}.{key}'?"
    message += f" Valid keys of [{section}]: {', '.join(options[section])}."
    return ConfigError(message)


def _unsectioned_key_error(
    key: str, options: dict[str, dict[str, _Option]], where: str, what: str
) -> ConfigError:
    """Error for a bare name like ``steps`` that should be ``training.steps``."""
    full_keys = [o.key for fields in options.values() for o in fields.values()]
    homes = [o.key for fields in options.values() for o in fields.values() if o.name == key]
    match = homes[0] if homes else _suggest(key, full_keys)
    message = f"{what} {_location(where)}: options are named 'section.key'"
    if match:
        message += f"; did you mean '{match}'?"
    message += f" Valid sections: {', '.join(options)}."
    return ConfigError(message)


# ---------------------------------------------------------------------------------------
# Values: type conversion and per-field checks
# ---------------------------------------------------------------------------------------


def _bad_value(option: _Option, raw: Any, where: str, expected: str) -> ConfigError:
    return ConfigError(
        f"invalid value for '{option.key}' {_location(where)}: {raw!r} ({expected})"
    )


def _is_instance(value: Any, typ: type) -> bool:
    """Strict scalar type test: bool is not an int, and an int is a valid float."""
    if typ is bool:
        return isinstance(value, bool)
    if typ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, typ)


def _from_toml(option: _Option, raw: Any, where: str) -> Any:
    """Check a value read from TOML against the field type; ints become floats if needed."""
    typ = option.type
    if typ in _LIST_TYPES:
        elem = _element_type(typ)
        if not isinstance(raw, list) or not all(_is_instance(x, elem) for x in raw):
            got = type(raw).__name__
            if isinstance(raw, list):
                got = "list containing " + ", ".join(
                    sorted({type(x).__name__ for x in raw if not _is_instance(x, elem)})
                )
            raise _bad_value(option, raw, where, f"expected {_type_name(typ)}, got {got}")
        return [float(x) for x in raw] if elem is float else list(raw)
    if not _is_instance(raw, typ):
        raise _bad_value(
            option, raw, where, f"expected {_type_name(typ)}, got {type(raw).__name__}"
        )
    return float(raw) if typ is float else raw


def _parse_scalar(text: str, typ: type) -> Any:
    """Parse one command-line word as ``typ``; raises ValueError when it does not parse."""
    if typ is bool:
        word = text.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
        raise ValueError(text)
    if typ is int:
        return int(text)  # rejects '1.5' and '1e3': a float is no int
    if typ is float:
        return float(text)
    return text


def _from_cli(option: _Option, text: str) -> Any:
    """Parse a command-line string for ``option``; lists are comma-separated."""
    typ = option.type
    if typ in _LIST_TYPES:
        elem = _element_type(typ)
        if text.strip() == "":
            return []
        items = [item.strip() for item in text.split(",")]
        if any(item == "" for item in items):
            raise _bad_value(
                option, text, COMMAND_LINE,
                f"expected a comma-separated {_type_name(typ)} without empty entries",
            )
        try:
            return [_parse_scalar(item, elem) for item in items]
        except ValueError:
            raise _bad_value(
                option, text, COMMAND_LINE, f"expected a comma-separated {_type_name(typ)}"
            ) from None
    try:
        return _parse_scalar(text, typ)
    except ValueError:
        expected = f"expected {_type_name(typ)}"
        if typ is bool:
            expected += ": true/false, 1/0 or yes/no"
        raise _bad_value(option, text, COMMAND_LINE, expected) from None


def _non_finite(option: _Option, value: Any) -> bool:
    """Whether a float option's value (or an entry of a float list) is nan or +-inf."""
    if option.type not in (float, list[float]):
        return False
    values = value if isinstance(value, list) else [value]
    return not all(math.isfinite(v) for v in values)


def _rule_violation(option: _Option, value: Any) -> str | None:
    """Which rule declared with :func:`opt` a well-typed value breaks, or None."""
    if _non_finite(option, value):  # TOML has nan/inf literals; float() parses 'nan', 'inf'
        return "must be a finite number; nan and inf are not allowed"
    if option.choices is not None and value not in option.choices:
        violation = "allowed: " + ", ".join(repr(c) for c in option.choices)
        if isinstance(value, str):
            # Catch case slips ('adamw') and typos ('cosin') with a suggestion.
            by_lower = {str(c).lower(): str(c) for c in option.choices}
            match = by_lower.get(value.lower()) or _suggest(value, list(by_lower.values()))
            if match is not None:
                violation += f"; did you mean {match!r}?"
        return violation
    if option.min is not None:
        values = value if isinstance(value, list) else [value]
        if any(v < option.min for v in values):
            rule = "every entry must be" if isinstance(value, list) else "must be"
            return f"{rule} >= {option.min}"
    if option.check is not None:
        predicate, description = option.check
        if not predicate(value):
            return description
    return None


def _check_rules(option: _Option, value: Any, where: str) -> None:
    """Raise a ConfigError naming ``where`` if ``value`` breaks a rule of ``option``."""
    violation = _rule_violation(option, value)
    if violation is not None:
        raise _bad_value(option, value, where, violation)


# ---------------------------------------------------------------------------------------
# Reading TOML
# ---------------------------------------------------------------------------------------


def _read_toml(path: str) -> dict[str, Any]:
    """Load a TOML file, turning every I/O or syntax problem into a ConfigError."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file is a directory, not a TOML file: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not valid UTF-8 text: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML in {path}: {e}") from None


def _apply_toml(config: Any, data: dict[str, Any], path: str) -> None:
    """Set every value of a parsed TOML document on ``config`` (checked, in place)."""
    options = _all_options(type(config))
    for section, table in data.items():
        if section not in options:
            if not isinstance(table, dict):
                raise _unsectioned_key_error(section, options, path, f"key '{section}'")
            raise _unknown_section_error(section, options, path)
        if not isinstance(table, dict):
            raise ConfigError(
                f"'{section}' {_location(path)} must be a table ([{section}]), "
                f"got {type(table).__name__} {table!r}"
            )
        for key, raw in table.items():
            if key not in options[section]:
                raise _unknown_key_error(section, key, options, path)
            option = options[section][key]
            value = _from_toml(option, raw, path)
            _check_rules(option, value, path)
            setattr(getattr(config, section), key, value)


# ---------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------


def _lookup(name: str, options: dict[str, dict[str, _Option]], token: str) -> _Option:
    """Resolve 'section.key' given on the command line to its option."""
    section, dot, key = name.partition(".")
    if not dot:
        raise _unsectioned_key_error(name, options, COMMAND_LINE, f"unknown option '{token}'")
    if section not in options:
        raise _unknown_section_error(section, options, COMMAND_LINE)
    if key not in options[section]:
        raise _unknown_key_error(section, key, options, COMMAND_LINE)
    return options[section][key]


def _parse_overrides(
    args: list[str], options: dict[str, dict[str, _Option]]
) -> list[tuple[_Option, Any]]:
    """Turn ``--section.key value`` arguments into a list of (option, typed value).

    Accepted forms: ``--s.k value``, ``--s.k=value``; for booleans also ``--s.k`` (true),
    ``--no-s.k`` (false) and ``--s.k true|false``. Later repeats of a key win.
    """
    overrides = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("--") or token == "--":
            raise ConfigError(
                f"unexpected argument {token!r} on {COMMAND_LINE}; "
                "options have the form --section.key VALUE (see --help)"
            )
        name, has_value, text = token[2:].partition("=")
        negated = name.startswith("no-")
        option = _lookup(name[3:] if negated else name, options, token)

        if negated:
            if option.type is not bool:
                raise ConfigError(
                    f"'{token}' on {COMMAND_LINE}: the --no- form only applies to booleans, "
                    f"and '{option.key}' is {_type_name(option.type)}"
                )
            if has_value:
                raise ConfigError(
                    f"'{token}' on {COMMAND_LINE}: --no-{option.key} takes no value"
                )
            value = False
        elif has_value:
            value = _from_cli(option, text)
        elif option.type is bool:
            # A bare flag means true; a following word that is not an option is its value.
            if i < len(args) and not args[i].startswith("--"):
                value = _from_cli(option, args[i])
                i += 1
            else:
                value = True
        else:
            if i >= len(args) or args[i].startswith("--"):
                raise ConfigError(
                    f"missing value for '{option.key}' on {COMMAND_LINE} "
                    f"(expected {_type_name(option.type)}; use --{option.key}=VALUE for a "
                    "value that starts with '--')"
                )
            value = _from_cli(option, args[i])
            i += 1
        _check_rules(option, value, COMMAND_LINE)
        overrides.append((option, value))
    return overrides


class ConfigManager:
    """Builds a validated :class:`JobConfig` from defaults, a TOML file and the CLI.

    Args:
        config_cls: the top-level config dataclass; a subclass of :class:`JobConfig` may add
            sections for a new task.
    """

    def __init__(self, config_cls: type = JobConfig):
        self.config_cls = config_cls
        self.config: Any = None

    def parse_args(self, args: list[str] | None = None) -> JobConfig:
        """Parse ``args`` (default: ``sys.argv[1:]``) and return the validated config.

        ``--help``/``-h`` prints every option and exits with status 0.
        """
        args = sys.argv[1:] if args is None else list(args)
        if "--help" in args or "-h" in args:
            print(help_text(self.config_cls))
            sys.exit(0)

        options = _all_options(self.config_cls)
        overrides = _parse_overrides(args, options)

        config = self.config_cls()
        # The TOML file is named on the command line, so find it before applying the rest.
        config_file = ""
        for option, value in overrides:
            if option.key == "job.config_file":
                config_file = value
        if config_file:
            _apply_toml(config, _read_toml(config_file), config_file)
        for option, value in overrides:
            setattr(getattr(config, option.section), option.name, value)

        validate(config)
        if os.environ.get("RANK", "0") == "0":
            for text in config_warnings(config):
                logging.getLogger("torchtitan").warning(text)
        self.config = config
        return config


# ---------------------------------------------------------------------------------------
# Validation of a whole config
# ---------------------------------------------------------------------------------------


def _field_problems(config: Any) -> list[str]:
    """Type and per-field rule violations (matters for configs built in code)."""
    problems = []
    for section, fields in _all_options(type(config)).items():
        for name, option in fields.items():
            value = getattr(getattr(config, section), name)
            if option.type in _LIST_TYPES:
                elem = _element_type(option.type)
                ok = isinstance(value, list) and all(_is_instance(x, elem) for x in value)
            else:
                ok = _is_instance(value, option.type)
            if not ok:
                problems.append(
                    f"'{option.key}' = {value!r} (expected {_type_name(option.type)})"
                )
                continue
            violation = _rule_violation(option, value)
            if violation is not None:
                problems.append(f"'{option.key}' = {value!r} ({violation})")
    return problems


def _cross_field_problems(config: JobConfig) -> list[str]:
    """Rules that relate several fields; none of them needs to know the hardware.

    Runs only on well-typed configs whose single-field rules hold (e.g. patch_size >= 1).
    """
    problems = []
    model = config.model

    if len(model.crop_size) != model.ndim:
        axes = "(y, x)" if model.ndim == 2 else "(z, y, x)"
        problems.append(
            f"'model.crop_size' = {model.crop_size} has {len(model.crop_size)} entries but "
            f"'model.ndim' = {model.ndim}; give one size per spatial axis {axes}"
        )
    not_multiple = [s for s in model.crop_size if s % model.patch_size]
    if not_multiple:
        problems.append(
            f"'model.crop_size' = {model.crop_size} is not a multiple of 'model.patch_size' "
            f"= {model.patch_size} (offending sizes: {not_multiple})"
        )
    if model.decoder_dim % model.decoder_num_heads:
        problems.append(
            f"'model.decoder_dim' = {model.decoder_dim} is not divisible by "
            f"'model.decoder_num_heads' = {model.decoder_num_heads}"
        )
    if (model.ndim == 2 and config.inference.planes == "zyx"
            and len(set(config.data.voxel_size)) > 1):
        problems.append(
            f"'inference.planes' = 'zyx' runs the 2D model on zx and zy planes too, which needs "
            f"an isotropic 'data.voxel_size' (got {config.data.voxel_size}); use planes = 'z'"
        )
    if (model.ndim == 2 and config.data.planes == "zyx"
            and len(set(config.data.voxel_size)) > 1):
        problems.append(
            f"'data.planes' = 'zyx' samples zx and zy planes too, which needs an isotropic "
            f"'data.voxel_size' (got {config.data.voxel_size}); use planes = 'z'"
        )
    if model.class_weights and len(model.class_weights) != len(config.data.classes):
        problems.append(
            f"'model.class_weights' has {len(model.class_weights)} entries but 'data.classes' "
            f"has {len(config.data.classes)} ({', '.join(config.data.classes)}); give one weight "
            "per class, or none"
        )
    problems += _ineffective_option_problems(config)
    return problems


def _ineffective_option_problems(config: JobConfig) -> list[str]:
    """Combinations in which an option set by the user could not take effect."""
    problems = []
    ckpt = config.checkpoint
    if config.lr_scheduler.decay_type == "constant" and config.lr_scheduler.min_lr_factor > 0:
        problems.append(
            f"'lr_scheduler.min_lr_factor' = {config.lr_scheduler.min_lr_factor} has no effect "
            "with 'lr_scheduler.decay_type' = 'constant' (the LR never decays); use 'cosine' or "
            "'linear', or leave min_lr_factor at 0"
        )
    if ckpt.initial_load_prefix_map and ckpt.initial_load_path and not ckpt.initial_load_model_only:
        problems.append(
            f"'checkpoint.initial_load_prefix_map' = {ckpt.initial_load_prefix_map} has no effect "
            "with 'checkpoint.initial_load_model_only' = false (a full checkpoint is restored "
            "under its own keys); set initial_load_model_only = true to rename the model's keys"
        )
    if ckpt.export_dtype != "float32" and not ckpt.last_save_model_only:
        problems.append(
            f"'checkpoint.export_dtype' = {ckpt.export_dtype!r} has no effect unless "
            "'checkpoint.last_save_model_only' = true (it sets the dtype of that export)"
        )
    if config.data.em_range and config.data.dataset_name:
        problems.append(
            f"'data.em_range' = {config.data.em_range} has no effect with 'data.dataset_name' = "
            f"{config.data.dataset_name!r} (a slices dataset holds uint8 images); leave it empty"
        )
    return problems


def config_warnings(config: JobConfig) -> list[str]:
    """Legal but probably unintended combinations, logged once at startup.

    ``training.warmup_steps > training.steps`` stays legal: a run is extended by resuming it
    with a larger ``training.steps`` (the warmup is unchanged while it lasts), and debug runs
    shorten a config with ``--training.steps``.
    """
    out = []
    training = config.training
    if training.warmup_steps > training.steps:
        out.append(
            f"'training.warmup_steps' = {training.warmup_steps} is more than 'training.steps' = "
            f"{training.steps}: the learning rate never reaches its peak 'optimizer.lr' = "
            f"{config.optimizer.lr:g} in this run (fine when the run is extended later by "
            "resuming with a larger training.steps)"
        )
    return out


def validate(config: JobConfig) -> None:
    """Check a whole config; raise one ConfigError that lists every problem found.

    Covers field types and the rules declared with :func:`opt` (again, for configs built in
    code) plus cross-field rules. Rules that need the world size (e.g. batch size divisible
    by the data-parallel degree) are checked where the device mesh is built.
    """
    problems = _field_problems(config)
    if not problems:  # cross-field rules assume well-typed fields
        problems = _cross_field_problems(config)
    if problems:
        source = config.job.config_file
        where = f" (config file: {source})" if source else ""
        raise ConfigError(
            f"invalid configuration{where}:\n" + "\n".join(f"  - {p}" for p in problems)
        )


# ---------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------


def config_to_dict(config: JobConfig) -> dict[str, dict[str, Any]]:
    """``{section: {key: value}}``, a deep copy safe to modify or serialize."""
    return dataclasses.asdict(config)


def config_to_toml(config: JobConfig) -> str:
    """The config as a TOML document that ``--job.config_file`` loads back unchanged."""
    header = "# Resolved configuration of a run; load it with --job.config_file.\n\n"
    return header + tomli_w.dumps(config_to_dict(config))


def save_config(config: JobConfig, path: str | os.PathLike) -> None:
    """Write the config as TOML to ``path`` atomically.

    The text goes to a temporary file in the same folder which then replaces ``path``, so a
    reader never sees a half-written file even if the job dies mid-write.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(dir=folder, prefix=".config-", suffix=".toml.tmp")
    try:
        os.chmod(tmp_path, 0o644)  # mkstemp makes the file private; a config is not
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(config_to_toml(config))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


# ---------------------------------------------------------------------------------------
# Launch history and resume compatibility
# ---------------------------------------------------------------------------------------

# Keys that decide the model's parameters (their names and shapes) or what its output channels
# mean: a run's checkpoints only fit a model built with the same values. Per task; others
# (lr, steps, crop_size, loss, augmentation, ...) may change between launches of one run.
MODEL_SHAPING_KEYS: dict[str, tuple[str, ...]] = {
    "segmentation": ("model.backbone", "model.ndim", "model.in_chans", "model.patch_size",
                     "data.classes", "model.head", "model.head_channels",
                     "model.backbone_out_layers"),
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


def _dotted(values: dict[str, dict[str, Any]], key: str) -> Any:
    section, name = key.split(".", 1)
    return values.get(section, {}).get(name, _MISSING)


_MISSING = object()


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
    old = _read_toml(previous)
    new = config_to_dict(config)
    changed = []
    for key in MODEL_SHAPING_KEYS.get(task, ()):
        before, after = _dotted(old, key), _dotted(new, key)
        if before is not _MISSING and before != after:  # a key older configs lack: not compared
            changed.append(f"{key}: {_format_value(before)} -> {_format_value(after)}")
    if changed:
        raise ConfigError(
            f"cannot resume the run in {dump_folder}: its checkpoints hold a different model. "
            f"Changed since {previous}: " + "; ".join(changed) + ". Put these values back to "
            "resume, or start a new job.dump_folder (with checkpoint.initial_load_path pointing "
            "at this run's checkpoint folder to warm-start from its weights)"
        )


# ---------------------------------------------------------------------------------------
# Help
# ---------------------------------------------------------------------------------------


def _format_value(value: Any) -> str:
    """A value as it would be written in TOML (for --help)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_format_value(v) for v in value) + "]"
    return repr(value)


def _option_help(option: _Option) -> list[str]:
    """The lines describing one option in ``--help``."""
    if option.type is bool:
        usage = f"--{option.key}, --no-{option.key}"
    else:
        usage = f"--{option.key} {_type_name(option.type).upper().replace(' ', '_')}"
    details = [f"default: {_format_value(option.default)}"]
    if option.choices is not None:
        details.append("choices: " + ", ".join(_format_value(c) for c in option.choices))
    if option.min is not None:
        details.append(f">= {option.min}")
    if option.check is not None:
        details.append(option.check[1])
    text = f"{option.help} ({'; '.join(details)})"
    wrapped = textwrap.wrap(text, width=88, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return [f"  {usage}", *wrapped]


def help_text(config_cls: type = JobConfig) -> str:
    """The ``--help`` text: every section and option with type, default, choices and doc."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
    lines = [
        f"usage: {prog} [-h] [--job.config_file FILE] [--section.key VALUE ...]",
        "",
        "Each option is read from its default, then from the TOML file given by",
        "--job.config_file, then from the command line; later sources win.",
        "  values:   --section.key VALUE or --section.key=VALUE",
        "  lists:    comma-separated, e.g. --data.classes nuc,mito ('' gives an empty list)",
        "  booleans: --section.key, --no-section.key, or --section.key true|false (1/0, yes/no)",
    ]
    for section, section_cls in _sections(config_cls).items():
        doc = (section_cls.__doc__ or "").strip().splitlines()
        lines += ["", f"[{section}]" + (f"  {doc[0]}" if doc else "")]
        for option in _options(section, section_cls).values():
            lines += _option_help(option)
    return "\n".join(lines)
