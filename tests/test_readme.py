"""The commands and paths of the README and the docs pages stay true to the repository.

The pages checked are README.md and every docs/*.md but the generated configuration reference
(docs/configuration.md) and the benchmark pages (docs/benchmarks/, whose commands are those of
the benchmarks). Every command of a shell code block (```bash, ```sh, ```console or an unlabelled fence;
backslash-continued lines joined) that runs one of our files is checked:

* the files it names exist (entry scripts, helpers, ``train_configs/*.toml``, ...);
* each ``--flag`` given to one of our argparse scripts (``predict.py``, ``pth_to_dcp.py``,
  ``helpers/*.py``, ``python -m torchtitan.scoring``, ...) appears in its ``--help``, and
  each flag given to ``torchrun`` in torchrun's;
* the arguments of the training entries (``train_mae.py``, ``train_segmentation.py``, also
  through ``sbatch train_*.sh CONFIG ...``) are ``--section.key`` options of the config
  schema (``JobConfig``), and, unless they hold placeholders, parse and validate with the
  named TOML file exactly as the entry would parse them;
* every ``train_configs/*.toml`` named exists and loads, and every requirements file given
  to ``pip install -r`` exists.

Placeholders (UPPERCASE words such as ``NODE_RANK``, ``<N>``, ``$VAR``, ``/path/to/...``) are
accepted as values, never as the name of one of our files. Paths in inline code spans and
relative links must exist in the repository too: users clone only the repository.

Failures name the page and line. ``--help`` runs once per script, all in parallel. Every docs
page opens with a command that does what it is about, and the README's sample of the demo's
output has the shape of what the demo prints.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# The pages whose commands are checked: the README and the docs by task.
NOT_CHECKED = {"configuration.md"}  # generated from the schema
DOC_PAGES = sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in NOT_CHECKED)
PAGES = [README, *DOC_PAGES]

SHELL_FENCES = {"", "bash", "sh", "shell", "console", "zsh"}
SEPARATORS = {"&&", "||", "|", ";", "&"}
PYTHONS = {"python", "python3"}
# Folders at the top of the repository whose files the README may name.
REPO_DIRS = {"helpers", "bench", "torchtitan", "tests", "train_configs", "docs", ".ci"}
# Made by a run, not part of the repository.
GENERATED_NAMES = {"config.toml", "best.json", "metrics.jsonl"}

_PLACEHOLDER = re.compile(r"<[^>]*>|\$|/path/to/|\.\.\.|(?<![A-Za-z0-9])[A-Z][A-Z0-9_]+(?![A-Za-z0-9])")


def is_placeholder(token: str) -> bool:
    """True for a value written as a placeholder: NODE_RANK, <N>, $VAR, /path/to/x, RUN/..."""
    return bool(_PLACEHOLDER.search(token))


# ---------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Command:
    line: int  # 1-based line of the page where the command starts
    text: str  # the command as written (continuations joined)
    argv: tuple[str, ...]  # its words, separators removed, environment assignments dropped
    page: str = "README.md"  # the page, relative to the repository

    def __str__(self) -> str:
        return f"{self.page} line {self.line}: {self.text}"


def fenced_blocks(text: str):
    """(language, first line number, lines) of every fenced code block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        start = i + 1
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        yield lang, start + 1, body
        i += 1


def _is_command(argv: list[str]) -> bool:
    """Whether a line of a shell block runs something we check (not output or a listing)."""
    first = argv[0]
    return (first in PYTHONS
            or first in {"torchrun", "sbatch", "srun", "bash", "sh", "source", ".", "pip", "pip3"}
            or first.startswith("./")
            or bool(re.fullmatch(r"(helpers|bench)/[\w.-]+\.(py|sh)", first)))


def readme_commands(text: str, page: str = "README.md") -> list[Command]:
    commands = []
    for lang, first_line, body in fenced_blocks(text):
        if lang not in SHELL_FENCES:
            continue
        j = 0
        while j < len(body):
            line_no = first_line + j
            parts = [body[j]]
            while parts[-1].rstrip().endswith("\\") and j + 1 < len(body):
                parts[-1] = parts[-1].rstrip()[:-1]
                j += 1
                parts.append(body[j])
            j += 1
            raw = " ".join(p.strip() for p in parts).strip()
            if lang == "console":
                if not re.match(r"^[$%#] ", raw):
                    continue  # output, not a command
                raw = raw[2:]
            if not raw or raw.startswith("#"):
                continue
            try:
                words = shlex.split(raw, comments=True)
            except ValueError:  # unbalanced quotes: report it as a command that cannot parse
                commands.append(Command(line_no, raw, ("<unparsable>",), page))
                continue
            # One line may chain several commands: a && b; c | d.
            current: list[str] = []
            for word in [*words, "&&"]:
                if word in SEPARATORS:
                    while current and re.fullmatch(r"[A-Za-z_]\w*=.*", current[0]):
                        current.pop(0)  # FOO=bar cmd
                    if current and _is_command(current):
                        commands.append(Command(line_no, raw, tuple(current), page))
                    current = []
                else:
                    current.append(word)
    return commands


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


COMMANDS = [c for page in PAGES for c in readme_commands(page.read_text(), _rel(page))]


# ---------------------------------------------------------------------------------------
# What each command asks to check
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    problems: list[str] = dataclasses.field(default_factory=list)
    # (argv that prints the help, flags that must appear in it, whose flags they are)
    help_checks: list[tuple[tuple[str, ...], list[str], str]] = dataclasses.field(default_factory=list)
    # argument lists of a training entry, checked against the config schema
    config_args: list[list[str]] = dataclasses.field(default_factory=list)
    # train_configs/*.toml files named
    toml_files: list[str] = dataclasses.field(default_factory=list)


def _repo_file(plan: Plan, path: str, what: str) -> Path | None:
    """Check that one of our files exists; return it, or None (and note the problem)."""
    if is_placeholder(path):
        plan.problems.append(f"{what} {path!r} is a placeholder, not a file of the repository")
        return None
    p = (REPO / path).resolve()
    try:
        p.relative_to(REPO)
    except ValueError:
        plan.problems.append(f"{what} {path!r} lies outside the repository")
        return None
    if not p.exists():
        plan.problems.append(f"{what} {path!r} does not exist in the repository")
        return None
    return p


def _flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("-") and a != "--" and a != "-"
            and not re.fullmatch(r"-\d.*", a)]


def _check_arg_paths(plan: Plan, args: list[str]) -> None:
    """Arguments that name files of ours (a folder of the repository) must exist."""
    for arg in args:
        value = arg.split("=", 1)[1] if arg.startswith("--") and "=" in arg else arg
        top = value.split("/", 1)[0]
        if "/" not in value or top not in REPO_DIRS:
            continue
        if _repo_file(plan, value, "file") and value.startswith("train_configs/"):
            plan.toml_files.append(value)


def _script_kind(path: Path) -> str:
    """'config' for the training entries, 'argparse', 'slurm' or 'other'."""
    if path.suffix == ".py":
        source = path.read_text()
        # A script with its own argument parser (e.g. a benchmark that also starts training
        # workers) is checked against its --help; the training entries have none.
        if "argparse" in source:
            return "argparse"
        if re.search(r"from torchtitan\.trainer import run\b", source):
            return "config"
    if path.suffix == ".sh" and "slurm_launch.sh" in path.read_text():
        return "slurm"
    return "other"


def _slurm_entry(path: Path) -> str | None:
    m = re.search(r"SCRIPT=\$\{SCRIPT:-([\w./-]+\.py)\}", path.read_text())
    return m.group(1) if m else None


def _plan_script(plan: Plan, script: str, args: list[str], how: str, run_argv: tuple[str, ...]) -> None:
    """Checks for running one of our scripts ``script`` with ``args``."""
    path = _repo_file(plan, script, how)
    if path is None:
        return
    kind = _script_kind(path)
    if kind == "config":
        plan.config_args.append(list(args))
        _check_arg_paths(plan, args)
    elif kind == "argparse":
        plan.help_checks.append((run_argv, _flags(args), script))
        _check_arg_paths(plan, args)
    elif kind == "slurm":
        entry = _slurm_entry(path)
        if entry is None:
            plan.problems.append(f"cannot tell which entry script {script} starts")
            return
        if not args or args[0].startswith("-"):
            plan.problems.append(f"{script} takes the config TOML as its first argument")
            return
        _plan_script(plan, entry, ["--job.config_file", args[0], *args[1:]], f"entry of {script}",
                     (sys.executable, entry, "--help"))
    else:
        _check_arg_paths(plan, args)


def _split_python(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """python [opts] (-m MOD | -c CODE | SCRIPT) ARGS -> (module, script, args)."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-m":
            return argv[i + 1], None, argv[i + 2:]
        if a == "-c":
            return None, None, []
        if a in ("-X", "-W"):
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        return None, a, argv[i + 1:]
    return None, None, []


def _plan_torchrun(plan: Plan, argv: list[str]) -> None:
    """torchrun [torchrun options] SCRIPT ARGS (or -m MOD ARGS)."""
    # The script is the first word naming a .py file (option values never do here).
    i = next((k for k, a in enumerate(argv) if a in ("-m", "--module") or a.endswith(".py")),
             len(argv))
    torchrun_args, rest = argv[:i], argv[i:]
    plan.help_checks.append(((sys.executable, "-m", "torch.distributed.run", "--help"),
                             _flags(torchrun_args), "torchrun"))
    if not rest:
        plan.problems.append("torchrun is given no script")
        return
    if rest[0] in ("-m", "--module"):
        _plan_module(plan, rest[1], rest[2:])
        return
    script, args = rest[0], rest[1:]
    _plan_script(plan, script, args, "script", (sys.executable, script, "--help"))


def _plan_module(plan: Plan, module: str, args: list[str]) -> None:
    """python -m MODULE ARGS: only our own modules are checked."""
    if module == "torch.distributed.run":
        _plan_torchrun(plan, args)
        return
    if module == "pip":
        _plan_pip(plan, args)
        return
    top = module.split(".")[0]
    if not (REPO / top).is_dir():
        return  # python -m venv, pip, pytest, ...
    rel = module.replace(".", "/")
    candidates = [f"{rel}.py", f"{rel}/__main__.py"]
    found = next((c for c in candidates if (REPO / c).is_file()), None)
    if found is None:
        plan.problems.append(f"module {module!r} does not exist in the repository")
        return
    plan.help_checks.append(((sys.executable, "-m", module, "--help"), _flags(args), f"python -m {module}"))
    _check_arg_paths(plan, args)


def _plan_pip(plan: Plan, args: list[str]) -> None:
    """pip install -r FILE: our requirement files exist."""
    for i, a in enumerate(args):
        if a in ("-r", "--requirement", "-c", "--constraint") and i + 1 < len(args):
            _repo_file(plan, args[i + 1], "requirements file")
        elif a.startswith("--requirement="):
            _repo_file(plan, a.split("=", 1)[1], "requirements file")


def plan_command(command: Command) -> Plan:
    plan = Plan()
    argv = list(command.argv)
    head, rest = argv[0], argv[1:]
    if head == "<unparsable>":
        plan.problems.append("the command does not parse as shell words (unbalanced quotes?)")
    elif head in PYTHONS:
        module, script, args = _split_python(rest)
        if module:
            _plan_module(plan, module, args)
        elif script:
            _plan_script(plan, script, args, "script", (sys.executable, script, "--help"))
    elif head == "torchrun":
        _plan_torchrun(plan, rest)
    elif head in ("pip", "pip3"):
        _plan_pip(plan, rest)
    elif head in ("sbatch", "srun"):
        scripts = [i for i, a in enumerate(rest) if re.fullmatch(r"[\w./-]+\.(sh|py)", a)]
        if not scripts:
            if head == "sbatch":
                plan.problems.append("sbatch is given no batch script")
            return plan
        i = scripts[0]
        _plan_script(plan, rest[i], rest[i + 1:], "batch script",
                     (sys.executable, rest[i], "--help"))
    elif head in ("bash", "sh", "source", "."):
        if rest:
            _plan_script(plan, rest[0], rest[1:], "script", (sys.executable, rest[0], "--help"))
    else:  # ./script or helpers/x.py
        script = head[2:] if head.startswith("./") else head
        path = _repo_file(plan, script, "script")
        if path is not None and not os.access(path, os.X_OK):
            plan.problems.append(f"{script} is run as ./{script} but is not executable")
        if path is not None:
            _plan_script(plan, script, rest, "script", (sys.executable, script, "--help"))
    return plan


PLANS = {c: plan_command(c) for c in COMMANDS}


# ---------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="module")
def help_texts() -> dict[tuple[str, ...], tuple[int, str]]:
    """``--help`` of every script the README runs, each once, all at the same time."""
    wanted = sorted({argv for plan in PLANS.values() for argv, _, _ in plan.help_checks})
    procs = {argv: subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for argv in wanted}
    out = {}
    for argv, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
            out[argv] = (-1, "timed out after 120 s\n" + text)
            continue
        out[argv] = (proc.returncode, text)
    return out


def _config_keys() -> dict[str, type]:
    """'section.key' -> type for every field of JobConfig (walks the dataclasses)."""
    import typing

    from torchtitan.config.job_config import JobConfig

    keys = {}
    sections = typing.get_type_hints(JobConfig)
    for section in dataclasses.fields(JobConfig):
        section_cls = sections[section.name]
        hints = typing.get_type_hints(section_cls)
        for f in dataclasses.fields(section_cls):
            keys[f"{section.name}.{f.name}"] = hints[f.name]
    return keys


def _config_problems(args: list[str]) -> list[str]:
    from torchtitan.config.manager import ConfigManager
    from torchtitan.errors import ConfigError

    keys = _config_keys()
    problems = []
    for flag in _flags(args):
        name = flag[2:] if flag.startswith("--") else flag
        negated = name.startswith("no-")
        key = name[3:] if negated else name
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            hint = f" (did you mean --{close[0]}?)" if close else ""
            problems.append(f"{flag!r} is not a config option{hint}")
        elif negated and keys[key] is not bool:
            problems.append(f"{flag!r}: the --no- form is only for booleans")
    if problems or any(is_placeholder(a) for a in args):
        return problems
    cwd = os.getcwd()
    os.chdir(REPO)  # --job.config_file is relative to the repository, as in the README
    try:
        ConfigManager().parse_args(args)
    except ConfigError as e:
        problems.append(f"the arguments do not parse: {e}")
    finally:
        os.chdir(cwd)
    return problems


def _toml_problems(path: str) -> list[str]:
    from torchtitan.config.manager import ConfigManager
    from torchtitan.errors import ConfigError

    try:
        ConfigManager().parse_args(["--job.config_file", str(REPO / path)])
    except ConfigError as e:
        return [f"{path} does not load: {e}"]
    return []


def test_readme_has_commands():
    """The extractor finds the README's commands (guards against it silently finding none)."""
    readme = [c for c in COMMANDS if c.page == "README.md"]
    assert len(readme) >= 8, [str(c) for c in readme]
    heads = {c.argv[0] for c in readme}
    assert {"torchrun", "python", "sbatch"} <= heads, heads
    scripts = " ".join(" ".join(c.argv) for c in readme)
    for name in ("train_segmentation.py", "predict.py", "train_configs/", "torchtitan.scoring",
                 "helpers/import_stack.py", "helpers/export_model.py", "--data.dataset_path"):
        assert name in scripts, f"no README command runs {name}"


def test_every_docs_page_opens_with_its_command():
    """Each docs page says what it helps you do and gives the command that does it before its
    first section."""
    assert {p.name for p in DOC_PAGES} >= {
        "installation.md", "quickstart.md", "cellmap_challenge.md", "own_em.md", "scaling.md",
        "models.md", "prediction.md", "export.md", "checkpoints.md", "reliability.md",
        "architecture.md"}
    for page in DOC_PAGES:
        text = page.read_text()
        first_section = text.find("\n## ")
        opening = text if first_section < 0 else text[:first_section]
        assert readme_commands(opening, _rel(page)), f"{_rel(page)} opens without a command"


def test_the_demo_output_shown_is_what_the_demo_prints(capsys):
    """The README's sample of the demo's last lines (values shown as ``...``) matches what the
    segmentation task prints for the quickstart config, and run_demo.sh's closing line."""
    from torchtitan.config.manager import ConfigManager
    from torchtitan.tasks.segmentation import SegmentationTask

    text = README.read_text()
    sample = next(body for lang, _, body in fenced_blocks(text)
                  if lang in ("", "text") and any("segmentation finished" in line for line in body))
    cfg = ConfigManager().parse_args(
        ["--job.config_file", str(REPO / "train_configs/quickstart_segmentation_2d.toml")])
    scores = {f"val/iou/{c}": 0.5 for c in cfg.data.classes}
    scores |= {"val/mean_iou": 0.5, "val_post/mean_iou": 0.5}
    SegmentationTask(cfg).summary(scores)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    demo_script = (REPO / "run_demo.sh").read_text()
    printed.append(re.search(r'echo "(== demo finished in .*)"', demo_script).group(1))
    assert len(sample) == len(printed), (sample, printed)
    for shown, real in zip(sample, printed):
        pattern = re.escape(shown).replace(re.escape("..."), ".+")
        assert re.fullmatch(pattern, real), f"README shows {shown!r}, the demo prints {real!r}"


@pytest.mark.parametrize("command", COMMANDS,
                         ids=[f"{c.page}:{c.line}-{c.argv[0]}" for c in COMMANDS])
def test_readme_command(command: Command, help_texts):
    plan = PLANS[command]
    problems = list(plan.problems)
    for argv, flags, whose in plan.help_checks:
        rc, text = help_texts[argv]
        if rc != 0:
            problems.append(f"`{' '.join(argv[1:])}` failed (exit {rc}):\n{text[-2000:]}")
            continue
        for flag in flags:
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                problems.append(f"{whose} does not accept {flag!r} (not in its --help)")
    for args in plan.config_args:
        problems += _config_problems(args)
    for path in plan.toml_files:
        problems += _toml_problems(path)
    assert not problems, f"{command}\n  " + "\n  ".join(problems)


# ---------------------------------------------------------------------------------------
# Paths in the prose
# ---------------------------------------------------------------------------------------


def _repo_names() -> set[str]:
    """Base names of the repository's files (without generated or hidden folders)."""
    names = set()
    skip = {".git", ".venv", "__pycache__", ".pytest_cache"}
    generated = {"data", "outputs"}  # the demo data and runs, at the top of the repository only
    for root, dirs, files in os.walk(REPO):
        top = Path(root) == REPO
        dirs[:] = [d for d in dirs if d not in skip and not (top and d in generated)]
        names.update(files)
    return names


def _prose_problems(text: str, page: str = "README.md") -> list[str]:
    """Problems of the paths in ``page``'s prose (links relative to the page's folder)."""
    problems = []
    folder = (REPO / page).parent
    names = None
    in_fence = False
    for n, line in enumerate(text.splitlines(), 1):
        if re.match(r"^\s*(```|~~~)", line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        spans = re.findall(r"`([^`]+)`", line)
        links = [t for t in re.findall(r"\]\(([^)\s]+)\)", line)
                 if not re.match(r"^[a-z]+:|^#", t)]
        for target in links:
            if not (folder / target.split("#")[0]).exists():
                problems.append(f"{page} line {n}: link target {target!r} is not in the repository")
        for span in spans:
            for word in re.split(r"[\s,]+", span):
                word = word.strip("()")
                word, _, test = word.partition("::")  # tests/test_x.py::test_name[case]
                top = word.split("/", 1)[0]
                test_file = next((f for f in (REPO / word, REPO / "tests" / word) if f.is_file()),
                                 None) if test and word.endswith(".py") else None
                if test_file is not None:
                    name = re.split(r"[\[:]", test)[0]
                    if not re.search(rf"^\s*def {re.escape(name)}\(", test_file.read_text(), re.M):
                        problems.append(f"{page} line {n}: {word} has no test {name!r}")
                if top in ("shared", "..") or word.startswith("../"):
                    problems.append(
                        f"{page} line {n}: {word!r} is outside the repository (users clone "
                        "only the repository)")
                elif not word or re.search(r"[<>*$]", word):
                    continue  # a placeholder or a pattern
                elif "/" in word and top in REPO_DIRS:
                    if not (REPO / word).exists():
                        problems.append(f"{page} line {n}: {word!r} does not exist")
                elif re.fullmatch(r"[\w-]+\.(py|sh|md|txt|toml)", word) and word not in GENERATED_NAMES:
                    names = _repo_names() if names is None else names
                    if word not in names:
                        problems.append(f"{page} line {n}: no file {word!r} in the repository")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_readme_paths_exist(page):
    """Repository paths in inline code and relative links exist; none points outside."""
    problems = _prose_problems(page.read_text(), _rel(page))
    assert not problems, "\n".join(problems)


def test_placeholder_rule():
    for word in ("NODE_RANK", "$FIRST_NODE:29500", "<N>", "/path/to/x", "RUN/checkpoint",
                 "PRED.zarr/crop<N>/<class>"):
        assert is_placeholder(word), word
    for word in ("train_configs/debug_mae_2d.toml", "outputs/debug_mae_2d/checkpoint",
                 "encoder.=backbone.", "0:640,0:2560,0:2560", "dinov3_vitl16_pretrain_lvd1689m.pth",
                 "bfloat16", "mito,nuc", "DINOv3"):
        assert not is_placeholder(word), word


def test_extractor_on_a_sample():
    sample = "\n".join([
        "```bash",
        "source helpers/setup_env.sh   # or: python -m venv .venv",
        "FOO=1 torchrun --standalone --nproc_per_node 2 train_mae.py \\",
        "    --job.config_file train_configs/debug_mae_2d.toml --training.steps 3",
        "```",
        "```",
        "<data.dataset_path>/<ds>/em/s0",
        "train_mae.py, train_segmentation.py   thin entries",
        "```",
        "```console",
        "$ python predict.py --checkpoint c --out o && ./run_tests.sh -k x",
        "wrote o",
        "```",
        "```python",
        "python not_a_shell_block.py",
        "```",
    ])
    cmds = readme_commands(sample)
    assert [(c.line, c.argv[0]) for c in cmds] == [
        (2, "source"), (3, "torchrun"), (11, "python"), (11, "./run_tests.sh")]
    assert cmds[1].argv[-1] == "3" and "FOO=1" not in cmds[1].argv
    plan = plan_command(cmds[1])
    assert not plan.problems
    assert plan.config_args == [["--job.config_file", "train_configs/debug_mae_2d.toml",
                                 "--training.steps", "3"]]
    assert plan.toml_files == ["train_configs/debug_mae_2d.toml"]
    assert plan_command(Command(1, "x", ("pip", "install", "-r", "requirements-nope.txt"))).problems
    assert not plan_command(Command(1, "x", ("pip", "install", "-r", "requirements.txt"))).problems
    bad = plan_command(Command(1, "x", ("python", "helpers/no_such_helper.py", "--x")))
    assert bad.problems and "does not exist" in bad.problems[0]
    assert _config_problems(["--training.stepz", "3"]) == [
        "'--training.stepz' is not a config option (did you mean --training.steps?)"]


def test_prose_check_on_a_sample():
    """Links resolve from the page's folder; test ids name a test that exists."""
    sample = ("see [quickstart](quickstart.md), [gone](gone.md), `tests/test_run_lock.py::test_nope` "
              "and `test_readme.py::test_placeholder_rule`")
    assert _prose_problems(sample, "docs/page.md") == [
        "docs/page.md line 1: link target 'gone.md' is not in the repository",
        "docs/page.md line 1: tests/test_run_lock.py has no test 'test_nope'"]
