"""A table of bad inputs to every entry point, each a real process that must exit non-zero with
one message naming the key / file / value, no traceback, and no process left behind.

Config errors happen before any process group exists, so most cases run one plain ``python
script.py ...`` process; a few run under ``torchrun`` with 2 processes to prove that every rank
stops with a single message. The cases run concurrently (each its own process, each with a
timeout) and every case is then checked as its own test.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import zarr

from conftest import REPO, _env, script_module
from torchtitan.errors import UserError
from torchtitan.data.io.stores import StoreContext

SEG = "train_segmentation.py"
MAE = "train_mae.py"
PREDICT = "predict.py"
SEG2D = "train_configs/debug_segmentation_2d.toml"
EM = "recon-1/em/fibsem-uint8"
SECRET = "hf_secretTOKEN1234567890abcdef"
TIMEOUT = 180


@dataclass
class Case:
    id: str
    script: str
    args: list[str]  # "{data}", "{tmp}", "{run}", ... are filled from the context
    expect: list[str]  # substrings of stderr, each naming the key / file / value
    nproc: int = 0
    rc: int = 2
    toml: str | None = None  # written to {tmp}/<id>.toml and named by "{toml}"
    env: dict = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)  # must not appear in stdout or stderr
    slow: bool = False  # a further case of a kind the fast set covers (run with -m slow)


def train(*args: str, toml: str | None = None, **kw) -> dict:
    return {"args": list(args), "toml": toml, **kw}


CASES = [
    # ---- config: non-finite floats, command line and TOML --------------------------------------
    Case("cli_nan_lr", SEG, ["--optimizer.lr", "nan"],
         ["'optimizer.lr' on the command line: nan (must be a finite number"]),
    Case("cli_inf_weight_decay", SEG, ["--optimizer.weight_decay", "inf"],
         ["'optimizer.weight_decay' on the command line: inf (must be a finite number"], slow=True),
    Case("cli_nan_max_norm", SEG, ["--training.max_norm", "nan"],
         ["'training.max_norm' on the command line: nan (must be a finite"], slow=True),
    Case("cli_neg_inf_max_norm", MAE, ["--training.max_norm=-inf"],
         ["'training.max_norm' on the command line: -inf"], slow=True),
    Case("cli_inf_voxel_size", SEG, ["--data.voxel_size", "8,inf,8"],
         ["'data.voxel_size' on the command line: [8.0, inf, 8.0] (must be a finite"], slow=True),
    Case("cli_nan_noise_std", SEG, ["--augmentation.noise_std", "nan"],
         ["'augmentation.noise_std' on the command line: nan"], slow=True),
    Case("cli_nan_threshold", SEG, ["--inference.threshold", "NaN"],
         ["'inference.threshold' on the command line: nan"], slow=True),
    Case("cli_nan_class_weight", SEG, ["--model.class_weights", "1,nan,1,1"],
         ["'model.class_weights' on the command line: [1.0, nan, 1.0, 1.0]"]),
    Case("toml_nan_lr", SEG, ["--job.config_file", "{toml}"],
         ["invalid value for 'optimizer.lr' in {toml}: nan (must be a finite number"],
         toml="[optimizer]\nlr = nan\n"),
    Case("toml_inf_voxel_size", SEG, ["--job.config_file", "{toml}"],
         ["'data.voxel_size' in {toml}: [8.0, 8.0, inf]"], toml="[data]\nvoxel_size = [8, 8, inf]\n",
         slow=True),
    Case("toml_nan_max_norm", MAE, ["--job.config_file", "{toml}"],
         ["'training.max_norm' in {toml}: nan"], toml="[training]\nmax_norm = nan\n", slow=True),
    Case("toml_neg_inf_class_weight", SEG, ["--job.config_file", "{toml}"],
         ["'model.class_weights' in {toml}: [1.0, -inf]"],
         toml="[model]\nclass_weights = [1.0, -inf]\n", slow=True),
    Case("toml_nan_em_range", SEG, ["--job.config_file", "{toml}"],
         ["'data.em_range' in {toml}: [0.0, nan]"], toml="[data]\nem_range = [0, nan]\n", slow=True),
    # ---- config: options that could not take effect, and other value errors ---------------------
    Case("min_lr_factor_with_constant", SEG, ["--lr_scheduler.decay_type", "constant",
                                              "--lr_scheduler.min_lr_factor", "0.1"],
         ["'lr_scheduler.min_lr_factor' = 0.1 has no effect with 'lr_scheduler.decay_type' = "
          "'constant'"]),
    Case("export_dtype_without_model_only", SEG, ["--checkpoint.export_dtype", "bfloat16"],
         ["'checkpoint.export_dtype' = 'bfloat16' has no effect unless "
          "'checkpoint.last_save_model_only' = true"], slow=True),
    Case("prefix_map_with_full_load", SEG, ["--checkpoint.initial_load_path", "{tmp}",
                                            "--no-checkpoint.initial_load_model_only",
                                            "--checkpoint.initial_load_prefix_map", "a.=b."],
         ["'checkpoint.initial_load_prefix_map' = ['a.=b.'] has no effect with "
          "'checkpoint.initial_load_model_only' = false"], slow=True),
    Case("em_range_reversed", SEG, ["--data.em_range", "255,0"],
         ["'data.em_range' on the command line: [255.0, 0.0] (must be empty or two numbers"]),
    Case("em_range_with_slices", SEG, ["--data.em_range", "0,1", "--data.dataset_name", "x/y"],
         ["'data.em_range' = [0.0, 1.0] has no effect with 'data.dataset_name' = 'x/y'"]),
    Case("prefix_map_without_equals", SEG, ["--checkpoint.initial_load_prefix_map", "encoder."],
         ["'checkpoint.initial_load_prefix_map' on the command line",
          "'old_prefix=new_prefix'"], slow=True),
    Case("unknown_key_typo", SEG, ["--training.setps", "3"], ["training.setps", "training.steps"], slow=True),
    Case("steps_not_int", MAE, ["--training.steps", "ten"],
         ["'training.steps' on the command line: 'ten' (expected int"], slow=True),
    Case("class_weights_count", SEG, ["--model.class_weights", "1,2"],
         ["'model.class_weights' has 2 entries but 'data.classes' has 4"], slow=True),
    Case("crop_not_multiple_of_patch", SEG, ["--model.crop_size", "60,64"],
         ["'model.crop_size' = [60, 64] is not a multiple of 'model.patch_size' = 16"], slow=True),
    Case("config_file_missing", SEG, ["--job.config_file", "{tmp}/nowhere.toml"],
         ["config file not found: {tmp}/nowhere.toml"], slow=True),
    Case("toml_syntax", SEG, ["--job.config_file", "{toml}"], ["invalid TOML in {toml}"],
         toml="[training\nsteps = 3\n", slow=True),
    Case("toml_unknown_section", MAE, ["--job.config_file", "{toml}"], ["'optimiser'", "{toml}"],
         toml="[optimiser]\nlr = 0.1\n", slow=True),
    # ---- data --------------------------------------------------------------------------------------
    Case("dataset_path_missing", SEG, ["--job.config_file", SEG2D,
                                       "--data.dataset_path", "{tmp}/no_data"],
         ["data.dataset_path '{tmp}/no_data' does not exist"]),
    Case("unknown_class", SEG, ["--job.config_file", SEG2D, "--data.dataset_path", "{data}",
                                "--data.classes", "mito,mitochondria"],
         ["data.classes: unknown class 'mitochondria'"]),
    Case("float_em_without_range", MAE, ["--job.config_file", "train_configs/debug_mae_2d.toml",
                                         "--data.dataset_path", "{float_data}"],
         ["EM array {float_data}/", "is float32 and its group stores no intensity range",
          "data.em_range"]),
    Case("float_em_with_nan", SEG, ["--job.config_file", SEG2D, "--data.dataset_path",
                                    "{nan_data}", "--data.em_range", "0,1"],
         ["EM array {nan_data}/", "fibsem-uint8/s0 holds NaN"]),
    Case("unknown_val_crop", SEG, ["--job.config_file", SEG2D, "--data.dataset_path", "{data}",
                                   "--data.val_crops", "crop999"], ["crop999"], slow=True),
    # ---- checkpoints -------------------------------------------------------------------------------
    Case("initial_load_path_missing", SEG, ["--job.config_file", SEG2D, "--data.dataset_path",
                                            "{data}", "--job.dump_folder", "{tmp}/ck1",
                                            "--checkpoint.initial_load_path", "{tmp}/no_ckpt",
                                            "--training.steps", "1"], ["{tmp}/no_ckpt"]),
    Case("load_step_missing", SEG, ["--job.config_file", SEG2D, "--data.dataset_path", "{data}",
                                    "--job.dump_folder", "{run}", "--checkpoint.load_step", "7",
                                    "--training.steps", "8"],
         ["checkpoint.load_step=7: no complete checkpoint"]),
    # ---- predict.py --------------------------------------------------------------------------------
    Case("predict_no_config", PREDICT, ["--checkpoint", "{tmp}/nowhere", "--out", "{tmp}/p.zarr"],
         ["no config.toml found for checkpoint '{tmp}/nowhere'"]),
    Case("predict_missing_out", PREDICT, ["--checkpoint", "{run}/checkpoint"],
         ["the following arguments are required: --out"]),
    Case("predict_unknown_crop", PREDICT, ["--checkpoint", "{run}/checkpoint", "--data", "{data}",
                                           "--crops", "crop999", "--out", "{tmp}/p.zarr"],
         ["--crops 'crop999' matches no label crop"]),
    Case("predict_unknown_dataset", PREDICT, ["--checkpoint", "{run}/checkpoint", "--data",
                                              "{data}", "--dataset", "jrc_nowhere",
                                              "--out", "{tmp}/p.zarr"],
         ["--dataset 'jrc_nowhere' not found"]),
    Case("predict_manifest_missing", PREDICT, ["--checkpoint", "{run}/checkpoint", "--manifest",
                                               "{tmp}/none.csv", "--out", "{tmp}/p.zarr"],
         ["--manifest '{tmp}/none.csv' does not exist"]),
    Case("predict_pth_missing", PREDICT, ["--checkpoint", "{tmp}/model.pth", "--config",
                                          "{run}/config.toml", "--data", "{data}", "--crops",
                                          "crop1", "--out", "{tmp}/p.zarr"],
         ["checkpoint file {tmp}/model.pth does not exist"]),
    # ---- converters and helpers --------------------------------------------------------------------
    Case("pth_to_dcp_missing_file", "pth_to_dcp.py", ["--pth", "{tmp}/nowhere.pth",
                                                      "--dcp_root", "{tmp}/dcp"],
         ["{tmp}/nowhere.pth", "does not exist"], rc=2),
    Case("pth_to_dcp_bad_backbone", "pth_to_dcp.py", ["--pth", "x.pth", "--backbone", "vit_nope"],
         ["argument --backbone: invalid choice: 'vit_nope'"]),
    Case("dcp_to_pth_missing", "helpers/dcp_to_pth.py", ["--dcp", "{tmp}/no_dcp",
                                                         "--out", "{tmp}/o.pth"],
         ["{tmp}/no_dcp"], rc=2),
    Case("make_demo_data_scale", "helpers/make_demo_data.py", ["--scale", "5", "--out", "{tmp}/d"],
         ["scale must be in [0.1, 2.0] (--scale), got 5.0"]),
    Case("plot_single_unknown_crop", "helpers/plot_volumes_single.py",
         ["--zarr", "{data}", "--crop", "crop999", "--out", "{tmp}/x.gif"],
         ["no crop 'crop999'; available"]),
    Case("plot_grid_no_data", "helpers/plot_volumes_grid.py", ["--data", "{tmp}/no_data",
                                                              "--out", "{tmp}/g.gif"],
         ["{tmp}/no_data"]),
    Case("slices_no_data", "helpers/create_slice_dataset.py", ["--zarr", "{tmp}/no_data",
                                                              "--out", "{tmp}/s"],
         ["{tmp}/no_data"], rc=2),
    Case("slices_push_without_token", "helpers/create_slice_dataset.py",
         ["--zarr", "{data}", "--out", "{tmp}/s2", "--push_to_hub", "me/x"],
         ["--push_to_hub me/x: no Hugging Face token found"],
         env={"HF_TOKEN": "", "HF_HOME": "{tmp}/hf_home"}),
    Case("hub_dataset_token_not_printed", SEG, ["--job.config_file", SEG2D, "--data.dataset_name",
                                                "nobody/no-such-dataset"],
         ["data.dataset_name 'nobody/no-such-dataset'"],
         env={"HF_TOKEN": SECRET, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
              "HF_HOME": "{tmp}/hf_home"}, absent=[SECRET]),
    Case("score_no_predictions", "torchtitan/scoring/__main__.py", ["--predictions", "{tmp}/none.zarr",
                                                              "--groundtruth", "{data}"],
         ["{tmp}/none.zarr"]),
    # ---- output folders and seeds of a training run ---------------------------------------------
    Case("dump_folder_is_a_file", SEG, ["--job.config_file", SEG2D, "--data.dataset_path", "{data}",
                                        "--job.dump_folder", "{tmp}/run/config.toml"],
         ["job.dump_folder {tmp}/run/config.toml is an existing file, not a folder"]),
    Case("seed_beyond_2_64", SEG, ["--training.seed", str(2**64)],
         [f"'training.seed' on the command line: {2**64} (must be in [0, 2^64 - 1]"]),
    Case("seed_negative", MAE, ["--training.seed", "-1"],
         ["'training.seed' on the command line: -1 (must be in [0, 2^64 - 1]"], slow=True),
    Case("initial_load_of_another_backbone", SEG, [
        "--job.config_file", SEG2D, "--data.dataset_path", "{data}", "--job.dump_folder",
        "{tmp}/other_backbone", "--model.backbone", "vit_debug", "--training.steps", "1",
        "--checkpoint.initial_load_path", "{run}/checkpoint"],
         ["the checkpoint {run}/checkpoint/step-0 does not fit this model", "shape mismatches",
          "Check model.backbone"]),
    Case("full_load_of_another_backbone", SEG, [
        "--job.config_file", SEG2D, "--data.dataset_path", "{data}", "--job.dump_folder",
        "{tmp}/other_backbone_full", "--model.backbone", "vit_debug", "--training.steps", "1",
        "--checkpoint.initial_load_path", "{run}/checkpoint",
        "--no-checkpoint.initial_load_model_only"],
         ["{run}/checkpoint/step-0 holds only model weights"], slow=True),
    # ---- torchrun, 2 processes: every rank stops, one message --------------------------------------
    Case("torchrun_nan_lr", SEG, ["--job.config_file", SEG2D, "--optimizer.lr", "nan"],
         ["'optimizer.lr' on the command line: nan"], nproc=2, rc=None),
    Case("torchrun_nan_em", MAE, ["--job.config_file", "train_configs/debug_mae_2d.toml",
                                  "--data.dataset_path", "{nan_data}", "--data.em_range", "0,1"],
         ["holds NaN"], nproc=2, rc=None, slow=True),
]


# ---------------------------------------------------------------------------------------------
# Context: data stores and a run folder the cases point at
# ---------------------------------------------------------------------------------------------


def float_em_copy(demo_data: Path, dest: Path, nan: bool) -> Path:
    """The demo data with float32 EM (values / 255), optionally one NaN in each s0's centre."""
    shutil.copytree(demo_data, dest)
    for store in sorted(dest.glob("*/*.zarr")):
        g = zarr.open_group(str(store / EM), mode="r+")
        for name, arr in list(g.arrays()):
            data = arr[:].astype(np.float32) / 255
            if nan and name == "s0":
                data[tuple(n // 2 for n in data.shape)] = np.nan
            g.create_array(name, data=data, chunks=arr.chunks, overwrite=True)
    return dest


def command(case: Case) -> list[str]:
    script = str(REPO / case.script)
    if case.nproc == 0:
        return [sys.executable, script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(case.nproc), script]


def fill(text: str, ctx: dict) -> str:
    return text.format(**ctx)


def run_case(case: Case, ctx: dict) -> subprocess.CompletedProcess:
    ctx = dict(ctx, toml=str(Path(ctx["tmp"]) / f"{case.id}.toml"))
    if case.toml is not None:
        Path(ctx["toml"]).write_text(textwrap.dedent(case.toml))
    env = _env()
    env.update({k: fill(v, ctx) for k, v in case.env.items()})
    args = [fill(a, ctx) for a in case.args]
    return subprocess.run(command(case) + args, cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT, start_new_session=True)


def selected_ids(request) -> set[str]:
    """The cases this session runs (the fast set, or with -m slow also the others)."""
    return {item.callspec.params["case"].id for item in request.session.items
            if item.module is request.module and hasattr(item, "callspec")
            and "case" in item.callspec.params}


@pytest.fixture(scope="module")
def results(demo_data, tmp_path_factory, request) -> dict:
    tmp = tmp_path_factory.mktemp("bad")
    run = tmp / "run"
    seed = subprocess.run([sys.executable, str(REPO / SEG), "--job.config_file", SEG2D,
                           "--data.dataset_path", str(demo_data), "--job.dump_folder", str(run),
                           "--checkpoint.create_seed_checkpoint", "--no-metrics.progress_bar"],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert seed.returncode == 0, seed.stderr[-3000:]
    ctx = {"tmp": str(tmp), "data": str(demo_data), "run": str(run),
           "float_data": str(float_em_copy(demo_data, tmp / "float_data", nan=False)),
           "nan_data": str(float_em_copy(demo_data, tmp / "nan_data", nan=True))}
    with ThreadPoolExecutor(max_workers=4) as pool:
        wanted = selected_ids(request)
        futures = {c.id: pool.submit(run_case, c, ctx) for c in CASES if c.id in wanted}
        return {"ctx": ctx, **{k: f.result() for k, f in futures.items()}}


def test_at_least_eighty_cases():
    """Bad inputs in all: the processes of CASES and the in-process calls of CALLS."""
    ids = [c.id for c in CASES] + [c.id for c in CALLS]
    assert len(ids) >= 80 and len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.slow else c
                                  for c in CASES], ids=[c.id for c in CASES])
def test_bad_input(case: Case, results):
    r = results[case.id]
    ctx = dict(results["ctx"], toml=str(Path(results["ctx"]["tmp"]) / f"{case.id}.toml"))
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    if case.rc is not None:
        assert r.returncode == case.rc, out[-3000:]
    for text in case.expect:
        assert fill(text, ctx) in r.stderr, r.stderr[-3000:]
    # No traceback of ours (torchrun's launcher prints its own ChildFailedError traceback).
    ours = [f'File "{REPO}/{p}' for p in ("torchtitan", "train_", "predict", "pth_to", "helpers")]
    assert not any(frame in out for frame in ours), out[-3000:]
    if case.nproc == 0:
        assert "Traceback" not in out, out[-3000:]
    errors = re.findall(r"^(\S+\.py: )?error( \(rank \d+\))?:", r.stderr, re.M)
    assert len(errors) == 1, r.stderr[-3000:]  # one message, also under torchrun
    for text in case.absent:
        assert text not in out


def test_warmup_longer_than_the_run_is_said(results, demo_data, tmp_path):
    """warmup_steps > steps stays legal (runs are extended by resuming with more steps, debug
    runs shorten configs), but is said once at startup: here before a data error stops it."""
    r = subprocess.run([sys.executable, str(REPO / SEG), "--training.warmup_steps", "50",
                        "--training.steps", "10", "--data.dataset_path", str(tmp_path / "none")],
                       cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2
    assert ("'training.warmup_steps' = 50 is more than 'training.steps' = 10: the learning rate "
            "never reaches its peak") in r.stderr


def test_no_process_left(results):
    """Every case's process group is gone (each ran in its own session, and has exited)."""
    for case in CASES:
        if case.id in results:
            assert results[case.id].returncode is not None
    # Nothing of ours still runs with the case folder on its command line.
    tmp = results["ctx"]["tmp"]
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    left = [line for line in ps.splitlines() if tmp in line and "ps -eo" not in line]
    assert not left, left


def test_every_torch_load_is_weights_only():
    """A .pth is data, never code: every torch.load of the code (not the tests, which read files
    they wrote themselves) passes weights_only=True."""
    calls = []
    for path in sorted(REPO.rglob("*.py")):
        if any(part in (".venv", "shared", ".git", "tests") for part in path.relative_to(REPO).parts):
            continue
        text = path.read_text()
        for m in re.finditer(r"torch\.load\(", text):
            end, depth = m.end(), 1
            while depth and end < len(text):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            calls.append((path, text[m.start():end]))
    assert calls
    unsafe = [f"{p}: {c}" for p, c in calls if "weights_only=True" not in c]
    assert not unsafe, unsafe


# ---------------------------------------------------------------------------------------------
# In-process calls: the command lines of predict.py, the scoring command, pth_to_dcp.py and the
# helpers, given to their main(argv) in this process (the checks run at parse time or before
# any work, so a process each would only add interpreter start-ups)
# ---------------------------------------------------------------------------------------------


@dataclass
class Call:
    id: str
    entry: str  # "predict", "score", "pth_to_dcp" or a helper script, "helpers/<name>.py"
    args: list[str]  # filled from the context like Case.args
    expect: list[str]  # substrings of stderr
    rc: int = 2
    absent: list[str] = field(default_factory=list)  # must not appear in stderr


GT = "{data_copy}/jrc_synth-1/jrc_synth-1.zarr/recon-1/labels/groundtruth"
RUN = ["--checkpoint", "{run}/checkpoint"]
CROP1 = [*RUN, "--crops", "crop1"]
FLAG = "as the config's"

CALLS = [
    # ---- predict.py: flags checked as their config twins ----------------------------------------
    Call("predict_batch_size_negative", "predict", [*CROP1, "--out", "{tmp}/p.zarr", "--batch_size", "-1"],
         [f"argument --batch_size: -1 (must be >= 1; {FLAG} 'inference.batch_size')"]),
    Call("predict_batch_size_zero", "predict", [*CROP1, "--out", "{tmp}/p.zarr", "--batch_size", "0"],
         [f"argument --batch_size: 0 (must be >= 1; {FLAG} 'inference.batch_size')"]),
    Call("predict_batch_size_not_int", "predict", [*CROP1, "--out", "{tmp}/p.zarr", "--batch_size", "2.5"],
         [f"argument --batch_size: '2.5' (expected int; {FLAG} 'inference.batch_size')"]),
    Call("predict_threshold_nan", "predict", [*CROP1, "--out", "{tmp}/p.zarr", "--threshold", "nan"],
         ["argument --threshold: nan (must be a finite number; nan and inf are not allowed; "
          f"{FLAG} 'inference.threshold')"]),
    Call("predict_threshold_5", "predict", [*CROP1, "--out", "{tmp}/p.zarr", "--threshold", "5"],
         [f"argument --threshold: 5.0 (must be in [0, 1]; {FLAG} 'inference.threshold')"]),
    Call("predict_threshold_negative", "predict", [*CROP1, "--out", "{tmp}/p.zarr", "--threshold=-0.1"],
         [f"argument --threshold: -0.1 (must be in [0, 1]; {FLAG} 'inference.threshold')"]),
    Call("predict_planes_unknown", "predict", [*CROP1, "--out", "{tmp}/p.zarr", "--planes", "xy"],
         [f"argument --planes: 'xy' (allowed: 'z', 'zyx'; {FLAG} 'inference.planes')"]),
    Call("predict_max_block_mb_zero", "predict", [*CROP1, "--out", "{tmp}/p.zarr", "--max_block_mb", "0"],
         ["argument --max_block_mb: 0.0 (must be > 0)"]),
    Call("predict_max_block_mb_inf", "predict", [*CROP1, "--out", "{tmp}/p.zarr", "--max_block_mb", "inf"],
         ["argument --max_block_mb: inf (must be a finite number"]),
    Call("predict_pyramid_levels_negative", "predict", [*CROP1, "--out", "{tmp}/p.zarr",
                                                        "--pyramid_levels=-1"],
         ["argument --pyramid_levels: -1 (must be 0 (automatic) or a number of levels in [1, 64])"]),
    Call("predict_pyramid_levels_huge", "predict", [*CROP1, "--out", "{tmp}/p.zarr",
                                                    "--pyramid_levels", "1000"],
         ["argument --pyramid_levels: 1000 (must be 0 (automatic) or a number of levels"]),
    Call("predict_roi_nan", "predict", [*RUN, "--dataset", "jrc_synth-1", "--roi", "0:nan,0:80,0:80",
                                        "--out", "{tmp}/p.zarr"],
         ["--roi '0:nan,0:80,0:80': expected 'z0:z1,y0:y1,x0:x1' in nm"]),
    # ---- predict.py: outputs it did not create ----------------------------------------------------
    Call("predict_out_is_a_file", "predict", [*CROP1, "--out", "{run}/config.toml"],
         ["--out {run}/config.toml is an existing file, not a zarr store"]),
    Call("predict_out_is_label_data", "predict", [*CROP1, "--out", GT],
         [f"--out {GT}: lies inside the zarr store {GT[:-len('/groundtruth')]} (inside its "
          "labels/ group: a dataset's data)", "not with --overwrite either"]),
    Call("predict_out_is_label_data_overwrite", "predict", [*CROP1, "--out", GT, "--overwrite"],
         [f"--out {GT}: lies inside the zarr store"]),
    Call("predict_out_inside_em", "predict", [*CROP1, "--out", "{data_copy}/jrc_synth-1/jrc_synth-1.zarr/"
                                                              "recon-1/em/pred.zarr"],
         ["recon-1/em/pred.zarr: lies inside the zarr store", "(inside its em/ group"]),
    Call("predict_out_is_a_dataset_store", "predict", [*CROP1, "--out", "{data_copy}/jrc_synth-1/"
                                                                       "jrc_synth-1.zarr", "--overwrite"],
         ["jrc_synth-1.zarr: is a zarr store that predict.py did not write (no "
          "'torchtitan_prediction' attribute)"]),
    Call("predict_out_foreign_store", "predict", [*CROP1, "--out", "{foreign}/other.zarr"],
         ["{foreign}/other.zarr: is a zarr store that predict.py did not write"]),
    Call("predict_out_foreign_folder", "predict", [*CROP1, "--out", "{foreign}/notes"],
         ["{foreign}/notes: is a folder that is not a zarr store and not empty"]),
    Call("predict_out_foreign_region", "predict", [*CROP1, "--out", "{foreign}/ours_region.zarr",
                                                   "--overwrite"],
         ["{foreign}/ours_region.zarr/crop1: was not written by predict.py (no prediction attributes)"]),
    Call("predict_out_foreign_array", "predict", [*CROP1, "--out", "{foreign}/ours_array.zarr",
                                                  "--overwrite"],
         ["{foreign}/ours_array.zarr/crop1/mito: holds data predict.py did not write"]),
    Call("predict_submission_is_a_dataset_store", "predict", [
        *CROP1, "--out", "{tmp}/sub_pred.zarr", "--submission", "{data_copy}/jrc_synth-1/jrc_synth-1.zarr"],
         ["--submission {data_copy}/jrc_synth-1/jrc_synth-1.zarr: is a zarr store that predict.py "
          "did not write (no 'torchtitan_submission' attribute)"]),
    Call("predict_truncated_pth", "predict", ["--checkpoint", "{pth_truncated}", "--config",
                                              "{run}/config.toml", "--crops", "crop1",
                                              "--out", "{tmp}/trunc.zarr"],
         ["--checkpoint '{pth_truncated}' could not be read with torch.load",
          "the file is truncated or not a PyTorch checkpoint"]),
    # ---- the scoring command ---------------------------------------------------------------------
    Call("score_out_is_a_folder", "score", ["--predictions", "{pred_good}", "--groundtruth", "{data}",
                                            "--out", "{tmp}"],
         ["--out {tmp} is a folder; give the path of the JSON file to write"]),
    Call("score_voxel_size_in_um", "score", ["--predictions", "{pred_um}", "--groundtruth", "{data}"],
         ["{pred_um}/crop1/", "is 1000x off the crop's [8.0, 8.0, 8.0] nm; voxel_size and "
          "translation must be in nm"]),
    Call("score_translation_in_voxels", "score", ["--predictions", "{pred_vox}", "--groundtruth",
                                                  "{data}"],
         ["warning: {pred_vox}/crop1/", "of its crop", "check its translation (nm, centre of voxel 0)"],
         rc=0),
    Call("score_misspelt_class", "score", ["--predictions", "{pred_good}", "--groundtruth", "{data}",
                                           "--classes", "mitochondria"],
         ["--classes: unknown class 'mitochondria': not a CellMap class"]),
    Call("score_crops_not_numbers", "score", ["--predictions", "{pred_good}", "--groundtruth", "{data}",
                                              "--crops", "first"],
         ["--crops: 'first' is not a crop number"]),
    Call("score_metric_version", "score", ["--predictions", "{pred_good}", "--groundtruth", "{data}",
                                           "--metric-version", "2023"],
         ["argument --metric-version/--metric_version: invalid choice: '2023'"]),
    # ---- pth_to_dcp.py and helpers ---------------------------------------------------------------
    Call("pth_to_dcp_in_chans_zero", "pth_to_dcp", ["--pth", "{pth}", "--in_chans", "0"],
         [f"argument --in_chans: 0 (must be >= 1; {FLAG} 'model.in_chans')"]),
    Call("pth_to_dcp_ndim_4", "pth_to_dcp", ["--pth", "{pth}", "--ndim", "4"],
         ["argument --ndim: invalid choice: 4"]),
    Call("pth_to_dcp_dcp_root_is_a_file", "pth_to_dcp", ["--pth", "{pth}", "--dcp_root",
                                                         "{run}/config.toml"],
         ["--dcp_root {run}/config.toml is an existing file"]),
    Call("pth_to_dcp_truncated", "pth_to_dcp", ["--pth", "{pth_truncated}", "--dcp_root", "{tmp}/dcp_t"],
         ["--pth '{pth_truncated}' could not be read with torch.load"]),
    Call("dcp_to_pth_out_is_a_folder", "helpers/dcp_to_pth.py", ["--dcp", "{run}/checkpoint", "--out",
                                                              "{tmp}"],
         ["--out {tmp} is a folder; give the path of the .pth file to write"]),
    Call("plot_single_misspelt_class", "helpers/plot_volumes_single.py", [
        "--zarr", "{data}", "--classes", "mitochondria", "--out", "{tmp}/c.gif"],
         ["--classes: unknown class 'mitochondria': not a CellMap class and annotated by no crop"]),
    Call("plot_single_voxel_size_nan", "helpers/plot_volumes_single.py", [
        "--zarr", "{data}", "--voxel_size", "8,nan,8", "--out", "{tmp}/v.gif"],
         ["argument --voxel_size: [8.0, nan, 8.0] (must be a finite number"]),
    Call("plot_single_voxel_size_zero", "helpers/plot_volumes_single.py", [
        "--zarr", "{data}", "--voxel_size", "0", "--out", "{tmp}/v.gif"],
         ["argument --voxel_size: [0.0] (must be one or three numbers > 0, nm (z,y,x))"]),
    Call("plot_single_scale_huge", "helpers/plot_volumes_single.py", [
        "--zarr", "{data}", "--scale", "1000", "--out", "{tmp}/s.gif"],
         ["argument --scale: 1000 (must be an integer zoom in [1, 32])"]),
    Call("plot_single_out_is_a_folder", "helpers/plot_volumes_single.py", ["--zarr", "{data}", "--out",
                                                                       "{tmp}"],
         ["--out {tmp} is a folder; give the path of the file to write"]),
    Call("plot_max_frames_zero", "helpers/plot_volumes_single.py", [
        "--zarr", "{data}", "--max_frames", "0", "--out", "{tmp}/m.gif"],
         ["argument --max_frames: 0 (must be >= 1)"]),
    Call("plot_duration_negative", "helpers/plot_volumes_grid.py", [
        "--data", "{data}", "--duration_ms=-5", "--out", "{tmp}/d.gif"],
         ["argument --duration_ms: -5 (must be in [1, 60000] ms)"]),
    Call("plot_grid_cols_zero", "helpers/plot_volumes_grid.py", ["--data", "{data}", "--cols", "0",
                                                             "--out", "{tmp}/g.gif"],
         ["argument --cols: 0 (must be in [1, 64])"]),
    Call("plot_grid_tile_px_huge", "helpers/plot_volumes_grid.py", ["--data", "{data}", "--tile_px",
                                                                "100000", "--out", "{tmp}/g.gif"],
         ["argument --tile_px: 100000 (must be in [16, 4096])"]),
    Call("plot_grid_misspelt_class", "helpers/plot_volumes_grid.py", [
        "--data", "{data}", "--classes", "nucleus", "--out", "{tmp}/g.gif"],
         ["--classes: unknown class 'nucleus'"]),
    Call("slices_num_proc_zero", "helpers/create_slice_dataset.py", ["--zarr", "{data}", "--out",
                                                                  "{tmp}/sl", "--num_proc", "0"],
         ["argument --num_proc: 0 (must be >= 1)"]),
    Call("slices_voxel_size_inf", "helpers/create_slice_dataset.py", ["--zarr", "{data}", "--out",
                                                                   "{tmp}/sl", "--voxel_size", "inf"],
         ["argument --voxel_size: [inf] (must be a finite number"]),
    Call("slices_misspelt_class", "helpers/create_slice_dataset.py", ["--zarr", "{data}", "--out",
                                                                   "{tmp}/sl", "--classes", "mitochondria"],
         ["--classes: unknown class 'mitochondria'"]),
    Call("make_demo_seed_negative", "helpers/make_demo_data.py", ["--seed", "-3", "--out", "{tmp}/dm"],
         [f"argument --seed: -3 (must be in [0, 2^64 - 1] (torch's seeds); {FLAG} 'training.seed')"]),
    Call("make_demo_scale_nan", "helpers/make_demo_data.py", ["--scale", "nan", "--out", "{tmp}/dm"],
         ["scale must be in [0.1, 2.0] (--scale), got nan"]),
]


def call_entry(entry: str, argv: list[str]) -> int:
    """``entry``'s main(argv) as its command line runs it: a UserError is one ``error:`` line
    (run_cli), an argparse error SystemExit(2)."""
    import importlib

    from torchtitan.errors import run_cli

    if entry == "predict":
        import predict

        return predict.main(argv)
    if entry == "score":
        from torchtitan.scoring.stores import main

        return main(argv)
    module = script_module(entry) if entry.endswith(".py") else importlib.import_module(entry)
    return run_cli(module.main, argv)


def _prediction_store(path: Path, crop, scale_by: float, translation_in_voxels: bool) -> str:
    """Crop ``crop``'s ground truth written as a prediction store (the submission format: arrays
    with voxel_size and translation), its voxel size scaled or its translation in voxels."""
    root = zarr.open_group(str(path), mode="w", zarr_format=2)
    for cls, levels in crop.classes.items():
        level = levels[0]
        data = (np.asarray(crop.stores.open_array(level.path)[...]) == 1).astype(np.uint8)
        arr = root.require_group(crop.name).create_array(cls, data=data, chunks=data.shape)
        scale, translation = np.asarray(level.scale), np.asarray(level.translation)
        arr.attrs["voxel_size"] = (scale * scale_by).tolist()
        arr.attrs["translation"] = (translation / scale if translation_in_voxels
                                    else translation * scale_by).tolist()
    return str(path)


@pytest.fixture(scope="module")
def call_ctx(results, tmp_path_factory) -> dict:
    """The context of the in-process calls: that of the processes, plus a copy of one dataset,
    stores predict.py did not write, prediction stores with grid mistakes and .pth files."""
    from torchtitan.data.crops.layout import discover
    from torchtitan.prediction.store import OWNER_ATTR

    ctx = dict(results["ctx"])
    tmp = tmp_path_factory.mktemp("calls")
    copy = tmp / "data_copy"
    shutil.copytree(Path(ctx["data"]) / "jrc_synth-1", copy / "jrc_synth-1")
    foreign = tmp / "foreign"
    zarr.open_group(str(foreign / "other.zarr"), mode="w", zarr_format=2).create_array(
        "raw", data=np.ones((4, 4, 4), np.uint8))
    (foreign / "notes").mkdir()
    (foreign / "notes" / "README.txt").write_text("mine\n")
    for name in ("ours_region.zarr", "ours_array.zarr"):
        root = zarr.open_group(str(foreign / name), mode="w", zarr_format=2)
        root.attrs[OWNER_ATTR] = {"checkpoint": "x"}
        region = root.require_group("crop1")
        if name == "ours_array.zarr":
            region.attrs[OWNER_ATTR] = True
            region.create_array("mito", data=np.ones((4, 4, 4), np.uint8))
        else:
            region.create_array("raw", data=np.ones((4, 4, 4), np.uint8))
    crop = next(c for s in discover(StoreContext(), ctx["data"]) for c in s.crops if c.name == "crop1")
    pth = tmp / "model.pth"
    assert call_entry("helpers/dcp_to_pth.py", ["--dcp", f"{ctx['run']}/checkpoint",
                                             "--out", str(pth)]) == 0
    truncated = tmp / "truncated.pth"
    truncated.write_bytes(pth.read_bytes()[: pth.stat().st_size // 3])
    return {**ctx, "tmp": str(tmp), "data_copy": str(copy), "foreign": str(foreign),
            "pth": str(pth), "pth_truncated": str(truncated),
            "pred_good": _prediction_store(tmp / "good.zarr", crop, 1.0, False),
            "pred_um": _prediction_store(tmp / "um.zarr", crop, 1e-3, False),
            "pred_vox": _prediction_store(tmp / "vox.zarr", crop, 1.0, True)}


def tree_digest(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder``."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("call", CALLS, ids=[c.id for c in CALLS])
def test_bad_call(call: Call, call_ctx, capsys):
    """One ``error:`` line naming the value (exit 2), no traceback; nothing written: the data
    copy and the foreign stores hold the same bytes afterwards."""
    data_copy, foreign = Path(call_ctx["data_copy"]), Path(call_ctx["foreign"])
    before = tree_digest(data_copy), tree_digest(foreign)
    capsys.readouterr()
    try:
        rc = call_entry(call.entry, [fill(a, call_ctx) for a in call.args])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err
    assert rc == call.rc, err[-3000:]
    for text in call.expect:
        assert fill(text, call_ctx) in err, err[-3000:]
    assert "Traceback" not in err
    errors = re.findall(r"(?:^|: )error( \(rank \d+\))?: ", err, re.M)
    assert len(errors) == (1 if call.rc else 0), err[-3000:]
    assert (tree_digest(data_copy), tree_digest(foreign)) == before


def test_predict_never_writes_into_label_data(call_ctx, capsys):
    """predict.py pointed at a dataset's ground truth (with and without --overwrite), its EM
    group or the dataset store itself refuses, and every label and EM file keeps its bytes."""
    store = Path(call_ctx["data_copy"]) / "jrc_synth-1" / "jrc_synth-1.zarr"
    before = tree_digest(store)
    assert any("labels/groundtruth/crop1/mito/s0" in k for k in before)
    for out, extra in ((store / "recon-1/labels/groundtruth", []),
                       (store / "recon-1/labels/groundtruth", ["--overwrite"]),
                       (store / "recon-1/labels/groundtruth/crop1", ["--overwrite"]),
                       (store / "recon-1/em/fibsem-uint8", ["--overwrite"]),
                       (store, ["--overwrite"])):
        rc = call_entry("predict", ["--checkpoint", f"{call_ctx['run']}/checkpoint",
                                    "--data", call_ctx["data_copy"], "--crops", "crop1",
                                    "--out", str(out), *extra])
        err = capsys.readouterr().err
        assert rc == 2 and f"--out {out}" in err, err[-3000:]
        assert "did not write" in err or "lies inside" in err, err[-3000:]
    assert tree_digest(store) == before


# ---------------------------------------------------------------------------------------------
# A second run into the dump folder of a live one
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nproc", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_second_run_into_a_live_runs_folder_stops(demo_data, tmp_path, nproc):
    """The first run trains (under torchrun: its two ranks share the lock); frozen with SIGSTOP
    once it has a checkpoint and logs, it is a live holder whose files cannot change. A second
    run into its folder (another seed) exits 2 naming it, and leaves every file as it was."""
    import json
    import os
    import signal
    import socket
    import time

    from torchtitan.checkpoint.reading import complete_steps

    dump = tmp_path / "run"
    common = ["--job.config_file", SEG2D, "--data.dataset_path", str(demo_data),
              "--job.dump_folder", str(dump), "--no-metrics.progress_bar"]
    first_case = Case("first", SEG, [], [], nproc=nproc)
    first = subprocess.Popen(command(first_case) + common + [
        "--training.steps", "1000", "--checkpoint.interval", "1", "--metrics.log_freq", "1",
        "--metrics.eval_freq", "0"], cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT * 2
        while not (complete_steps(dump / "checkpoint") and (dump / "logs" / "metrics.jsonl").is_file()):
            assert first.poll() is None, first.stderr.read()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.5)
        # torchrun starts its workers in sessions of their own: stop each of them too.
        frozen = [first.pid] + [int(p) for p in subprocess.run(
            ["pgrep", "-P", str(first.pid)], capture_output=True, text=True).stdout.split()]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        holder = json.loads((dump / "run.lock").read_text())
        launcher = first.pid  # python itself, or torchrun's agent (the workers' parent)
        before = tree_digest(dump)
        second = subprocess.run(command(first_case) + common + ["--training.seed", "1"], cwd=REPO,
                                env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
        assert second.returncode != 0 and (nproc or second.returncode == 2), second.stderr[-3000:]
        assert (f"error: job.dump_folder {dump} is in use by another run (host "
                f"{socket.gethostname()}, PID {launcher}, started {holder['started']}; lock file "
                f"{dump}/run.lock)") in second.stderr, second.stderr[-3000:]
        assert tree_digest(dump) == before
    finally:
        for pid in [int(p) for p in subprocess.run(["pgrep", "-P", str(first.pid)],
                                                   capture_output=True, text=True).stdout.split()]:
            os.kill(pid, signal.SIGKILL)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folders_are_named(call_ctx, tmp_path, capsys):
    """predict.py --out and a training's job.dump_folder in a folder the user cannot write."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        rc = call_entry("predict", [fill(a, call_ctx) for a in RUN]
                        + ["--crops", "crop1", "--out", str(locked / "p.zarr")])
        assert rc == 2
        assert f"--out {locked / 'p.zarr'}: {locked} is not writable" in capsys.readouterr().err
        from torchtitan.run.lock import DumpFolderLock

        with pytest.raises(UserError, match=f"job.dump_folder {locked / 'run'} cannot be written"):
            DumpFolderLock(locked / "run", 0, 5).acquire()
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)
