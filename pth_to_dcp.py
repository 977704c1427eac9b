"""Meta DINOv3 backbone .pth -> DCP seed checkpoint, in 2D or inflated to 3D.

    python pth_to_dcp.py --pth dinov3_vitl16_pretrain_lvd1689m.pth --backbone dinov3_vitl16 \
        --dcp_root seeds --ndim 3 --in_chans 1

writes ``seeds/dinov3_vitl16_linear/checkpoint/step-0`` and prints the training flags that
load it. The architecture is built in (``torchtitan/models``), so neither torch hub nor a
clone of Meta's repository is needed. See ``torchtitan/convert.py`` for what is done to the
weights (channel adaptation, 3D inflation) and why.
"""

import argparse
import sys
from pathlib import Path

from torchtitan.convert import (
    ConversionError,
    convert_meta_backbone,
    load_pth_state_dict,
    save_seed_checkpoint,
    seed_checkpoint_dir,
)
from torchtitan.models import list_backbones


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pth", required=True, help="Meta DINOv3 backbone checkpoint (.pth)")
    parser.add_argument("--dcp_root", required=True, help="root folder of the seed checkpoints")
    parser.add_argument("--backbone", default="dinov3_vitl16", choices=list_backbones(),
                        help="registry name of the backbone (default: dinov3_vitl16)")
    parser.add_argument("--ndim", type=int, default=2, choices=(2, 3),
                        help="2: images; 3: volumes, patch kernel inflated over depth (default: 2)")
    parser.add_argument("--in_chans", type=int, default=1,
                        help="input channels of the target model (default: 1, grey EM)")
    parser.add_argument("--head", default=None,
                        help="names the output folder <backbone>_<head> and is recorded "
                             "(default: linear, or mae with --prefix encoder.)")
    parser.add_argument("--prefix", default="backbone.", choices=("backbone.", "encoder."),
                        help="model key prefix: backbone. for segmentation, encoder. for an MAE "
                             "encoder (default: backbone.)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing seed checkpoint")
    # Accepted for compatibility with the torch-hub based converter; not needed here.
    parser.add_argument("--torch_hub_path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dinov3_repo_path", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def training_flags(args, step_dir: Path, patch_size: int) -> str:
    """The flags that make a training run start from the seed checkpoint."""
    return (
        f"--model.backbone {args.backbone} --model.ndim {args.ndim} "
        f"--model.in_chans {args.in_chans} --model.patch_size {patch_size} \\\n"
        f"    --checkpoint.initial_load_path {step_dir} \\\n"
        f"    --checkpoint.initial_load_prefix_map {args.prefix}={args.prefix}"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    for flag in ("torch_hub_path", "dinov3_repo_path"):
        if getattr(args, flag):
            print(f"note: --{flag} is not needed (the DINOv3 architecture is built in); ignored")
    head = args.head or ("mae" if args.prefix == "encoder." else "linear")
    step_dir = seed_checkpoint_dir(args.dcp_root, args.backbone, head)
    try:
        if step_dir.exists() and not args.overwrite:
            raise ConversionError(f"{step_dir} already exists; pass --overwrite to replace it")
        pth_sd = load_pth_state_dict(args.pth)
        print(f"loaded {len(pth_sd)} tensors from {args.pth}")
        converted = convert_meta_backbone(pth_sd, args.backbone, args.ndim, args.in_chans,
                                          source=f"--pth {args.pth}")
        for note in converted.notes:
            print(f"note: {note}")
        record = {
            "source": str(Path(args.pth).resolve()),
            "backbone": args.backbone,
            "head": head,
            "ndim": args.ndim,
            "in_chans": args.in_chans,
            "patch_size": converted.patch_size,
            "prefix": args.prefix,
            "overrides": converted.overrides,
            "notes": converted.notes,
        }
        save_seed_checkpoint(converted.state_dict, step_dir, prefix=args.prefix, record=record,
                             overwrite=args.overwrite)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n_params = sum(t.numel() for t in converted.state_dict.values())
    print(f"wrote {step_dir}: {len(converted.state_dict)} tensors ({n_params / 1e6:.1f}M values) "
          f"as model.{args.prefix}*, {args.ndim}D, in_chans={args.in_chans}")
    print(f"record: {step_dir / 'conversion.json'}")
    script = "train_mae.py" if args.prefix == "encoder." else "train_segmentation.py"
    print("train from it with (plus your --job.config_file and other options):")
    print(f"  torchrun --nproc_per_node <N> {script} \\\n"
          f"    {training_flags(args, step_dir, converted.patch_size)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
