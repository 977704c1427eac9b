"""The base class of every error a user's input can cause, and how entry points show it.

A :class:`UserError` means "the user must change something" (a config value, a data store, a
checkpoint path, a command-line argument): entry points print its message once, without a
traceback, and exit with :data:`USER_ERROR_EXIT`, so that a launcher does not retry a run that
cannot succeed. Programming errors stay ``ValueError`` / ``RuntimeError`` with tracebacks.

This is the ground floor: it imports nothing of ours, so that every floor (the config, the
CellMap domain, ...) can raise these errors. ``ConfigError`` and ``CheckpointError`` are here
too; ``DatasetError`` is the domain's (:mod:`torchtitan.cellmap.errors`, which imports only
this module).
"""

from __future__ import annotations

import importlib
import os
import re
import sys

__all__ = ["USER_ERROR_EXIT", "CheckpointError", "ConfigError", "MissingExtraError", "UserError",
           "optional_import", "print_user_error", "redact_secrets", "run_cli"]

USER_ERROR_EXIT = 2


class UserError(Exception):
    """Base of every error a user's input can cause (config, data, checkpoint path, command
    line): entry points print its message once, without a traceback, and exit with status 2."""


class ConfigError(UserError, ValueError):
    """A user-facing configuration problem; the message says what to change."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used as asked; the message says why and what to do."""


class MissingExtraError(UserError, ImportError):
    """An optional feature was asked for, but its package is not installed."""


def optional_import(module: str, extra: str, purpose: str):
    """Import ``module``, a dependency of an optional feature (pyproject.toml's extra
    ``extra``), or raise :class:`MissingExtraError` saying what needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{purpose} needs the optional package '{module.split('.')[0]}', which is not "
            f"installed ({e}). Install it with: pip install 'torchtitan-em[{extra}]' (in a "
            f"checkout: pip install -e '.[{extra}]'; pip install -r requirements.txt installs "
            "every extra)") from None


def print_user_error(error: BaseException) -> int:
    """Print ``error: <message>`` to stderr and return the exit status for it."""
    print(f"error: {error}", file=sys.stderr, flush=True)
    return USER_ERROR_EXIT


def run_cli(main, argv=None) -> int:
    """Run a script's ``main(argv)`` for the command line: a :class:`UserError` (bad data,
    config, checkpoint or argument) is one message without a traceback, exit status 2."""
    try:
        return main(argv) or 0
    except UserError as e:
        return print_user_error(e)


# Hugging Face access tokens look like hf_ followed by letters and digits.
_HF_TOKEN_RE = re.compile(r"hf_[A-Za-z0-9]{8,}")
_TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def redact_secrets(text: str) -> str:
    """``text`` with Hugging Face tokens (the values of HF_TOKEN / HUGGING_FACE_HUB_TOKEN, and
    anything shaped like ``hf_...``) replaced by ``<redacted>``, for messages that quote
    exceptions of libraries that saw the token."""
    for name in _TOKEN_VARIABLES:
        value = os.environ.get(name, "").strip()
        if len(value) >= 8:
            text = text.replace(value, "<redacted>")
    return _HF_TOKEN_RE.sub("<redacted>", text)
