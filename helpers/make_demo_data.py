"""Generate the synthetic demo datasets (CellMap challenge layout) used by the demo and tests.

    python helpers/make_demo_data.py --out data/demo [--seed 0] [--scale 1.0] [--force]

Does nothing when ``--out`` already holds a complete set made with the same seed and scale
(a marker file is written last, so an interrupted run is redone). See
``torchtitan/demo/data.py`` for what the data look like.
"""

import argparse
import sys
import time
from pathlib import Path

from torchtitan.demo.data import (
    demo_data_complete,
    generate_demo_data,
    preview_png,
    summarize_demo_data,
)
from torchtitan.config.manager import flag_type
from torchtitan.errors import run_cli


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/demo", help="output folder (default: data/demo)")
    parser.add_argument("--seed", type=flag_type("training.seed"), default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="shrink factor of the volumes, e.g. 0.4 for a tiny set (default: 1.0)"
    )
    parser.add_argument("--force", action="store_true", help="regenerate even if a complete set is there")
    parser.add_argument("--preview", default=None, help="also save a PNG of the central slices with labels")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    if not args.force and demo_data_complete(out, seed=args.seed, scale=args.scale):
        print(f"Demo data already complete in {out} (seed {args.seed}, scale {args.scale}); use --force to redo.")
    else:
        start = time.perf_counter()
        names = generate_demo_data(out, seed=args.seed, scale=args.scale)
        print(f"Wrote {len(names)} demo datasets to {out} in {time.perf_counter() - start:.1f} s:")
        print(summarize_demo_data(out))
    if args.preview:
        preview_png(out, args.preview)
        print(f"Saved preview to {args.preview}")



if __name__ == "__main__":
    sys.exit(run_cli(main))
