"""Job configuration: :class:`ConfigManager` reads defaults, a TOML file and the command line
into the schema (:class:`~torchtitan.config.job_config.JobConfig`, one documented dataclass
per TOML section) and checks the result.

Values are resolved in three layers, each later one winning::

    defaults (job_config.py)  <  TOML file (--job.config_file)  <  command line (--section.key)

Usage::

    config = ConfigManager().parse_args()          # reads sys.argv
    config = ConfigManager().parse_args(["--job.config_file", "train_configs/x.toml",
                                         "--training.steps", "20", "--no-training.compile"])

Every problem a user can cause (an unknown key, a value of the wrong type, a missing file,
inconsistent options) raises :class:`~torchtitan.errors.ConfigError` with a message that
names the file or the command line, the full ``section.key``, the offending value and what was
expected, so that a bad config fails before any process group is started.

This module is the entry to the config floor: :class:`ConfigManager`, :func:`flag_type` (the
config's rules for other programs' flags) and the names the rest of the code imports for
saving and validation, which live beside it in :mod:`torchtitan.config.parsing` (TOML and
command line into checked dataclasses, ``--help``, the TOML round trip) and
:mod:`torchtitan.config.checks` (rules across options). The schema is
:mod:`torchtitan.config.job_config`. The errors are :mod:`torchtitan.errors`'s.

Floor 1: the config modules import only the standard library, ``tomli_w``, each other and
:mod:`torchtitan.errors`.
"""

import logging
import os
import sys

from torchtitan.config.checks import config_warnings, validate
from torchtitan.config.job_config import JobConfig
from torchtitan.config.parsing import (
    COMMAND_LINE,
    Rule,
    config_to_dict,
    config_to_toml,
    find_option,
    flag_checker,
    opt,
    parse_layers,
    save_config,
)
from torchtitan.config.parsing import _Option
from torchtitan.config.parsing import help_text as _help_text

__all__ = [
    "COMMAND_LINE",
    "ConfigManager",
    "JobConfig",
    "config_to_dict",
    "config_to_toml",
    "config_warnings",
    "flag_type",
    "help_text",
    "opt",
    "save_config",
    "validate",
]


class ConfigManager:
    """Builds a validated :class:`JobConfig` from defaults, a TOML file and the command line.

    Args:
        config_cls: the top-level config dataclass; a subclass of :class:`JobConfig` may add
            sections for a new task.
    """

    def __init__(self, config_cls: type = JobConfig):
        self.config_cls = config_cls
        self.config: JobConfig | None = None

    def parse_args(self, args: list[str] | None = None) -> JobConfig:
        """Parse ``args`` (default: ``sys.argv[1:]``) and return the validated config.

        ``--help``/``-h`` prints every option and exits with status 0.
        """
        args = sys.argv[1:] if args is None else list(args)
        config = parse_layers(self.config_cls, args)
        validate(config)
        if os.environ.get("RANK", "0") == "0":
            for text in config_warnings(config):
                logging.getLogger("torchtitan").warning(text)
        self.config = config
        return config


def flag_type(key: str | None = None, *, type: type = int, min: int | float | None = None,
              check: Rule | None = None, choices: tuple | None = None):
    """An ``argparse`` ``type=`` for a command-line flag of an entry point other than training
    (``predict.py``, the scoring command, ``pth_to_dcp.py``, ``helpers/``), so that its values
    are checked by the config's own rules rather than a copy of them.

    With ``key`` the flag is the twin of that config option (``--threshold`` of
    ``inference.threshold``): it has the option's type, finiteness, choices and range, and a
    bad value names the option. Without, the flag is checked by ``type`` (floats finite) and
    the rules given (``min``, ``check`` such as :data:`POSITIVE`, ``choices``). A bad value is
    one argparse ``error:`` line naming it, exit status 2.
    """
    if key is not None:
        return flag_checker(find_option(JobConfig, key), twin=True)
    option = _Option("flag", type, None, "", choices, min, check)
    return flag_checker(option, twin=False)


def help_text(config_cls: type = JobConfig) -> str:
    """The ``--help`` text: every section and option with type, default, choices and doc."""
    return _help_text(config_cls)
