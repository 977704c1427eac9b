"""Predict whole EM volumes, regions or label crops with a trained segmentation model.

    python predict.py --checkpoint outputs/run/checkpoint --crops all --out pred.zarr
    python predict.py --checkpoint outputs/run/checkpoint/step-300 --dataset jrc_synth-1 \
        --roi 0:640,0:1280,0:1280 --out pred.zarr --probabilities
    torchrun --nproc_per_node 4 predict.py --checkpoint model.pth --config run/config.toml \
        --dataset jrc_hela-2 --out hela2.zarr          # blocks split across ranks
    python predict.py --checkpoint outputs/run/checkpoint --manifest test_crops.csv \
        --out pred.zarr --tta --planes zyx       # every crop of a manifest, no labels
    python predict.py --checkpoint outputs/run/checkpoint --manifest test_crop_manifest.csv \
        --out pred.zarr --instances --submission submission.zarr   # + the challenge's layout
    python predict.py --model exported/run/bioimageio --weights onnx --data data/demo \
        --crops all --out pred.zarr              # an exported model (helpers/export_model.py)
    python predict.py --checkpoint run/checkpoint --dataset jrc_hela-2 --out hela2.zarr \
        --instances --shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT   # one job of many
    python predict.py --checkpoint run/checkpoint --dataset jrc_hela-2 --out hela2.zarr \
        --instances --finish                     # the last step, when the shards are done

``--manifest`` takes a CSV with the columns crop_name, dataset, origin_z/y/x (nm, outer corner
of voxel 0), shape_z/y/x (voxels) and voxel_size_z/y/x (nm), or the challenge's test-crop
manifest (crop_name, dataset, class_label, voxel_size, translation, shape); see
torchtitan/prediction/predictor.py. ``--submission SUB.zarr`` also writes the challenge's
submission layout (every test crop and class on the crop's own grid; SUB.zip for upload) and
checks it with the submission linter (torchtitan/prediction/submission.py).
``--tta`` averages over the flips of each window and ``--planes zyx`` makes a 2D model predict
yx, zx and zy planes and average them; both override the run's ``[inference]`` settings.

``--shard I/N`` predicts every N-th block of the requested regions, starting at block I, into
the same ``--out`` (jobs of a SLURM array, one after another or together); the shard that
finds every block written runs the last step (post-processing and instances across the
blocks, pyramids, completion markers, ``--submission``), or ``--finish`` does. A job that is
stopped is simply run again: it resumes at the blocks it had not written. Regions already
finished in ``--out`` are kept (``--overwrite`` predicts them again), so crops and regions can
be added to a store one command at a time.

The run's ``config.toml`` (found next to the checkpoint, or given with --config) rebuilds the
model; the output is OME-NGFF zarr that napari and neuroglancer open (multiscale pyramids of
at least 3 levels, 64^3 chunks), laid out as ``PRED.zarr/crop<N>/<class>`` for crops. See
torchtitan/prediction/predictor.py.
"""

import argparse
import sys

from torchtitan.config.manager import flag_type
from torchtitan.config.job_config import POSITIVE
from torchtitan.errors import USER_ERROR_EXIT, UserError
from torchtitan.logging_metrics import report_user_error, setup_logging

# OME-NGFF levels s0.. of each output group: 0 = automatic; a pyramid halves each level, so
# more levels than a 64-bit volume's sides can halve are a mistake.
PYRAMID_LEVELS = (lambda v: 0 <= v <= 64, "must be 0 (automatic) or a number of levels in [1, 64]")


def shard_type(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 0 <= I < N."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/N, e.g. 0/4") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"{text!r}: needs 0 <= I < N (shards are counted from "
                                         "0, as SLURM_ARRAY_TASK_ID is with --array=0-N)")
    return i, n


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    weights = p.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint",
                         help="DCP step folder, a run's checkpoint folder (latest step), or a .pth")
    weights.add_argument("--model", help="an exported model (helpers/export_model.py): a "
                                         "bioimage.io package folder, its rdf.yaml or .zip, or "
                                         "a hub folder; its config.toml is the run's")
    p.add_argument("--weights", choices=("state_dict", "torchscript", "onnx"), default=None,
                   help="with --model: which of its weights run (default state_dict; onnx "
                        "needs onnxruntime)")
    p.add_argument("--config", help="the run's config.toml (default: found beside the checkpoint)")
    p.add_argument("--data", help="data root (default: the run's data.dataset_path)")
    p.add_argument("--crops", help="predict label crops: 'all' or names (crop3,jrc_x/crop4)")
    p.add_argument("--dataset", help="predict this dataset's EM volume (or --roi of it)")
    p.add_argument("--roi", help="region in nm: z0:z1,y0:y1,x0:x1")
    p.add_argument("--manifest", help="CSV of crops to predict (crop_name, dataset, origin_z/y/x "
                                      "nm, shape_z/y/x, voxel_size_z/y/x nm), e.g. test crops")
    p.add_argument("--out", required=True, help="output zarr (created or updated)")
    p.add_argument("--overwrite", action="store_true",
                   help="predict regions again that --out already holds finished (default: "
                        "keep them; unfinished regions of an interrupted run resume anyway). "
                        "Only stores predict.py wrote are ever written into")
    jobs = p.add_mutually_exclusive_group()
    jobs.add_argument("--shard", type=shard_type, metavar="I/N",
                      help="predict only shard I of N (0 <= I < N) of the blocks, e.g. "
                           "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT; the shard that finds "
                           "every block written runs the last step")
    jobs.add_argument("--finish", action="store_true",
                      help="only the last step (post-processing, instances, pyramids, "
                           "completion, --submission) of blocks that shards have written")
    p.add_argument("--probabilities", action="store_true", help="write float32 probabilities")
    p.add_argument("--threshold", type=flag_type("inference.threshold"), default=None,
                   help="mask threshold (default: the run's inference.threshold)")
    p.add_argument("--tta", action=argparse.BooleanOptionalAction, default=None,
                   help="average over the flips of each window (default: inference.tta_flips)")
    p.add_argument("--planes", type=flag_type("inference.planes"), default=None,
                   help="2D models: 'z' (yx planes) or 'zyx' (yx, zx and zy planes averaged; "
                        "isotropic voxel size only) (default: inference.planes)")
    p.add_argument("--instances", action="store_true",
                   help="instance ids (connected components) for CellMap instance classes")
    p.add_argument("--batch_size", type=flag_type("inference.batch_size"), default=None,
                   help="windows per forward (default: the run's inference.batch_size)")
    p.add_argument("--submission", metavar="SUB.zarr",
                   help="also write the challenge's submission layout of the predicted crops "
                        "(--manifest or --crops) here, zip it (SUB.zip) and check it")
    p.add_argument("--pyramid_levels", type=flag_type(type=int, check=PYRAMID_LEVELS), default=0,
                   help="levels s0.. of each output group (default 0: at least 3, until the "
                        "largest side is <= 64 voxels)")
    p.add_argument("--max_block_mb", type=flag_type(type=float, check=POSITIVE), default=1024,
                   help="memory for one output block's buffers, MiB (default 1024)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    if args.overwrite and (args.shard or args.finish):
        p.error("--overwrite cannot be used with --shard or --finish: each shard would start the "
                "others' regions again; predict into a new --out instead")
    if args.weights and not args.model:
        p.error("--weights chooses the weights of an exported --model")
    if args.model:  # the export stands where a checkpoint would (its config, the output's record)
        args.checkpoint = args.model
    return args


def bound_malloc_arenas(arenas: int = 2) -> None:
    """Let glibc's malloc keep at most ``arenas`` arenas. By default every thread that
    allocates may get an arena of its own (up to 8 per core), and memory freed in one is rarely
    given back: with zarr's decoding threads a long prediction's resident memory creeps up by
    hundreds of MiB over what its blocks need (docs/benchmarks/prediction_memory.md).
    Elsewhere than glibc, nothing to do."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def main(argv=None) -> int:
    import os

    bound_malloc_arenas()
    rank = int(os.environ.get("RANK", 0))
    setup_logging(rank)
    args = parse_args(argv)
    from torchtitan.prediction.predictor import predict_regions

    try:
        written = predict_regions(args)
    except UserError as e:  # ConfigError, DatasetError, CheckpointError, ...: one message
        report_user_error(e, rank)
        return USER_ERROR_EXIT
    if rank == 0:
        for path in written:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
