"""The schema of a job's configuration: one documented dataclass per TOML section.

Every option of a run is one field of a small dataclass, one dataclass per TOML section
(``[training]``, ``[optimizer]``, ...), all gathered in :class:`JobConfig`. Each field is
declared with :func:`~torchtitan.config.parsing.opt`, which records its default, a one-line
doc, and optionally the allowed choices or a range check. That single declaration drives
``--help``, type conversion of TOML and command-line values, and the error messages;
:class:`~torchtitan.config.manager.ConfigManager` reads a TOML file and the command line
into it.

Floor 1: the standard library, the ground floor (``choices``) and the config's parsing.
"""

from dataclasses import dataclass, field
from typing import ClassVar

from torchtitan.choices import (AFFINITY_CUTS, ATTENTION_BACKENDS, HEADS, LOSSES,
                                OUT_LAYER_SETS, PLANES, PROBABILITY_THRESHOLD, parse_offset)
from torchtitan.config.parsing import Rule, opt

# Rules shared by several options: (predicate, what a valid value is).
POSITIVE: Rule = (lambda v: v > 0, "must be > 0")
FRACTION: Rule = (lambda v: 0 <= v <= 1, "must be in [0, 1]")
BELOW_ONE: Rule = (lambda v: 0 <= v < 1, "must be in [0, 1)")


def _entries_in(*allowed: str) -> Rule:
    """Every entry of a list option must be one of ``allowed``."""
    return (lambda v: set(v) <= set(allowed),
            f"entries must be {', '.join(allowed[:-1])} or {allowed[-1]}")


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
    seed: int = opt(0, "Random seed for model init, sampling and augmentation.",
                    check=(lambda v: 0 <= v < 2**64, "must be in [0, 2^64 - 1] (torch's seeds)"))
    deterministic: bool = opt(
        False, "Use deterministic algorithms (slower; for bitwise-reproducible runs)."
    )
    warmup_steps: int = opt(10, "Steps of linear LR warmup from 0 to optimizer.lr.", min=0)
    max_norm: float = opt(1.0, "Max gradient norm for clipping; <= 0 disables clipping.")
    data_parallel_shard_degree: int = opt(
        -1,
        "FSDP shard degree; -1 uses the rest of the world size.",
        check=(lambda v: v == -1 or v >= 1, "must be -1 or >= 1"),
    )
    data_parallel_replicate_degree: int = opt(
        1, "Data-parallel replicate degree (HSDP when > 1 with sharding, else DDP).", min=1
    )
    tensor_parallel_degree: int = opt(1, "Tensor-parallel degree.", min=1)
    context_parallel_degree: int = opt(
        1,
        "Context-parallel degree: the ranks of a group train on the same samples, each on an "
        "equal slab of every sample's patch tokens (along the first spatial axis of the patch "
        "grid); attention gathers keys and values across the group. For 3D models whose token "
        "sequences do not fit one device; combines with FSDP/HSDP, not with TP.",
        min=1,
    )
    compile: bool = opt(False, "Compile each transformer block with torch.compile.")
    mixed_precision_param: str = opt(
        "bfloat16",
        "Dtype of parameters in forward/backward (FSDP mixed precision). On a CPU, bfloat16 "
        "pays only where the CPU has bf16 instructions (the trainer warns where it has none).",
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
        "the requeue code 3 (torchtitan.run.preemption.REQUEUE_EXIT_CODE); [] keeps the default "
        "actions. Under torchrun add SIGUSR1 to --signals_to_handle (helpers/slurm_launch.sh).",
        check=_entries_in("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"),
    )
    time_limit: str = opt(
        "", "Wall-clock limit 'HH:MM:SS' from launch (env TORCHTITAN_LAUNCH_TIME, else process "
        "start): when reached, save and exit with the requeue code as on a preemption signal; "
        "'' = none.",
        check=(lambda v: v == "" or (len(v.split(":")) == 3
                                     and all(x.isdigit() for x in v.split(":"))),
               "must be 'HH:MM:SS' or ''"),
    )
    time_budget_s: float = opt(
        0.0, "Seconds of training in this launch, counted from its first step: the run stops at "
        "the first step boundary past which another step would end beyond them (judged by the "
        "mean step so far), then saves and validates as at its last step and exits 0, "
        "finished. The LR schedule still spans training.steps (with decay_type = 'constant' "
        "it does not matter where the run stops). For a run sized by the time it may take "
        "rather than by steps (a budget on a shared machine; models compared at equal "
        "wall-clock time, as bench/quality.py --budget does); 0 = none.", min=0)
    ema_decay: float = opt(
        0.0, "Exponential moving average of the weights (EMA), updated after every optimizer "
        "step with this decay (warmed up as timm does: min(decay, (1 + n) / (10 + n)) after n "
        "updates); 0 = none. With it, validation scores the averaged weights, and checkpoints "
        "hold them as the model (what predict.py, exports, seeds and fine-tuning read) beside "
        "the trained weights, from which training resumes.",
        check=(lambda v: 0.0 <= v < 1.0, "must lie in [0, 1)"))
    max_skipped_steps: int = opt(
        5, "Stop the run after this many non-finite (NaN/Inf loss or gradient norm) steps in a "
        "row; each such step is skipped (no update).", min=1)


@dataclass
class Optimizer:
    """The optimizer and its hyperparameters."""

    name: str = opt("AdamW", "Optimizer.", choices=("AdamW", "Adam"))
    lr: float = opt(1e-3, "Peak learning rate (after warmup).", check=POSITIVE)
    weight_decay: float = opt(0.05, "Weight decay.", min=0)
    beta1: float = opt(0.9, "Adam beta1 (first-moment decay).", check=BELOW_ONE)
    beta2: float = opt(0.95, "Adam beta2 (second-moment decay).", check=BELOW_ONE)
    eps: float = opt(1e-8, "Adam epsilon.", check=POSITIVE)
    layer_decay: float = opt(
        1.0, "Layer-wise LR decay for fine-tuning (BEiT/MAE): the backbone's block i of L gets "
        "lr * layer_decay^(L - i), its embeddings lr * layer_decay^(L + 1); the head and the "
        "final norm get lr. 1 = off; 0.65-0.85 is usual after pretraining.",
        check=FRACTION,
    )


@dataclass
class LRScheduler:
    """The learning-rate schedule after warmup."""

    decay_type: str = opt(
        "cosine", "Shape of the decay after warmup.", choices=("cosine", "linear", "constant")
    )
    min_lr_factor: float = opt(
        0.0, "Final LR as a fraction of optimizer.lr.", check=FRACTION
    )
    backbone_frozen_steps: int = opt(
        0, "Segmentation fine-tuning: the backbone's LR is 0 for this many first steps (the "
        "head learns on the frozen, e.g. MAE-pretrained, encoder), then ramps up linearly over "
        "training.warmup_steps into the schedule; 0 = off.", min=0)


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
        check=(lambda v: all("=" in e for e in v),
               "each entry must have the form 'old_prefix=new_prefix'"),
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
        check=_entries_in("model", "optimizer", "lr_scheduler", "train_state"),
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
        check=(lambda v: v == "op" or (v.isdigit() and int(v) >= 1),
               "must be 'op' or an integer >= 1"),
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
        check=(lambda v: len(set(v)) == len(v), "each class may appear only once"),
    )
    voxel_size: list[float] = opt(
        [8.0, 8.0, 8.0],
        "Voxel size to train at, (z, y, x) in nm.",
        check=(lambda v: len(v) == 3 and min(v) > 0, "must have 3 entries (z, y, x), each > 0"),
    )
    num_workers: int = opt(0, "Data loader worker processes per rank.", min=0)
    val_crops: list[str] = opt(
        [], "Validation crops, e.g. 'crop2' or 'jrc_synth-1/crop2' (empty: use val_fraction). "
        "MAE: their EM is held out of pretraining and scores its reconstruction (empty: a "
        "separate stream of crops of all the EM)."
    )
    val_fraction: float = opt(
        0.2,
        "Fraction of crops held out for validation when val_crops is empty.",
        check=BELOW_ONE,
    )
    min_label_fraction: float = opt(
        1.0,
        "Fraction of each sample that must lie inside its label crop; below 1 samples may "
        "extend past the crop (EM context is read, labels there are invalid). A crop smaller "
        "than the sample is centred on it.",
        check=FRACTION,
    )
    train_label_fraction: float = opt(
        1.0, "Segmentation: the fraction of each training crop's sections (z planes of the "
        "training grid; at least one) whose labels are used, a slab in the middle of the crop; "
        "the rest is unannotated (its EM is still read as context). To learn how many labels "
        "your EM needs, and whether MAE pretraining pays for it, before annotating more "
        "(docs/benchmarks/label_efficiency.md); 1 = all labels.", check=(lambda v: 0 < v <= 1, "must be in (0, 1]"))
    foreground_threshold: float = opt(
        0.0,
        "MAE: redraw a sample's place (from its own generator, up to 16 times, keeping the "
        "best) until this fraction of its EM voxels is non-zero; 0 disables.",
        check=FRACTION,
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
        choices=PLANES,
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
        check=(lambda v: v == [] or (len(v) == 2 and v[0] < v[1]),
               "must be empty or two numbers [min, max] with min < max"),
    )
    cache_mb: int = opt(
        256,
        "Chunk cache of arrays read with TensorStore (remote s3:// gs:// http(s):// stores, "
        "sharded zarr, N5), MiB per process (each loader worker has its own); 0 = no cache.",
        min=0,
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
        check=BELOW_ONE,
    )
    contrast: float = opt(
        0.0, "Random contrast factor in [1 - contrast, 1 + contrast] (0 disables).",
        check=BELOW_ONE,
    )
    gamma: float = opt(
        0.0, "Random gamma in [1 - gamma, 1 + gamma] (0 disables).",
        check=BELOW_ONE,
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
        0.75, "MAE: fraction of patches masked.", check=BELOW_ONE
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
        choices=HEADS,
    )
    head_channels: int = opt(
        64, "Segmentation 'upconv' and 'multiscale' heads: channels of the first stage.", min=1)
    head_min_channels: int = opt(
        16, "Segmentation 'upconv' and 'multiscale' heads: the narrowest decoder width (the "
        "channels halve per x2 upsampling down to this; it is the width at full resolution) "
        "and the width of the image skip at full resolution.", min=1)
    head_image_levels: int = opt(
        0, "Segmentation 'upconv' and 'multiscale' heads: resolutions at which the input "
        "image is encoded by convolutions and fused into the decoder: 1 = full resolution, "
        "2 = also 1/2, ... up to log2(patch_size) + 1 (down to the patch grid, where the "
        "convolutional features join the ViT's: a U-Net encoder beside the ViT); 0 = the "
        "head's own (upconv 1, multiscale 3).", min=0)
    loss: str = opt(
        "bce",
        "Segmentation loss: per-class 'bce', soft 'dice', 'bce_dice' (multi-label, per-class "
        "validity masks) or 'ce' (mutually exclusive classes, invalid voxels ignored).",
        choices=LOSSES,
    )
    class_weights: list[float] = opt(
        [], "Per-class loss weights in data.classes order; empty = all 1.", min=0
    )
    freeze_backbone: bool = opt(False, "Segmentation: train only the head (backbone frozen).")
    backbone_out_layers: str = opt(
        "four_even_intervals",
        "Backbone blocks whose outputs feed the segmentation head.",
        choices=OUT_LAYER_SETS,
    )
    attention: str = opt(
        "sdpa", "Attention kernel ('auto' picks fa4 when available).",
        choices=ATTENTION_BACKENDS,
    )


def _offsets_rule(values: list[str]) -> bool:
    try:
        return all(any(parse_offset(v)) for v in values)
    except ValueError:
        return False


@dataclass
class Affinities:
    """Affinity targets of instance classes (torchtitan/cellmap/affinities.py): for each offset,
    whether a voxel and its partner at that offset lie in the same object. The model predicts
    them as extra output channels (after data.classes), and post-processing cuts the objects
    from them (inference.affinity_cut)."""

    classes: list[str] = opt(
        [], "Instance classes (names from data.classes, stored with object ids) whose "
        "affinities the model predicts, e.g. ['cell'] for neurons; empty = none.",
        check=(lambda v: len(set(v)) == len(v), "each class may appear only once"))
    offsets: list[str] = opt(
        [], "Offsets in voxels of the training grid, each 'z:y:x' ('y:x' for 2D models), "
        "e.g. ['1:0:0', '0:1:0', '0:0:1', '0:0:9']; every face-neighbour offset first, "
        "long-range ones after. Empty = the face neighbours plus offsets of about 3 and 9 "
        "voxels of the finest axis along each axis (shorter on a coarser axis).",
        check=(_offsets_rule, "entries must be whole numbers joined by ':', not all 0"))
    boundary: str = opt(
        "", "A semantic class of data.classes (e.g. 'pm') taken from the face-neighbour "
        "affinities of the one class of affinities.classes instead of an output channel of its "
        "own: a voxel is a boundary voxel by 1 minus its least affinity to a face neighbour, "
        "so membranes and objects come from one prediction and the class's loss trains the "
        "affinities too. Its labels must mean that (helpers/import_stack.py --boundary). "
        "Needs every face-neighbour offset and a convolutional head; '' = its own channel.")
    loss_weight: float = opt(
        0.0, "Weight in the loss of all of one class's affinity channels together, shared "
        "evenly by its offsets (a class of data.classes weighs 1, or its model.class_weights "
        "entry): 1 gives the affinities of a class the pull of one class; 0 = 1 per "
        "channel, as many classes' worth as there are offsets.", min=0)


@dataclass
class Inference:
    """Sliding-window prediction (validation during training and predict.py)."""

    overlap: float = opt(
        0.25, "Overlap of neighbouring windows, as a fraction of the window.",
        check=BELOW_ONE,
    )
    blend: str = opt(
        "gaussian", "Blending of overlapping windows.", choices=("gaussian", "constant")
    )
    batch_size: int = opt(8, "Windows per forward pass (per rank).", min=1)
    threshold: float = opt(PROBABILITY_THRESHOLD, "Probability above which a voxel is foreground.",
                           check=FRACTION)
    tta_flips: bool = opt(
        False, "Test-time augmentation: average each window's probabilities over every "
        "combination of flips of its spatial axes (2D: 4, 3D: 8 forwards' worth of work, in "
        "one forward of a batch that many times larger).")
    planes: str = opt(
        "z", "2D models on 3D volumes: 'z' predicts yx planes along z; 'zyx' also predicts zx "
        "and zy planes and averages the three (isotropic data.voxel_size only; 3D models "
        "ignore it).", choices=PLANES)
    # Post-processing of the masks (torchtitan/postprocess/masks.py): validation reports it as
    # val_post/... beside the raw val/... scores; predict.py applies it to the masks it writes.
    min_object_nm3: float = opt(
        0.0, "Post-processing: remove predicted objects (connected components, every class) "
        "smaller than this volume in nm^3, so that it holds at any voxel size (0 = keep all; "
        "e.g. 1e6 = a 100 nm cube).", min=0)
    fill_holes: str = opt(
        "none", "Post-processing: fill holes of the masks of fill_holes_classes: 'planes' in "
        "each yx plane on its own (2D models), 'volume' closed 3D cavities, 'none'.",
        choices=("none", "planes", "volume"))
    fill_holes_classes: list[str] = opt(
        [], "Classes whose holes fill_holes fills (names from data.classes; empty = every class).")
    instances: str = opt(
        "components", "Post-processing: how instance classes are split into objects (val_post/ "
        "scores, predict.py --instances): 'components' (connected components) or 'watershed' "
        "(touching objects split at narrow necks of the distance map).",
        choices=("components", "watershed"))
    watershed_neck_ratio: float = opt(
        0.5, "instances = 'watershed': two touching objects stay apart when the neck between "
        "them is thinner than this fraction of the smaller one's thickness (higher: more "
        "splits).", check=(lambda v: 0 < v <= 1, "must be in (0, 1]"))
    boundary_instances: bool = opt(
        False, "Post-processing: an instance class whose membrane class is predicted too (cell "
        "with pm) takes its objects from a seeded watershed of the distance to the predicted "
        "membrane (neurons from boundaries, torchtitan/postprocess/neurons.py) instead of "
        "inference.instances (val_post/ scores, predict.py --instances).")
    affinity_cut: str = opt(
        "mutex", "Post-processing of a class with predicted affinities (affinities.classes): "
        "'mutex' (mutex watershed of every offset, long-range ones keeping objects apart), "
        "'mutex_graph' (the same on the region graph of watershed fragments: predict.py's "
        "blockwise run gives the whole volume's objects) or 'boundary' (the affinities "
        "are not used: boundary_instances or inference.instances cut the class). "
        "torchtitan/postprocess/affinities.py.", choices=AFFINITY_CUTS + ("boundary",),
        removed_choices={"agglomerate": "mean-affinity agglomeration cut neurons worse than "
                         "the mutex cuts and 6-10x slower (docs/benchmarks/neurons.md); use "
                         "'mutex_graph' for a graph cut of watershed fragments"})
    mutex_threshold_nearest: float = opt(
        0.5, "affinity_cut = 'mutex' or 'mutex_graph': a face-neighbour edge joins its voxels "
        "(fragments: by their mean) where the predicted affinity is above this and keeps them apart below it (lower: fewer splits).",
        check=FRACTION)
    mutex_threshold_long: float = opt(
        0.5, "affinity_cut = 'mutex' or 'mutex_graph': a long-range edge keeps its voxels "
        "(fragments) apart where the predicted affinity is below this (higher: more splits); "
        "long-range edges never join (only face neighbours do, so every object is connected).",
        check=FRACTION)
    mutex_long_stride: int = opt(
        1, "affinity_cut = 'mutex': a long-range edge is taken at every this-many-th voxel "
        "along each axis of the volume (the rest left out), so that the repulsions, which "
        "outnumber and out-split the joins, are thinned (Wolf et al. 2018 sub-sample theirs); "
        "1 = every voxel.", min=1)
    boundary_seed_nm: float = opt(
        10.0, "boundary_instances: seeds are the parts of the interior farther than this from a "
        "predicted membrane (nm); larger bridges wider gaps in the membrane but splits thin "
        "processes. Seeds smaller than min_object_nm3 are dropped.", min=0)


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

    # Options that earlier releases had, with what replaced them: a config that still sets
    # one is refused with this message (torchtitan.config.parsing).
    REMOVED_OPTIONS: ClassVar[dict[str, str]] = {
        "optimizer.implementation": "the optimizer runs torch's fused kernel wherever it can "
        "(else the foreach ops); they compute the same update",
        "affinities.dice_on": "a Dice term of model.loss measures the joins (the voxel pairs "
        "of one object); on the cuts it gave no better neurons (docs/benchmarks/neurons.md)",
        "inference.agglomerate_threshold": "the 'agglomerate' cut is gone (it cut neurons worse "
        "than the mutex cuts, 6-10x slower); inference.mutex_threshold_nearest and "
        "mutex_threshold_long set the mutex cuts",
    }

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
    affinities: Affinities = field(default_factory=Affinities)
    inference: Inference = field(default_factory=Inference)
    comm: Comm = field(default_factory=Comm)
