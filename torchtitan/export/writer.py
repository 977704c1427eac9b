"""Exporting a trained segmentation model so that it can leave the project.

Used by ``helpers/export_model.py``. A checkpoint (a DCP step folder, a run's checkpoint
folder for its latest step, or a full-model ``.pth`` with ``--config``) and the config that
trained it become, in ``--out``:

* ``bioimageio/`` and ``bioimageio.zip``: a bioimage.io model package (spec 0.5, written and
  checked with ``bioimageio.spec``; :mod:`torchtitan.export.bioimageio`), with the
  network as TorchScript, ONNX and a PyTorch state dict;
* ``hub/``: a folder to share on a model hub: a model card (``README.md``), the weights as
  ``model.safetensors`` and the resolved config (``config.toml``).

The network is the segmentation model in float32 with SDPA attention: its output is one logit
per class (:mod:`torchtitan.prediction.exported`), and a sigmoid per class gives the probabilities
(the package's postprocessing; "ce" runs: a softmax after a zero background logit). Its input is
one window of the training crop size (``model.crop_size``), the tile of blockwise prediction;
the batch size is free. The EM reaches it as training reads it: on the uint8 scale (through the
run's or the data's intensity range) and mapped to [-1, 1].

The test tensors are a real window of the training data: the centre of the first validation
crop (else the first label crop), as the EM is stored, and the network's output on it. The
validation scores come from the run's ``logs/metrics.jsonl`` (the validation of the exported
step, else the latest one before it). The export is written into ``OUT.partial`` and renamed
into place when complete; an ``--out`` that exists is refused before any work.
"""


from __future__ import annotations

import shutil
from pathlib import Path

from torchtitan.errors import optional_import
from torchtitan.config.parsing import config_to_toml
from torchtitan.cellmap.affinities import config_outputs
from torchtitan.prediction import exported
from torchtitan.export.bioimageio import write_package
from torchtitan.prediction.exported import ExportError
from torchtitan.export.trained_model import (
    DEFAULT_OPSET,
    Card,
    TrainedModel,
    check_out,
    load_for_export,
    model_card,
    state_dict,
)

FORMATS = ("bioimageio", "hub")


def export_model(checkpoint: str, out: str | Path, *, config: str | None = None,
                 data: str | None = None, formats: tuple[str, ...] = FORMATS,
                 card: Card | None = None, opset: int = DEFAULT_OPSET,
                 onnx: bool = True) -> list[Path]:
    """Export ``checkpoint`` into ``out`` in ``formats`` (see the module docstring); returns
    the paths written. ``data`` overrides the run's ``data.dataset_path`` (where the test
    window comes from)."""
    out = Path(out)
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ExportError(f"--format {','.join(formats)}: choose from {', '.join(FORMATS)}")
    check_out(out)
    card = card or Card()
    model = load_for_export(checkpoint, config, data)
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True)
    try:
        written = []
        if "hub" in formats:
            written.append(write_hub(model, card, partial / "hub"))
        if "bioimageio" in formats:
            written += write_package(model, card, partial / "bioimageio", opset, onnx)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(out)
    return [out / p.relative_to(partial) for p in written]


def write_hub(model: TrainedModel, card: Card, folder: Path) -> Path:
    """The hub folder: model card, ``model.safetensors`` and ``config.toml``."""
    save_file = optional_import("safetensors.torch", "export", "The hub folder").save_file
    folder.mkdir()
    save_file(state_dict(model), str(folder / exported.SAFETENSORS),
              metadata={"format": "pt", "classes": ",".join(model.cfg.data.classes),
                        "outputs": ",".join(config_outputs(model.cfg))})
    (folder / exported.CONFIG).write_text(config_to_toml(model.cfg))
    (folder / exported.CARD).write_text(model_card(model, card, hub=True))
    return folder
