"""Models that left the project: reading an exported model back, for ``predict.py --model``.

``helpers/export_model.py`` (:mod:`torchtitan.export.writer`) writes two kinds of folder:

* a **bioimage.io package** (a folder with ``rdf.yaml``, or its ``.zip``): the network as
  TorchScript (``weights_torchscript.pt``), ONNX (``weights.onnx``) and a PyTorch state dict
  (``weights.pt``), with the run's resolved config attached (``config.toml``);
* a **hub folder** (``README.md`` model card, ``model.safetensors``, ``config.toml``).

Both hold the network in the same form: the segmentation model's logits, one channel per class
(for ``model.loss = "ce"`` a constant zero background logit comes first, as the loss reads it:
see :func:`add_background_channel`). :func:`exported_predict_module` turns any of their weight
files back into a module whose output is the checkpoint model's logits, so the sliding-window
predictor (:class:`torchtitan.inference.sliding_window.VolumePredictor`) runs it unchanged, with the run's
window, overlap, blending and thresholds from the exported ``config.toml``.

The state dict and safetensors weights load into the architecture rebuilt from the config
(:func:`build_network`, also the architecture the bioimage.io package names); TorchScript
needs only PyTorch; ONNX needs ``onnxruntime`` (an optional dependency: ``pip install
onnxruntime``).
"""

from __future__ import annotations

import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from torchtitan.errors import CheckpointError, UserError, optional_import

RDF = "rdf.yaml"
CONFIG = "config.toml"
CARD = "README.md"
STATE_DICT = "weights.pt"
TORCHSCRIPT = "weights_torchscript.pt"
ONNX = "weights.onnx"
SAFETENSORS = "model.safetensors"
WEIGHTS = ("state_dict", "torchscript", "onnx")  # predict.py --weights


class ExportError(UserError):
    """An export that cannot be written or read: the message names the file and the fix."""


@dataclass
class ExportedModel:
    """An exported model folder: what kind it is and where its files are."""

    kind: str  # "bioimageio" or "hub"
    root: Path  # the folder holding the files (a zip is extracted to a temporary folder)

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    def weights_file(self, weights: str) -> Path:
        """The file of ``weights`` (one of :data:`WEIGHTS`) in this export, checked."""
        if weights not in WEIGHTS:
            raise ExportError(f"--weights {weights!r}: use one of {', '.join(WEIGHTS)}")
        if self.kind == "hub":
            if weights != "state_dict":
                raise ExportError(f"{self.root} is a hub folder: it holds the state dict "
                                  f"({SAFETENSORS}) only; use --weights state_dict, or the "
                                  "bioimage.io package of the same export for TorchScript/ONNX")
            name = SAFETENSORS
        else:
            name = {"state_dict": STATE_DICT, "torchscript": TORCHSCRIPT, "onnx": ONNX}[weights]
        path = self.root / name
        if not path.is_file():
            raise ExportError(f"{path} is missing: the export holds no {weights} weights; "
                              "export again with helpers/export_model.py")
        return path


_extracted: dict[Path, tempfile.TemporaryDirectory] = {}  # zips opened in this process


def is_export(path: str | Path) -> bool:
    """Whether ``path`` is an exported model: a folder with ``rdf.yaml`` or with
    ``model.safetensors`` and ``config.toml``, an ``rdf.yaml`` file, or a ``.zip``."""
    p = Path(path)
    if p.is_file():
        return p.name == RDF or p.suffix == ".zip"
    return (p / RDF).is_file() or ((p / SAFETENSORS).is_file() and (p / CONFIG).is_file())


def refuse_as_checkpoint(path: str | Path) -> None:
    """A :class:`CheckpointError` when an export is given where a checkpoint belongs."""
    if is_export(path):
        raise CheckpointError(f"{path} is an exported model, not a checkpoint: pass it with "
                              "predict.py --model")


def open_export(path: str | Path) -> ExportedModel:
    """The exported model at ``path`` (a package folder, its ``rdf.yaml`` or ``.zip``, or a
    hub folder), with its ``config.toml`` checked to be there."""
    p = Path(path)
    if not p.exists():
        raise ExportError(f"--model {p} does not exist; give an exported package folder, its "
                          "rdf.yaml or .zip, or a hub folder (helpers/export_model.py writes them)")
    if not is_export(p):
        raise ExportError(f"--model {p} is not an exported model (no {RDF}, and not a hub folder "
                          f"with {SAFETENSORS} and {CONFIG}); a training checkpoint goes to "
                          "--checkpoint")
    if p.is_file() and p.suffix == ".zip":
        p = _extract(p)
    elif p.is_file():
        p = p.parent
    kind = "bioimageio" if (p / RDF).is_file() else "hub"
    model = ExportedModel(kind, p)
    if not model.config.is_file():
        raise ExportError(f"{p} holds no {CONFIG} (the resolved config of the run that trained "
                          "the model); export it again with helpers/export_model.py")
    return model


def _extract(path: Path) -> Path:
    """A package zip extracted once per process into a temporary folder."""
    key = path.resolve()
    if key not in _extracted:
        folder = tempfile.TemporaryDirectory(prefix="exported_model_")
        try:
            with zipfile.ZipFile(path) as z:
                z.extractall(folder.name)
        except (zipfile.BadZipFile, OSError) as e:
            folder.cleanup()
            raise ExportError(f"--model {path} cannot be read as a zip ({e}); copy it again") \
                from None
        _extracted[key] = folder
    return Path(_extracted[key].name)


# ---------------------------------------------------------------------------------------------
# The network as exported
# ---------------------------------------------------------------------------------------------


def add_background_channel(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model`` output a constant 0 background logit before its class logits, the form
    in which ``model.loss = "ce"`` reads them (a softmax over background and classes gives the
    probabilities; the bioimage.io package says so). A forward hook: the keys of the state
    dict stay the model's own."""

    def hook(module, inputs, logits):
        return torch.cat([torch.zeros_like(logits[:, :1]), logits], dim=1)

    model.register_forward_hook(hook)
    return model


def build_network(model: dict, classes: list[str], affinities: dict | None = None) -> torch.nn.Module:
    """The exported network, untrained: the segmentation model that ``[model]`` (a dict of
    the run's ``[model]`` section) builds for ``classes`` (and the affinity channels of
    ``affinities``, a dict of the run's ``[affinities]`` section), with SDPA attention, in eval
    mode on the CPU; with the background channel for the "ce" loss. The architecture of the
    bioimage.io package's state dict, and what the hub folder's weights load into."""
    from torchtitan.config.job_config import JobConfig
    from torchtitan.models import use_attention
    from torchtitan.tasks import SegmentationTask

    cfg = JobConfig()
    for key, value in model.items():
        setattr(cfg.model, key, value)
    cfg.data.classes = list(classes)
    for key, value in (affinities or {}).items():
        setattr(cfg.affinities, key, value)
    network = SegmentationTask(cfg).build_model()
    use_attention(network, "sdpa")
    network.eval()
    return add_background_channel(network) if cfg.model.loss == "ce" else network


def network_of_config(cfg) -> torch.nn.Module:
    """:func:`build_network` for a run's JobConfig."""
    import dataclasses

    from torchtitan.cellmap.affinities import AffinitySpec

    return build_network(dataclasses.asdict(cfg.model), list(cfg.data.classes),
                         AffinitySpec.from_config(cfg).as_config())


class LogitsOf(torch.nn.Module):
    """An exported network as the checkpoint's model: its output without the background
    channel that the "ce" export adds, so ``predict_probabilities`` reads it as it reads the
    model's logits."""

    def __init__(self, network, background: bool):
        super().__init__()
        self.network = network
        self.background = background

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.network(x)
        return out[:, 1:] if self.background else out


class OnnxNetwork(torch.nn.Module):
    """An ONNX file run by ``onnxruntime`` on the CPU, as a module: float32 tensors in and out
    (on the input's device)."""

    def __init__(self, path: Path):
        super().__init__()
        onnxruntime = optional_import("onnxruntime", "export", "--weights onnx")
        self.session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feed = {self.input_name: x.detach().float().cpu().numpy()}
        out = self.session.run(None, feed)[0]
        return torch.from_numpy(np.ascontiguousarray(out)).to(x.device)


def load_state_dict_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` or ``.pt`` state dict file, on the CPU."""
    if path.suffix == ".safetensors":
        load_file = optional_import("safetensors.torch", "export", f"Reading {path.name}").load_file
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or foreign file
        raise ExportError(f"{path} cannot be read ({type(e).__name__}: {e}); export the model "
                          "again") from None


def exported_predict_module(export: ExportedModel, cfg, weights: str,
                            device: torch.device) -> torch.nn.Module:
    """The exported ``weights`` (see :data:`WEIGHTS`) as a module giving the checkpoint
    model's logits, in eval mode on ``device`` (ONNX runs on the CPU whatever ``device``)."""
    path = export.weights_file(weights)
    if weights == "onnx":
        network: torch.nn.Module = OnnxNetwork(path)
    elif weights == "torchscript":
        try:
            network = torch.jit.load(str(path), map_location=device)
        except Exception as e:
            raise ExportError(f"{path} cannot be loaded as TorchScript ({e}); export again") \
                from None
    else:
        network = network_of_config(cfg)
        missing, unexpected = network.load_state_dict(load_state_dict_file(path), strict=False)
        if missing or unexpected:
            raise ExportError(f"{path} does not match the model of {export.config}: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}; export again")
    module = LogitsOf(network, background=cfg.model.loss == "ce")
    return module.to(device).eval()
