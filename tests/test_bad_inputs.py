"""A table of bad inputs to every entry point, each a real process that must exit non-zero with
one message naming the key / file / value, no traceback, and no process left behind.

Config errors happen before any process group exists, so most cases run one plain ``python
script.py ...`` process; a few run under ``torchrun`` with 2 processes to prove that every rank
stops with a single message. The cases run concurrently (each its own process, each with a
timeout) and every case is then checked as its own test.
"""

from __future__ import annotations

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

from conftest import REPO, _env

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
         ["'optimizer.weight_decay' on the command line: inf (must be a finite number"]),
    Case("cli_nan_max_norm", SEG, ["--training.max_norm", "nan"],
         ["'training.max_norm' on the command line: nan (must be a finite"]),
    Case("cli_neg_inf_max_norm", MAE, ["--training.max_norm=-inf"],
         ["'training.max_norm' on the command line: -inf"], slow=True),
    Case("cli_inf_voxel_size", SEG, ["--data.voxel_size", "8,inf,8"],
         ["'data.voxel_size' on the command line: [8.0, inf, 8.0] (must be a finite"]),
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
         ["'data.voxel_size' in {toml}: [8.0, 8.0, inf]"], toml="[data]\nvoxel_size = [8, 8, inf]\n"),
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
          "'checkpoint.last_save_model_only' = true"]),
    Case("prefix_map_with_full_load", SEG, ["--checkpoint.initial_load_path", "{tmp}",
                                            "--no-checkpoint.initial_load_model_only",
                                            "--checkpoint.initial_load_prefix_map", "a.=b."],
         ["'checkpoint.initial_load_prefix_map' = ['a.=b.'] has no effect with "
          "'checkpoint.initial_load_model_only' = false"]),
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
    Case("score_no_predictions", "torchtitan/tools/scoring.py", ["--predictions", "{tmp}/none.zarr",
                                                              "--groundtruth", "{data}"],
         ["{tmp}/none.zarr"]),
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


def test_at_least_forty_cases():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)


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
