"""Pretrained weights: channel adaptation and 2D -> 3D inflation of DINOv3 backbones, the
Meta .pth -> DCP seed converter (pth_to_dcp.py), training from its seed, and the way back
(helpers/dcp_to_pth.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, _env, launch
from torchtitan.checkpoint import checkpoint_keys
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
    sys.path.insert(0, str(REPO / "helpers"))
    try:
        import dcp_to_pth
    finally:
        sys.path.remove(str(REPO / "helpers"))
    return dcp_to_pth.main(list(args))


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
    assert rc == 1
    assert "error:" in out.err and "missing keys: blocks.1.ls2.gamma" in out.err, out.err
    assert "unexpected keys: head.weight" in out.err, out.err
    assert not (tmp_path / "seeds" / "vit_debug_linear" / "checkpoint" / "step-0").exists()


def test_wrong_backbone_names_the_mismatched_shapes(meta_pth, tmp_path, capsys):
    rc, out = _convert(capsys, "--pth", str(meta_pth), "--dcp_root", str(tmp_path),
                       "--backbone", "vit_tiny")
    assert rc == 1 and "shape mismatches" in out.err, out.err
    assert "blocks.0.attn.proj.weight (64, 64) (model: (96, 96))" in out.err, out.err


def test_missing_pth_file(tmp_path, capsys):
    rc, out = _convert(capsys, "--pth", str(tmp_path / "nowhere.pth"), "--dcp_root", str(tmp_path),
                       "--backbone", "vit_debug")
    assert rc == 1 and "nowhere.pth" in out.err and "does not exist" in out.err, out.err


def test_existing_seed_is_kept_unless_overwrite(meta_pth, tmp_path, capsys):
    args = ["--pth", str(meta_pth), "--dcp_root", str(tmp_path), "--backbone", "vit_debug",
            "--prefix", "encoder.", "--dinov3_repo_path", "/somewhere"]
    rc, out = _convert(capsys, *args)
    assert rc == 0 and "not needed" in out.out
    step0 = tmp_path / "vit_debug_mae" / "checkpoint" / "step-0"
    assert "model.encoder.cls_token" in checkpoint_keys(step0)
    assert "train_mae.py" in out.out and "encoder.=encoder." in out.out
    rc, out = _convert(capsys, *args)
    assert rc == 1 and "--overwrite" in out.err
    rc, out = _convert(capsys, *args, "--overwrite")
    assert rc == 0


def test_dcp_to_pth_without_a_checkpoint(tmp_path, capsys):
    rc = _dcp_to_pth("--dcp", str(tmp_path), "--out", str(tmp_path / "x.pth"))
    err = capsys.readouterr().err
    assert rc == 1 and "not a complete DCP checkpoint" in err
    assert not (tmp_path / "x.pth").exists()
