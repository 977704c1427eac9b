"""The machinery behind :mod:`torchtitan.config.manager`: from TOML and the command line to
checked dataclasses, ``--help``, and the TOML round trip.

It knows nothing of the schema beyond its shape: a top-level dataclass whose fields are
section dataclasses, whose fields are options declared with :func:`opt` and typed as
``bool``, ``int``, ``float``, ``str`` or a list of one of those.

Why not a library (``tyro``, which torchtitan uses)? ``tyro`` builds the command line only:
it does not read TOML, so checking a file's keys, types and ranges would stay ours anyway;
it reports a bad option by printing a box and calling ``sys.exit(2)`` rather than raising
(callers and tests cannot catch it), without naming the value or "the command line"; it
has no range rules, suggests nothing for a case slip ('adamw'), accepts ``nan``; and it
would change the command-line syntax (``--training.no-compile``, space-separated lists).
What stays here is small: one type check, one rule check, one error builder per kind.

Floor 1: imports only the standard library, ``tomli_w`` and :mod:`torchtitan.errors`.
"""

import argparse
import dataclasses
import difflib
import math
import os
import sys
import tempfile
import textwrap
import tomllib
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import tomli_w

from torchtitan.errors import ConfigError

COMMAND_LINE = "the command line"
CONFIG_FILE_KEY = "job.config_file"  # the option naming the TOML file (read before the rest)

# Spellings accepted for booleans on the command line (compared case-insensitively).
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}

# Field types a config option may have: few, so that parsing, help and TOML stay simple.
_SCALAR_TYPES = (bool, int, float, str)
_LIST_TYPES = (list[str], list[int], list[float])

Rule = tuple[Callable[[Any], bool], str]  # (predicate, what a valid value is)


def opt(default: Any, help: str, *, choices: tuple | None = None,
        min: int | float | None = None, check: Rule | None = None,
        removed_choices: dict[str, str] | None = None) -> Any:
    """Declare one documented config field.

    Args:
        default: the default value; a list default is copied for every instance.
        help: a one-line description shown by ``--help``.
        choices: if given, the value must be one of these.
        min: if given, the value (each element, for a list) must be ``>= min``.
        check: ``(predicate, description)``; the value is valid when ``predicate(value)``
            is true, and ``description`` (e.g. ``"must be > 0"``) explains the rule.
        removed_choices: ``{value: what replaced it}`` for choices that earlier releases
            offered: such a value is refused with that message.
    """
    metadata = {"help": help, "choices": choices, "min": min, "check": check,
                "removed_choices": removed_choices or {}}
    if isinstance(default, list):
        # Dataclasses forbid mutable defaults; give every instance its own copy.
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


# ---------------------------------------------------------------------------------------
# The options of a config class
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Option:
    """Everything known about one field, gathered from its declaration."""

    key: str  # 'section.name'
    type: Any
    default: Any
    help: str
    choices: tuple | None
    min: int | float | None
    check: Rule | None
    removed_choices: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def element(self) -> type | None:
        """The element type of a list option, else None."""
        return typing.get_args(self.type)[0] if self.type in _LIST_TYPES else None

    @property
    def type_name(self) -> str:
        """'int', 'list of str', ..."""
        return f"list of {self.element.__name__}" if self.element else self.type.__name__


class Options(dict[str, dict[str, _Option]]):
    """Section -> field name -> :class:`_Option`; ``removed``: ``{'section.key': what
    replaced it}`` for the options that earlier releases had (the config class's
    ``REMOVED_OPTIONS``), so that an old config is told what to write instead."""

    removed: dict[str, str] = {}


def sections(config_cls: type) -> dict[str, type]:
    """Section name -> section dataclass, in declaration order."""
    hints = typing.get_type_hints(config_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_cls)}


def all_options(config_cls: type) -> Options:
    """Section -> field -> :class:`_Option` for a whole config class, in declaration order."""
    options = Options()
    options.removed = dict(getattr(config_cls, "REMOVED_OPTIONS", {}))
    for section, section_cls in sections(config_cls).items():
        hints = typing.get_type_hints(section_cls)
        options[section] = {}
        for f in dataclasses.fields(section_cls):
            key, typ = f"{section}.{f.name}", hints[f.name]
            if typ not in _SCALAR_TYPES and typ not in _LIST_TYPES:
                raise TypeError(f"unsupported config field type {typ!r} for '{key}'")
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            meta = f.metadata
            options[section][f.name] = _Option(
                key, typ, default, meta.get("help", ""), meta.get("choices"), meta.get("min"),
                meta.get("check"), meta.get("removed_choices", {}))
    return options


# ---------------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------------


def _location(where: str) -> str:
    """'in FILE' or 'on the command line', to finish a sentence."""
    return f"on {where}" if where == COMMAND_LINE else f"in {where}"


def _suggest(word: str, candidates: list[str]) -> str | None:
    matches = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None


def _unknown_name_error(options: Options, where: str, section: str,
                        key: str | None = None, bare: str | None = None) -> ConfigError:
    """The error for a name that is no option: an unknown ``section``, an unknown ``key`` of a
    known section, or (``bare`` given: how the user wrote it) a name without a section."""
    if key is not None and f"{section}.{key}" in options.removed:
        return ConfigError(f"'{section}.{key}' {_location(where)} is no longer an option: "
                           f"{options.removed[f'{section}.{key}']}. Remove it from the config.")
    keys = [o.key for fields in options.values() for o in fields.values()]
    homes = [k for k in keys if k.split(".", 1)[1] == (section if bare else key)]
    valid = f"Valid sections: {', '.join(options)}."
    if bare is not None:  # e.g. `steps` for `training.steps`
        message = f"{bare} {_location(where)}: options are named 'section.key'"
        match = homes[0] if homes else _suggest(section, keys)
    elif key is None:
        message = f"unknown section '{section}' {_location(where)}"
        match = _suggest(section, list(options))
    else:
        message = f"unknown key '{section}.{key}' {_location(where)}"
        close = _suggest(key, list(options[section]))
        # A correctly spelled key in the wrong section (e.g. training.lr) is a common slip.
        match = f"{section}.{close}" if close else (homes[0] if homes else None)
        valid = f"Valid keys of [{section}]: {', '.join(options[section])}."
    if match:
        message += f"; did you mean '{match}'?"
    return ConfigError(f"{message} {valid}")


def _bad_value(option: _Option, raw: Any, where: str, expected: str) -> ConfigError:
    return ConfigError(
        f"invalid value for '{option.key}' {_location(where)}: {raw!r} ({expected})")


def format_value(value: Any) -> str:
    """A value as it is written in TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return repr(value)


# ---------------------------------------------------------------------------------------
# Values: types and rules
# ---------------------------------------------------------------------------------------


def _is_instance(value: Any, typ: type) -> bool:
    """Strict scalar type test: bool is not an int, and an int is a valid float."""
    if typ in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if typ is float else typ)


def _type_problem(option: _Option, value: Any) -> str | None:
    """'expected list of int, got list containing float' when ``value`` has the wrong type."""
    if option.element is None:
        ok = _is_instance(value, option.type)
        got = type(value).__name__
    else:
        ok = isinstance(value, list) and all(_is_instance(x, option.element) for x in value)
        got = type(value).__name__
        if isinstance(value, list):
            got = "list containing " + ", ".join(sorted(
                {type(x).__name__ for x in value if not _is_instance(x, option.element)}))
    return None if ok else f"expected {option.type_name}, got {got}"


def _rule_problem(option: _Option, value: Any) -> str | None:
    """Which rule declared with :func:`opt` a well-typed value breaks, or None."""
    values = value if isinstance(value, list) else [value]
    # TOML has nan/inf literals, and float() parses 'nan' and 'inf'.
    if float in (option.type, option.element) and not all(math.isfinite(v) for v in values):
        return "must be a finite number; nan and inf are not allowed"
    if option.choices is not None and value in option.removed_choices:
        return (f"no longer offered: {option.removed_choices[value]}; allowed: "
                + ", ".join(repr(c) for c in option.choices))
    if option.choices is not None and value not in option.choices:
        problem = "allowed: " + ", ".join(repr(c) for c in option.choices)
        if isinstance(value, str):  # catch case slips ('adamw') and typos ('cosin')
            by_lower = {str(c).lower(): str(c) for c in option.choices}
            match = by_lower.get(value.lower()) or _suggest(value, list(by_lower.values()))
            if match is not None:
                problem += f"; did you mean {match!r}?"
        return problem
    if option.min is not None and any(v < option.min for v in values):
        return f"{'every entry must be' if isinstance(value, list) else 'must be'} >= {option.min}"
    if option.check is not None and not option.check[0](value):
        return option.check[1]
    return None


def _checked(option: _Option, value: Any, where: str) -> Any:
    """``value`` (ints made floats where the type asks for floats) if it has the option's
    type and keeps its rules; else a ConfigError naming ``where``, the key and the value."""
    problem = _type_problem(option, value)
    if problem is None:
        if float in (option.type, option.element):
            value = [float(v) for v in value] if option.element else float(value)
        problem = _rule_problem(option, value)
    if problem is not None:
        raise _bad_value(option, value, where, problem)
    return value


def field_problems(config: Any) -> list[str]:
    """Every type or per-field rule violation of a config (matters for configs built in code)."""
    problems = []
    for section, fields in all_options(type(config)).items():
        for name, option in fields.items():
            value = getattr(getattr(config, section), name)
            problem = _type_problem(option, value) or _rule_problem(option, value)
            if problem is not None:
                problems.append(f"'{option.key}' = {value!r} ({problem})")
    return problems


# ---------------------------------------------------------------------------------------
# TOML
# ---------------------------------------------------------------------------------------


def read_toml(path: str) -> dict[str, Any]:
    """Load a TOML file, turning every I/O or syntax problem into a ConfigError."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config file is a directory, not a TOML file: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not valid UTF-8 text: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML in {path}: {e}") from None


def _apply_toml(config: Any, options: Options, data: dict[str, Any], path: str) -> None:
    """Set every value of a parsed TOML document on ``config`` (checked, in place)."""
    for section, table in data.items():
        if section not in options:
            bare = None if isinstance(table, dict) else f"key '{section}'"
            raise _unknown_name_error(options, path, section, bare=bare)
        if not isinstance(table, dict):
            raise ConfigError(f"'{section}' {_location(path)} must be a table ([{section}]), "
                              f"got {type(table).__name__} {table!r}")
        for key, raw in table.items():
            if key not in options[section]:
                raise _unknown_name_error(options, path, section, key)
            setattr(getattr(config, section), key, _checked(options[section][key], raw, path))


def config_to_dict(config: Any) -> dict[str, dict[str, Any]]:
    """``{section: {key: value}}``, a deep copy safe to modify or serialize."""
    return dataclasses.asdict(config)


def config_to_toml(config: Any) -> str:
    """The config as a TOML document that ``--job.config_file`` loads back unchanged."""
    header = "# Resolved configuration of a run; load it with --job.config_file.\n\n"
    return header + tomli_w.dumps(config_to_dict(config))


def save_config(config: Any, path: str | os.PathLike) -> None:
    """Write the config as TOML to ``path`` atomically: the text goes to a temporary file in
    the same folder which then replaces ``path``, so no reader sees a half-written file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(dir=folder, prefix=".config-", suffix=".toml.tmp")
    try:
        os.chmod(tmp_path, 0o644)  # mkstemp makes the file private; a config is not
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(config_to_toml(config))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


# ---------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------


class _WordProblem(Exception):
    """A command-line word that is no valid value: (what to show of it, what was expected)."""

    def __init__(self, shown: Any, expected: str):
        super().__init__(expected)
        self.shown, self.expected = shown, expected


def _word_value(option: _Option, text: str) -> Any:
    """A command-line word for ``option`` (lists are comma-separated), parsed and checked by
    the option's type and rules; :class:`_WordProblem` when it is not valid."""
    def word(w: str, typ: type) -> Any:
        if typ is bool:
            return _BOOL_WORDS[w.strip().lower()]  # KeyError: not a bool
        return typ(w)  # int('1.5') and int('1e3') fail: a float is no int

    items = [] if text.strip() == "" else [i.strip() for i in text.split(",")]
    if option.element is not None and "" in items:
        raise _WordProblem(text, f"expected a comma-separated {option.type_name} without empty "
                                 "entries")
    try:
        if option.element is None:
            value = word(text, option.type)
        else:
            value = [word(item, option.element) for item in items]
    except (ValueError, KeyError):
        expected = (f"expected a comma-separated {option.type_name}" if option.element else
                    f"expected {option.type_name}"
                    + (": true/false, 1/0 or yes/no" if option.type is bool else ""))
        raise _WordProblem(text, expected) from None
    if float in (option.type, option.element):
        value = [float(v) for v in value] if option.element else float(value)
    problem = _rule_problem(option, value)
    if problem is not None:
        raise _WordProblem(value, problem)
    return value


def _from_cli(option: _Option, text: str) -> Any:
    """Parse a command-line word for ``option`` (lists are comma-separated) and check it."""
    try:
        return _word_value(option, text)
    except _WordProblem as p:
        raise _bad_value(option, p.shown, COMMAND_LINE, p.expected) from None


def find_option(config_cls: type, key: str) -> _Option:
    """The option ``'section.name'`` of ``config_cls``."""
    section, _, name = key.partition(".")
    return all_options(config_cls)[section][name]


def flag_checker(option: _Option, twin: bool) -> Callable[[str], Any]:
    """An ``argparse`` ``type=`` that parses and checks a flag's word as ``option`` does on the
    config's command line (type, finiteness, choices, rules); a bad word becomes an argparse
    error (one ``error:`` line, exit 2) naming the value, the rule and, for a flag that is a
    config option's twin (``twin``), that option."""
    def check(text: str) -> Any:
        try:
            return _word_value(option, text)
        except _WordProblem as p:
            same = f"; as the config's '{option.key}'" if twin else ""
            shown = repr(p.shown) if isinstance(p.shown, str) else p.shown
            raise argparse.ArgumentTypeError(f"{shown} ({p.expected}{same})") from None

    check.__name__ = option.type_name
    return check


def _parse_overrides(args: list[str], options: Options) -> list[tuple[_Option, Any]]:
    """Turn ``--section.key value`` arguments into a list of (option, checked value).

    Accepted forms: ``--s.k value``, ``--s.k=value``; for booleans also ``--s.k`` (true),
    ``--no-s.k`` (false) and ``--s.k true|false``. Later repeats of a key win.
    """
    overrides = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r} on {COMMAND_LINE}; "
                              "options have the form --section.key VALUE (see --help)")
        name, has_value, text = token[2:].partition("=")
        negated = name.startswith("no-")
        section, dot, key = name.removeprefix("no-").partition(".")
        if not dot:
            raise _unknown_name_error(options, COMMAND_LINE, section,
                                      bare=f"unknown option '{token}'")
        if section not in options or key not in options[section]:
            raise _unknown_name_error(options, COMMAND_LINE, section,
                                      key if section in options else None)
        option = options[section][key]
        next_is_value = i < len(args) and not args[i].startswith("--")

        if negated:
            if option.type is not bool:
                raise ConfigError(f"'{token}' on {COMMAND_LINE}: the --no- form only applies "
                                  f"to booleans, and '{option.key}' is {option.type_name}")
            if has_value:
                raise ConfigError(f"'{token}' on {COMMAND_LINE}: --no-{option.key} takes no value")
            value = False
        elif has_value:
            value = _from_cli(option, text)
        elif next_is_value:
            value = _from_cli(option, args[i])
            i += 1
        elif option.type is bool:  # a bare flag means true
            value = True
        else:
            raise ConfigError(
                f"missing value for '{option.key}' on {COMMAND_LINE} (expected "
                f"{option.type_name}; use --{option.key}=VALUE for a value that starts with '--')")
        overrides.append((option, value))
    return overrides


def parse_layers(config_cls: type, args: list[str]) -> Any:
    """Defaults, then the TOML file named by ``--job.config_file``, then the other command-line
    values: a config whose every value is checked on its own (not yet as a whole).

    ``--help``/``-h`` prints every option and exits with status 0.
    """
    if "--help" in args or "-h" in args:
        print(help_text(config_cls))
        sys.exit(0)
    options = all_options(config_cls)
    overrides = _parse_overrides(args, options)
    config = config_cls()
    files = [value for option, value in overrides if option.key == CONFIG_FILE_KEY]
    if files and files[-1]:
        _apply_toml(config, options, read_toml(files[-1]), files[-1])
    for option, value in overrides:
        section, name = option.key.split(".")
        setattr(getattr(config, section), name, value)
    return config


# ---------------------------------------------------------------------------------------
# Help
# ---------------------------------------------------------------------------------------


def _option_help(option: _Option) -> list[str]:
    """The lines describing one option in ``--help``."""
    if option.type is bool:
        usage = f"--{option.key}, --no-{option.key}"
    else:
        usage = f"--{option.key} {option.type_name.upper().replace(' ', '_')}"
    details = [f"default: {format_value(option.default)}"]
    if option.choices is not None:
        details.append("choices: " + ", ".join(format_value(c) for c in option.choices))
    if option.min is not None:
        details.append(f">= {option.min}")
    if option.check is not None:
        details.append(option.check[1])
    text = f"{option.help} ({'; '.join(details)})"
    return [f"  {usage}", *textwrap.wrap(text, width=88, initial_indent=" " * 8,
                                         subsequent_indent=" " * 8)]


def help_text(config_cls: type) -> str:
    """The ``--help`` text: every section and option with type, default, choices and doc."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
    lines = [
        f"usage: {prog} [-h] [--job.config_file FILE] [--section.key VALUE ...]",
        "",
        "Each option is read from its default, then from the TOML file given by",
        "--job.config_file, then from the command line; later sources win.",
        "  values:   --section.key VALUE or --section.key=VALUE",
        "  lists:    comma-separated, e.g. --data.classes nuc,mito ('' gives an empty list)",
        "  booleans: --section.key, --no-section.key, or --section.key true|false (1/0, yes/no)",
    ]
    options = all_options(config_cls)
    for section, section_cls in sections(config_cls).items():
        doc = (section_cls.__doc__ or "").strip().splitlines()
        lines += ["", f"[{section}]" + (f"  {doc[0]}" if doc else "")]
        for option in options[section].values():
            lines += _option_help(option)
    return "\n".join(lines)
