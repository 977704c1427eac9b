"""Exported models (helpers/export_model.py, predict.py --model) on real trained checkpoints.

Trained here, a few steps each, sizes reduced: the own-EM 2D and 3D recipes as shipped
(``bench/shipped_configs.py``'s reductions: sizes and paths only) and the 2D and 3D debug
configs with the linear and upconv heads; the demo model (``seg2d_four_steps``) is exported
and run by the README's commands (tests/test_readme_export.py). Every model is exported once
(module fixtures), in-process:

* ``predict.py --model`` with each weight format gives the checkpoint's probabilities:
  state dict and TorchScript to 1e-5, ONNX (onnxruntime) to 1e-4, 2D and 3D, every head;
* ``bioimageio.core``'s own test passes on the recipes' packages (every weight format on the
  test tensors), and the package says what the trainer does (voxel size, tile and halo, EM
  scaling, class names, card fields, validation scores);
* clear errors: an output folder that exists, a checkpoint that cannot be read, an ONNX opset
  that cannot express the model's attention, an export given where a checkpoint belongs and
  the reverse.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, debug_run, launch, script_module

pytest.importorskip("bioimageio.spec")
pytest.importorskip("onnxruntime")

predict = script_module("predict.py")
shipped = script_module("bench/shipped_configs.py")

# name -> (config, extra flags): what each model is trained with (2 steps, tiny sizes).
MODELS = {
    "own_em_2d": ("train_configs/own_em_segmentation_2d.toml", ()),
    "own_em_3d": ("train_configs/own_em_segmentation_3d.toml", ()),
    "linear_2d": ("train_configs/debug_segmentation_2d.toml", ("--model.head", "linear")),
    "upconv_2d": ("train_configs/debug_segmentation_2d.toml", ("--model.head", "upconv")),
    "linear_3d": ("train_configs/debug_segmentation_3d.toml", ("--model.head", "linear")),
    "upconv_3d": ("train_configs/debug_segmentation_3d.toml", ("--model.head", "upconv")),
}
PACKAGED = ("own_em_2d", "own_em_3d")  # bioimage.io's own test runs on these
TOLERANCE = {"state_dict": 1e-5, "torchscript": 1e-5, "onnx": 1e-4}
MEASURED: dict[tuple[str, str], float] = {}  # (model, weights) -> max abs difference


def train(name: str, data: Path, dump: Path, neurons: Path | None = None) -> Path:
    """One model, trained 2 steps on the demo ``data`` (on ``neurons``, an id volume, when
    its config's targets need ids)."""
    import tomllib

    config, extra = MODELS[name]
    if config.startswith("train_configs/own_em"):  # the recipe as shipped, sizes reduced
        if shipped.needs_ids(tomllib.loads((REPO / config).read_text())):
            data = neurons
        flags = shipped.reduced_overrides(REPO / config, data, dump, 2)
        r = launch("train_segmentation.py", [*flags, "--no-metrics.progress_bar"], nproc=0)
        assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    else:
        debug_run("train_segmentation.py", config, data, dump, "--training.steps", "2",
                  "--checkpoint.interval", "2", "--metrics.eval_freq", "0", *extra)
    return dump


@pytest.fixture(scope="module")
def exports(demo_data, neuron_data, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (run dump folder, export folder), every model trained and exported once."""
    from torchtitan.export.writer import Card, export_model

    root = tmp_path_factory.mktemp("exports")
    out = {}
    for name in MODELS:
        dump = train(name, demo_data, root / "runs" / name, neuron_data)
        formats = ("bioimageio", "hub") if name in PACKAGED else ("bioimageio",)
        card = Card(authors=["Test Author"], cite=[("A test citation", "10.1234/test")])
        export_model(str(dump / "checkpoint"), root / "exported" / name, formats=formats,
                     card=card)
        out[name] = (dump, root / "exported" / name)
    return out


def probabilities(tmp: Path, tag: str, *args: str) -> dict[str, np.ndarray]:
    """``predict.py ARGS --crops crop1 --probabilities`` in this process -> class -> s0."""
    import zarr

    store = tmp / f"{tag}.zarr"
    assert predict.main([*args, "--crops", "crop1", "--probabilities", "--out", str(store),
                         "--no-progress"]) == 0
    group = zarr.open_group(str(store), mode="r")["crop1"]
    return {cls: group[f"{cls}/s0"][:] for cls in group.group_keys()}


@pytest.mark.parametrize("name", list(MODELS))
def test_predict_from_each_export_equals_the_checkpoint(name, exports, tmp_path):
    dump, export = exports[name]
    reference = probabilities(tmp_path, "checkpoint", "--checkpoint", str(dump / "checkpoint"))
    sources = [("bioimageio", w) for w in TOLERANCE]  # the zip: tests/test_readme_export.py
    if name in PACKAGED:
        sources.append(("hub", "state_dict"))
    for folder, weights in sources:
        got = probabilities(tmp_path, f"{folder}_{weights}", "--model", str(export / folder),
                            "--weights", weights)
        assert got.keys() == reference.keys()
        diff = max(float(np.abs(got[c] - reference[c]).max()) for c in reference)
        MEASURED[(name, f"{folder}/{weights}")] = diff
        assert diff <= TOLERANCE[weights], (folder, weights, diff)
    print({k: f"{v:.1e}" for k, v in MEASURED.items() if k[0] == name})


@pytest.mark.parametrize("name", PACKAGED)
def test_bioimageio_core_test_passes_and_the_package_says_what_the_trainer_does(name, exports):
    from bioimageio.core import test_model
    from bioimageio.spec import load_model_description

    from torchtitan.cellmap.affinities import config_outputs
    from torchtitan.prediction.runs import load_run_config

    dump, export = exports[name]
    summary = test_model(export / "bioimageio.zip")
    failed = [(d.name, [e.msg for e in d.errors]) for d in summary.details if d.status != "passed"]
    assert summary.status == "passed", failed
    tested = {d.name for d in summary.details}
    for weights in ("onnx", "pytorch_state_dict", "torchscript"):
        assert f"Reproduce test outputs from test inputs ({weights})" in tested

    cfg = load_run_config(str(dump / "checkpoint"), None)
    descr = load_model_description(export / "bioimageio" / "rdf.yaml")
    em, probs = descr.inputs[0], descr.outputs[0]
    spatial = em.axes[2:]
    assert [a.size for a in spatial] == list(cfg.model.crop_size)  # the tile
    assert [a.scale for a in spatial] == list(cfg.data.voxel_size)[3 - cfg.model.ndim:]
    assert all(a.unit == "nanometer" for a in spatial)
    assert [a.halo for a in probs.axes[2:]] == [int(n * cfg.inference.overlap) // 2
                                                for n in cfg.model.crop_size]
    assert probs.axes[1].channel_names == config_outputs(cfg)  # classes, then affinities
    assert [p.id for p in em.preprocessing] == ["ensure_dtype", "scale_linear", "ensure_dtype"]
    assert em.preprocessing[1].kwargs.gain == pytest.approx(1 / 127.5)  # uint8 EM: x/127.5 - 1
    assert [p.id for p in probs.postprocessing][0] == "sigmoid"
    assert [a.name for a in descr.authors] == ["Test Author"]
    assert str(descr.cite[0].doi) == "10.1234/test" and descr.license == "CC-BY-4.0"
    scores = descr.config.model_dump()["torchtitan"]["validation"]
    assert scores["step"] == 2 and 0 <= scores["val/mean_iou"] <= 1
    card = (export / "hub" / "README.md").read_text()
    assert "## Training data" in card and "## Validation" in card and "val/mean_iou" in card
    assert "## Intended use" in card and (export / "hub" / "config.toml").is_file()


def test_an_existing_output_folder_is_refused_before_any_work(tmp_path):
    from torchtitan.export.writer import ExportError, export_model

    (tmp_path / "out").mkdir()
    with pytest.raises(ExportError, match="exists; choose a new folder"):
        export_model(str(tmp_path / "no_such_checkpoint"), tmp_path / "out")


def test_a_checkpoint_that_cannot_be_read_is_named(exports, tmp_path):
    from torchtitan.errors import UserError
    from torchtitan.export.writer import export_model

    with pytest.raises(UserError, match="does not exist"):
        export_model(str(tmp_path / "missing" / "checkpoint"), tmp_path / "a")
    dump, _ = exports["linear_2d"]
    broken = tmp_path / "run"
    shutil.copytree(dump, broken)
    for f in (broken / "checkpoint" / "step-2").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])  # truncated, as by a full disk
    with pytest.raises(UserError, match="step-2 cannot be read"):
        export_model(str(broken / "checkpoint"), tmp_path / "b")
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


def test_an_opset_without_the_models_attention_names_the_operator(exports, tmp_path):
    from torchtitan.export.writer import ExportError, export_model

    dump, _ = exports["linear_2d"]
    with pytest.raises(ExportError, match=r"opset 13 cannot express the operator "
                                          r"aten::scaled_dot_product_attention.*--opset"):
        export_model(str(dump / "checkpoint"), tmp_path / "out", formats=("bioimageio",),
                     opset=13)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_exports_and_checkpoints_are_not_taken_for_each_other(exports, tmp_path, capsys):
    dump, export = exports["linear_2d"]
    out = str(tmp_path / "p.zarr")
    assert predict.main(["--checkpoint", str(export / "bioimageio"), "--crops", "crop1",
                         "--out", out]) == 2
    assert "is an exported model, not a checkpoint: pass it with predict.py --model" in \
        capsys.readouterr().err
    assert predict.main(["--model", str(dump / "checkpoint"), "--crops", "crop1",
                         "--out", out]) == 2
    assert "is not an exported model" in capsys.readouterr().err
    hub = exports["own_em_2d"][1] / "hub"
    assert predict.main(["--model", str(hub), "--weights", "onnx", "--crops", "crop2",
                         "--out", out]) == 2
    assert "holds the state dict (model.safetensors) only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        predict.parse_args(["--checkpoint", str(dump), "--weights", "onnx", "--out", out])
