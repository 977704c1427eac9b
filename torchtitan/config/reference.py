"""The configuration reference, ``docs/configuration.md``, generated from the schema.

    python -m torchtitan.config.reference docs/configuration.md           # write it
    python -m torchtitan.config.reference --check docs/configuration.md   # exit 1 if stale

Every option of :class:`~torchtitan.config.job_config.JobConfig`, section by section, with its
type, default, allowed values and the docstring it is declared with; then the options that
earlier releases had and what replaced them. The page is never edited by hand: the test suite
regenerates it and compares (``tests/test_config.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchtitan.config.job_config import JobConfig
from torchtitan.config.parsing import _Option, all_options, format_value, sections

HEADER = """\
# Configuration reference

Every option of a run, as a TOML key (`[section]` then `key = value`) or on the command line
(`--section.key value`; the command line wins over the file given by `--job.config_file`). A
key that is not listed here, a value of the wrong type and a value outside its allowed values
stop the run before it starts, naming the key. The shipped configs in `train_configs/` set the
options that differ from these defaults.

This page is generated from the schema (`torchtitan/config/job_config.py`) by
`python -m torchtitan.config.reference docs/configuration.md`; do not edit it by hand.
"""


def _allowed(option: _Option) -> str | None:
    """The rule a value must keep, in words, or None."""
    parts = []
    if option.choices is not None:
        parts.append("one of " + ", ".join(f"`{format_value(c)}`" for c in option.choices))
    if option.min is not None:
        each = "each entry " if option.element is not None else ""
        parts.append(f"{each}>= {option.min}")
    if option.check is not None:
        parts.append(option.check[1])
    return "; ".join(parts) or None


def _option(option: _Option) -> list[str]:
    facts = [f"`{option.type_name}`", f"default `{format_value(option.default)}`"]
    allowed = _allowed(option)
    if allowed:
        facts.append(f"allowed: {allowed}")
    return [f"- **`{option.key}`** ({', '.join(facts)}). {option.help}"]


def markdown(config_cls: type = JobConfig) -> str:
    """The reference page of ``config_cls`` as Markdown."""
    options = all_options(config_cls)
    lines = [HEADER, "Sections: " + ", ".join(f"[`[{s}]`](#{s})" for s in options) + ".", ""]
    for section, section_cls in sections(config_cls).items():
        doc = " ".join((section_cls.__doc__ or "").split())
        lines += [f"## {section}", "", doc, ""] if doc else [f"## {section}", ""]
        for option in options[section].values():
            lines += _option(option)
        lines.append("")
    removed = {f"`{key}`": why for key, why in options.removed.items()}
    removed.update({f"`{o.key} = {format_value(value)}`": why
                    for fields in options.values() for o in fields.values()
                    for value, why in o.removed_choices.items()})
    if removed:
        lines += ["## Removed options", "",
                  "A config that sets one of these is refused with the reason given here.", ""]
        lines += [f"- **{name}**: {why}." for name, why in sorted(removed.items())]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write the configuration reference (Markdown).")
    p.add_argument("path", help="the page to write, e.g. docs/configuration.md")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when the page differs from the schema's")
    args = p.parse_args(argv)
    text, path = markdown(), Path(args.path)
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is stale: run python -m torchtitan.config.reference {path}",
                  file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
