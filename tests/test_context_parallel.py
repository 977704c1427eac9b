"""Context parallelism: parity with one process (models and trainer), the config rules, and
checkpoints that move between CP and other layouts.

CI: one ``torchrun --nproc_per_node 2`` launch of ``context_parallel_worker.py`` checks loss
and gradients of the 3D segmentation model (linear and multiscale heads) and the 3D MAE under
CP 2 against one process, to 1e-5 in float32, plus the config and mesh rules in process. The
slow suite trains through the trainer: CP 2, CP 2 x FSDP 2, CP with activation checkpointing
and torch.compile, MAE, and DCP checkpoints written under CP 2 resumed on one process and the
other way round.
"""

from __future__ import annotations

import pytest

from conftest import assert_same_losses, launch, train_losses
from torchtitan.config.manager import ConfigManager
from torchtitan.errors import ConfigError
from torchtitan.parallelisms.parallel_dims import ParallelDims, ParallelismError


@pytest.mark.distributed
def test_cp2_loss_and_gradients_match_one_process():
    r = launch("tests/context_parallel_worker.py", [], nproc=2)
    assert r.returncode == 0, r.stderr[-4000:]
    for case in ("segmentation_3d_linear", "segmentation_3d_multiscale", "mae_3d"):
        assert f"CP OK {case} " in r.stdout, r.stdout[-2000:]


# -- the rules -----------------------------------------------------------------------------------
SEG3D = "train_configs/debug_segmentation_3d.toml"  # crop (16, 32, 32), patch 8: 2 rows
CP2 = ["--training.context_parallel_degree", "2"]


def _problems(*args: str) -> str:
    with pytest.raises(ConfigError) as e:
        ConfigManager().parse_args(["--job.config_file", SEG3D, *CP2, *args])
    return str(e.value)


def test_config_rules_name_the_keys_and_the_way_out():
    ConfigManager().parse_args(["--job.config_file", SEG3D, *CP2])  # fits
    msg = _problems("--model.crop_size", "24,32,32")  # 3 rows of patches
    assert "context_parallel_degree' = 2 must divide the patch grid's first axis, 3 rows" in msg
    assert "multiple of 16" in msg
    assert "do not combine" in _problems("--training.tensor_parallel_degree", "2")
    assert "2D model" in _problems("--model.ndim", "2", "--model.crop_size", "32,32")
    assert "use 'bce' or 'ce'" in _problems("--model.loss", "bce_dice")


def test_mesh_sizes_with_cp():
    dims = ParallelDims(1, -1, 1, 8, cp=2)
    assert (dims.dp_shard, dims.dp_degree, dims.loss_degree) == (4, 4, 8)
    assert dims.fsdp_enabled and not dims.hsdp_enabled and dims.describe() == "FSDP 4 + CP 2"
    # CP alone reduces its gradients with FSDP over the CP ranks; with DDP, HSDP
    alone = ParallelDims(1, -1, 1, 2, cp=2)
    assert alone.fsdp_enabled and alone.dp_degree == 1 and alone.describe() == "CP 2"
    assert ParallelDims(2, 1, 1, 4, cp=2).hsdp_enabled
    with pytest.raises(ParallelismError, match="context_parallel_degree=3"):
        ParallelDims(1, -1, 1, 8, cp=3)


def test_mae_kept_tokens_must_split(tmp_path):
    from torchtitan.tasks.mae import MAETask

    cfg = ConfigManager().parse_args(["--job.config_file", "train_configs/debug_mae_3d.toml",
                                      *CP2, "--model.mask_ratio", "0.9"])  # 32 patches: 3 kept
    with pytest.raises(ConfigError, match="must divide the number of patches the MAE encoder "
                                          "keeps, 3"):
        MAETask(cfg)._check_context_parallel()


# -- through the trainer (slow) ------------------------------------------------------------------
STEPS = 4
DEBUG = ["--model.backbone", "vit_debug"]


def _train(cfg, data, dump, nproc, *extra, steps=STEPS):
    r = launch("train_segmentation.py" if "segmentation" in cfg else "train_mae.py", [
        "--job.config_file", cfg, "--data.dataset_path", str(data), "--job.dump_folder", str(dump),
        "--training.steps", str(steps), "--metrics.log_freq", "1", "--no-metrics.progress_bar",
        "--checkpoint.interval", "2", "--training.deterministic", *DEBUG, *extra], nproc=nproc,
               timeout=1200)  # compile on a busy CPU
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout + r.stderr


def _losses(cfg, data, dump, nproc, *extra):
    _train(cfg, data, dump, nproc, "--no-checkpoint.enable_checkpoint", *extra)
    return train_losses(dump)


def _same(reference, other, name):
    assert_same_losses(reference, other, name, rel=1e-5)


@pytest.fixture(scope="module")
def seg_single(demo_data, tmp_path_factory):
    return _losses(SEG3D, demo_data, tmp_path_factory.mktemp("cp") / "single", 0)


AC_FULL = ["--activation_checkpoint.mode", "full"]
TRAINER_CASES = {
    "cp2": (2, CP2),
    "cp2_fsdp2": (4, CP2),
    "cp2_ac_full_compile": (2, [*CP2, *AC_FULL, "--training.compile"]),
    "cp2_ddp2": (4, [*CP2, "--training.data_parallel_replicate_degree", "2",
                     "--training.data_parallel_shard_degree", "1"]),
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("nproc,extra", list(TRAINER_CASES.values()), ids=list(TRAINER_CASES))
def test_trainer_losses_match_one_process(seg_single, demo_data, tmp_path, nproc, extra):
    _same(seg_single, _losses(SEG3D, demo_data, tmp_path / "run", nproc, *extra), str(extra))


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_mae_and_multiscale_match_one_process(demo_data, tmp_path):
    mae = "train_configs/debug_mae_3d.toml"
    _same(_losses(mae, demo_data, tmp_path / "mae1", 0),
          _losses(mae, demo_data, tmp_path / "mae2", 2, *CP2, *AC_FULL), "mae cp2")
    multiscale = ["--model.head", "multiscale", "--model.head_channels", "16"]
    _same(_losses(SEG3D, demo_data, tmp_path / "ms1", 0, *multiscale),
          _losses(SEG3D, demo_data, tmp_path / "ms2", 2, *CP2, *multiscale), "multiscale cp2")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("save,load", [((2, CP2), (0, [])), ((0, []), (2, CP2))],
                         ids=["cp2_to_single", "single_to_cp2"])
def test_checkpoints_move_between_cp_and_one_process(seg_single, demo_data, tmp_path, save,
                                                     load):
    # warmup_steps (5) outlasts both runs, so stopping at step 2 leaves the LR schedule of the
    # uninterrupted 4-step run unchanged; steps 3 and 4 test the restored weights and the
    # restored optimizer state
    dump = tmp_path / "run"
    _train(SEG3D, demo_data, dump, save[0], *save[1], steps=2)
    assert (dump / "checkpoint" / "step-2" / ".metadata").is_file()
    out = _train(SEG3D, demo_data, dump, load[0], *load[1], steps=STEPS)
    assert "resumed from" in out and "step-2" in out, out[-2000:]
    _same(seg_single, train_losses(dump), f"resumed {save} -> {load}")
