"""Meta DINOv3 backbone .pth -> DCP seed checkpoints, in 2D or inflated to 3D.

Every backbone of a torch hub folder (the command of the original project)::

    python -u pth_to_dcp.py --torch_hub_path TORCH_HUB_PATH --dinov3_repo_path DINOV3_REPO_PATH \
        --dcp_root DCP_ROOT

converts each Meta backbone file in ``TORCH_HUB_PATH/checkpoints`` (and ``TORCH_HUB_PATH``),
recognised by its name: ``dinov3_vitl16_pretrain_lvd1689m-8aa4cbdd.pth`` ->
``DCP_ROOT/dinov3_vitl16_linear/checkpoint/step-0``; weights of another pretraining set get
it as a suffix (``dinov3_vitl16_pretrain_sat493m-*.pth`` -> ``dinov3_vitl16_linear_sat493m``).
A training run with ``--job.dump_folder DCP_ROOT/dinov3_vitl16_linear`` starts from it.
``DCP_ROOT`` defaults to ``outputs``.

One file::

    python pth_to_dcp.py --pth dinov3_vitl16_pretrain_lvd1689m.pth --backbone dinov3_vitl16 \
        --dcp_root seeds --ndim 3 --in_chans 1

writes ``seeds/dinov3_vitl16_linear/checkpoint/step-0`` and prints the training flags that
load it. The architecture is built in (``torchtitan/models``), so neither torch hub nor a
clone of Meta's repository is needed (``--dinov3_repo_path`` is accepted and unused). See
``torchtitan/checkpoint/convert.py`` for what is done to the weights (channel adaptation, 3D inflation)
and why.
"""

import argparse
import sys
from pathlib import Path

from torchtitan.checkpoint.convert import (
    ConversionError,
    HubCheckpoint,
    NotABackboneFile,
    convert_meta_backbone,
    find_hub_checkpoints,
    load_pth_state_dict,
    recognise_meta_checkpoint,
    save_seed_checkpoint,
    seed_checkpoint_dir,
)
from torchtitan.config.manager import flag_type
from torchtitan.models import list_backbones
from torchtitan.errors import USER_ERROR_EXIT, run_cli

DEFAULT_BACKBONE = "dinov3_vitl16"  # of a --pth file


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_argument_group("what to convert (exactly one of)")
    source.add_argument("--pth", default=None,
                        help="one Meta DINOv3 backbone checkpoint (.pth), of --backbone")
    source.add_argument("--torch_hub_path", default=None,
                        help="torch hub root: every DINOv3 backbone .pth in "
                             "TORCH_HUB_PATH/checkpoints (and TORCH_HUB_PATH), each recognised by "
                             "its name, e.g. dinov3_vitl16_pretrain_lvd1689m-8aa4cbdd.pth")
    parser.add_argument("--dcp_root", default="outputs",
                        help="root folder of the seed checkpoints (default: outputs)")
    parser.add_argument("--backbone", default=None, choices=list_backbones(),
                        help=f"with --pth: registry name of its backbone (default: {DEFAULT_BACKBONE}); "
                             "with --torch_hub_path: convert only the files of this backbone")
    parser.add_argument("--ndim", type=int, default=2, choices=(2, 3),
                        help="2: images; 3: volumes, patch kernel inflated over depth (default: 2)")
    parser.add_argument("--in_chans", type=flag_type("model.in_chans"), default=1,
                        help="input channels of the target model (default: 1, grey EM)")
    parser.add_argument("--head", default=None,
                        help="names the output folder <backbone>_<head> and is recorded "
                             "(default: linear, or mae with --prefix encoder.)")
    parser.add_argument("--prefix", default="backbone.", choices=("backbone.", "encoder."),
                        help="model key prefix: backbone. for segmentation, encoder. for an MAE "
                             "encoder (default: backbone.)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing seed checkpoint")
    # The original converter built the model from a clone of Meta's repository.
    parser.add_argument("--dinov3_repo_path", default=None,
                        help="accepted for the original command line; unused (the DINOv3 "
                             "architecture is built in)")
    args = parser.parse_args(argv)
    if (args.pth is None) == (args.torch_hub_path is None):
        parser.error(
            "give exactly one of --pth FILE (one backbone checkpoint) or --torch_hub_path DIR "
            "(every DINOv3 backbone .pth in DIR/checkpoints); "
            + ("both were given" if args.pth is not None else "neither was given")
        )
    return args


def model_flags(backbone: str, ndim: int, in_chans: int, patch_size: int) -> str:
    """The model options a training run needs to match the converted weights."""
    return (f"--model.backbone {backbone} --model.ndim {ndim} "
            f"--model.in_chans {in_chans} --model.patch_size {patch_size}")


def training_flags(args, backbone: str, step_dir: Path, patch_size: int) -> str:
    """The flags that make a training run start from the seed checkpoint."""
    return (
        f"{model_flags(backbone, args.ndim, args.in_chans, patch_size)} \\\n"
        f"    --checkpoint.initial_load_path {step_dir} \\\n"
        f"    --checkpoint.initial_load_prefix_map {args.prefix}={args.prefix}"
    )


def train_script(args) -> str:
    return "train_mae.py" if args.prefix == "encoder." else "train_segmentation.py"


def convert_to_seed(args, pth: Path, backbone: str, step_dir: Path, head: str, source: str,
                    label: str, extra_record: dict | None = None) -> int:
    """Convert one ``.pth`` and write it as ``step_dir``; returns the patch size. A
    ``ConversionError`` says what is wrong (nothing is written then)."""
    if step_dir.exists() and not args.overwrite:
        raise ConversionError(f"{step_dir} already exists; pass --overwrite to replace it")
    pth_sd = load_pth_state_dict(pth, label=label)
    print(f"loaded {len(pth_sd)} tensors from {pth}")
    converted = convert_meta_backbone(pth_sd, backbone, args.ndim, args.in_chans, source=source)
    for note in converted.notes:
        print(f"note: {note}")
    record = {
        "source": str(Path(pth).resolve()),
        "backbone": backbone,
        "head": head,
        "ndim": args.ndim,
        "in_chans": args.in_chans,
        "patch_size": converted.patch_size,
        "prefix": args.prefix,
        "overrides": converted.overrides,
        "notes": converted.notes,
        **(extra_record or {}),
    }
    save_seed_checkpoint(converted.state_dict, step_dir, prefix=args.prefix, record=record,
                         overwrite=args.overwrite)
    n_params = sum(t.numel() for t in converted.state_dict.values())
    print(f"wrote {step_dir}: {len(converted.state_dict)} tensors ({n_params / 1e6:.1f}M values) "
          f"as model.{args.prefix}*, {args.ndim}D, in_chans={args.in_chans}")
    print(f"record: {step_dir / 'conversion.json'}")
    return converted.patch_size


# ----------------------------------------------------------------------------- --pth FILE
def convert_one(args, head: str) -> int:
    backbone = args.backbone or DEFAULT_BACKBONE
    step_dir = seed_checkpoint_dir(args.dcp_root, backbone, head)
    try:
        patch_size = convert_to_seed(args, Path(args.pth), backbone, step_dir, head,
                                     source=f"--pth {args.pth}", label="--pth")
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    print("train from it with (plus your --job.config_file and other options):")
    print(f"  torchrun --nproc_per_node <N> {train_script(args)} \\\n"
          f"    {training_flags(args, backbone, step_dir, patch_size)}")
    print(f"or train with --job.dump_folder {step_dir.parent.parent} (a run there starts from "
          "its step-0)")
    return 0


# ----------------------------------------------------------------------------- --torch_hub_path DIR
def recognise(files: list[Path], only: str | None) -> tuple[list[HubCheckpoint], list[tuple[Path, str]]]:
    """The backbone files to convert, and the others with the reason they are skipped."""
    found, skipped = [], []
    for path in files:
        try:
            ckpt = recognise_meta_checkpoint(path)
        except NotABackboneFile as e:
            skipped.append((path, str(e)))
            continue
        if only and ckpt.backbone != only:
            skipped.append((path, f"a {ckpt.backbone} file, and --backbone {only} was asked for"))
            continue
        found.append(ckpt)
    return found, skipped


def convert_hub(args, head: str) -> int:
    hub = Path(args.torch_hub_path)
    try:
        files = find_hub_checkpoints(hub)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    if not files:
        print(f"error: no .pth file in {hub / 'checkpoints'} or {hub}; put Meta's DINOv3 backbone "
              "checkpoints there (e.g. dinov3_vitl16_pretrain_lvd1689m-8aa4cbdd.pth)", file=sys.stderr)
        return USER_ERROR_EXIT
    found, skipped = recognise(files, args.backbone)
    for path, why in skipped:
        print(f"skipped {path}: {why}")
    if not found:
        print(f"error: none of the {len(files)} .pth files in {hub} is a DINOv3 backbone checkpoint "
              "to convert (see 'skipped' above)", file=sys.stderr)
        return USER_ERROR_EXIT

    # Two files of one backbone and pretraining set (e.g. two downloads) would write one folder.
    targets: dict[Path, list[Path]] = {}
    for ckpt in found:
        step_dir = seed_checkpoint_dir(args.dcp_root, ckpt.backbone, head, ckpt.suffix)
        targets.setdefault(step_dir, []).append(ckpt.path)
    for step_dir, paths in targets.items():
        if len(paths) > 1:
            print(f"error: {', '.join(map(str, paths))} would all be written to {step_dir}; keep "
                  "one of them in the hub folder, or convert each with --pth", file=sys.stderr)
            return USER_ERROR_EXIT

    print(f"converting {len(found)} backbone checkpoint(s) from {hub} into {args.dcp_root}")
    done, failed = [], []
    for ckpt in found:
        step_dir = seed_checkpoint_dir(args.dcp_root, ckpt.backbone, head, ckpt.suffix)
        print(f"\n{ckpt.path.name} ({ckpt.backbone}, {ckpt.data}) -> {step_dir}")
        try:
            patch_size = convert_to_seed(
                args, ckpt.path, ckpt.backbone, step_dir, head, label="file",
                source=f"{ckpt.path} (a {ckpt.backbone} checkpoint by its name)",
                extra_record={"pretrain_data": ckpt.data},
            )
        except ConversionError as e:
            print(f"error: {e}", file=sys.stderr)
            failed.append(ckpt.path)
            continue
        done.append((ckpt.backbone, step_dir, patch_size))

    if done:
        print("\ntrain from them with (plus your --job.config_file and other options); a run "
              "starts from the step-0 in its dump folder:")
        for backbone, step_dir, patch_size in done:
            print(f"  torchrun --nproc_per_node <N> {train_script(args)} --job.dump_folder "
                  f"{step_dir.parent.parent} \\\n"
                  f"    {model_flags(backbone, args.ndim, args.in_chans, patch_size)}")
    if failed:
        print(f"error: {len(failed)} of {len(found)} files were not converted: "
              f"{', '.join(str(p) for p in failed)} (reasons above)", file=sys.stderr)
        return USER_ERROR_EXIT
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dinov3_repo_path:
        print("note: --dinov3_repo_path is not needed (the DINOv3 architecture is built in); ignored")
    head = args.head or ("mae" if args.prefix == "encoder." else "linear")
    if Path(args.dcp_root).exists() and not Path(args.dcp_root).is_dir():
        raise ConversionError(f"--dcp_root {args.dcp_root} is an existing file; give a folder "
                              "for the seed checkpoints")
    if args.torch_hub_path is not None:
        return convert_hub(args, head)
    return convert_one(args, head)



if __name__ == "__main__":
    sys.exit(run_cli(main))
