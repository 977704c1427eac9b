"""Checks of a whole configuration that are ours, not a parser's: rules that relate several
options (crop size vs. patch size, class weights vs. classes, ...), options that could not
take effect, and startup warnings. (A run's launch history in its dump folder is
:mod:`torchtitan.run.launch_history`.)

Floor 1: imports only the standard library, the other config modules and the ground floor.
``config`` below is a ``job_config.JobConfig``; this module does not import ``manager``, which
imports it.
"""

from __future__ import annotations

from torchtitan.choices import HEAD_IMAGE_LEVELS, MULTI_LABEL_LOSSES, is_isotropic, parse_offset
from torchtitan.config.context_parallel import config_problems as cp_config_problems
from torchtitan.config.parsing import field_problems
from torchtitan.errors import ConfigError


# ---------------------------------------------------------------------------------------
# Validation of a whole config
# ---------------------------------------------------------------------------------------


def _cross_field_problems(config) -> list[str]:
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
    if model.head_image_levels:
        most = model.patch_size.bit_length()  # log2(patch_size) + 1 for a power of two
        if model.head not in HEAD_IMAGE_LEVELS:
            problems.append(
                f"'model.head_image_levels' = {model.head_image_levels} applies to the "
                f"{' and '.join(map(repr, HEAD_IMAGE_LEVELS))} heads, not '{model.head}'; set it to 0 or change "
                "'model.head'")
        elif model.head_image_levels > most:
            problems.append(
                f"'model.head_image_levels' = {model.head_image_levels} goes past the patch "
                f"grid: with 'model.patch_size' = {model.patch_size} the image can be fused "
                f"at most at {most} resolutions (full size down to 1/{model.patch_size}); "
                f"use 1..{most}")
    if model.decoder_dim % model.decoder_num_heads:
        problems.append(
            f"'model.decoder_dim' = {model.decoder_dim} is not divisible by "
            f"'model.decoder_num_heads' = {model.decoder_num_heads}"
        )
    anisotropic = not is_isotropic(config.data.voxel_size)
    for key, planes, what in (("inference.planes", config.inference.planes, "runs the 2D model on"),
                              ("data.planes", config.data.planes, "samples")):
        if model.ndim == 2 and planes == "zyx" and anisotropic:
            problems.append(
                f"'{key}' = 'zyx' {what} zx and zy planes too, which needs an isotropic "
                f"'data.voxel_size' (got {config.data.voxel_size}); use planes = 'z'")
    if model.class_weights and len(model.class_weights) != len(config.data.classes):
        problems.append(
            f"'model.class_weights' has {len(model.class_weights)} entries but 'data.classes' "
            f"has {len(config.data.classes)} ({', '.join(config.data.classes)}); give one weight "
            "per class, or none"
        )
    unknown = [c for c in config.inference.fill_holes_classes if c not in config.data.classes]
    if unknown:
        problems.append(
            f"'inference.fill_holes_classes' names {unknown}, which 'data.classes' does not hold "
            f"({', '.join(config.data.classes)}); name classes the model predicts, or none (= all)"
        )
    problems += _affinity_problems(config)
    problems += _context_parallel_problems(config)
    problems += _ineffective_option_problems(config)
    return problems


def _affinity_problems(config) -> list[str]:
    """Affinity targets: of predicted classes, along offsets that fit the model's crop, with a
    loss that scores each channel on its own."""
    aff, model = config.affinities, config.model
    problems = []
    unknown = [c for c in aff.classes if c not in config.data.classes]
    if unknown:
        problems.append(
            f"'affinities.classes' names {unknown}, which 'data.classes' does not hold "
            f"({', '.join(config.data.classes)}); add them there (their masks are predicted "
            "too) or remove them")
    if aff.offsets and not aff.classes:
        problems.append(
            f"'affinities.offsets' = {aff.offsets} has no effect with 'affinities.classes' "
            "empty; name the instance classes whose affinities to predict, or remove the offsets")
    if aff.boundary:
        problems += _boundary_problems(config)
    if not aff.classes:
        return problems
    if model.loss not in MULTI_LABEL_LOSSES:
        problems.append(
            f"'affinities.classes' = {aff.classes} needs a multi-label loss (each channel its "
            f"own sigmoid), not 'model.loss' = {model.loss!r}; use one of "
            f"{', '.join(map(repr, MULTI_LABEL_LOSSES))}")
    axes = "y:x" if model.ndim == 2 else "z:y:x"
    for text in aff.offsets:
        offset = parse_offset(text)
        if len(offset) != model.ndim:
            problems.append(
                f"'affinities.offsets' entry {text!r} has {len(offset)} entries but "
                f"'model.ndim' = {model.ndim}; write each offset as '{axes}'")
        elif any(abs(o) >= c for o, c in zip(offset, model.crop_size)):
            problems.append(
                f"'affinities.offsets' entry {text!r} reaches past 'model.crop_size' = "
                f"{model.crop_size}: no voxel of a training window would have its partner "
                "inside it; use offsets shorter than the crop on every axis")
    cut = config.inference.affinity_cut
    if cut == "mutex_graph" and aff.offsets:
        units = {tuple(int(a == axis) for a in range(model.ndim)) for axis in range(model.ndim)}
        given = {parse_offset(t) for t in aff.offsets}
        if not units <= given:
            problems.append(
                f"'inference.affinity_cut' = {cut!r} cuts fragments from the face-neighbour "
                f"affinities, but 'affinities.offsets' = {aff.offsets} lacks "
                f"{sorted(':'.join(map(str, u)) for u in units - given)}; add them")
    if model.ndim == 2 and config.inference.planes == "zyx":
        problems.append(
            f"'inference.planes' = 'zyx' averages a 2D model's outputs on yx, zx and zy planes, "
            f"but its affinity channels ('affinities.classes' = {aff.classes}) are along its "
            "own plane's axes, which differ between those planes; use planes = 'z'")
    return problems


def _boundary_problems(config) -> list[str]:
    """``affinities.boundary``: a semantic class taken from one class's face affinities."""
    aff, model = config.affinities, config.model
    name = f"'affinities.boundary' = {aff.boundary!r}"
    if aff.boundary not in config.data.classes:
        return [f"{name} is not in 'data.classes' ({', '.join(config.data.classes)}); name the "
                "boundary class the model predicts (e.g. 'pm'), or leave it empty"]
    if aff.boundary in aff.classes:
        return [f"{name} is a class of 'affinities.classes' (objects); the boundary is the "
                "semantic class where they meet (e.g. 'pm')"]
    problems = []
    if len(aff.classes) != 1:
        problems.append(f"{name} is taken from the affinities of one class, but "
                        f"'affinities.classes' = {aff.classes}; name exactly one (e.g. ['cell'])")
    if aff.offsets:
        units = {tuple(int(a == axis) for a in range(model.ndim)) for axis in range(model.ndim)}
        missing = units - {parse_offset(t) for t in aff.offsets}
        if missing:
            problems.append(f"{name} needs the face-neighbour affinities, but 'affinities.offsets'"
                            f" = {aff.offsets} lacks "
                            f"{sorted(':'.join(map(str, u)) for u in missing)}; add them")
    if model.head == "linear":
        problems.append(f"{name} needs full-resolution logits: use a convolutional "
                        "'model.head' ('upconv' or 'multiscale'), not 'linear'")
    return problems


def _context_parallel_problems(config) -> list[str]:
    """Where ``training.context_parallel_degree`` cannot split the token sequence (the rules
    are :mod:`torchtitan.config.context_parallel`'s)."""
    model = config.model
    return cp_config_problems(config.training.context_parallel_degree,
                              tensor_parallel=config.training.tensor_parallel_degree,
                              ndim=model.ndim, crop_size=model.crop_size,
                              patch_size=model.patch_size, loss=model.loss)


def _ineffective_option_problems(config) -> list[str]:
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
    if config.inference.fill_holes_classes and config.inference.fill_holes == "none":
        problems.append(
            f"'inference.fill_holes_classes' = {config.inference.fill_holes_classes} has no effect "
            "with 'inference.fill_holes' = 'none'; set fill_holes = 'planes' or 'volume', or "
            "leave fill_holes_classes empty"
        )
    if config.data.em_range and config.data.dataset_name:
        problems.append(
            f"'data.em_range' = {config.data.em_range} has no effect with 'data.dataset_name' = "
            f"{config.data.dataset_name!r} (a slices dataset holds uint8 images); leave it empty"
        )
    if config.data.train_label_fraction < 1 and config.data.dataset_name:
        problems.append(
            f"'data.train_label_fraction' = {config.data.train_label_fraction} has no effect "
            f"with 'data.dataset_name' = {config.data.dataset_name!r} (it limits the sections "
            "of zarr label crops); leave it at 1"
        )
    return problems


def config_warnings(config) -> list[str]:
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


def validate(config) -> None:
    """Check a whole config; raise one ConfigError that lists every problem found.

    Covers field types and the rules declared with :func:`opt` (again, for configs built in
    code) plus cross-field rules. Rules that need the world size (e.g. batch size divisible
    by the data-parallel degree) are checked where the device mesh is built.
    """
    problems = field_problems(config)
    if not problems:  # cross-field rules assume well-typed fields
        problems = _cross_field_problems(config)
    if problems:
        source = config.job.config_file
        where = f" (config file: {source})" if source else ""
        raise ConfigError(
            f"invalid configuration{where}:\n" + "\n".join(f"  - {p}" for p in problems)
        )
