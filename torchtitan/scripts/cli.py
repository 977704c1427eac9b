"""The command-line pieces the helper scripts (``helpers/*.py``) share: a parser made from the
script's docstring, the flags for crops, classes and voxel sizes, and the GIF output options
with the writer behind them."""

from __future__ import annotations

import argparse
from pathlib import Path

from torchtitan.cellmap.classes import check_class_names
from torchtitan.config.manager import flag_type
from torchtitan.errors import UserError
from torchtitan.pictures.visualization import save_gif


def script_parser(doc: str) -> argparse.ArgumentParser:
    """The argument parser of a helper script: its docstring's first paragraph as the
    description, the rest (usage examples, outputs) as the epilog, kept as written."""
    summary, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(description=summary, epilog=rest or None,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_list(text: str | None) -> list[str] | None:
    """A comma-separated flag as a list of its non-empty items; None stays None."""
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


_VOXEL_SIZE = flag_type(type=list[float], check=(lambda v: len(v) in (1, 3) and min(v) > 0,
                                                  "must be one or three numbers > 0, nm (z,y,x)"))


def parse_voxel_size(text):
    """"8" or "8,8,8" (nm, z, y, x) -> three floats; None (and a parsed tuple) stays as it is.
    An argparse ``type``: a bad value (no numbers, nan, <= 0) is one argparse error."""
    if text is None or isinstance(text, tuple):
        return text
    values = _VOXEL_SIZE(text)
    return tuple(values * 3 if len(values) == 1 else values)


def parse_classes(text: str | None, crops) -> list[str] | None:
    """``--classes`` as a list, each a CellMap class or one a crop of ``crops`` annotates (else
    the error that training gives, with the closest name)."""
    classes = parse_list(text)
    if classes:
        check_class_names(classes, {c for crop in crops for c in crop.classes}, "--classes")
    return classes


def add_gif_args(parser: argparse.ArgumentParser) -> None:
    """The output options both plot helpers share."""
    parser.add_argument("--out", required=True, help="output GIF")
    parser.add_argument("--png", default=None, help="also save the middle frame as this PNG")
    parser.add_argument("--max_frames", type=flag_type(type=int, min=1), default=32,
                        help="number of depth steps (z slices) at most (default: 32)")
    parser.add_argument("--duration_ms", default=150, help="time per frame, ms (default: 150)",
                        type=flag_type(type=int, check=(lambda v: 1 <= v <= 60000,
                                                        "must be in [1, 60000] ms")))


def write_gif(frames, args: argparse.Namespace, what: str) -> None:
    """Save the frames as ``--out`` (and the middle one as ``--png``) and say so."""
    for flag, out in (("--out", args.out), ("--png", args.png)):
        if out and Path(out).is_dir():
            raise UserError(f"{flag} {out} is a folder; give the path of the file to write")
    path = save_gif(frames, args.out, duration_ms=args.duration_ms)
    print(f"wrote {path} ({len(frames)} frames, {frames[0].width}x{frames[0].height} px, {what})")
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        frames[len(frames) // 2].save(args.png)
        print(f"wrote {args.png}")
