"""Loss parity across parallelisms: the same global batch and seed give the same losses on one
process, under DDP, FSDP, HSDP, tensor parallelism (alone and with FSDP or DDP), with
activation checkpointing and with torch.compile (float32, gloo, relative tolerance 1e-4).

CI runs a representative subset; the rest of the matrix is marked ``slow`` (``-m slow``).
"""

from __future__ import annotations

import pytest

from conftest import assert_same_losses, launch, train_losses

pytestmark = pytest.mark.distributed

STEPS = 5


def _train(cfg, data, dump, nproc, *extra, steps=STEPS):
    """Train (checkpoints every 2 steps unless ``extra`` turns them off); returns the output."""
    r = launch("train_segmentation.py" if "segmentation" in cfg else "train_mae.py", [
        "--job.config_file", cfg, "--data.dataset_path", str(data), "--job.dump_folder", str(dump),
        "--training.steps", str(steps), "--metrics.log_freq", "1", "--no-metrics.progress_bar",
        "--checkpoint.interval", "2", "--training.deterministic", *extra], nproc=nproc)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout + r.stderr


def _run(cfg, data, dump, nproc, *extra):
    """Train STEPS steps without checkpoints; returns {step: loss}."""
    _train(cfg, data, dump, nproc, "--no-checkpoint.enable_checkpoint", *extra)
    return train_losses(dump)


def _same(reference, other, name):
    assert_same_losses(reference, other, name, rel=1e-4)


SEG = "train_configs/debug_segmentation_2d.toml"
SHARD1 = ["--training.data_parallel_shard_degree", "1"]

# DDP and FSDP run in CI with activation checkpointing (the cases below them) and in the other
# configs' cases (without it); alone, on this config, in the slow suite.
CASES = {
    "ddp2": pytest.param(2, [*SHARD1, "--training.data_parallel_replicate_degree", "2"],
                         marks=pytest.mark.slow),
    "fsdp2": pytest.param(2, [], marks=pytest.mark.slow),
    "fsdp2_ac_full": (2, ["--activation_checkpoint.mode", "full"]),
    "ddp2_ac_every2": (2, [*SHARD1, "--training.data_parallel_replicate_degree", "2",
                           "--activation_checkpoint.mode", "selective",
                           "--activation_checkpoint.selective_ac_option", "2"]),
    "fsdp2_ac_per_op": (2, ["--activation_checkpoint.mode", "selective",
                            "--activation_checkpoint.selective_ac_option", "op"]),
    "hsdp2x2": (4, ["--training.data_parallel_replicate_degree", "2",
                    "--training.data_parallel_shard_degree", "2"]),
}


@pytest.fixture(scope="module")
def single(demo_data, tmp_path_factory):
    return _run(SEG, demo_data, tmp_path_factory.mktemp("parity") / "single", 0)


@pytest.mark.parametrize("nproc,extra", list(CASES.values()), ids=list(CASES))
def test_segmentation_losses_match_single_process(single, demo_data, tmp_path, nproc, extra):
    _same(single, _run(SEG, demo_data, tmp_path / "run", nproc, *extra), str(extra))


def test_mae_losses_match_single_process_under_fsdp_with_ac(demo_data, tmp_path):
    """MAE masks are drawn per sample from the data generator: the split does not matter."""
    cfg = "train_configs/debug_mae_3d.toml"
    reference = _run(cfg, demo_data, tmp_path / "single", 0)
    _same(reference, _run(cfg, demo_data, tmp_path / "fsdp", 2, "--activation_checkpoint.mode",
                          "full"), "mae fsdp2 + ac")


# -- tensor parallelism ------------------------------------------------------------------------
# vit_debug has 2 heads (vit_tiny: 3), so it splits over 2 tp ranks; the 3D MAE decoder too.
MAE = "train_configs/debug_mae_3d.toml"
DEBUG = ["--model.backbone", "vit_debug"]
TP2 = ["--training.tensor_parallel_degree", "2"]
AC_FULL = ["--activation_checkpoint.mode", "full"]
DDP2 = [*SHARD1, "--training.data_parallel_replicate_degree", "2"]
HSDP2X2 = ["--training.data_parallel_replicate_degree", "2",
           "--training.data_parallel_shard_degree", "2"]


@pytest.fixture(scope="module")
def single_debug(demo_data, tmp_path_factory):
    return _run(SEG, demo_data, tmp_path_factory.mktemp("parity") / "single_debug", 0, *DEBUG)


@pytest.fixture(scope="module")
def mae_single_debug(demo_data, tmp_path_factory):
    return _run(MAE, demo_data, tmp_path_factory.mktemp("parity") / "mae_single_debug", 0,
                *DEBUG)


slow = pytest.mark.slow
TP_CASES = {
    "tp2": (2, TP2),
    "fsdp2_tp2": pytest.param(4, TP2, marks=slow),
    "ddp2_tp2_ac_full": pytest.param(4, [*TP2, *DDP2, *AC_FULL], marks=slow),
    "hsdp2x2_tp2": pytest.param(8, [*TP2, *HSDP2X2], marks=slow),
    "tp2_ac_per_op": pytest.param(2, [*TP2, "--activation_checkpoint.mode", "selective",
                                      "--activation_checkpoint.selective_ac_option", "op"],
                                  marks=slow),
    "tp2_compile": pytest.param(2, [*TP2, "--training.compile"], marks=slow),
}


@pytest.mark.parametrize("nproc,extra", list(TP_CASES.values()), ids=list(TP_CASES))
def test_segmentation_losses_match_single_process_with_tp(single_debug, demo_data, tmp_path,
                                                          nproc, extra):
    _same(single_debug, _run(SEG, demo_data, tmp_path / "run", nproc, *DEBUG, *extra), str(extra))


MAE_TP_CASES = {
    "tp2_ac_full": (2, [*TP2, *AC_FULL]),
    "fsdp2_tp2": pytest.param(4, TP2, marks=slow),
}


@pytest.mark.parametrize("nproc,extra", list(MAE_TP_CASES.values()), ids=list(MAE_TP_CASES))
def test_mae_3d_losses_match_single_process_with_tp(mae_single_debug, demo_data, tmp_path,
                                                    nproc, extra):
    _same(mae_single_debug, _run(MAE, demo_data, tmp_path / "run", nproc, *DEBUG, *extra),
          f"mae {extra}")


# A checkpoint written by one parallelism resumes under another: 2 steps, then step 3 elsewhere;
# the loss of step 3 is the uninterrupted single-process one (the LR is still in warmup, so the
# shorter first run does not change the schedule).
RESHARD_CASES = {
    "tp2_to_single": (2, TP2, 0, []),
    "tp2_to_fsdp2": pytest.param(2, TP2, 2, [], marks=slow),
    "fsdp2_to_fsdp2_tp2": pytest.param(2, [], 4, TP2, marks=slow),
    "ddp2_tp2_to_tp2": pytest.param(4, [*DDP2, *TP2], 2, TP2, marks=slow),
    "hsdp2x2_tp2_to_single": pytest.param(8, [*HSDP2X2, *TP2], 0, [], marks=slow),
}


@pytest.mark.parametrize("save_nproc,save_extra,load_nproc,load_extra",
                         list(RESHARD_CASES.values()), ids=list(RESHARD_CASES))
def test_tp_checkpoints_reshard(single_debug, demo_data, tmp_path, save_nproc, save_extra,
                                load_nproc, load_extra):
    dump = tmp_path / "run"
    _train(SEG, demo_data, dump, save_nproc, *DEBUG, *save_extra, steps=2)
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file()
    out = _train(SEG, demo_data, dump, load_nproc, *DEBUG, *load_extra, steps=3)
    assert "resumed from" in out
    assert train_losses(dump)[3] == pytest.approx(single_debug[3], rel=1e-4)


# -- torch.compile -----------------------------------------------------------------------------
# Inductor on the CPU compiles each block in about a minute here: slow suite only.
COMPILE_CASES = {
    "compile_single": (0, ["--training.compile"]),
    "compile_fsdp2_ac_full": (2, ["--training.compile", *AC_FULL]),
}


@slow
@pytest.mark.parametrize("nproc,extra", list(COMPILE_CASES.values()), ids=list(COMPILE_CASES))
def test_segmentation_losses_match_single_process_with_compile(single, demo_data, tmp_path,
                                                               nproc, extra):
    _same(single, _run(SEG, demo_data, tmp_path / "run", nproc, *extra), str(extra))


# -- the other configs: 3D segmentation and 2D MAE ---------------------------------------------
SEG3D = "train_configs/debug_segmentation_3d.toml"
ALL_AUGMENTATIONS = ["--augmentation.rot90", "--augmentation.rotate_deg", "30",
                     "--augmentation.scale", "0.1", "--augmentation.contrast", "0.2",
                     "--augmentation.gamma", "0.2", "--augmentation.noise_std", "0.05",
                     "--augmentation.blur_sigma", "1.0", "--data.num_workers", "2"]
ON_DEVICE = ["--augmentation.resample_on", "device"]
MAE2D = "train_configs/debug_mae_2d.toml"
OTHER_CASES = {
    "seg3d_fsdp2_ac_full": (SEG3D, 2, AC_FULL, []),
    "seg3d_ddp2_ac_every2": pytest.param(SEG3D, 2, [*DDP2, "--activation_checkpoint.mode",
                                                    "selective",
                                                    "--activation_checkpoint.selective_ac_option",
                                                    "2"], [], marks=slow),
    "seg3d_hsdp2x2": pytest.param(SEG3D, 4, HSDP2X2, [], marks=slow),
    "seg3d_compile_fsdp2": pytest.param(SEG3D, 2, ["--training.compile"], [], marks=slow),
    "mae2d_ddp2_ac_per_op": pytest.param(MAE2D, 2, [*DDP2, "--activation_checkpoint.mode",
                                                    "selective",
                                                    "--activation_checkpoint.selective_ac_option",
                                                    "op"], [], marks=slow),
    "mae2d_fsdp2": pytest.param(MAE2D, 2, [], [], marks=slow),
    "mae2d_tp2_ac_full": pytest.param(MAE2D, 2, [*TP2, *AC_FULL], DEBUG, marks=slow),
    "mae2d_compile_single": pytest.param(MAE2D, 0, ["--training.compile"], [], marks=slow),
    # Every augmentation, with loader workers: intensity changes are made per sample on the
    # device, so the split of the batch does not matter either.
    "seg2d_ddp2_all_augmentations": (SEG, 2, DDP2, ALL_AUGMENTATIONS),
    # Rotation and zoom of EM made on the device too (on a GPU by default, here by choice).
    "mae2d_ddp2_all_augmentations": (MAE2D, 2, DDP2, [*ALL_AUGMENTATIONS, *ON_DEVICE]),
    "seg3d_fsdp2_all_augmentations": pytest.param(SEG3D, 2, [],
                                                  [*ALL_AUGMENTATIONS, *ON_DEVICE], marks=slow),
}


@pytest.mark.parametrize("cfg,nproc,extra,common", list(OTHER_CASES.values()),
                         ids=list(OTHER_CASES))
def test_other_configs_match_single_process(demo_data, tmp_path, cfg, nproc, extra, common):
    reference = _run(cfg, demo_data, tmp_path / "single", 0, *common)
    _same(reference, _run(cfg, demo_data, tmp_path / "run", nproc, *common, *extra), str(extra))


# -- the multiscale head (convolutional decoder with image skips at 1, 1/2, 1/4) -------------------
MULTISCALE = ["--model.head", "multiscale", "--model.head_channels", "32", *DEBUG]
# The 2D debug config's own head is the multiscale one: the cases above run it in CI under
# FSDP, DDP, HSDP and TP (with its default head_channels), so these 2D cases are slow only.
MULTISCALE_CASES = {
    "fsdp2": pytest.param(SEG, 2, [], marks=slow),
    "ddp2": pytest.param(SEG, 2, DDP2, marks=slow),
    "tp2": pytest.param(SEG, 2, TP2, marks=slow),
    "seg3d_fsdp2_tp2": pytest.param(SEG3D, 4, TP2, marks=slow),
    "seg3d_ddp2_ac_full": pytest.param(SEG3D, 2, [*DDP2, *AC_FULL], marks=slow),
}


@pytest.fixture(scope="module")
def single_multiscale(demo_data, tmp_path_factory):
    runs = {}

    def get(cfg):
        if cfg not in runs:
            runs[cfg] = _run(cfg, demo_data, tmp_path_factory.mktemp("multiscale") / "single", 0,
                             *MULTISCALE)
        return runs[cfg]
    return get


@pytest.mark.parametrize("cfg,nproc,extra", list(MULTISCALE_CASES.values()),
                         ids=list(MULTISCALE_CASES))
def test_multiscale_head_losses_match_single_process(single_multiscale, demo_data, tmp_path,
                                                     cfg, nproc, extra):
    _same(single_multiscale(cfg), _run(cfg, demo_data, tmp_path / "run", nproc, *MULTISCALE,
                                       *extra), str(extra))


# -- bfloat16 ----------------------------------------------------------------------------------
# bf16 parameters/activations (FSDP's mixed-precision policy, autocast on one process) round
# differently from float32 and from each other: FSDP casts each block's weights once, autocast
# casts per op, and reduction orders differ. The tolerance for bf16 is therefore that of the
# format (8 significant bits), not of the parallelism: relative 2e-2 between bf16 runs and
# between bf16 and float32, over 5 steps.
BF16_TOLERANCE = 2e-2
BF16 = ["--training.mixed_precision_param", "bfloat16"]


@slow
def test_bf16_losses_match_within_the_bf16_tolerance(single, demo_data, tmp_path):
    one = _run(SEG, demo_data, tmp_path / "single_bf16", 0, *BF16)
    fsdp = _run(SEG, demo_data, tmp_path / "fsdp2_bf16", 2, *BF16)
    ddp = _run(SEG, demo_data, tmp_path / "ddp2_bf16", 2, *DDP2, *BF16)
    for name, run in (("fsdp2", fsdp), ("ddp2", ddp), ("float32", single)):
        for step, loss in one.items():
            assert run[step] == pytest.approx(loss, rel=BF16_TOLERANCE), f"{name}, step {step}"
    # ...and bf16 really ran: not bit-equal to float32.
    assert any(one[s] != single[s] for s in one)
