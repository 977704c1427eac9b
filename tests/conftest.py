"""Shared fixtures: a small demo dataset made once per test session, and a torchrun helper.

The tests import the project as installed (`pip install -e .`, which ./run_tests.sh does), and
so do the scripts they start; pytest itself makes this file importable (`from conftest import
...`), as it does for every rootdir-relative conftest.py. The helper and benchmark scripts
(helpers/, bench/) are folders of scripts, not packages: a test runs one as a process, or
loads it from its file with :func:`script_module` to call its functions.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """A small demo set (same layout and objects as the default one, smaller volumes)."""
    from torchtitan.demo.data import generate_demo_data

    root = tmp_path_factory.mktemp("demo") / "data"
    generate_demo_data(root, seed=0, scale=0.5)
    return root


@pytest.fixture(scope="session")
def neuron_data(tmp_path_factory) -> Path:
    """A small volume of touching cells with object ids, imported as connectomics ground truth
    (``bench/shipped_configs.py`` ``neuron_data``): what configs with ``[affinities]`` train on."""
    shipped = script_module("bench/shipped_configs.py")
    return shipped.neuron_data(tmp_path_factory.mktemp("neurons"))


SEG2D_FOUR_STEPS = ["--job.config_file", "train_configs/debug_segmentation_2d.toml",
                    "--training.steps", "4", "--metrics.log_freq", "1",
                    "--checkpoint.interval", "2", "--no-metrics.progress_bar"]


@pytest.fixture(scope="session")
def seg2d_four_steps(demo_data, tmp_path_factory) -> Path:
    """The dump folder of one finished 2-process FSDP run of the 2D debug segmentation config
    (``SEG2D_FOUR_STEPS``): a loss record per step, checkpoints step-2 and step-4, validation
    at step 4. Made once for every module that needs such a run; copy it before changing it."""
    dump = tmp_path_factory.mktemp("seg2d_four_steps") / "run"
    r = launch("train_segmentation.py", ["--data.dataset_path", str(demo_data),
                                         "--job.dump_folder", str(dump), *SEG2D_FOUR_STEPS])
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return dump


def pytest_sessionstart(session) -> None:
    """Stop at once, saying what to do, when this checkout is not the one installed in the
    interpreter's environment: the scripts the tests start (python helpers/..., torchrun) would
    otherwise fail one by one, or run another checkout's code."""
    code = "import torchtitan; print(torchtitan.__file__)"
    r = subprocess.run([sys.executable, "-c", code], cwd=tempfile.gettempdir(),
                       env=_env(), capture_output=True, text=True, timeout=120)
    found = r.stdout.strip()
    if r.returncode != 0 or Path(found) != REPO / "torchtitan" / "__init__.py":
        where = f"it finds {found}" if r.returncode == 0 else r.stderr.strip().splitlines()[-1]
        pytest.exit(f"this checkout ({REPO}) is not installed in the environment of "
                    f"{sys.executable} ({where}). Run `pip install -e {REPO} --no-deps` "
                    "there, or ./run_tests.sh, which sets up .venv and does it.",
                    returncode=pytest.ExitCode.USAGE_ERROR)


@functools.cache
def script_module(path: str):
    """The script at ``path`` (relative to the repository: ``helpers/dcp_to_pth.py``) loaded
    from its file as a module named after it (``dcp_to_pth``, as when it runs), once."""
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickle look their module up by name
    spec.loader.exec_module(module)
    return module


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch(script: str, args: list[str], nproc: int = 2, timeout: int = 600,
           extra_torchrun: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run an entry script under torchrun (or plain python for nproc=0) and capture output."""
    if nproc == 0:
        cmd = [sys.executable, str(REPO / script), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               *(extra_torchrun or ["--standalone"]), str(REPO / script), *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def train_losses(dump: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(dump / "logs" / "metrics.jsonl") if "loss" in r}


def assert_same_losses(reference: dict, other: dict, name: str, rel: float) -> None:
    """Two runs' {step: loss} logged the same steps, each loss equal to ``rel``."""
    assert reference.keys() == other.keys(), name
    for step, loss in reference.items():
        assert other[step] == pytest.approx(loss, rel=rel), f"{name}, step {step}"


def assert_meta_init_is_finite(model) -> None:
    """A model built on the meta device and materialised with NaN everywhere comes out of
    ``init_weights`` with every parameter and buffer finite (nothing is left uninitialised)."""
    import torch

    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.fill_(float("nan"))
    model.init_weights()
    for key, value in model.state_dict().items():
        assert torch.isfinite(value).all(), key


def debug_run(script: str, config: str, data, dump, *extra: str, nproc: int = 0,
              timeout: int = 600):
    """Run ``script`` with ``config`` on ``data`` into ``dump`` (no progress bar) and check it
    exits 0; returns the completed process."""
    r = launch(script, ["--job.config_file", config, "--data.dataset_path", str(data),
                        "--job.dump_folder", str(dump), "--no-metrics.progress_bar", *extra],
               nproc=nproc, timeout=timeout)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r


# Cases that run in the slow suite (./run_tests.sh -m slow) because another CI test already
# covers their kind: CI keeps one warm start (an MAE encoder into a segmentation run), one real kill and resume, real signals (the SLURM
# scripts' SIGUSR1 and time limit), most shipped configs as shipped, FSDP/TP parity and DCP
# resumes, and keeps the non-slow suite within 15 minutes on 2 cores.
SLOW_SUITE_CASES = (
    "test_reliability_checkpoint.py::test_exclude_from_loading_applies_to_the_warm_start_only",
    "test_reliability_checkpoint.py::test_model_changes_stop_the_resume_and_other_changes_are_kept",
    "test_reliability_checkpoint.py::test_disk_full_on_rank1_keeps_the_previous_checkpoint",
    "test_reliability_checkpoint.py::test_initial_load_path_with_checkpointing_off",
    "test_shipped_configs.py::test_shipped_config_runs[demo_segmentation_2d]",
    "test_shipped_configs.py::test_shipped_config_runs[debug_mae_2d]",
    "test_shipped_configs.py::test_shipped_config_runs[quickstart_mae_2d]",
    # CI trains it as shipped in test_readme_own_em_3d.py (the README's 3D commands).
    "test_shipped_configs.py::test_shipped_config_runs[own_em_segmentation_3d]",
    "test_shipped_configs.py::test_compiled_blocks_see_a_fixed_attention_backend[sdpa-full]",
    "test_checkpointing.py::test_seed_checkpoint_gives_identical_starts",
    "test_checkpointing.py::test_model_only_final_export_and_resume_from_the_last_full_checkpoint",
    "test_checkpointing.py::test_two_node_launch_trains_and_checkpoints",
    "test_reliability_loop.py::test_train_timeout_applies_after_the_first_step",
    "test_reliability_loop.py::test_sigusr1_to_one_worker_saves_and_requeues",
    "test_reliability_loop.py::test_non_finite_steps_in_a_row_stop_the_run",
    "test_reliability_loop.py::test_corrupt_validation_crop_is_skipped_and_counted",
    "test_inference_extra.py::test_parity_with_tta_and_zyx_planes",
    "test_inference_extra.py::test_manifest_predicts_boxes_without_labels",
    "test_pth_to_dcp.py::test_original_readme_command_converts_a_hub_and_training_starts_from_it",
    "test_predict_outputs.py::test_marker_refusal_resume_and_overwrite",
    # CI predicts crops in one process in test_readme_predict.py (the README's commands).
    "test_predict.py::test_predict_crops_writes_ome_ngff_with_crop_geometry[0]",
    # CI resumes a killed run against a straight one (test_reliability_loop.py) and a checkpoint
    # across layouts (test_checkpointing.py), and runs TP against one process (test_parity.py).
    "test_training.py::test_resume_continues_after_the_last_checkpoint",
    "test_parity.py::test_tp_checkpoints_reshard[tp2_to_single]",
    "test_resume_workers.py::test_resume_reproduces_the_straight_run[fsdp-0]",
    "test_startup.py::test_resume_initialises_nothing",
    "test_startup.py::test_fsdp_start_holds_no_full_model_on_rank0",
    "test_parity.py::test_mae_3d_losses_match_single_process_with_tp[tp2_ac_full]",
    "test_parity.py::test_segmentation_losses_match_single_process[hsdp2x2]",
    "test_parity.py::test_segmentation_losses_match_single_process[fsdp2_ac_per_op]",
    "test_parity.py::test_segmentation_losses_match_single_process[ddp2_ac_every2]",
    "test_parity.py::test_other_configs_match_single_process[mae2d_ddp2_all_augmentations]",
    "test_remote_stores.py::test_training_from_http_matches_disk",
    "test_remote_stores.py::test_persistent_network_error_is_counted_like_a_corrupt_chunk",
    "test_slice_dataset.py::test_training_from_original_schema_slices",
    "test_slice_dataset.py::test_mae_training_from_slices",
    # CI keeps FSDP with AC, TP and the MAE under FSDP as its parity cases (test_parity.py),
    # the 2D seed conversion and training from it, one resume of workers' loaders, the compiled
    # loss inside a compiled model, and the device check's dry run of the GPU code.
    "test_parity.py::test_other_configs_match_single_process[seg2d_ddp2_all_augmentations]",
    "test_parity.py::test_other_configs_match_single_process[seg3d_fsdp2_ac_full]",
    "test_bench_quality.py::test_label_fractions_pretraining_and_equal_time",
    "test_heads_losses.py::test_compiled_loss_takes_the_same_sums_and_gradient",
    "test_pth_to_dcp.py::test_training_starts_from_the_seed_and_exports_a_meta_backbone[3d]",
    "test_pth_to_dcp.py::test_seed_round_trips_through_dcp_to_pth[3d]",
    "test_reliability_loop.py::test_best_checkpoint_survives_restart_and_purges",
    "test_resume_workers.py::test_the_weights_average_resumes_exactly",
    "test_bench_gpu.py::test_gpu_bench_dry_run_fills_every_section",
    # The debug configs train in many tests of their own; the own-EM MAE configs differ
    # from the segmentation ones CI runs by their task only.
    "test_shipped_configs.py::test_shipped_config_runs[debug_segmentation_2d]",
    "test_shipped_configs.py::test_shipped_config_runs[debug_segmentation_3d]",
    "test_shipped_configs.py::test_shipped_config_runs[debug_mae_3d]",
    "test_shipped_configs.py::test_shipped_config_runs[own_em_mae_2d]",
    "test_shipped_configs.py::test_shipped_config_runs[own_em_mae_3d]",
    # docs/own_em.md's commands train it as shipped (test_readme_own_em.py); the prediction
    # page's commands run two shards into one store (test_readme_predict.py), and CI's real
    # kill is the whole training job's (test_reliability_loop.py).
    "test_shipped_configs.py::test_shipped_config_runs[own_em_segmentation_2d]",
    "test_predict_shards.py::test_a_killed_shard_run_again_gives_the_store_of_one_job",
    "test_bench_quality.py::test_calibrate_only_times_each_model_and_trains_nothing",
    "test_bench_quality.py::test_each_trainer_model_gets_its_own_calibration_and_clock",
)


# The files whose tests take longest, longest first: they start first, so that with two test
# processes (./run_tests.sh) neither is left with a long file while the other has finished.
LONGEST_FILES = (
    "test_export.py", "test_bad_inputs.py", "test_readme_predict.py", "test_readme_export.py",
    "test_device_check.py", "test_reliability_loop.py", "test_readme_own_em.py",
    "test_inference_extra.py", "test_submission.py", "test_predict_shards.py",
    "test_readme_own_em_3d.py", "test_checkpointing.py", "test_parity.py", "test_training.py",
    "test_resume_workers.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    slow = set(SLOW_SUITE_CASES)
    for item in items:
        if item.nodeid.split("tests/", 1)[-1] in slow:
            item.add_marker(pytest.mark.slow)
    first = {name: rank for rank, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable otherwise
