"""A trained run made ready to leave the project: its network, a test window of its
training data, its validation scores, its weights in each format and its model card.

The pieces :mod:`torchtitan.export.writer` (the hub folder, the command) and
:mod:`torchtitan.export.bioimageio` (the bioimage.io package) put together.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tomli_w
import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from torchtitan.checkpoint.reading import STEP_RE, resolve_step_folder
from torchtitan.config.parsing import config_to_dict
from torchtitan.data.crops.layout import discover
from torchtitan.data.crops.reader import (crop_grid, em_level, em_to_model_input, grid_shape,
                                          read_linear, set_em_ranges)
from torchtitan.data.io.stores import StoreContext
from torchtitan.errors import UserError, optional_import
from torchtitan.prediction import exported
from torchtitan.prediction.exported import ExportError
from torchtitan.prediction.runs import load_run_config, load_weights

logger = logging.getLogger(__name__)

DEFAULT_OPSET = 17  # the ONNX opset written unless asked otherwise


@dataclass
class Card:
    """What the model card says beyond what the run knows: from the command line."""

    name: str = ""  # default: from the run's job.description / dump folder
    description: str = ""
    authors: list[str] = field(default_factory=list)
    license: str = "CC-BY-4.0"  # an SPDX identifier
    cite: list[tuple[str, str]] = field(default_factory=list)  # (text, DOI or URL)
    training_data: str = ""  # default: the run's data.dataset_path and crops
    intended_use: str = ""
    git_repo: str = ""


@dataclass
class TestSample:
    """One window of the training data: the stored EM and the network's input made from it."""

    raw: np.ndarray  # (1, *window), the EM's stored dtype (uint8, uint16, float32, ...)
    image: np.ndarray  # (1, *window) float32, normalised as in training
    where: str  # e.g. "jrc_synth-1/crop2, window at z,y,x voxel 4,0,0 of the crop"
    em_range: tuple[float, float] | None  # the range that maps the EM onto 0..255


@dataclass
class TrainedModel:
    """Everything an export is made from."""

    cfg: object  # the run's JobConfig
    network: torch.nn.Module  # float32, eval, CPU: the exported network
    checkpoint: Path  # the step folder (or .pth) the weights came from
    step: int | None
    sample: TestSample
    scores: dict[str, float]  # validation scores of the run (val/...)
    expected: np.ndarray = None  # the network's output on sample.image, (1, K, *window)


# ---------------------------------------------------------------------------------------------
# Reading the trained model
# ---------------------------------------------------------------------------------------------


def check_out(out: Path) -> None:
    """``--out`` must not exist (an export never overwrites), nor its partial folder."""
    for path in (out, out.with_name(out.name + ".partial")):
        if path.exists():
            raise ExportError(f"--out {path} exists; choose a new folder (or remove it: an "
                              "export never writes into an existing one)")


def load_trained(checkpoint: str, config: str | None) -> tuple[object, torch.nn.Module, Path]:
    """(run config, network with the checkpoint's weights, the weights' path)."""
    path = Path(checkpoint)
    if not path.exists():
        raise ExportError(f"--checkpoint {path} does not exist; give a DCP step folder, a run's "
                          "checkpoint folder or a .pth (with --config)")
    cfg = load_run_config(checkpoint, config)
    if cfg.model.ndim not in (2, 3):
        raise ExportError(f"model.ndim = {cfg.model.ndim} in the run's config: only 2D and 3D "
                          "segmentation models are exported")
    network = exported.network_of_config(cfg)
    step_path = path if path.suffix == ".pth" else resolve_step_folder(path)
    try:
        load_weights(network, checkpoint)
    except UserError:
        raise
    except (Exception, CheckpointException) as e:  # corrupt: DCP and pickle raise anything
        raise ExportError(f"--checkpoint {step_path} cannot be read ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}); export an earlier step (step-N "
                          "folder) or copy the checkpoint again") from None
    network.eval()
    return cfg, network, step_path


def _window_origin(crop_origin, crop_shape, window, voxel) -> np.ndarray:
    """The origin (nm) of a ``window`` (z, y, x voxels) centred on a crop's grid."""
    offset = [(c - w) // 2 for c, w in zip(crop_shape, window)]
    return np.asarray(crop_origin) + np.asarray(offset) * np.asarray(voxel)


def test_sample(cfg) -> TestSample:
    """The centre window of the first validation crop (else the first label crop) of the
    training data, as stored and as the network's input."""
    sources = discover(StoreContext.from_config(cfg.data), cfg.data.dataset_path)
    set_em_ranges(sources, cfg.data.em_range)
    crops = [(s, c) for s in sources for c in s.crops]
    if not crops:
        raise ExportError(f"the training data {cfg.data.dataset_path} holds no label crop to take "
                          "the package's test window from; pass --data with the training data")
    wanted = set(cfg.data.val_crops)
    source, crop = next(((s, c) for s, c in crops if c.name in wanted or c.full_name in wanted),
                        crops[0])
    voxel = np.asarray(cfg.data.voxel_size, dtype=float)
    window = grid_shape(cfg.model.crop_size)
    origin, shape = crop_grid(crop, voxel)
    start = _window_origin(origin, shape, window, voxel)
    level = em_level(source, voxel)
    raw, inside = read_linear(source.stores, level, start, voxel, window)
    if not inside.all():
        raise ExportError(f"the test window of {crop.full_name} leaves its EM volume; the crop "
                          "lies at the volume's edge: choose another with --data.val_crops")
    image = em_to_model_input(raw.copy(), source, level.path, inside)
    squeeze = (lambda a: a[0]) if len(cfg.model.crop_size) == 2 else (lambda a: a)
    where = (f"{crop.full_name}, the centre window ({'x'.join(map(str, cfg.model.crop_size))} "
             f"voxels of {'x'.join(f'{v:g}' for v in voxel)} nm)")
    return TestSample(squeeze(raw)[None], squeeze(image)[None].astype(np.float32), where,
                      source.em_range)


def validation_scores(cfg, step: int | None) -> dict[str, float]:
    """The run's validation scores (``val/...``) at ``step``, else the latest validation
    before it, from ``logs/metrics.jsonl``; empty when the run logged none."""
    path = Path(cfg.job.dump_folder) / "logs" / "metrics.jsonl"
    if not path.is_file():
        return {}
    found: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a killed run
        vals = {k: v for k, v in record.items() if k.startswith("val") and isinstance(v, float)}
        if vals and "step" in record:
            found.setdefault(int(record["step"]), {}).update(vals, step=record["step"])
    usable = [s for s in found if step is None or s <= step]
    return found[max(usable)] if usable else {}


def _step_of(path: Path) -> int | None:
    m = STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def load_for_export(checkpoint: str, config: str | None, data: str | None = None) -> TrainedModel:
    """The trained model, its test window and output, and its validation scores."""
    cfg, network, path = load_trained(checkpoint, config)
    if data:
        cfg.data.dataset_path = data
    sample = test_sample(cfg)
    step = _step_of(path)
    model = TrainedModel(cfg, network, path, step, sample, validation_scores(cfg, step))
    with torch.no_grad():
        model.expected = network(torch.from_numpy(sample.image)[None]).numpy()
    return model


# ---------------------------------------------------------------------------------------------
# Writing the weights
# ---------------------------------------------------------------------------------------------


def example_input(model: TrainedModel) -> torch.Tensor:
    return torch.from_numpy(model.sample.image)[None]


def write_torchscript(model: TrainedModel, path: Path) -> None:
    """The network traced on the test window (its control flow depends on shapes only)."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(model.network, example_input(model), check_trace=False)
    traced.save(str(path))


def write_onnx(model: TrainedModel, path: Path, opset: int) -> None:
    """The network as ONNX at ``opset`` (the TorchScript-based exporter; batch size free). An
    operator the opset cannot express is an :class:`ExportError` naming it."""
    # The exporter needs onnx: say so before it fails.
    optional_import("onnx", "export", "ONNX weights (leave them out with --no-onnx)")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's deprecation and tracer notes
            torch.onnx.export(model.network, (example_input(model),), str(path), dynamo=False,
                              opset_version=opset, input_names=["input"],
                              output_names=["output"],
                              dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    except torch.onnx.errors.OnnxExporterError as e:
        message = " ".join(str(e).split())
        op = re.search(r"operator '([^']+)'", message)
        what = f"the operator {op.group(1)}" if op else "an operator of the model"
        raise ExportError(f"ONNX opset {opset} cannot express {what}: {message[:400]} Choose "
                          "another opset with --opset (default "
                          f"{DEFAULT_OPSET}), or leave ONNX out (--no-onnx)") from None


def state_dict(model: TrainedModel) -> dict[str, torch.Tensor]:
    """The network's weights, contiguous float32 tensors on the CPU, by the model's keys."""
    return {k: v.detach().cpu().contiguous() for k, v in model.network.state_dict().items()}


# ---------------------------------------------------------------------------------------------
# The export
# ---------------------------------------------------------------------------------------------


def model_name(model: TrainedModel, card: Card) -> str:
    """The card's name, else one made of the run's dump folder name (bioimage.io allows
    letters, digits, ``_+- ()``, 5 to 128 characters)."""
    name = card.name or f"torchtitan-em {Path(model.cfg.job.dump_folder).name}"
    name = re.sub(r"[^A-Za-z0-9_+\- ()]", "-", name)
    return name if len(name) >= 5 else f"{name} model"


# ---------------------------------------------------------------------------------------------
# The model card
# ---------------------------------------------------------------------------------------------


def _scores_table(model: TrainedModel) -> str:
    scores = model.scores
    if not scores:
        return "The run logged no validation (metrics.eval_freq = 0).\n"
    rows = ["| score | value |", "| --- | --- |"]
    rows += [f"| `{k}` | {v:.4f} |" for k, v in sorted(scores.items()) if k != "step"]
    return (f"Validation of the run at step {int(scores['step'])} (`logs/metrics.jsonl`; crops "
            f"{', '.join(model.cfg.data.val_crops) or 'held out by data.val_fraction'}), "
            "scored with the CellMap challenge's 2025 metric:\n\n" + "\n".join(rows) + "\n")


def training_data(model: TrainedModel, card: Card) -> str:
    d = model.cfg.data
    return card.training_data or (
        f"{d.dataset_path} (CellMap / OME-NGFF layout), classes {', '.join(d.classes)}, at "
        f"{'x'.join(f'{v:g}' for v in d.voxel_size)} nm voxels (z, y, x)")


def model_card(model: TrainedModel, card: Card, hub: bool) -> str:
    """The model card (Markdown): what the model is, its data, config, scores and use."""
    cfg, m = model.cfg, model.cfg.model
    window = "x".join(map(str, m.crop_size))
    front = ""
    if hub:
        front = (f"---\nlicense: {card.license.lower()}\nlibrary_name: pytorch\ntags:\n"
                 "- image-segmentation\n- electron-microscopy\n- torchtitan-em\n---\n\n")
    use = card.intended_use or (
        f"Semantic segmentation of {', '.join(cfg.data.classes)} in EM like the training data, "
        f"at {'x'.join(f'{v:g}' for v in cfg.data.voxel_size)} nm voxels. Other microscopes, "
        "stainings or voxel sizes need checking against ground truth first.")
    authors = ", ".join(card.authors) or "not given"
    cites = "\n".join(f"- {text} ({ref})" for text, ref in card.cite) or "- not given"
    return f"""{front}# {model_name(model, card)}

{card.description or cfg.job.description}

{m.ndim}D segmentation: a `{m.backbone}` ViT backbone (patch {m.patch_size}) with the
`{m.head}` head, trained with `{m.loss}` by torchtitan-em for {cfg.training.steps} steps
(checkpoint `{model.checkpoint.name}`). Input: one EM channel, windows of {window} voxels (the
tile; predict overlapping windows of a larger volume, blended, as `predict.py` does). Output:
one logit per class ({', '.join(cfg.data.classes)}); the sigmoid of each is its probability.
Authors: {authors}. License: {card.license}.

## Training data

{training_data(model, card)}.

## Intended use

{use}

## How to use

```bash
python predict.py --model {'hub' if hub else 'bioimageio'} --data DATA --crops all --out pred.zarr
```

## Validation

{_scores_table(model)}
## Config

The `[model]` section of the run's resolved config (all of it: `config.toml`):

```toml
{tomli_w.dumps({"model": config_to_dict(cfg)["model"]}).strip()}
```

## Citation

{cites}
"""
