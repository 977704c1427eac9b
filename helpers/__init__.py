"""Command-line helpers, run as ``python helpers/<script>.py``: demo data, plots, slice datasets,
checkpoint conversion. Thin: they parse arguments and call ``torchtitan``. A package (installed
with the project, see pyproject.toml) so that they and the tests can import each other's
functions without editing the import path."""

import argparse


def script_parser(doc: str) -> argparse.ArgumentParser:
    """The argument parser of a helper script: its docstring's first paragraph as the
    description, the rest (usage examples, outputs) as the epilog, kept as written."""
    summary, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(description=summary, epilog=rest or None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_gif_args(parser: argparse.ArgumentParser) -> None:
    """The output options both plot helpers share."""
    parser.add_argument("--out", required=True, help="output GIF")
    parser.add_argument("--png", default=None, help="also save the middle frame as this PNG")
    from torchtitan.config_manager import flag_type

    parser.add_argument("--max_frames", type=flag_type(type=int, min=1), default=32,
                        help="number of depth steps (z slices) at most (default: 32)")
    parser.add_argument("--duration_ms", default=150, help="time per frame, ms (default: 150)",
                        type=flag_type(type=int, check=(lambda v: 1 <= v <= 60000,
                                                        "must be in [1, 60000] ms")))


def write_gif(frames, args: argparse.Namespace, what: str) -> None:
    """Save the frames as ``--out`` (and the middle one as ``--png``) and say so."""
    from pathlib import Path

    from torchtitan.errors import UserError
    from torchtitan.tools.visualization import save_gif

    for flag, out in (("--out", args.out), ("--png", args.png)):
        if out and Path(out).is_dir():
            raise UserError(f"{flag} {out} is a folder; give the path of the file to write")
    path = save_gif(frames, args.out, duration_ms=args.duration_ms)
    print(f"wrote {path} ({len(frames)} frames, {frames[0].width}x{frames[0].height} px, {what})")
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        frames[len(frames) // 2].save(args.png)
        print(f"wrote {args.png}")
