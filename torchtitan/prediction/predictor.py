"""Blockwise prediction of whole EM volumes, regions or label crops with a trained model.

Used by ``predict.py``. The model is rebuilt from the run's ``config.toml`` and its weights
are loaded from a DCP checkpoint (a step folder, or a run's checkpoint folder for its latest
step) or from an exported ``.pth``; ``--model`` runs an export's weights with its own config
instead (:mod:`torchtitan.prediction.exported`). Input is read from zarr window by window and the
output is written block by block (:func:`torchtitan.inference.sliding_window.predict_blockwise`), and the
post-processing works block by block too (:mod:`torchtitan.postprocess.blockwise`), so the memory of a
process is set by the block (``--max_block_mb``), never by the volume. Under ``torchrun`` the
blocks are split across ranks; ``--shard I/N`` splits them across jobs (a SLURM array).

Output (OME-NGFF 0.4, zarr format 2), one multiscale group per predicted region and class::

    PRED.zarr/<region>/<class>/s0      uint8 masks (0/1), float32 probabilities, or
                                       uint32 instance ids (instance classes, --instances)
    PRED.zarr/<region>/<class>/s1..    2x pyramid for viewers (at least 3 levels in all, until
                                       the largest side is <= 64 voxels; --pyramid_levels):
                                       mean of probabilities, mode of masks and ids
    PRED.zarr/<region>/<class>_aff_<z>_<y>_<x>/s0
                                       a model with [affinities]: each affinity channel, uint16
                                       probability x 65535 (float32 with --probabilities), no
                                       pyramid; --instances cuts <class> from them
                                       (inference.affinity_cut, block by block)

Arrays are chunked 64^3 (viewers fetch them quickly); blocks are whole chunks, so ranks
never write into the same chunk. Readers (scoring, plots) read ``s0``.

where ``<region>`` is ``crop<N>`` for label crops and for the rows of a crop manifest (the
CellMap submission layout) or the dataset name for a whole volume / ROI (the
formats of crop manifests: :mod:`torchtitan.prediction.regions`). Each class group has ``multiscales`` (scale = the
model's voxel size, translation = centre of voxel 0, nm) and the plain ``voxel_size`` and
``translation`` attributes of the submission format.

The steps of a region:

1. **Blocks.** Each block's classes are written, then the block is marked written
   (:mod:`torchtitan.prediction.store`: ``<region>/_blocks/<k>``). The region records
   its plan (geometry, block grid, dtype, classes, checkpoint and inference settings): a job
   that finds the same plan resumes at the blocks not yet written; another plan, or a region
   without one, is predicted again from its start.
2. **The last step**, once every block of the region is written: post-processing (the run's
   ``[inference]`` ``min_object_nm3``, ``fill_holes`` and, for ``--instances``, ``instances``
   and ``boundary_instances``) block by block over the ranks, with one global numbering of the
   instances (:func:`torchtitan.postprocess.blockwise.postprocess_region`; ``--probabilities`` are written
   raw), then the viewer pyramid (classes dealt out to the ranks), then the completion marker
   ``prediction_complete = true`` on ``PRED.zarr/<region>``; last, ``--submission``.

Jobs: without ``--shard`` one job (of any number of ranks) predicts every block and runs the
last step. ``--shard I/N`` (``0 <= I < N``) predicts only the blocks ``j`` with ``j % N == I``
(``j`` counts the blocks of all requested regions in order) and runs the last step only when
it finds every block written (the last shard to finish: one job claims it, see
:func:`torchtitan.prediction.store.claim_finishing`); ``--finish`` runs the last step
alone, e.g. after the shards of a SLURM array, and says which blocks are missing if any are.
Shards and ``--finish`` take the same arguments otherwise.

A finished region is kept: asked for again without ``--overwrite`` it is skipped (an error
when it was predicted with another checkpoint or other inference settings, naming them), so
crops and regions can be added to a store one command at a time. ``--overwrite`` predicts
finished regions again (unfinished ones always resume); it is refused with ``--shard``, whose
jobs would reset each other's blocks.

Ownership: predict.py writes only into stores it created. The root and every region and class
group it creates carry ``torchtitan_prediction`` before anything is written into them; an
``--out`` that is an existing file, lies inside another zarr store (a dataset's ``em/`` or
``labels/`` groups), is a non-empty folder or a zarr store without that attribute, or whose
region or class groups lack it, is refused before any work, naming the path, with
``--overwrite`` too (:func:`check_output_store`). ``--submission`` likewise replaces only a
submission it wrote (``torchtitan_submission`` on its root).
"""

from __future__ import annotations

import json
import logging
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from torchtitan.cellmap.affinities import AffinitySpec, channel_name, from_stored, to_stored
from torchtitan.postprocess.blockwise import postprocess_region
from torchtitan.postprocess.blockwise_labels import Blocks
from torchtitan.cellmap.ome_ngff import (
    VIEW_CHUNKS,
    auto_pyramid_levels,
    pyramid_steps,
    write_pyramid,
)
from torchtitan.checkpoint.reading import complete_steps, resolve_step_folder
from torchtitan.data.crops.layout import DatasetError, discover
from torchtitan.data.crops.reader import read_em, set_em_ranges
from torchtitan.data.io.stores import StoreContext
from torchtitan.errors import ConfigError
from torchtitan.inference.sliding_window import (
    VolumePredictor,
    block_shape_for_budget,
    block_window,
    resolve_planes,
)
from torchtitan.models import resolve_attention_backend, use_attention
from torchtitan.parallelisms.process_group import init_process_group
from torchtitan.postprocess.masks import PostProcessing
from torchtitan.prediction import exported
from torchtitan.prediction.runs import load_run_config, load_weights
from torchtitan.prediction.regions import (
    Region,
    read_manifest,
    requested_regions,
    test_manifest_crops,
)
from torchtitan.prediction.store import (
    COMPLETE_ATTR,
    OWNER_ATTR,
    check_output_store,
    claim_finishing,
    done_blocks,
    mark_block,
    prepare_region,
    release_finishing,
    remove_scratch,
    select_regions,
    store_lock,
    stored_plan,
)
from torchtitan.prediction.submission import SUBMISSION_ATTR

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# The job: ranks of this process group, and this job's shard of the blocks
# ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    """This process's place: its rank among the job's ``world`` ranks (torchrun), and the
    job's shard ``shard`` of ``shards`` (``--shard I/N``; 0 of 1 without)."""

    rank: int = 0
    world: int = 1
    shard: int = 0
    shards: int = 1
    finish_only: bool = False  # --finish

    @classmethod
    def start(cls, args, cfg) -> Job:
        """The job of the parsed arguments, its process group joined under torchrun."""
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if world > 1 and not dist.is_initialized():
            init_process_group(predict_device(), cfg.comm.init_timeout_seconds)
        shard, shards = args.shard or (0, 1)
        return cls(rank, world, shard, shards, bool(args.finish))

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def from_rank0(self, value):
        """``value`` as rank 0 has it, on every rank."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        """Log each rank's peak memory (resident set) and leave the process group."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        peaks = [peak]
        if self.world > 1 and dist.is_initialized():
            peaks = [None] * self.world
            dist.all_gather_object(peaks, peak)
            dist.destroy_process_group()
        if self.rank == 0:
            logger.info("peak memory per rank (MiB): %s", ", ".join(f"{p:.0f}" for p in peaks))


def predict_device() -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# The whole prediction
# ---------------------------------------------------------------------------------------------


def predict_regions(args) -> list[str]:
    """Run the whole prediction described by the parsed ``predict.py`` arguments: the run's
    config, the regions and their plans, the checked outputs, then this job's blocks of every
    unfinished region and, when every block is written, the last step (module docstring)."""
    cfg = load_run_config(args.checkpoint, args.config)
    if args.data:
        cfg.data.dataset_path = args.data
    settings = inference_options(cfg, args)
    sources = discover(StoreContext.from_config(cfg.data), cfg.data.dataset_path)
    set_em_ranges(sources, cfg.data.em_range)
    requested = requested_regions(args, sources, cfg.data.voxel_size)
    check_outputs(args, [r.name for r in requested])
    classes = list(cfg.data.classes)
    plans = {r.name: region_plan(r, cfg, args, settings, classes) for r in requested}
    todo, redo = select_regions(requested, plans, args.out, args.overwrite)
    job = Job.start(args, cfg)  # an error on one rank ends the job: torchrun stops the others
    written: list[str] = []
    if todo:
        prepare_regions(job, args, todo, plans, redo)
        if not job.finish_only:
            predict_blocks(job, args, cfg, settings, requested, todo, plans)
        job.barrier()
        if not decide_finishing(job, args, todo, plans):
            job.close()
            return []
        post = PostProcessing.from_config(cfg.inference)
        for region in todo:
            finish_region(job, args, region, plans[region.name], post)
            written.append(f"{args.out}/{region.name}")
        if job.rank == 0:
            release_finishing(args.out)
    job.close()
    if args.submission and job.rank == 0:  # after the other ranks are done, so none waits
        written += _write_submission(args, cfg, [r.name for r in requested], classes)
    return written


class InferenceSettings(NamedTuple):
    """The settings of a prediction that ``predict.py``'s flags may override."""

    tta: bool
    planes: str
    threshold: float


def inference_options(cfg, args) -> InferenceSettings:
    """The run's ``[inference]`` settings, overridden by ``--tta/--no-tta``, ``--planes`` and
    ``--threshold``; checked against the model and grid before any model is built."""
    inf = cfg.inference
    tta = inf.tta_flips if args.tta is None else bool(args.tta)
    threshold = inf.threshold if args.threshold is None else float(args.threshold)
    try:
        planes = resolve_planes(args.planes or inf.planes, len(cfg.model.crop_size),
                                cfg.data.voxel_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return InferenceSettings(tta, planes, threshold)


def checkpoint_identity(args) -> str:
    """The weights a prediction comes from: a run's checkpoint folder resolved to its latest
    step (so that a run still training does not change a region between two jobs)."""
    path = Path(args.checkpoint)
    if not args.model and path.suffix != ".pth" and complete_steps(path):
        path = resolve_step_folder(path)
    ident = str(path.resolve())
    return f"{ident} ({args.weights or 'state_dict'})" if args.model else ident


def region_plan(region: Region, cfg, args, settings: InferenceSettings, classes: list[str]) -> dict:
    """Everything a region's blocks depend on (JSON): equal plans give equal blocks."""
    window = tuple(cfg.model.crop_size)
    spec = AffinitySpec.from_config(cfg)
    outputs = len(classes) + len(spec)
    buffers = outputs * (2 if settings.planes == "zyx" else 1)  # outputs (+ sum)
    block = block_shape_for_budget(region.shape, block_window(window, settings.planes),
                                   buffers, args.max_block_mb * 2**20)
    block, chunks = view_chunking(block, region.shape)
    inf = cfg.inference
    plan = {
        "dataset": region.source.name, "origin": region.origin, "shape": region.shape,
        "voxel_size": region.voxel_size, "block": block, "chunks": chunks,
        "dtype": "float32" if args.probabilities else "uint8", "classes": classes,
        "affinities": spec.channel_names(), "offsets": [list(o) for o in spec.offsets],
        "checkpoint": checkpoint_identity(args),
        "inference": {"window": window, "overlap": inf.overlap, "blend": inf.blend,
                      "tta_flips": settings.tta, "planes": settings.planes,
                      "threshold": None if args.probabilities else settings.threshold},
    }
    return json.loads(json.dumps(plan, default=lambda a: np.asarray(a).tolist()))


# ---------------------------------------------------------------------------------------------
# Regions and their blocks
# ---------------------------------------------------------------------------------------------


def prepare_regions(job: Job, args, todo: list[Region], plans: dict, redo: set[str]) -> None:
    """Create each region to predict, or keep it to resume: on rank 0, under the store's lock
    (shards started together create a region once); then every rank goes on."""
    if job.rank == 0:
        import zarr

        with store_lock(args.out):
            root = zarr.open_group(args.out, mode="a", zarr_format=2)
            root.attrs[OWNER_ATTR] = {"checkpoint": str(args.checkpoint)}
            for region in todo:
                prepare_region(root, args.out, region, plans[region.name],
                               region.name in redo, job.finish_only)
    job.barrier()
    # The store's plans from here on: a region resumed keeps the block grid it was started with.
    for name in plans:
        plans[name] = stored_plan(args.out, name) or plans[name]


def job_blocks(job: Job, args, requested: list[Region], todo: list[Region],
               plans: dict) -> list[tuple[Region, int]]:
    """The blocks this job (its shard) still has to write, as (region, k): block ``k`` of the
    ``j``-th block of every requested region in order belongs to shard ``j % shards``."""
    out, offset = [], 0
    names = {r.name for r in todo}
    for region in requested:
        n = len(Blocks(plans[region.name]["shape"], plans[region.name]["block"]))
        if region.name in names:
            done = done_blocks(args.out, region.name)
            out += [(region, k) for k in range(n)
                    if (offset + k) % job.shards == job.shard and k not in done]
        offset += n
    return out


def predict_blocks(job: Job, args, cfg, settings: InferenceSettings, requested: list[Region],
                   todo: list[Region], plans: dict) -> None:
    """Predict this rank's share of the job's blocks. The model is built when the job has
    blocks left, on every rank (loading a DCP checkpoint is collective)."""
    remaining = job_blocks(job, args, requested, todo, plans)
    mine = remaining[job.rank::job.world]
    if job.rank == 0:
        for region in todo:
            plan = plans[region.name]
            logger.info("%s: %s voxels in blocks %s", region.name, list(region.shape),
                        list(plan["block"]))
        shard = f"shard {job.shard}/{job.shards}: " if job.sharded else ""
        logger.info("%s%d block(s) of %d region(s) to predict", shard, len(remaining),
                    len({r.name for r, _ in remaining}))
    if not remaining:
        return
    predictor = build_predictor(args, cfg, settings)
    if job.rank == 0:
        logger.info("window %s, overlap %s, %s blending, tta_flips=%s, planes=%s, threshold "
                    "%s", "x".join(map(str, predictor.window)), predictor.overlap,
                    predictor.blend, settings.tta, settings.planes, settings.threshold)
    bar = None
    if job.rank == 0 and args.progress:
        from tqdm import tqdm

        bar = tqdm(total=len(mine), desc="blocks", unit="block")
    for region in todo:
        ks = [k for r, k in mine if r.name == region.name]
        if ks:
            predict_region_blocks(predictor, args.out, region, plans[region.name], ks,
                                  bar.update if bar else None)
    if bar is not None:
        bar.close()


def predict_region_blocks(predictor: VolumePredictor, out: str, region: Region, plan: dict,
                          ks: list[int], progress) -> None:
    """Write blocks ``ks`` of a region (every class), marking each when it is written."""
    import zarr

    block = tuple(plan["block"])
    counts = Blocks(plan["shape"], block).counts
    channels = plan["classes"] + plan.get("affinities", [])
    arrays = {name: zarr.open_array(f"{out}/{region.name}/{name}/s0", mode="r+")
              for name in channels}
    threshold = plan["inference"]["threshold"]
    k_classes = len(plan["classes"])

    def write_block(lo, hi, probs):
        box = tuple(slice(l, h) for l, h in zip(lo, hi))
        for c, name in enumerate(channels):
            p = probs[c].numpy()
            if threshold is None:
                arrays[name][box] = p
            elif c < k_classes:
                arrays[name][box] = (p > threshold).astype(np.uint8)
            else:  # affinities stay probabilities, in 16 bits
                arrays[name][box] = to_stored(p)
        k = int(np.ravel_multi_index(tuple(l // b for l, b in zip(lo, block)), counts))
        mark_block(out, region.name, k)

    predictor.predict_blockwise(region_reader(region), write_block, region.shape, block,
                                indices=ks, progress=progress)


# ---------------------------------------------------------------------------------------------
# The last step
# ---------------------------------------------------------------------------------------------


def decide_finishing(job: Job, args, todo: list[Region], plans: dict) -> bool:
    """Whether this job runs the last step now (the same answer on every rank): when every
    block of every region is written and this job holds the store's claim on it. A shard
    that finds blocks missing leaves the last step to another; ``--finish`` with blocks
    missing is an error naming them."""
    decision = None
    if job.rank == 0:
        missing = {r.name: len(Blocks(plans[r.name]["shape"], plans[r.name]["block"]))
                   - len(done_blocks(args.out, r.name)) for r in todo}
        missing = {name: n for name, n in missing.items() if n}
        if missing and (job.finish_only or not job.sharded):
            decision = ("error", "; ".join(f"{name}: {n} block(s)" for name, n in missing.items()))
        elif missing:
            logger.info("shard %d/%d is done; %d block(s) of other shards remain (the last "
                        "shard to finish runs the last step, or predict.py --finish)", job.shard,
                        job.shards, sum(missing.values()))
            decision = ("wait", None)
        else:
            held = claim_finishing(args.out, take_over=not job.sharded)
            decision = ("finish", None) if held is None else ("held", held)
    kind, detail = job.from_rank0(decision)
    if kind == "error":
        raise ConfigError(f"--out {args.out}: blocks are not written yet ({detail}); run every "
                          "shard (--shard I/N) with the same arguments first")
    if kind == "held" and job.rank == 0:
        logger.info("the last step of %s is claimed by process %s on %s (since %s); if that job "
                    "is gone, run predict.py with the same arguments and --finish", args.out,
                    detail.get("pid"), detail.get("host"), detail.get("time"))
    return kind == "finish"


def finish_region(job: Job, args, region: Region, plan: dict, post: PostProcessing) -> None:
    """Post-process a region whose blocks are all written, block by block over the ranks,
    build its viewer pyramid and mark it finished."""
    import zarr

    group = zarr.open_group(f"{args.out}/{region.name}", mode="r+")
    classes, v = plan["classes"], region.voxel_size
    affinities = stored_affinities(group, plan) if args.instances else {}
    if plan["dtype"] == "uint8" and (args.instances or post.enabled):
        counts = postprocess_region(group, classes, v, post, args.instances, tuple(plan["block"]),
                                    job.rank, job.world, job.barrier, affinities=affinities)
        for cls, n in counts.items():
            if job.rank == 0:
                how = post.instances if post.membrane(cls, classes) is None else \
                    f"cut by the predicted {post.membrane(cls, classes)}"
                if post.cuts_affinities(affinities) and cls in affinities:
                    how = f"cut from its affinities, {post.affinity_cut}"
                logger.info("%s/%s: %d instances (%s)", region.name, cls, n, how)
    for cls in classes[job.rank::job.world]:  # viewer levels from the finished s0
        write_class_pyramid(group[cls], args.pyramid_levels, v, plan["block"])
    job.barrier()
    if job.rank == 0:
        group.attrs[COMPLETE_ATTR] = True
        remove_scratch(args.out, region.name)
    job.barrier()


def stored_affinities(group, plan: dict) -> dict:
    """``{class: (reader, offsets)}`` of the affinity channels a region's plan holds: the
    reader gives (C, *box) probabilities of any box (what
    :func:`torchtitan.postprocess.blockwise.postprocess_region` cuts)."""
    names = set(plan.get("affinities", []))
    offsets = [tuple(o) for o in plan.get("offsets", [])]
    out = {}
    for cls in plan["classes"]:
        mine = [channel_name(cls, o) for o in offsets]
        if not offsets or not set(mine) <= names:
            continue
        arrays = [group[f"{n}/s0"] for n in mine]

        def read(lo, hi, arrays=arrays):
            box = tuple(slice(int(l), int(h)) for l, h in zip(lo, hi))
            return np.stack([from_stored(a[box]) for a in arrays])

        out[cls] = (read, offsets)
    return out


def write_class_pyramid(group, levels: int, voxel_size, block) -> None:
    """Levels s1.. of a class group (:func:`write_pyramid`: the mean of probabilities, the
    mode of masks and ids), halving the finer axes of anisotropic voxels first
    (:func:`pyramid_steps`: thin sections keep their z until y and x approach it), reading at
    most a prediction ``block`` of the finer level at a time."""
    shape = group["s0"].shape
    wanted = levels or auto_pyramid_levels(shape)
    steps = pyramid_steps(voxel_size, shape, coarsest_side=1, max_levels=wanted)
    most = max(int(np.prod(VIEW_CHUNKS)), int(np.prod(block)) // 8)
    write_pyramid(group, len(steps) + 1, "mode" if group["s0"].dtype.kind in "iub" else "mean",
                  steps=steps, max_block_voxels=most)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def check_outputs(args, requested: list[str]) -> None:
    """``--out`` (and ``--submission``) are ours to write, before any work, on every rank."""
    if args.submission and not (args.manifest or args.crops):
        raise ConfigError("--submission writes test crops: give them with --manifest (the "
                          "challenge's test-crop manifest) or --crops")
    check_output_store(args.out, requested)
    if args.submission:
        check_output_store(args.submission, [], "--submission", SUBMISSION_ATTR)
        if Path(args.submission).resolve() == Path(args.out).resolve():
            raise ConfigError(f"--submission {args.submission} is --out: give it a path of "
                              "its own")


def build_predictor(args, cfg, settings: InferenceSettings) -> VolumePredictor:
    """The trained model on this rank's device, as a volume predictor with the run's window
    plan and the arguments' overrides."""
    device = predict_device()
    from torchtitan.tasks import SegmentationTask

    if getattr(args, "model", None):  # an export: its weights as the model's logits
        model = exported.exported_predict_module(exported.open_export(args.model), cfg,
                                                 args.weights or "state_dict", device)
    else:
        model = SegmentationTask(cfg).build_model()
        use_attention(model, resolve_attention_backend(cfg.model.attention, device))
        load_weights(model, args.checkpoint)
        model.to(device).eval()
    return VolumePredictor.from_config(model, cfg, device, tta_flips=settings.tta,
                                       planes=settings.planes, batch_size=args.batch_size,
                                       bf16=device.type == "cuda", inference_mode=True)


def region_reader(region: Region):
    """``read_input(lo, hi)`` of the region's EM on the model's grid, normalised as in
    training; zero outside the EM volume, as the sliding window pads."""
    v = region.voxel_size

    def read_input(lo, hi):
        origin = region.origin + np.asarray(lo) * v
        shape = tuple(h - l for l, h in zip(lo, hi))
        img, inside = read_em(region.source, v, origin, shape)
        img[~inside] = 0.0
        return torch.from_numpy(img)[None]

    return read_input


def view_chunking(block, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(block, chunks): 64^3 chunks (smaller along an axis whose block is smaller), and the
    block grown to whole chunks, so every chunk lies in one block (one writing rank)."""
    chunks = tuple(min(c, b) for c, b in zip(VIEW_CHUNKS, block))
    block = tuple(min(s, -(-b // c) * c) for b, c, s in zip(block, chunks, shape))
    return block, chunks


def _write_submission(args, cfg, names: list[str], classes: list[str]) -> list[str]:
    """The challenge submission of the predicted crops (``--submission``), checked by the
    linter; an error when the linter would reject it."""
    from torchtitan.prediction.submission import (
        check_submission,
        crops_from_boxes,
        crops_from_groundtruth,
        format_report,
        write_submission,
    )

    if args.manifest:
        crops = test_manifest_crops(args.manifest)
        if crops is None:  # our own manifest format: the model's classes on each row's grid
            crops = crops_from_boxes(read_manifest(args.manifest), classes)
    else:
        crops = crops_from_groundtruth(cfg.data.dataset_path, names)
    crops = {n: c for n, c in crops.items() if n in names}
    notes = write_submission(args.out, args.submission, crops)
    for note in notes:
        logger.info("submission: %s", note)
    problems = check_submission(args.submission, crops)
    report = format_report(problems, crops, args.submission)
    logger.info("%s", report)
    if any(p.severity == "error" for p in problems):
        raise DatasetError(report)
    return [str(args.submission), str(Path(args.submission).with_suffix(".zip"))]
