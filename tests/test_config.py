"""Tests of torchtitan.config.manager: defaults, TOML, CLI overrides, errors, save/load, help."""

import ast
import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from torchtitan.config.manager import (
    ConfigManager,
    JobConfig,
    config_to_dict,
    config_to_toml,
    help_text,
    save_config,
    validate,
)
from torchtitan.errors import ConfigError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(*args: str) -> JobConfig:
    return ConfigManager().parse_args(list(args))


def write_toml(tmp_path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def with_config_file(cfg: JobConfig, path: str) -> JobConfig:
    """A copy of ``cfg`` whose job.config_file is ``path``."""
    return dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, config_file=path))


def parse_error(*args: str) -> str:
    """Parse ``args``, expect a ConfigError and return its message."""
    with pytest.raises(ConfigError) as info:
        parse(*args)
    return str(info.value)


# ---------------------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------------------


def test_defaults():
    cfg = parse()
    assert cfg == JobConfig()
    assert cfg.job.config_file == ""
    assert cfg.job.dump_folder == "./outputs"
    assert cfg.job.print_config is False
    assert cfg.training.steps == 100
    assert cfg.training.batch_size == 8
    assert cfg.training.data_parallel_shard_degree == -1
    assert cfg.training.mixed_precision_param == "bfloat16"
    assert cfg.optimizer.name == "AdamW"
    assert cfg.optimizer.lr == 1e-3
    assert cfg.lr_scheduler.decay_type == "cosine"
    assert cfg.checkpoint.keep_latest_k == 2
    assert cfg.checkpoint.initial_load_prefix_map == []
    assert cfg.activation_checkpoint.mode == "none"
    assert cfg.metrics.eval_freq == 100
    assert cfg.data.classes == ["nuc", "mito", "er", "cell"]
    assert cfg.data.voxel_size == [8.0, 8.0, 8.0]
    assert cfg.data.val_crops == []
    assert cfg.model.ndim == 2
    assert cfg.model.crop_size == [64, 64]
    assert cfg.model.attention == "sdpa"
    assert cfg.comm.init_timeout_seconds == 300


def test_defaults_are_valid():
    validate(JobConfig())


def test_list_defaults_are_not_shared():
    a, b = JobConfig(), JobConfig()
    a.data.classes.append("ves")
    assert b.data.classes == ["nuc", "mito", "er", "cell"]


def test_every_field_is_documented():
    for section in dataclasses.fields(JobConfig):
        section_cls = section.default_factory
        assert section_cls.__doc__, section.name
        for f in dataclasses.fields(section_cls):
            assert f.metadata.get("help"), f"{section.name}.{f.name} has no doc"


# ---------------------------------------------------------------------------------------
# TOML and the command line
# ---------------------------------------------------------------------------------------


def test_toml_load(tmp_path):
    path = write_toml(
        tmp_path,
        """
        [job]
        description = "from toml"

        [training]
        steps = 7
        compile = true

        [optimizer]
        name = "Adam"
        lr = 3   # an int is fine for a float field

        [data]
        classes = ["mito"]
        voxel_size = [16, 4.0, 4]

        [model]
        ndim = 3
        crop_size = [32, 32, 32]
        """,
    )
    cfg = parse("--job.config_file", path)
    assert cfg.job.config_file == path
    assert cfg.job.description == "from toml"
    assert cfg.training.steps == 7
    assert cfg.training.compile is True
    assert cfg.optimizer.name == "Adam"
    assert cfg.optimizer.lr == 3.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.data.classes == ["mito"]
    assert cfg.data.voxel_size == [16.0, 4.0, 4.0]
    assert all(isinstance(v, float) for v in cfg.data.voxel_size)
    assert cfg.model.ndim == 3
    assert cfg.model.crop_size == [32, 32, 32]
    # Untouched keys keep their defaults.
    assert cfg.training.batch_size == 8


def test_cli_beats_toml_beats_defaults(tmp_path):
    path = write_toml(
        tmp_path,
        """
        [training]
        steps = 7
        batch_size = 4
        """,
    )
    cfg = parse("--job.config_file", path, "--training.steps", "9")
    assert cfg.training.steps == 9  # CLI over TOML
    assert cfg.training.batch_size == 4  # TOML over default
    assert cfg.training.seed == 0  # default


def test_cli_order_does_not_matter_for_config_file(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 7\n")
    cfg = parse("--training.steps=9", f"--job.config_file={path}")
    assert cfg.training.steps == 9


def test_cli_equals_form_and_last_repeat_wins():
    cfg = parse("--training.steps=5", "--optimizer.lr=2e-4", "--training.steps", "6")
    assert cfg.training.steps == 6
    assert cfg.optimizer.lr == 2e-4


def test_cli_negative_and_float_values():
    cfg = parse("--checkpoint.load_step", "-1", "--training.max_norm", "-1", "--optimizer.lr", "1")
    assert cfg.checkpoint.load_step == -1
    assert cfg.training.max_norm == -1.0
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


def test_cli_lists():
    cfg = parse(
        "--data.classes", "mito, nuc",
        "--data.voxel_size", "16,8,8",
        "--model.crop_size", "32,48",
        "--data.val_crops", "crop2,jrc_synth-1/crop3",
    )
    assert cfg.data.classes == ["mito", "nuc"]
    assert cfg.data.voxel_size == [16.0, 8.0, 8.0]
    assert cfg.model.crop_size == [32, 48]
    assert cfg.data.val_crops == ["crop2", "jrc_synth-1/crop3"]


def test_cli_empty_string_gives_empty_list(tmp_path):
    path = write_toml(tmp_path, '[data]\nval_crops = ["crop1"]\n')
    assert parse("--job.config_file", path, "--data.val_crops", "").data.val_crops == []
    assert parse("--job.config_file", path, "--data.val_crops=").data.val_crops == []


def test_toml_empty_list(tmp_path):
    path = write_toml(tmp_path, "[checkpoint]\ninitial_load_prefix_map = []\n")
    assert parse("--job.config_file", path).checkpoint.initial_load_prefix_map == []


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--training.compile"], True),
        (["--no-training.compile"], False),
        (["--training.compile", "true"], True),
        (["--training.compile", "False"], False),
        (["--training.compile", "TRUE"], True),
        (["--training.compile", "1"], True),
        (["--training.compile", "0"], False),
        (["--training.compile", "yes"], True),
        (["--training.compile", "No"], False),
        (["--training.compile=true"], True),
        (["--training.compile=0"], False),
        (["--training.compile", "--training.steps", "3"], True),
    ],
)
def test_cli_bool_spellings(args, expected):
    assert parse(*args).training.compile is expected


def test_no_flag_overrides_toml_true(tmp_path):
    path = write_toml(tmp_path, "[metrics]\nprogress_bar = true\n")
    cfg = parse("--job.config_file", path, "--no-metrics.progress_bar")
    assert cfg.metrics.progress_bar is False


def test_parse_args_reads_sys_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--training.steps", "3"])
    manager = ConfigManager()
    cfg = manager.parse_args()
    assert cfg.training.steps == 3
    assert manager.config is cfg


# ---------------------------------------------------------------------------------------
# Errors: unknown names
# ---------------------------------------------------------------------------------------


# Each bad input and the pieces its one message must contain: the key (and the file, for
# TOML), the value, what is allowed, and a suggestion where one fits.
CLI_ERRORS = [
    pytest.param(('--training.setps', '3'),
                 ["unknown key 'training.setps'", 'command line', "did you mean 'training.steps'?"],
                 id="unknown_key_on_cli_suggests_close_match"),
    pytest.param(('--training.lr', '1e-4'),
                 ["did you mean 'optimizer.lr'?"],
                 id="key_in_wrong_section_suggests_its_section"),
    pytest.param(('--optimiser.lr', '1e-4'),
                 ["unknown section 'optimiser'", 'command line', "did you mean 'optimizer'?"],
                 id="unknown_section_on_cli"),
    pytest.param(('--steps', '3'),
                 ['--steps', "did you mean 'training.steps'?"],
                 id="cli_option_without_section"),
    pytest.param(('train_configs/x.toml',),
                 ["'train_configs/x.toml'", '--section.key'],
                 id="cli_positional_argument"),
    pytest.param(('--optimizer.name', 'SGD'),
                 ["'optimizer.name'", "'SGD'", "'AdamW'", "'Adam'"],
                 id="bad_choice_on_cli_names_allowed_values"),
    pytest.param(('--optimizer.name', 'adamw'),
                 ["did you mean 'AdamW'?"],
                 id="bad_choice_suggests_correct_case"),
    pytest.param(('--model.ndim', '4'),
                 ["'model.ndim'", '4', '2, 3'],
                 id="bad_int_choice"),
    pytest.param(('--model.ndim', '3'),
                 ["'model.crop_size'", "'model.ndim'", '[64, 64]', '3'],
                 id="crop_size_length_must_match_ndim"),
    pytest.param(('--model.crop_size', '64,60'),
                 ["'model.crop_size'", "'model.patch_size'", '[64, 60]', '16'],
                 id="crop_size_must_be_multiple_of_patch_size"),
    pytest.param(('--model.decoder_dim', '100', '--model.decoder_num_heads', '8'),
                 ["'model.decoder_dim'", "'model.decoder_num_heads'"],
                 id="decoder_dim_divisible_by_heads"),
]
TOML_ERRORS = [
    pytest.param("[training]\nsetps = 3\n",
                 ["unknown key 'training.setps'", "did you mean 'training.steps'?", 'batch_size', 'warmup_steps'],
                 id="unknown_key_in_toml_suggests_close_match"),
    pytest.param("[trainng]\nsteps = 3\n",
                 ["unknown section 'trainng'", "did you mean 'training'?", 'optimizer'],
                 id="unknown_section_in_toml"),
    pytest.param("steps = 3\n",
                 ["'steps'", "did you mean 'training.steps'?"],
                 id="toml_key_outside_any_section"),
    pytest.param("training = 3\n",
                 ['training', 'table'],
                 id="toml_section_that_is_not_a_table"),
    pytest.param("[lr_scheduler]\ndecay_type = \"step\"\n",
                 ["'lr_scheduler.decay_type'", "'step'", "'cosine'", "'linear'", "'constant'"],
                 id="bad_choice_in_toml_names_file_and_allowed_values"),
    pytest.param("[training]\nsteps = = 3\n",
                 ['invalid TOML', 'line 2'],
                 id="bad_toml_syntax"),
    pytest.param("[model]\nndim = 2\ncrop_size = [64, 64, 64]\n",
                 ["'model.crop_size'", '[64, 64, 64]'],
                 id="crop_size_length_in_toml_names_file"),
]


@pytest.mark.parametrize("args, expected", CLI_ERRORS)
def test_command_line_error_message(args, expected):
    msg = parse_error(*args)
    for piece in expected:
        assert piece in msg, (piece, msg)


@pytest.mark.parametrize("text, expected", TOML_ERRORS)
def test_toml_error_message_names_the_file(tmp_path, text, expected):
    path = write_toml(tmp_path, text)
    msg = parse_error("--job.config_file", path)
    for piece in [path, *expected]:
        assert piece in msg, (piece, msg)











# ---------------------------------------------------------------------------------------
# Errors: bad values
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "toml, key, bad, expected",
    [
        ('[training]\nsteps = "ten"\n', "training.steps", "'ten'", "expected int"),
        ("[training]\nsteps = 1.5\n", "training.steps", "1.5", "expected int"),
        ("[training]\nsteps = true\n", "training.steps", "True", "expected int"),
        ("[training]\ncompile = 1\n", "training.compile", "1", "expected bool"),
        ('[optimizer]\nlr = "fast"\n', "optimizer.lr", "'fast'", "expected float"),
        ("[job]\ndescription = 3\n", "job.description", "3", "expected str"),
        ('[data]\nclasses = "mito"\n', "data.classes", "'mito'", "expected list of str"),
        ('[data]\nclasses = ["mito", 3]\n', "data.classes", "['mito', 3]", "expected list of str"),
        ("[model]\ncrop_size = [64.0, 64]\n", "model.crop_size", "[64.0, 64]", "list of int"),
        ("[model]\ncrop_size = 64\n", "model.crop_size", "64", "expected list of int"),
    ],
)
def test_wrong_type_in_toml(tmp_path, toml, key, bad, expected):
    path = write_toml(tmp_path, toml)
    msg = parse_error("--job.config_file", path)
    assert f"'{key}'" in msg
    assert path in msg
    assert bad in msg
    assert expected in msg


@pytest.mark.parametrize(
    "args, key, bad, expected",
    [
        (["--training.steps", "ten"], "training.steps", "'ten'", "expected int"),
        (["--training.steps", "1.5"], "training.steps", "'1.5'", "expected int"),
        (["--training.steps=1e3"], "training.steps", "'1e3'", "expected int"),
        (["--optimizer.lr", "fast"], "optimizer.lr", "'fast'", "expected float"),
        (["--training.compile", "maybe"], "training.compile", "'maybe'", "true/false"),
        (["--model.crop_size", "64,x"], "model.crop_size", "'64,x'", "list of int"),
        (["--model.crop_size", "64,,64"], "model.crop_size", "'64,,64'", "empty"),
        (["--data.voxel_size", "8,8,a"], "data.voxel_size", "'8,8,a'", "list of float"),
    ],
)
def test_wrong_type_on_cli(args, key, bad, expected):
    msg = parse_error(*args)
    assert f"'{key}'" in msg
    assert "command line" in msg
    assert bad in msg
    assert expected in msg






@pytest.mark.parametrize(
    "key, value, rule",
    [
        ("training.steps", "0", ">= 1"),
        ("training.batch_size", "0", ">= 1"),
        ("training.warmup_steps", "-1", ">= 0"),
        ("checkpoint.keep_latest_k", "-1", ">= 0"),
        ("optimizer.lr", "0", "> 0"),
        ("model.mask_ratio", "1.0", "[0, 1)"),
        ("model.mask_ratio", "-0.1", "[0, 1)"),
        ("training.data_parallel_shard_degree", "0", "-1 or >= 1"),
        ("training.data_parallel_replicate_degree", "0", ">= 1"),
        ("training.tensor_parallel_degree", "0", ">= 1"),
        ("data.voxel_size", "8,8", "3 entries"),
        ("data.voxel_size", "8,0,8", "> 0"),
        ("data.classes", "mito,mito", "once"),
        ("model.crop_size", "0,64", ">= 1"),
        ("checkpoint.initial_load_prefix_map", "encoder.", "old_prefix=new_prefix"),
        ("activation_checkpoint.selective_ac_option", "every", "'op'"),
    ],
)
def test_range_rules(key, value, rule):
    msg = parse_error(f"--{key}", value)
    assert f"'{key}'" in msg
    assert "command line" in msg
    assert rule in msg


def test_range_rule_in_toml_names_file(tmp_path):
    path = write_toml(tmp_path, "[training]\nsteps = 0\n")
    msg = parse_error("--job.config_file", path)
    assert path in msg and "'training.steps'" in msg and ">= 1" in msg


def test_valid_edge_values():
    cfg = parse(
        "--training.data_parallel_shard_degree", "4",
        "--model.mask_ratio", "0",
        "--activation_checkpoint.selective_ac_option", "2",
        "--checkpoint.initial_load_prefix_map", "encoder.=backbone.,=model.",
        "--checkpoint.keep_latest_k", "0",
    )
    assert cfg.training.data_parallel_shard_degree == 4
    assert cfg.checkpoint.initial_load_prefix_map == ["encoder.=backbone.", "=model."]


def test_cli_missing_value():
    msg = parse_error("--training.steps")
    assert "missing value" in msg and "'training.steps'" in msg
    msg = parse_error("--training.steps", "--training.seed", "1")
    assert "missing value" in msg and "'training.steps'" in msg


def test_cli_no_prefix_only_for_bools():
    msg = parse_error("--no-training.steps")
    assert "'training.steps'" in msg and "int" in msg
    msg = parse_error("--no-training.compile=true")
    assert "takes no value" in msg


# ---------------------------------------------------------------------------------------
# Errors: files
# ---------------------------------------------------------------------------------------


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "nope.toml")
    msg = parse_error("--job.config_file", path)
    assert "not found" in msg and path in msg


def test_config_file_is_a_directory(tmp_path):
    msg = parse_error("--job.config_file", str(tmp_path))
    assert str(tmp_path) in msg



def test_toml_not_utf8(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[job]\ndescription = "caf\xe9"\n')
    msg = parse_error("--job.config_file", str(path))
    assert str(path) in msg and "UTF-8" in msg


# ---------------------------------------------------------------------------------------
# Cross-field validation
# ---------------------------------------------------------------------------------------






def test_valid_3d_config():
    cfg = parse("--model.ndim", "3", "--model.crop_size", "32,64,64", "--model.patch_size", "8")
    assert cfg.model.crop_size == [32, 64, 64]


def test_validate_lists_every_problem():
    cfg = JobConfig()
    cfg.training.steps = 0
    cfg.optimizer.name = "SGD"
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    msg = str(info.value)
    assert "'training.steps'" in msg and "'optimizer.name'" in msg


def test_validate_checks_types_of_configs_built_in_code():
    cfg = JobConfig()
    cfg.model.crop_size = (64, 64)
    with pytest.raises(ConfigError, match="model.crop_size"):
        validate(cfg)


# ---------------------------------------------------------------------------------------
# Saving and loading back
# ---------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    cfg = parse(
        "--job.description", 'quotes " and \\ backslash',
        "--training.steps", "17",
        "--training.compile",
        "--optimizer.lr", "2.5e-4",
        "--optimizer.eps", "1e-10",
        "--data.classes", "mito",
        "--data.val_crops", "",
        "--data.voxel_size", "16,4,4",
        "--model.ndim", "3",
        "--model.crop_size", "32,64,64",
        "--checkpoint.initial_load_prefix_map", "encoder.=backbone.",
    )
    path = tmp_path / "out" / "config.toml"
    save_config(cfg, path)
    loaded = parse("--job.config_file", str(path))
    # Loading records the file it came from; everything else is identical.
    assert loaded.job.config_file == str(path)
    assert loaded == with_config_file(cfg, str(path))


def test_save_round_trip_of_defaults(tmp_path):
    path = tmp_path / "config.toml"
    save_config(JobConfig(), path)
    loaded = parse("--job.config_file", str(path))
    assert with_config_file(loaded, "") == JobConfig()


def test_save_is_atomic_and_overwrites(tmp_path):
    path = tmp_path / "config.toml"
    save_config(JobConfig(), path)
    cfg = parse("--training.steps", "3")
    save_config(cfg, path)
    assert os.listdir(tmp_path) == ["config.toml"]  # no temporary file left behind
    assert "steps = 3" in path.read_text()


def test_config_to_dict_and_toml():
    cfg = JobConfig()
    d = config_to_dict(cfg)
    assert d["training"]["steps"] == 100
    assert d["data"]["classes"] == ["nuc", "mito", "er", "cell"]
    d["data"]["classes"].append("x")  # a copy: the config is unchanged
    assert cfg.data.classes == ["nuc", "mito", "er", "cell"]
    text = config_to_toml(cfg)
    assert "[training]" in text and "[model]" in text


# ---------------------------------------------------------------------------------------
# Help and module floor
# ---------------------------------------------------------------------------------------


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit) as info:
        parse("--help")
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.strip() == help_text().strip()
    for section, fields in config_to_dict(JobConfig()).items():
        assert f"[{section}]" in out
        for key in fields:
            assert f"--{section}.{key}" in out
    assert "--no-training.compile" in out
    assert "Peak learning rate" in out  # the doc
    assert "default: 100" in out
    assert '"AdamW", "Adam"' in out  # the choices


def test_short_help_exits_zero_even_with_other_args(capsys):
    with pytest.raises(SystemExit) as info:
        parse("--training.steps", "ten", "-h")
    assert info.value.code == 0
    assert "--training.steps" in capsys.readouterr().out


def test_help_in_subprocess():
    code = "from torchtitan.config.manager import ConfigManager; ConfigManager().parse_args()"
    result = subprocess.run(
        [sys.executable, "-c", code, "--help"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "--model.crop_size" in result.stdout


def test_module_imports_nothing_of_ours():
    """Floor 1: the config package's modules import only the standard library, tomli_w, each
    other and the ground floor (errors, choices)."""
    import torchtitan.config.manager as module

    folder = os.path.dirname(module.__file__)
    files = [os.path.join(folder, name) for name in sorted(os.listdir(folder))
             if name.endswith(".py")]
    assert len(files) >= 2
    imported = set()
    for path in files:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"relative import in {path}"
                imported.add(node.module)
    ours = {name for name in imported if name.split(".")[0] == "torchtitan"}
    assert ours <= {"torchtitan.config.parsing", "torchtitan.config.checks",
                    "torchtitan.config.context_parallel", "torchtitan.config.manager",
                    "torchtitan.config.job_config",
                    "torchtitan.errors", "torchtitan.choices"}
    outside_stdlib = {name.split(".")[0] for name in imported - ours} - set(sys.stdlib_module_names)
    assert outside_stdlib == {"tomli_w"}


def test_head_image_levels_is_checked_against_the_head_and_patch():
    assert parse("--model.head", "multiscale", "--model.patch_size", "8",
                 "--model.head_image_levels", "4").model.head_image_levels == 4
    msg = parse_error("--model.head", "multiscale", "--model.patch_size", "8",
                      "--model.head_image_levels", "5")
    assert "'model.head_image_levels' = 5 goes past the patch grid" in msg and "use 1..4" in msg
    msg = parse_error("--model.head", "linear", "--model.head_image_levels", "2")
    assert "applies to the 'upconv' and 'multiscale' heads, not 'linear'" in msg
