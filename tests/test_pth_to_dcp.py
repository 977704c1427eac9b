"""Pretrained weights: channel adaptation and 2D -> 3D inflation of DINOv3 backbones, the
Meta .pth -> DCP seed converter (pth_to_dcp.py), training from its seed, and the way back
(helpers/dcp_to_pth.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, _env, launch, script_module
from torchtitan.checkpoint.reading import checkpoint_keys
from torchtitan.models import build_backbone
from torchtitan.models.inflate import (
    adapt_in_chans,
    adapt_patch_kernel_in_chans,
    inflate_state_dict_2d_to_3d,
)

SEG2D = "train_configs/debug_segmentation_2d.toml"
SEG3D = "train_configs/debug_segmentation_3d.toml"
PATCH = "patch_embed.proj.weight"


def _tokens(model, x):
    return model.patch_embed(x)[0]


# ---------------------------------------------------------------------------------------------
# Inflation and channel adaptation (models only, in-process)
# ---------------------------------------------------------------------------------------------


def test_inflated_3d_embedding_of_identical_slices_equals_the_2d_embedding():
    torch.manual_seed(0)
    m2 = build_backbone("vit_debug", ndim=2, in_chans=1, patch_size=8)
    m3 = build_backbone("vit_debug", ndim=3, in_chans=1, patch_size=8)
    sd2 = m2.state_dict()
    sd3 = inflate_state_dict_2d_to_3d(sd2, patch_size=8, rope_periods=m3.rope_embed.periods)
    m3.load_state_dict(sd3, strict=True)

    assert m3.patch_embed.proj.weight.shape == (64, 1, 8, 8, 8)
    for key, value in sd2.items():  # everything but the kernel and the periods is untouched
        if key not in (PATCH, "rope_embed.periods"):
            assert sd3[key] is value, key
    # The 3D model keeps its own RoPE periods: head_dim // 6 of them, not head_dim // 4.
    assert m3.rope_embed.periods.numel() == 32 // 6 and m2.rope_embed.periods.numel() == 32 // 4

    image = torch.randn(2, 1, 32, 24)
    depth_patches = 3
    volume = image.unsqueeze(2).expand(-1, -1, 8 * depth_patches, -1, -1).contiguous()
    with torch.no_grad():
        t2 = _tokens(m2, image)  # (B, 4 * 3, D)
        t3 = _tokens(m3, volume)  # (B, 3 * 4 * 3, D), z-major
    t3 = t3.reshape(2, depth_patches, t2.shape[1], -1)
    for z in range(depth_patches):
        torch.testing.assert_close(t3[:, z], t2, atol=1e-5, rtol=1e-5)


def test_inflation_without_periods_drops_them_and_rejects_bad_kernels():
    m2 = build_backbone("vit_debug", ndim=2, in_chans=1, patch_size=8)
    sd3 = inflate_state_dict_2d_to_3d(m2.state_dict(), patch_size=8)
    assert "rope_embed.periods" not in sd3
    m3 = build_backbone("vit_debug", ndim=3, in_chans=1, patch_size=8)
    result = m3.load_state_dict(sd3, strict=False)
    assert result.missing_keys == ["rope_embed.periods"] and not result.unexpected_keys
    with pytest.raises(ValueError, match="patch_size"):
        inflate_state_dict_2d_to_3d(m2.state_dict(), patch_size=16)
    with pytest.raises(ValueError, match="already 3D"):
        inflate_state_dict_2d_to_3d(m3.state_dict(), patch_size=8)


def test_rgb_kernel_to_one_channel_keeps_the_embedding_of_a_grey_image():
    torch.manual_seed(0)
    rgb = build_backbone("vit_debug", ndim=2, in_chans=3, patch_size=8)
    grey = build_backbone("vit_debug", ndim=2, in_chans=1, patch_size=8)
    grey.load_state_dict(adapt_in_chans(rgb.state_dict(), 1), strict=True)
    image = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        # A grey image in one channel == the same image in every RGB channel.
        torch.testing.assert_close(_tokens(grey, image), _tokens(rgb, image.expand(-1, 3, -1, -1)))


@pytest.mark.parametrize("in_chans", [2, 3, 6])
def test_other_channel_counts(in_chans):
    torch.manual_seed(0)
    w = torch.randn(5, 3, 4, 4)
    adapted = adapt_patch_kernel_in_chans(w, in_chans)
    assert adapted.shape == (5, in_chans, 4, 4)
    if in_chans == 3:
        assert torch.equal(adapted, w)
    if in_chans % 3 == 0:  # tiled and rescaled: equal channels embed as in RGB
        x = torch.randn(1, 1, 8, 8)
        torch.testing.assert_close(F.conv2d(x.expand(-1, in_chans, -1, -1), adapted, stride=4),
                                   F.conv2d(x.expand(-1, 3, -1, -1), w, stride=4))


# ---------------------------------------------------------------------------------------------
# pth_to_dcp.py / helpers/dcp_to_pth.py
# ---------------------------------------------------------------------------------------------


def _meta_state_dict() -> dict[str, torch.Tensor]:
    """A random 2D RGB vit_debug backbone under Meta's key names, with a few recognisable
    values so that we can tell later whether training started from it."""
    torch.manual_seed(1)
    sd = build_backbone("vit_debug", ndim=2, in_chans=3).state_dict()
    sd["storage_tokens"].fill_(3.0)
    sd["norm.weight"].fill_(2.0)
    return sd


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, script, *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)


def _ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def _dcp_to_pth(*args: str) -> int:
    """helpers/dcp_to_pth.py in this process (saves the interpreter start of a subprocess)."""
    main = script_module("helpers/dcp_to_pth.py").main

    return main(list(args))


@pytest.fixture(scope="module")
def meta_pth(tmp_path_factory):
    path = tmp_path_factory.mktemp("pth") / "dinov3_debug.pth"
    torch.save(_meta_state_dict(), path)
    return path


@pytest.fixture(scope="module", params=[2, 3], ids=["2d", "3d"])
def seed(request, meta_pth, tmp_path_factory):
    """pth_to_dcp.py run as a user would: returns (ndim, step-0 folder, its stdout)."""
    ndim = request.param
    root = tmp_path_factory.mktemp(f"seeds{ndim}d")
    result = _run("pth_to_dcp.py", "--pth", str(meta_pth), "--dcp_root", str(root),
                  "--backbone", "vit_debug", "--ndim", str(ndim), "--in_chans", "1")
    _ok(result)
    return ndim, root / "vit_debug_linear" / "checkpoint" / "step-0", result.stdout


def test_seed_checkpoint_layout(seed):
    from torch.distributed.checkpoint import FileSystemReader

    ndim, step0, stdout = seed
    assert (step0 / ".metadata").is_file() and (step0 / "conversion.json").is_file()
    assert not list(step0.parent.glob(".*tmp*")), "no temporary folder is left"
    keys = checkpoint_keys(step0)
    expected = {f"model.backbone.{k}" for k in _meta_state_dict()}
    assert keys == expected
    sizes = {k: tuple(v.size) for k, v in FileSystemReader(str(step0)).read_metadata().state_dict_metadata.items()}
    assert sizes[f"model.backbone.{PATCH}"] == (64, 1) + (16,) * ndim
    assert sizes["model.backbone.rope_embed.periods"] == ((32 // (2 * ndim)),)
    # The exact flags to train from it are printed.
    assert f"--checkpoint.initial_load_path {step0}" in stdout
    assert "--checkpoint.initial_load_prefix_map backbone.=backbone." in stdout


def test_seed_round_trips_through_dcp_to_pth(seed, tmp_path):
    ndim, step0, _ = seed
    out = tmp_path / "seed.pth"
    _ok(_run("helpers/dcp_to_pth.py", "--dcp", str(step0), "--out", str(out), "--what", "backbone"))
    back = torch.load(out, weights_only=True)
    build_backbone("vit_debug", ndim=ndim, in_chans=1).load_state_dict(back, strict=True)
    meta = _meta_state_dict()
    for key, value in meta.items():
        if key not in (PATCH, "rope_embed.periods"):
            assert torch.equal(back[key], value), key
    kernel = meta[PATCH].sum(dim=1, keepdim=True)  # RGB summed to one channel
    if ndim == 3:
        kernel = kernel.unsqueeze(2).expand(-1, -1, 16, -1, -1) / 16
    torch.testing.assert_close(back[PATCH], kernel)


@pytest.mark.distributed
def test_training_starts_from_the_seed_and_exports_a_meta_backbone(seed, demo_data, tmp_path):
    ndim, step0, _ = seed
    dump = tmp_path / "run"
    crop = "64,64" if ndim == 2 else "16,32,32"
    result = launch("train_segmentation.py", [
        "--job.config_file", SEG2D if ndim == 2 else SEG3D, "--data.dataset_path", str(demo_data),
        "--job.dump_folder", str(dump), "--training.steps", "2", "--no-metrics.progress_bar",
        "--model.backbone", "vit_debug", "--model.patch_size", "16", "--model.crop_size", crop,
        "--checkpoint.initial_load_path", str(step0),
        "--checkpoint.initial_load_prefix_map", "backbone.=backbone.",
    ], nproc=2 if ndim == 2 else 0)  # 3D in one process: the load is the same, and it is faster
    _ok(result)
    log = result.stdout + result.stderr
    assert "loaded" in log and str(step0) in log, log[-3000:]

    out = tmp_path / "trained_backbone.pth"
    assert _dcp_to_pth("--dcp", str(dump / "checkpoint"), "--out", str(out), "--what", "backbone") == 0
    trained = torch.load(out, weights_only=True)
    build_backbone("vit_debug", ndim=ndim, in_chans=1).load_state_dict(trained, strict=True)
    # Two small steps from the seed: its recognisable values are still (nearly) there.
    torch.testing.assert_close(trained["storage_tokens"], torch.full_like(trained["storage_tokens"], 3.0),
                               atol=0.02, rtol=0)
    torch.testing.assert_close(trained["norm.weight"], torch.full_like(trained["norm.weight"], 2.0),
                               atol=0.02, rtol=0)

    full = tmp_path / "full.pth"
    assert _dcp_to_pth("--dcp", str(dump), "--out", str(full), "--dtype", "bfloat16") == 0
    weights = torch.load(full, weights_only=True)
    assert any(k.startswith("head.") for k in weights) and f"backbone.{PATCH}" in weights
    assert weights[f"backbone.{PATCH}"].dtype == torch.bfloat16
    assert weights["backbone.rope_embed.periods"].dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Bad input: a clear message, non-zero exit, nothing written
# ---------------------------------------------------------------------------------------------


def _convert(capsys, *args):
    import pth_to_dcp

    rc = pth_to_dcp.main(list(args))
    return rc, capsys.readouterr()


def test_missing_and_unexpected_keys_are_named(tmp_path, capsys):
    sd = _meta_state_dict()
    del sd["blocks.1.ls2.gamma"]
    sd["head.weight"] = torch.zeros(3)
    pth = tmp_path / "bad.pth"
    torch.save(sd, pth)
    rc, out = _convert(capsys, "--pth", str(pth), "--dcp_root", str(tmp_path / "seeds"),
                       "--backbone", "vit_debug")
    assert rc == 2
    assert "error:" in out.err and "missing keys: blocks.1.ls2.gamma" in out.err, out.err
    assert "unexpected keys: head.weight" in out.err, out.err
    assert not (tmp_path / "seeds" / "vit_debug_linear" / "checkpoint" / "step-0").exists()


def test_wrong_backbone_names_the_mismatched_shapes(meta_pth, tmp_path, capsys):
    rc, out = _convert(capsys, "--pth", str(meta_pth), "--dcp_root", str(tmp_path),
                       "--backbone", "vit_tiny")
    assert rc == 2 and "shape mismatches" in out.err, out.err
    assert "blocks.0.attn.proj.weight (64, 64) (model: (96, 96))" in out.err, out.err


def test_missing_pth_file(tmp_path, capsys):
    rc, out = _convert(capsys, "--pth", str(tmp_path / "nowhere.pth"), "--dcp_root", str(tmp_path),
                       "--backbone", "vit_debug")
    assert rc == 2 and "nowhere.pth" in out.err and "does not exist" in out.err, out.err


def test_existing_seed_is_kept_unless_overwrite(meta_pth, tmp_path, capsys):
    args = ["--pth", str(meta_pth), "--dcp_root", str(tmp_path), "--backbone", "vit_debug",
            "--prefix", "encoder.", "--dinov3_repo_path", "/somewhere"]
    rc, out = _convert(capsys, *args)
    assert rc == 0 and "not needed" in out.out
    step0 = tmp_path / "vit_debug_mae" / "checkpoint" / "step-0"
    assert "model.encoder.cls_token" in checkpoint_keys(step0)
    assert "train_mae.py" in out.out and "encoder.=encoder." in out.out
    rc, out = _convert(capsys, *args)
    assert rc == 2 and "--overwrite" in out.err
    rc, out = _convert(capsys, *args, "--overwrite")
    assert rc == 0


def test_dcp_to_pth_without_a_checkpoint(tmp_path, capsys):
    rc = _dcp_to_pth("--dcp", str(tmp_path), "--out", str(tmp_path / "x.pth"))
    err = capsys.readouterr().err
    assert rc == 2 and "not a complete DCP checkpoint" in err
    assert not (tmp_path / "x.pth").exists()


# ---------------------------------------------------------------------------------------------
# The original project's workflow: every backbone of a torch hub folder, then a training run
# whose dump folder is the converted one starts from its step-0
# ---------------------------------------------------------------------------------------------

HUB_BACKBONE = "dinov3_vits16"  # the smallest DINOv3 of the registry (21M parameters)


def _hub_state_dict(name: str) -> dict[str, torch.Tensor]:
    """A random 2D RGB ``name`` backbone under Meta's key names (our keys are Meta's), with
    recognisable values that a fresh initialisation never has."""
    torch.manual_seed(2)
    sd = build_backbone(name, ndim=2, in_chans=3).state_dict()
    sd["storage_tokens"].fill_(3.0)
    sd["norm.weight"].fill_(2.0)
    return sd


@pytest.mark.distributed
def test_original_readme_command_converts_a_hub_and_training_starts_from_it(demo_data, tmp_path):
    from torchtitan.checkpoint.convert import read_model_weights

    hub, dcp_root = tmp_path / "torch_hub", tmp_path / "dcp"
    (hub / "checkpoints").mkdir(parents=True)
    torch.save(_hub_state_dict(HUB_BACKBONE),
               hub / "checkpoints" / f"{HUB_BACKBONE}_pretrain_lvd1689m-1a2b3c4d.pth")
    torch.save({"fc.weight": torch.zeros(2, 2)}, hub / "checkpoints" / "resnet50-0676ba61.pth")

    # The README's command, verbatim.
    result = subprocess.run(
        [sys.executable, "-u", "pth_to_dcp.py", "--torch_hub_path", str(hub),
         "--dinov3_repo_path", str(tmp_path / "dinov3"), "--dcp_root", str(dcp_root)],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    _ok(result)
    assert "--dinov3_repo_path is not needed" in result.stdout
    assert "skipped" in result.stdout and "resnet50-0676ba61.pth" in result.stdout, result.stdout
    run = dcp_root / f"{HUB_BACKBONE}_linear"
    step0 = run / "checkpoint" / "step-0"
    assert (step0 / ".metadata").is_file() and sorted(p.name for p in dcp_root.iterdir()) == [run.name]
    assert f"--job.dump_folder {run}" in result.stdout

    # Training in that folder: one AdamW step at lr 1e-9 moves a weight by about 1e-9, so
    # step-1's backbone equals the seed's (to 1e-6) only if the run started from it.
    result = launch("train_segmentation.py", [
        "--job.config_file", SEG2D, "--data.dataset_path", str(demo_data),
        "--job.dump_folder", str(run), "--training.steps", "1", "--no-metrics.progress_bar",
        "--model.backbone", HUB_BACKBONE, "--model.patch_size", "16", "--model.crop_size", "64,64",
        "--optimizer.lr", "1e-9", "--training.warmup_steps", "0", "--inference.overlap", "0",
    ])
    _ok(result)
    log = result.stdout + result.stderr
    assert f"starting from the seed checkpoint {step0} at step 0" in log, log[-3000:]
    assert "head. left as initialised" in log, log[-3000:]
    seed = read_model_weights(step0)
    trained = read_model_weights(run / "checkpoint" / "step-1")
    assert any(k.startswith("optimizer.") for k in checkpoint_keys(run / "checkpoint" / "step-1"))
    assert any(k.startswith("head.") for k in trained)
    for key, value in seed.items():
        torch.testing.assert_close(trained[key], value, atol=1e-6, rtol=0, msg=key)
    assert torch.equal(trained["backbone.norm.weight"], torch.full((384,), 2.0))


def _hub(tmp_path, files: dict[str, dict]):
    """A torch hub folder holding ``files`` (path relative to it -> state dict)."""
    hub = tmp_path / "hub"
    (hub / "checkpoints").mkdir(parents=True)
    for name, sd in files.items():
        torch.save(sd, hub / name)
    return hub


def test_hub_folder_names_seeds_by_backbone_and_pretraining_set(tmp_path, capsys, monkeypatch):
    sd = _meta_state_dict()  # vit_debug: a registry name, so that it is quick
    hub = _hub(tmp_path, {
        "checkpoints/vit_debug_pretrain_lvd1689m-0a1b2c3d.pth": sd,
        "vit_debug_pretrain_sat493m-4e5f6a7b.pth": sd,  # in the hub root: found too
        "checkpoints/vit_debug_ade20k_m2f_head-bf307cb1.pth": {"w": torch.zeros(1)},
        "checkpoints/dinov3_convnext_tiny_pretrain_lvd1689m-21b726bb.pth": {"w": torch.zeros(1)},
    })
    monkeypatch.chdir(tmp_path)  # --dcp_root defaults to ./outputs
    rc, out = _convert(capsys, "--torch_hub_path", str(hub))
    assert rc == 0, out.err
    outputs = tmp_path / "outputs"
    assert sorted(p.name for p in outputs.iterdir()) == ["vit_debug_linear", "vit_debug_linear_sat493m"]
    for name, data in (("vit_debug_linear", "lvd1689m"), ("vit_debug_linear_sat493m", "sat493m")):
        step0 = outputs / name / "checkpoint" / "step-0"
        assert checkpoint_keys(step0) == {f"model.backbone.{k}" for k in sd}
        assert f'"pretrain_data": "{data}"' in (step0 / "conversion.json").read_text()
    # Files that are not backbones are listed with the reason, never passed over silently.
    assert "skipped" in out.out and "vit_debug_ade20k_m2f_head-bf307cb1.pth" in out.out
    assert "a head or text encoder" in out.out
    assert "dinov3_convnext_tiny is not a backbone" in out.out, out.out

    # --backbone picks one backbone's files; existing seeds are kept unless --overwrite.
    rc, out = _convert(capsys, "--torch_hub_path", str(hub), "--backbone", "vit_tiny")
    assert rc == 2 and "--backbone vit_tiny was asked for" in out.out and "none of the" in out.err
    rc, out = _convert(capsys, "--torch_hub_path", str(hub))
    assert rc == 2 and out.err.count("already exists; pass --overwrite") == 2, out.err
    rc, out = _convert(capsys, "--torch_hub_path", str(hub), "--overwrite")
    assert rc == 0, out.err


def test_hub_file_of_another_size_is_a_clear_error(tmp_path, capsys):
    # vit_debug weights under a dinov3_vits16 name, next to a good vit_debug file.
    hub = _hub(tmp_path, {"checkpoints/dinov3_vits16_pretrain_lvd1689m-deadbeef.pth": _meta_state_dict(),
                          "checkpoints/vit_debug_pretrain_lvd1689m-0a1b2c3d.pth": _meta_state_dict()})
    rc, out = _convert(capsys, "--torch_hub_path", str(hub), "--dcp_root", str(tmp_path / "out"))
    assert rc == 2
    assert "dinov3_vits16_pretrain_lvd1689m-deadbeef.pth (a dinov3_vits16 checkpoint by its name) " \
           "does not match the model" in out.err, out.err
    assert "shape mismatches" in out.err
    assert "the tensors are those of vit_debug, not dinov3_vits16" in out.err
    assert "1 of 2 files were not converted" in out.err
    assert not (tmp_path / "out" / "dinov3_vits16_linear").exists()
    assert (tmp_path / "out" / "vit_debug_linear" / "checkpoint" / "step-0" / ".metadata").is_file()


def test_hub_folder_without_backbones_and_source_options(tmp_path, capsys):
    hub = _hub(tmp_path, {})
    rc, out = _convert(capsys, "--torch_hub_path", str(hub))
    assert rc == 2 and f"no .pth file in {hub / 'checkpoints'}" in out.err, out.err
    torch.save({}, hub / "checkpoints" / "resnet50-0676ba61.pth")
    rc, out = _convert(capsys, "--torch_hub_path", str(hub))
    assert rc == 2 and "skipped" in out.out and "resnet50" in out.out and "none of the 1 .pth" in out.err
    rc, out = _convert(capsys, "--torch_hub_path", str(tmp_path / "nowhere"))
    assert rc == 2 and "is not a folder" in out.err
    # Two downloads of one backbone and set would write one folder.
    torch.save(_meta_state_dict(), hub / "checkpoints" / "vit_debug_pretrain_lvd1689m-00000001.pth")
    torch.save(_meta_state_dict(), hub / "vit_debug_pretrain_lvd1689m-00000002.pth")
    rc, out = _convert(capsys, "--torch_hub_path", str(hub), "--dcp_root", str(tmp_path / "out"))
    assert rc == 2 and "would all be written to" in out.err and not (tmp_path / "out").exists()
    # --pth and --torch_hub_path are alternatives: exactly one.
    for args in ([], ["--pth", "x.pth", "--torch_hub_path", str(hub)]):
        with pytest.raises(SystemExit) as exit_:
            _convert(capsys, *args)
        assert exit_.value.code == 2
        assert "exactly one of --pth FILE" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# CheckpointManager.resume with a seed in the run's own folder (in-process, no torchrun)
# ---------------------------------------------------------------------------------------------


def _manager(dump, *flags):
    """A CheckpointManager over a small segmentation model, as the trainer builds it."""
    from torchtitan.checkpoint.manager import CheckpointManager
    from torchtitan.config.manager import ConfigManager
    from torchtitan.models import SegmentationModel
    from torchtitan.optimizer import build_lr_scheduler, build_optimizer
    from torchtitan.checkpoint.train_state import TrainState

    cfg = ConfigManager().parse_args(["--job.config_file", SEG2D, "--job.dump_folder", str(dump),
                                      "--model.backbone", "vit_debug", *flags])
    torch.manual_seed(0)
    backbone = build_backbone(cfg.model.backbone, ndim=2, in_chans=1, patch_size=16)
    model = SegmentationModel(backbone, len(cfg.data.classes))
    optimizer = build_optimizer(model, cfg)
    manager = CheckpointManager(cfg, model, optimizer, build_lr_scheduler(optimizer, cfg),
                                TrainState(cfg.training.batch_size, 1))
    return manager, model


# Single-process DCP saves and loads, as intended here.
single_process_dcp = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def seeded_run(meta_pth, tmp_path, capsys):
    """A run folder whose checkpoint/ holds only pth_to_dcp's 2D step-0."""
    rc, out = _convert(capsys, "--pth", str(meta_pth), "--dcp_root", str(tmp_path),
                       "--backbone", "vit_debug")
    assert rc == 0, out.err
    return tmp_path / "vit_debug_linear"


@single_process_dcp
def test_resume_starts_from_a_seed_in_the_runs_own_folder(seeded_run, caplog):
    from torchtitan.checkpoint.convert import read_model_weights

    manager, model = _manager(seeded_run)
    head_before = {k: v.clone() for k, v in model.head.state_dict().items()}
    with caplog.at_level("INFO", logger="torchtitan.checkpoint.manager"):
        assert manager.resume() == 0
    assert "head. left as initialised" in caplog.text
    seed = read_model_weights(seeded_run / "checkpoint" / "step-0")
    for key, value in model.state_dict().items():
        if key.startswith("backbone."):
            assert torch.equal(value, seed[key]), key
    for key, value in model.head.state_dict().items():
        assert torch.equal(value, head_before[key]), key
    assert not manager.optimizer.state  # fresh optimizer
    assert manager.train_state.step == 0


@single_process_dcp
def test_resume_starts_from_a_create_seed_checkpoint_step0(tmp_path):
    # checkpoint.create_seed_checkpoint writes the whole model as a model-only step-0.
    manager, model = _manager(tmp_path)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    manager.save(0, model_only=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    manager, model = _manager(tmp_path)
    assert manager.resume() == 0
    for key, value in model.state_dict().items():  # head included
        assert torch.equal(value, saved[key]), key


@single_process_dcp
def test_a_full_checkpoint_after_the_seed_wins_also_after_purging(seeded_run):
    manager, model = _manager(seeded_run, "--checkpoint.keep_latest_k", "1")
    manager.resume()
    # One optimizer step, then a full checkpoint at step 1; keep_latest_k=1 purges the seed.
    model(torch.randn(1, 1, 32, 32)).sum().backward()
    manager.optimizer.step()
    manager.train_state.step = 1
    manager.save(1)
    assert [p.name for p in (seeded_run / "checkpoint").iterdir()] == ["step-1"]
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    manager, model = _manager(seeded_run)
    assert manager.resume() == 1 and manager.optimizer.state
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key


@single_process_dcp
def test_seed_with_full_checkpoint_kept_resumes_from_the_full_one(seeded_run):
    manager, _ = _manager(seeded_run, "--checkpoint.keep_latest_k", "0")
    manager.resume()
    manager.train_state.step = 2
    manager.save(2)
    manager, _ = _manager(seeded_run)
    assert manager.resume() == 2
    # load_step=0 picks the seed on purpose.
    manager, _ = _manager(seeded_run, "--checkpoint.load_step", "0")
    assert manager.resume() == 0 and not manager.optimizer.state


@single_process_dcp
def test_model_only_export_after_the_seed_is_not_a_seed(seeded_run):
    from torchtitan.errors import CheckpointError

    manager, _ = _manager(seeded_run)
    manager.resume()
    manager.save(3, model_only=True)  # a final export
    manager, _ = _manager(seeded_run)
    with pytest.raises(CheckpointError, match=r"holds only model-only checkpoints \[0, 3\]"):
        manager.resume()


@single_process_dcp
def test_seed_of_another_backbone_is_a_clear_error(seeded_run):
    from torchtitan.errors import CheckpointError

    manager, _ = _manager(seeded_run, "--model.backbone", "vit_tiny")
    with pytest.raises(CheckpointError, match="does not fit this model") as err:
        manager.resume()
    assert "converted for --model.backbone vit_debug --model.ndim 2" in str(err.value)
