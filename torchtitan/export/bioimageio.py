"""A trained model as a bioimage.io model package (spec 0.5, through ``bioimageio.spec``).

Written by :func:`write_package` for ``helpers/export_model.py``; what a package holds:

* **weights**: TorchScript (``weights_torchscript.pt``), ONNX (``weights.onnx``) and the
  PyTorch state dict (``weights.pt``, whose architecture is
  :func:`torchtitan.prediction.exported.build_network` with the run's ``[model]`` section: it needs
  this package installed; the other two need only PyTorch or an ONNX runtime);
* **input** ``em``: axes batch, channel (one: ``em``) and the spatial axes (2D: y, x; 3D: z,
  y, x) with the training voxel size in nanometres; the size is the training window
  (``model.crop_size``), the tile for blockwise prediction;
* **preprocessing**: the trainer's EM scaling as ``scale_linear`` (uint8 EM: ``x / 127.5 - 1``;
  EM with an intensity range [lo, hi]: ``clip`` to it, then the same on the uint8 scale);
* **output** ``probabilities``: one channel per class (named after it), each spatial axis with
  a halo of half the run's window overlap (``inference.overlap``), the part blended away when
  windows overlap; **postprocessing** ``sigmoid`` (``softmax`` over a background channel and
  the classes for the "ce" loss);
* **test tensors**: a real window of the training data and the network's output on it;
* the card: name, description, authors, licence, citations, tags, the model card
  (``README.md``, with the training data and validation scores), the resolved ``config.toml``
  as an attachment, and the run's validation scores under ``config.torchtitan``.

The folder is saved as ``rdf.yaml`` plus files, and zipped beside it (``bioimageio.zip``) with
``bioimageio.spec``'s own packager. ``bioimageio.core.test_model`` runs each weight format on
the test input and compares with the test output (tests/test_export.py does).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from torchtitan.errors import optional_import
from torchtitan.cellmap.affinities import AffinitySpec, config_outputs
from torchtitan.config.parsing import config_to_toml
from torchtitan.prediction import exported
from torchtitan.prediction.exported import ExportError
from torchtitan.data.crops.reader import em_input_affine
from torchtitan.export.trained_model import (
    Card,
    TrainedModel,
    model_card,
    model_name,
    state_dict,
    training_data,
    write_onnx,
    write_torchscript,
)

TEST_INPUT, TEST_OUTPUT = "test_input.npy", "test_output.npy"


def _spec():
    """``bioimageio.spec``'s model 0.5 module, or an error saying how to install it."""
    return optional_import("bioimageio.spec.model.v0_5", "export", "--format bioimageio")


def spatial_axes(ndim: int) -> list[str]:
    return ["z", "y", "x"][3 - ndim:]


def preprocessing(v, em_range: tuple[float, float] | None) -> list:
    """The trainer's EM input (:func:`torchtitan.data.crops.reader.em_to_model_input` of the
    stored EM) as bioimage.io operations: clipped to ``em_range`` (if any), then one linear
    map."""
    ops = [v.EnsureDtypeDescr(kwargs=v.EnsureDtypeKwargs(dtype="float32"))]
    if em_range is not None:
        lo, hi = em_range
        ops.append(v.ClipDescr(kwargs=v.ClipKwargs(min=lo, max=hi)))
    gain, offset = em_input_affine(em_range)
    ops.append(v.ScaleLinearDescr(kwargs=v.ScaleLinearKwargs(gain=gain, offset=offset)))
    ops.append(v.EnsureDtypeDescr(kwargs=v.EnsureDtypeKwargs(dtype="float32")))
    return ops


def input_tensor(v, model: TrainedModel, folder: Path):
    cfg = model.cfg
    ndim = cfg.model.ndim
    voxel = list(cfg.data.voxel_size)[3 - ndim:]
    axes = [v.BatchAxis(), v.ChannelAxis(channel_names=[v.Identifier("em")])]
    axes += [v.SpaceInputAxis(id=v.AxisId(a), size=int(n), scale=float(s), unit="nanometer")
             for a, n, s in zip(spatial_axes(ndim), cfg.model.crop_size, voxel)]
    raw = model.sample.raw
    np.save(folder / TEST_INPUT, raw[None])
    dtype = str(raw.dtype)
    data = v.IntervalOrRatioDataDescr(type=dtype) if dtype in _DTYPES else None
    if data is None:
        raise ExportError(f"the training EM is {dtype}, which bioimage.io inputs cannot be")
    return v.InputTensorDescr(
        id=v.TensorId("em"), axes=axes, test_tensor=v.FileDescr(source=Path(TEST_INPUT)),
        description=f"EM, as stored in the training data ({model.sample.where})", data=data,
        preprocessing=preprocessing(v, model.sample.em_range))


_DTYPES = ("float32", "float64", "uint8", "int8", "uint16", "int16", "uint32", "int32",
           "uint64", "int64")


def halo(window: int, overlap: float) -> int:
    """Half the overlap of neighbouring windows, in voxels: what blending leaves aside."""
    return int(window * overlap) // 2


def output_tensor(v, model: TrainedModel, folder: Path):
    cfg = model.cfg
    ndim, ce = cfg.model.ndim, cfg.model.loss == "ce"
    voxel = list(cfg.data.voxel_size)[3 - ndim:]
    names = (["background"] if ce else []) + config_outputs(cfg)
    axes = [v.BatchAxis(), v.ChannelAxis(channel_names=[v.Identifier(n) for n in names])]
    for a, n, s in zip(spatial_axes(ndim), cfg.model.crop_size, voxel):
        size = v.SizeReference(tensor_id=v.TensorId("em"), axis_id=v.AxisId(a))
        h = halo(int(n), cfg.inference.overlap)
        common = dict(id=v.AxisId(a), size=size, scale=float(s), unit="nanometer")
        axes.append(v.SpaceOutputAxisWithHalo(halo=h, **common) if h >= 1
                    else v.SpaceOutputAxis(**common))
    logits = torch.from_numpy(model.expected)
    probs = torch.softmax(logits, dim=1) if ce else torch.sigmoid(logits)
    np.save(folder / TEST_OUTPUT, probs.numpy())
    post = v.SoftmaxDescr(kwargs=v.SoftmaxKwargs(axis=v.AxisId("channel"))) if ce \
        else v.SigmoidDescr()
    what = "softmax over background and classes" if ce else "sigmoid of each class's logit"
    description = f"per-class probabilities ({what})"
    if len(names) > len(cfg.data.classes) + ce:  # at most 128 characters
        description = ("sigmoid probabilities of each class, then of the affinities "
                       "<class>_aff_<z>_<y>_<x> ('m': minus)")
    return v.OutputTensorDescr(
        id=v.TensorId("probabilities"), axes=axes, postprocessing=[post],
        test_tensor=v.FileDescr(source=Path(TEST_OUTPUT)),
        description=description,
        data=v.IntervalOrRatioDataDescr(type="float32"))


def write_weights(v, model: TrainedModel, folder: Path, opset: int, onnx: bool):
    """The weight files and their descriptions."""
    torch_version = v.Version(torch.__version__.split("+")[0])
    torch.save(state_dict(model), folder / exported.STATE_DICT)
    architecture = v.ArchitectureFromLibraryDescr(
        import_from="torchtitan.prediction.exported", callable=v.Identifier("build_network"),
        kwargs={"model": dataclasses.asdict(model.cfg.model),
                "classes": list(model.cfg.data.classes),
                "affinities": AffinitySpec.from_config(model.cfg).as_config()})
    weights = {"pytorch_state_dict": v.PytorchStateDictWeightsDescr(
        source=Path(exported.STATE_DICT), architecture=architecture,
        pytorch_version=torch_version)}
    write_torchscript(model, folder / exported.TORCHSCRIPT)
    weights["torchscript"] = v.TorchscriptWeightsDescr(
        source=Path(exported.TORCHSCRIPT), pytorch_version=torch_version,
        parent="pytorch_state_dict")
    if onnx:
        write_onnx(model, folder / exported.ONNX, opset)
        weights["onnx"] = v.OnnxWeightsDescr(source=Path(exported.ONNX), opset_version=opset,
                                             parent="pytorch_state_dict")
    return v.WeightsDescr(**weights)


def _cite(v, text: str, ref: str):
    if ref.startswith(("http://", "https://")):
        return v.CiteEntry(text=text, url=ref)
    return v.CiteEntry(text=text, doi=ref.removeprefix("https://doi.org/"))


def describe(v, model: TrainedModel, card: Card, folder: Path, opset: int, onnx: bool):
    """The package's description, with its files written into ``folder``."""
    cfg = model.cfg
    (folder / exported.CARD).write_text(model_card(model, card, hub=False))
    (folder / exported.CONFIG).write_text(config_to_toml(cfg))
    scores = {k: float(x) for k, x in model.scores.items()}
    return v.ModelDescr(
        name=model_name(model, card),
        description=card.description or cfg.job.description or "EM segmentation",
        authors=[v.Author(name=a) for a in card.authors],
        cite=[_cite(v, text, ref) for text, ref in card.cite],
        license=card.license,
        documentation=v.FileDescr(source=Path(exported.CARD)),
        git_repo=card.git_repo or None,
        tags=["electron-microscopy", "segmentation", f"{cfg.model.ndim}d", "pytorch",
              "torchtitan-em", *cfg.data.classes],
        inputs=[input_tensor(v, model, folder)],
        outputs=[output_tensor(v, model, folder)],
        weights=write_weights(v, model, folder, opset, onnx),
        attachments=[v.FileDescr(source=Path(exported.CONFIG))],
        config={"torchtitan": {"validation": scores, "checkpoint": model.checkpoint.name,
                               "training_data": training_data(model, card)}},
    )


def write_package(model: TrainedModel, card: Card, folder: Path, opset: int,
                  onnx: bool) -> list[Path]:
    """The package as a folder (``rdf.yaml`` and files) and as ``<folder>.zip``."""
    v = _spec()
    from bioimageio.spec import ValidationContext, save_bioimageio_package, \
        save_bioimageio_yaml_only

    folder.mkdir()
    with ValidationContext(root=folder, perform_io_checks=True):
        try:
            descr = describe(v, model, card, folder, opset, onnx)
        except ValueError as e:  # pydantic's ValidationError: a card field it refuses
            raise ExportError(f"the bioimage.io description is not valid: {e}") from None
    save_bioimageio_yaml_only(descr, folder / exported.RDF)
    zipped = folder.with_suffix(".zip")
    save_bioimageio_package(descr, output_path=zipped)
    return [folder, zipped]
