"""DCP checkpoint -> plain PyTorch .pth of the model weights, in a single process.

    python helpers/dcp_to_pth.py --dcp outputs/run/checkpoint --out run.pth [--what backbone]

``--dcp`` is a step folder, or a checkpoint folder (its latest complete ``step-N`` is used).
``--what full`` saves every model weight (keys without the ``model.`` prefix);
``--what backbone`` saves only the ViT backbone (``backbone.*`` of a segmentation model or
``encoder.*`` of an MAE) under Meta's DINOv3 key names, so it loads with ``strict=True``
into ``build_backbone(name, ndim=..., in_chans=...)`` or into Meta's own model of the same
shape. Weights sharded by FSDP are gathered; optimizer state is not read. The file is written
under a temporary name and renamed when complete.
"""

import argparse
import sys

import torch

from torchtitan.checkpoint.convert import (
    ConversionError,
    cast_weights,
    read_model_weights,
    resolve_checkpoint,
    save_pth,
    select_weights,
)
from torchtitan.errors import USER_ERROR_EXIT, run_cli

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dcp", required=True, help="a step-N folder, or a checkpoint folder (latest step)")
    parser.add_argument("--out", required=True, help="output .pth file")
    parser.add_argument("--what", default="full", choices=("full", "backbone"),
                        help="full: every model weight; backbone: the ViT under Meta's key names "
                             "(default: full)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="dtype of the floating-point weights (default: float32)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        path = resolve_checkpoint(args.dcp)
        weights = select_weights(read_model_weights(path), args.what)
        out = save_pth(cast_weights(weights, DTYPES[args.dtype]), args.out)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    n_values = sum(t.numel() for t in weights.values())
    print(f"read {path}")
    print(f"wrote {out}: {len(weights)} tensors ({n_values / 1e6:.1f}M values, {args.what}, {args.dtype})")
    return 0



if __name__ == "__main__":
    sys.exit(run_cli(main))
