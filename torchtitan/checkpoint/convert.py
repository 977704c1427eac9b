"""Weight conversion between Meta's DINOv3 ``.pth`` files and our DCP checkpoints.

Two directions, each used by a thin command-line script:

* ``pth_to_dcp.py``: a Meta backbone ``.pth`` (a plain state dict with Meta's key names) is
  loaded strictly into the 2D, 3-channel model it was trained as, adapted to ``in_chans`` and,
  if asked, inflated to 3D (``torchtitan.models.inflate``), loaded strictly into the target
  backbone, and written as a DCP *seed checkpoint*::

      <dcp_root>/<backbone>_<head>[_<data>]/checkpoint/step-0/   keys model.backbone.<meta key>
                                                                (or model.encoder.<meta key>)

  which a training run loads with ``--checkpoint.initial_load_path`` and
  ``--checkpoint.initial_load_prefix_map backbone.=backbone.``, or by training with
  ``job.dump_folder = <dcp_root>/<backbone>_<head>`` (see ``CheckpointManager.resume``).
  Given a torch hub folder, every Meta backbone file in it is found by name
  (``find_hub_checkpoints``, ``recognise_meta_checkpoint``).

* ``helpers/dcp_to_pth.py``: the model weights of any of our DCP checkpoints, read in a
  single process into plain tensors and saved with ``torch.save``; optionally only the
  backbone, under Meta's key names, so that it loads into a DINOv3 model again.

Models are built on the meta device, and the loaded tensors are *assigned* to them, so a
conversion holds each weight in memory once, even for ViT-7B.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchtitan.checkpoint.reading import complete_steps, partial_folder, step_folder
from torchtitan.errors import UserError
from torchtitan.models import backbone_config, build_backbone, list_backbones
from torchtitan.models.inflate import ROPE_PERIODS, adapt_in_chans, inflate_state_dict_2d_to_3d

# Meta's hub backbones are 2D models trained on RGB images.
META_NDIM = 2
META_IN_CHANS = 3
SEED_STEP = 0
RECORD_FILE = "conversion.json"
MODEL_PREFIXES = ("backbone.", "encoder.")  # where a backbone sits in a segmentation / MAE model
# Meta's default (web image) pretraining set. Seeds of other sets (e.g. sat493m) get the set
# as a folder suffix, so that both weights of one backbone can sit under one dcp_root.
DEFAULT_PRETRAIN_DATA = "lvd1689m"


class ConversionError(UserError, RuntimeError):
    """A file or option that cannot be converted as asked; the message says why."""


# ----------------------------------------------------------------------------- strict loading
def _describe(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def load_strict(model: nn.Module, sd: dict[str, Tensor], source: str) -> None:
    """Load ``sd`` into ``model`` with ``strict=True``, assigning the tensors (no copy).

    Before loading, the keys and shapes are compared, so that a mismatch is one error naming
    the missing, unexpected and mis-shaped keys. Tensors are cast to the model's dtypes.
    """
    expected = model.state_dict()
    missing = sorted(k for k in expected if k not in sd)
    unexpected = sorted(k for k in sd if k not in expected)
    shapes = sorted(
        f"{k} {tuple(sd[k].shape)} (model: {tuple(expected[k].shape)})"
        for k in expected
        if k in sd and tuple(sd[k].shape) != tuple(expected[k].shape)
    )
    problems = []
    if missing:
        problems.append(f"missing keys: {_describe(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_describe(unexpected)}")
    if shapes:
        problems.append(f"shape mismatches: {_describe(shapes)}")
    if problems:
        raise ConversionError(f"{source} does not match the model:\n  " + "\n  ".join(problems))
    cast = {k: sd[k].to(expected[k].dtype) for k in expected}
    model.load_state_dict(cast, strict=True, assign=True)


@contextlib.contextmanager
def _single_process():
    """DCP warns when it runs without a process group; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
        yield


def _build_on_meta(name: str, **overrides) -> nn.Module:
    with torch.device("meta"):
        return build_backbone(name, **overrides)


# ----------------------------------------------------------------------------- .pth -> DCP
def load_pth_state_dict(path: str | os.PathLike, label: str = "--pth") -> dict[str, Tensor]:
    """A Meta backbone ``.pth``: a flat dict of tensors, loaded on the CPU. ``label`` names
    where the path came from in error messages."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{label} {str(path)!r} does not exist (or is not a file)")
    try:
        sd = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # corrupt file, or a pickle that is not plain weights
        reason = " ".join(str(e).split())
        raise ConversionError(
            f"{label} {str(path)!r} could not be read with torch.load ({reason}): the file is "
            "truncated or not a PyTorch checkpoint; copy or export it again") from e
    if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
        keys = list(sd)[:5] if isinstance(sd, dict) else type(sd).__name__
        raise ConversionError(
            f"{label} {str(path)!r} is not a plain state dict of tensors (it holds {keys}); "
            "expected a backbone checkpoint as published by Meta (e.g. dinov3_vitl16_*.pth)"
        )
    return sd


@dataclass
class ConvertedBackbone:
    """A backbone state dict ready to be saved, and how it was made."""

    state_dict: dict[str, Tensor]
    backbone: str
    ndim: int
    in_chans: int
    patch_size: int
    overrides: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def convert_meta_backbone(
    pth_sd: dict[str, Tensor], backbone: str, ndim: int, in_chans: int, source: str = "the .pth"
) -> ConvertedBackbone:
    """Meta 2D RGB backbone weights -> weights of ``build_backbone(backbone, ndim, in_chans)``.

    1. load strictly into the 2D, 3-channel model Meta trained;
    2. adapt the patch kernel to ``in_chans`` (sum over RGB for one channel);
    3. for ``ndim=3``, inflate the patch kernel over depth and take the 3D RoPE periods;
    4. load strictly into the target backbone.
    """
    if backbone not in list_backbones():
        raise ConversionError(f"--backbone {backbone!r} is unknown; choose one of: {', '.join(list_backbones())}")
    if ndim not in (2, 3):
        raise ConversionError(f"--ndim must be 2 or 3, got {ndim}")
    if in_chans < 1:
        raise ConversionError(f"--in_chans must be >= 1, got {in_chans}")
    notes = []
    overrides = {}
    # ViT-7B and the SAT-493M ViT-L carry a second cls norm, used only in training; build
    # the model with it so that the checkpoint loads strictly.
    if any(k.startswith("local_cls_norm.") for k in pth_sd) and not backbone_config(backbone).get(
        "untie_global_and_local_cls_norm"
    ):
        overrides["untie_global_and_local_cls_norm"] = True
        notes.append("the checkpoint has local_cls_norm.*: built with untie_global_and_local_cls_norm=True")

    reference = _build_on_meta(backbone, ndim=META_NDIM, in_chans=META_IN_CHANS, **overrides)
    try:
        load_strict(reference, pth_sd, source)
    except ConversionError as e:
        # A file of another size under this name is the usual cause: say which it is.
        fits = backbones_fitting(pth_sd)
        hint = (f"the tensors are those of {' / '.join(fits)}, not {backbone}" if fits else
                "the tensors fit no backbone of torchtitan.models.list_backbones()")
        raise ConversionError(f"{e}\n  {hint}") from None
    sd = dict(reference.state_dict())
    patch_size = reference.patch_size

    # The periods follow from the RoPE settings; a checkpoint trained with other settings
    # would get wrong positions in 3D, where the periods are recomputed.
    expected_periods = reference.rope_embed.compute_periods(torch.device("cpu"))
    if not torch.allclose(sd[ROPE_PERIODS].float(), expected_periods.float(), rtol=1e-4):
        warnings.warn(
            f"{source}: rope_embed.periods differ from those of the {backbone!r} config "
            "(was it trained with other RoPE settings?)", stacklevel=2,
        )

    if in_chans != META_IN_CHANS:
        sd = adapt_in_chans(sd, in_chans)
        rule = "summed over RGB" if in_chans == 1 else f"tiled and scaled by {META_IN_CHANS}/{in_chans}"
        notes.append(f"patch kernel adapted from {META_IN_CHANS} to {in_chans} input channels ({rule})")

    target = _build_on_meta(backbone, ndim=ndim, in_chans=in_chans, **overrides)
    if ndim == 3:
        periods = target.rope_embed.compute_periods(torch.device("cpu"))
        sd = inflate_state_dict_2d_to_3d(sd, patch_size, rope_periods=periods)
        notes.append(
            f"inflated to 3D: patch kernel repeated over {patch_size} slices and divided by "
            f"{patch_size}; RoPE periods of the 3D model ({periods.numel()} per axis)"
        )
    load_strict(target, sd, f"the converted {ndim}D weights")
    return ConvertedBackbone(dict(target.state_dict()), backbone, ndim, in_chans, patch_size, overrides, notes)


def backbones_fitting(pth_sd: dict[str, Tensor]) -> list[str]:
    """Registry backbones whose 2D RGB model has exactly the keys and shapes of ``pth_sd``."""
    shapes = {k: tuple(v.shape) for k, v in pth_sd.items()}
    overrides = {}
    if any(k.startswith("local_cls_norm.") for k in pth_sd):
        overrides["untie_global_and_local_cls_norm"] = True
    fits = []
    for name in list_backbones():
        model = _build_on_meta(name, ndim=META_NDIM, in_chans=META_IN_CHANS, **overrides)
        if {k: tuple(v.shape) for k, v in model.state_dict().items()} == shapes:
            fits.append(name)
    return fits


def seed_checkpoint_dir(dcp_root: str | os.PathLike, backbone: str, head: str, suffix: str = "") -> Path:
    """``<dcp_root>/<backbone>_<head>[_<suffix>]/checkpoint/step-0``."""
    name = f"{backbone}_{head}" + (f"_{suffix}" if suffix else "")
    return step_folder(Path(dcp_root) / name / "checkpoint", SEED_STEP)


# ----------------------------------------------------------------------------- torch hub folder
# Torch hub names downloads <name>-<first hex digits of the sha256>.pth; Meta's backbone files
# are <backbone>_pretrain_<data>, e.g. dinov3_vitl16_pretrain_lvd1689m-8aa4cbdd.pth. Other
# files in the same folder (heads, text encoders, ConvNeXts, other models) are not backbones.
_DOWNLOAD_TAIL = re.compile(r"-[0-9A-Za-z]+$")
_PRETRAIN_NAME = re.compile(r"^(?P<backbone>.+?)_pretrain_(?P<data>[0-9a-z]+)$")


class NotABackboneFile(ValueError):
    """A ``.pth`` whose name is not that of a Meta DINOv3 backbone checkpoint; says why."""


@dataclass
class HubCheckpoint:
    """A Meta backbone file found in a torch hub folder, recognised by its name."""

    path: Path
    backbone: str  # registry name (torchtitan.models.list_backbones())
    data: str  # pretraining set named in the file, e.g. lvd1689m or sat493m

    @property
    def suffix(self) -> str:
        """Seed folder suffix: none for the default pretraining set, else the set's name."""
        return "" if self.data == DEFAULT_PRETRAIN_DATA else self.data


def find_hub_checkpoints(hub: str | os.PathLike) -> list[Path]:
    """The ``.pth`` files in ``<hub>/checkpoints`` (where torch hub downloads to) and ``<hub>``."""
    hub = Path(hub)
    if not hub.is_dir():
        raise ConversionError(f"--torch_hub_path {str(hub)!r} is not a folder")
    found = []
    for folder in (hub / "checkpoints", hub):
        if folder.is_dir():
            found += sorted(p for p in folder.iterdir() if p.suffix == ".pth" and p.is_file())
    return found


def recognise_meta_checkpoint(path: str | os.PathLike) -> HubCheckpoint:
    """The backbone and pretraining set a file name stands for; ``NotABackboneFile`` (with the
    reason) for a file that is not a backbone checkpoint of a registered backbone."""
    path = Path(path)
    stem = _DOWNLOAD_TAIL.sub("", path.stem)
    names = list_backbones()
    if stem in names:  # a renamed file, e.g. dinov3_vitl16.pth: no set named, the default one
        return HubCheckpoint(path, stem, DEFAULT_PRETRAIN_DATA)
    m = _PRETRAIN_NAME.match(stem)
    if m and m["backbone"] in names:
        return HubCheckpoint(path, m["backbone"], m["data"])
    if m:
        raise NotABackboneFile(f"{m['backbone']} is not a backbone of torchtitan.models.list_backbones()")
    named_after = [n for n in names if stem.startswith(n + "_")]
    if named_after:
        raise NotABackboneFile(
            f"named after {max(named_after, key=len)} but not its backbone weights (those are "
            "named <backbone>_pretrain_<data>-<hash>.pth); a head or text encoder?"
        )
    raise NotABackboneFile(
        "its name starts with no backbone of torchtitan.models.list_backbones() (expected e.g. "
        "dinov3_vitl16_pretrain_lvd1689m-8aa4cbdd.pth)"
    )


def save_seed_checkpoint(
    sd: dict[str, Tensor], step_dir: str | os.PathLike, prefix: str = "backbone.",
    record: dict | None = None, overwrite: bool = False,
) -> Path:
    """Write ``{"model": {prefix + key: tensor}}`` as a DCP checkpoint in one process.

    Written to ``.step-0.tmp`` and renamed when complete, like ``CheckpointManager.save``;
    ``record`` (how it was made) goes into ``conversion.json`` inside the step folder.
    """
    final = Path(step_dir)
    if final.exists() and not overwrite:
        raise ConversionError(f"{final} already exists; pass --overwrite to replace it")
    tmp = partial_folder(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    state = {"model": {f"{prefix}{k}": v.detach().contiguous() for k, v in sd.items()}}
    with _single_process():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    if record is not None:
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


# ----------------------------------------------------------------------------- DCP -> .pth
def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A step folder as given, or the latest complete ``step-N`` of a checkpoint folder
    (or of a run's dump folder, via its ``checkpoint/``)."""
    path = Path(path)
    if (path / ".metadata").is_file():
        return path
    for folder in (path, path / "checkpoint"):
        steps = complete_steps(folder)
        if steps:
            return step_folder(folder, steps[-1])
    raise ConversionError(
        f"--dcp {str(path)!r} is not a complete DCP checkpoint (no .metadata) and holds no "
        "complete step-N folder; point it at e.g. outputs/run/checkpoint/step-1000 or "
        "outputs/run/checkpoint"
    )


def read_model_weights(path: str | os.PathLike, part: str = "model") -> dict[str, Tensor]:
    """Every ``model.*`` tensor of a DCP checkpoint (``part.*``: e.g. ``train_model``, the
    trained weights beside a moving average), as plain CPU tensors, without the prefix.

    DCP stores sharded (FSDP / DTensor) weights as pieces of one global tensor, and the
    metadata gives its size and dtype, so loading into empty tensors of that size gathers
    them in a single process. Optimizer and training state are not read.
    """
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    wanted = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(f"{part}.") and isinstance(meta, TensorStorageMetadata)
    }
    if not wanted:
        raise ConversionError(f"{path} holds no {part}.* weights")
    with _single_process():
        dcp.load(wanted, checkpoint_id=str(path), no_dist=True)
    return {key[len(part) + 1:]: t for key, t in sorted(wanted.items())}


def select_weights(sd: dict[str, Tensor], what: str) -> dict[str, Tensor]:
    """``full``: everything; ``backbone``: the ``backbone.*`` (segmentation) or ``encoder.*``
    (MAE) weights without that prefix, i.e. Meta's DINOv3 key names."""
    if what == "full":
        return dict(sd)
    if what != "backbone":
        raise ConversionError(f"--what must be 'full' or 'backbone', got {what!r}")
    for prefix in MODEL_PREFIXES:
        picked = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        if picked:
            return picked
    top = sorted({k.split(".")[0] + "." for k in sd})
    raise ConversionError(
        f"no backbone weights: expected keys under {' or '.join(MODEL_PREFIXES)}, "
        f"the checkpoint's model keys start with {top}"
    )


def cast_weights(sd: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Floating tensors to ``dtype``; RoPE periods stay float32 (they set the positions)."""
    return {
        k: v.to(dtype) if v.is_floating_point() and not k.endswith(ROPE_PERIODS) else v
        for k, v in sd.items()
    }


def save_pth(sd: dict[str, Tensor], out: str | os.PathLike) -> Path:
    """``torch.save`` to a temporary name in the same folder, then rename."""
    out = Path(out)
    if out.is_dir():
        raise ConversionError(f"--out {out} is a folder; give the path of the .pth file to write")
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(sd, tmp)
        os.replace(tmp, out)
    except OSError as e:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        raise ConversionError(f"--out {out} cannot be written ({e.strerror or e}); choose a "
                              "path in a folder you can write") from None
    return out
