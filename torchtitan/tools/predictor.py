"""Blockwise prediction of whole EM volumes, regions or label crops with a trained model.

Used by ``predict.py``. The model is rebuilt from the run's ``config.toml`` and its weights
are loaded from a DCP checkpoint (a step folder, or a run's checkpoint folder for its latest
step) or from an exported ``.pth``; ``--model`` runs an export's weights with its own config
instead (:mod:`torchtitan.tools.exported`). Input is read from zarr window by window and the
output is written block by block (:func:`torchtitan.inference.predict_blockwise`), so volumes
far larger than host or device memory work. Under ``torchrun`` the blocks are split across ranks.

Output (OME-NGFF 0.4, zarr format 2), one multiscale group per predicted region and class::

    PRED.zarr/<region>/<class>/s0      uint8 masks (0/1), float32 probabilities, or
                                       uint32 instance ids (instance classes, --instances)
    PRED.zarr/<region>/<class>/s1..    2x pyramid for viewers (at least 3 levels in all, until
                                       the largest side is <= 64 voxels; --pyramid_levels):
                                       mean of probabilities, mode of masks and ids

Arrays are chunked 64^3 (viewers fetch them quickly); blocks are whole chunks, so ranks
never write into the same chunk. Readers (scoring, plots) read ``s0``.

Post-processing (the run's ``[inference]`` ``min_object_nm3``, ``fill_holes`` and, for
``--instances``, ``instances``; :mod:`torchtitan.postprocess`) is applied to the masks of each
finished region in memory, before the pyramid; ``--probabilities`` are written raw.

where ``<region>`` is ``crop<N>`` for label crops and for the rows of a crop manifest (the
CellMap submission layout) or the dataset name for a whole volume / ROI. Each class group has
``multiscales`` (scale = the model's voxel size, translation = centre of voxel 0, nm) and the
plain ``voxel_size`` and ``translation`` attributes of the submission format.

Completion: when a region is finished (every class written, instances labelled) its group
``PRED.zarr/<region>`` gets the attribute ``prediction_complete = true``. A later run refuses
to overwrite a finished region without ``--overwrite`` (a ConfigError before any work). When
some regions of the output are finished and others are not (an interrupted run), the run
resumes: finished regions are kept and skipped, an unfinished region is predicted again from
its start (blocks carry no record of their own, so a partial region is restarted cleanly).

Ownership: predict.py writes only into stores it created. The root and every region and class
group it creates carry ``torchtitan_prediction`` before anything is written into them; an
``--out`` that is an existing file, lies inside another zarr store (a dataset's ``em/`` or
``labels/`` groups), is a non-empty folder or a zarr store without that attribute, or whose
region or class groups lack it, is refused before any work, naming the path, with
``--overwrite`` too (:func:`check_output_store`). ``--submission`` likewise replaces only a
submission it wrote (``torchtitan_submission`` on its root).

Crop manifest (``--manifest FILE``): the boxes to predict where no labels exist (e.g. the
challenge's test crops). A CSV file with a header line and these columns (any order; other
columns are ignored)::

    crop_name,dataset,origin_z,origin_y,origin_x,shape_z,shape_y,shape_x,voxel_size_z,voxel_size_y,voxel_size_x
    crop123,jrc_hela-2,1000.0,2000.0,3000.0,100,200,200,4.0,4.0,4.0

The challenge's own test-crop manifest (columns ``crop_name,dataset,class_label,voxel_size,
translation,shape``, one row per crop and class; :mod:`torchtitan.cellmap.challenge`) is read
too: each crop becomes the box its classes cover.

``crop_name`` is ``crop<N>`` or ``<N>``; ``dataset`` names an EM dataset under the data
root; ``origin_*`` is the world position (nm) of the outer corner of the crop's voxel 0 (not
its centre), ``shape_*`` its size in voxels and ``voxel_size_*`` its voxel size (nm), so
the crop spans ``[origin, origin + shape * voxel_size)``. Each row is predicted as region
``crop<N>`` on the model's grid (``data.voxel_size``): the smallest whole number of voxels
covering the box, centred on it. Rows repeating a crop with the same box are merged.
"""

from __future__ import annotations

import csv
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from torchtitan.cellmap.classes import INSTANCE_CLASSES
from torchtitan.cellmap.grids import closest_level
from torchtitan.cellmap.challenge import ChallengeCrop, is_test_manifest, read_test_manifest
from torchtitan.cellmap.ome_ngff import (
    VIEW_CHUNKS,
    auto_pyramid_levels,
    create_multiscale_group,
    pyramid_steps,
    write_pyramid,
)
from torchtitan.checkpoint_reading import complete_steps, load_model_weights
from torchtitan.config_manager import ConfigManager
from torchtitan.convert import load_pth_state_dict
from torchtitan.datasets.cellmap import (
    DatasetError,
    EMSource,
    discover,
    em_to_uint8_scale,
    read_linear,
    set_em_ranges,
)
from torchtitan.datasets.samples import crop_grid, normalize_em
from torchtitan.errors import CheckpointError, ConfigError
from torchtitan.inference import VolumePredictor, block_shape_for_budget, resolve_planes
from torchtitan.models import resolve_attention_backend, use_attention
from torchtitan.parallelisms.process_group import init_process_group
from torchtitan.postprocess import PostProcessing, clean_mask, separate_instances
from torchtitan.tools import exported
from torchtitan.tools.prediction_store import (
    COMPLETE_ATTR,
    OWNER_ATTR,
    check_output_store,
    region_finished,
)
from torchtitan.tools.submission import SUBMISSION_ATTR

logger = logging.getLogger(__name__)



@dataclass
class Region:
    """A box of the model's voxel grid inside one EM volume."""

    name: str
    source: EMSource
    origin: np.ndarray  # nm, corner of voxel 0
    shape: tuple[int, int, int]
    voxel_size: np.ndarray  # nm, the model's grid (data.voxel_size)


def load_run_config(checkpoint: str, config: str | None):
    """The run's JobConfig: ``config``, the ``config.toml`` of the checkpoint's run, or the one
    an exported model (``predict.py --model``) holds."""
    path = Path(config) if config else None
    if path is None and exported.is_export(checkpoint):
        path = exported.open_export(checkpoint).config
    if path is None:
        ckpt = Path(checkpoint)
        for parent in (ckpt.parent, ckpt.parent.parent, ckpt.parent.parent.parent):
            if (parent / "config.toml").is_file():
                path = parent / "config.toml"
                break
    if path is None or not path.is_file():
        raise ConfigError(
            f"no config.toml found for checkpoint {checkpoint!r}; pass --config "
            "<dump_folder>/config.toml of the run that trained it"
        )
    return ConfigManager().parse_args(["--job.config_file", str(path)])


def load_weights(model: torch.nn.Module, checkpoint: str) -> None:
    """Weights from an exported ``.pth`` (full model) or a DCP checkpoint, strictly."""
    path = Path(checkpoint)
    exported.refuse_as_checkpoint(path)
    if path.suffix == ".pth":
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} does not exist")
        state = load_pth_state_dict(path, "--checkpoint")  # a clear error for a corrupt file
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise CheckpointError(
                f"{path} does not match the model of its config: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}; export the full model with "
                "helpers/dcp_to_pth.py --what full"
            )
        return
    if not (path / ".metadata").is_file() and not complete_steps(path):
        raise CheckpointError(
            f"checkpoint {path} is neither a .pth file, a DCP step folder nor a checkpoint "
            "folder with step-N folders"
        )
    load_model_weights(model, path)


def parse_roi(roi: str) -> tuple[np.ndarray, np.ndarray]:
    """``"z0:z1,y0:y1,x0:x1"`` in nm -> (min corner, max corner)."""
    try:
        parts = [tuple(float(v) for v in axis.split(":")) for axis in roi.split(",")]
        lo, hi = np.array([p[0] for p in parts]), np.array([p[1] for p in parts])
        assert len(parts) == 3 and np.all(hi > lo)
    except (ValueError, AssertionError, IndexError):
        raise ConfigError(f"--roi {roi!r}: expected 'z0:z1,y0:y1,x0:x1' in nm with z1 > z0 etc.")
    return lo, hi


def regions(sources: list[EMSource], voxel_size, dataset: str | None, roi: str | None,
            crops: str | None) -> list[Region]:
    """What to predict: label crops (``crops`` = names or 'all'), or one dataset's EM volume
    (optionally restricted to ``roi``)."""
    v = np.asarray(voxel_size, dtype=float)
    if crops:
        wanted = None if crops == "all" else set(crops.split(","))
        out = []
        for s in sources:
            for c in s.crops:
                if wanted is None or c.name in wanted or c.full_name in wanted:
                    origin, shape = crop_grid(c, v)
                    out.append(Region(c.name, s, origin, shape, v))
        if not out:
            raise DatasetError(f"--crops {crops!r} matches no label crop; available: "
                               + ", ".join(c.full_name for s in sources for c in s.crops))
        return out
    by_name = {s.name: s for s in sources}
    if dataset is None:
        if len(sources) != 1:
            raise ConfigError(f"--dataset is needed: the data holds {', '.join(by_name)}")
        dataset = sources[0].name
    if dataset not in by_name:
        raise DatasetError(f"--dataset {dataset!r} not found; available: {', '.join(by_name)}")
    source = by_name[dataset]
    lo, hi = source.levels[0].box_min, source.levels[0].box_max
    if roi:
        rlo, rhi = parse_roi(roi)
        if np.any(rlo < lo - 1e-6) or np.any(rhi > hi + 1e-6):
            raise DatasetError(f"--roi {roi} leaves the volume of {dataset} "
                               f"({lo.tolist()}..{hi.tolist()} nm)")
        lo, hi = rlo, rhi
    shape = tuple(int(max(1, np.floor((b - a) / s + 1e-6))) for a, b, s in zip(lo, hi, v))
    return [Region(dataset, source, lo, shape, v)]  # type: ignore[arg-type]


MANIFEST_COLUMNS = ("crop_name", "dataset", "origin_z", "origin_y", "origin_x", "shape_z",
                    "shape_y", "shape_x", "voxel_size_z", "voxel_size_y", "voxel_size_x")


@dataclass
class ManifestCrop:
    """One row of a crop manifest: a box in world coordinates (nm)."""

    name: str  # crop<N>
    dataset: str
    box_min: np.ndarray  # outer corner of voxel 0
    box_max: np.ndarray
    voxel_size: np.ndarray | None = None  # the crop's own voxel size (nm), when the row gives it


def read_manifest(path: str) -> list[ManifestCrop]:
    """The crops of a manifest CSV (format: module docstring), duplicates merged."""
    if not Path(path).is_file():
        raise ConfigError(f"--manifest {path!r} does not exist")
    challenge = test_manifest_crops(path)
    if challenge is not None:
        return [ManifestCrop(c.name, c.dataset, c.box_min, c.box_max) for c in challenge.values()]
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in MANIFEST_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ConfigError(f"--manifest {path}: missing columns {missing}; expected "
                              + ",".join(MANIFEST_COLUMNS))
        crops: dict[str, ManifestCrop] = {}
        for line, row in enumerate(reader, start=2):
            try:
                number = row["crop_name"].strip().removeprefix("crop")
                if not number.isdigit():
                    raise ValueError(f"crop_name {row['crop_name']!r} is not crop<N> or <N>")
                origin = np.array([float(row[f"origin_{a}"]) for a in "zyx"])
                shape = np.array([int(row[f"shape_{a}"]) for a in "zyx"])
                voxel = np.array([float(row[f"voxel_size_{a}"]) for a in "zyx"])
                if np.any(shape < 1) or np.any(voxel <= 0):
                    raise ValueError("shape must be >= 1 and voxel_size > 0")
                dataset = row["dataset"].strip()
            except (ValueError, TypeError, AttributeError) as e:
                raise ConfigError(f"--manifest {path}, line {line}: {e}") from None
            crop = ManifestCrop(f"crop{int(number)}", dataset, origin, origin + shape * voxel, voxel)
            seen = crops.get(crop.name)
            if seen is None:
                crops[crop.name] = crop
            elif (seen.dataset != crop.dataset or not np.allclose(seen.box_min, crop.box_min, atol=1e-3)
                  or not np.allclose(seen.box_max, crop.box_max, atol=1e-3)):
                raise ConfigError(f"--manifest {path}, line {line}: {crop.name} appears again "
                                  "with another dataset or box")
    if not crops:
        raise ConfigError(f"--manifest {path} lists no crop")
    return list(crops.values())


def test_manifest_crops(path: str) -> dict[str, ChallengeCrop] | None:
    """The crops of the challenge's test-crop manifest at ``path``, or None when the CSV is in
    our own manifest format."""
    with open(path, newline="") as f:
        if not is_test_manifest(csv.DictReader(f).fieldnames):
            return None
    try:
        return read_test_manifest(path)
    except DatasetError as e:
        raise ConfigError(f"--manifest {e}") from None


def covering_grid(box_min, box_max, voxel_size) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Origin (nm, outer corner of voxel 0) and shape of the smallest grid of ``voxel_size``
    that covers the box, centred on it."""
    v = np.asarray(voxel_size, dtype=float)
    extent = np.asarray(box_max, dtype=float) - np.asarray(box_min, dtype=float)
    shape = tuple(int(max(1, np.ceil(e / s - 1e-6))) for e, s in zip(extent, v))
    origin = np.asarray(box_min, dtype=float) + (extent - np.asarray(shape) * v) / 2
    return origin, shape  # type: ignore[return-value]


def manifest_regions(sources: list[EMSource], voxel_size, path: str) -> list[Region]:
    """One region ``crop<N>`` per crop of the manifest, on the model's grid."""
    by_name = {s.name: s for s in sources}
    out = []
    for crop in read_manifest(path):
        if crop.dataset not in by_name:
            raise DatasetError(f"--manifest: {crop.name} is in dataset {crop.dataset!r}, which is "
                               f"not under the data root; available: {', '.join(by_name)}")
        origin, shape = covering_grid(crop.box_min, crop.box_max, voxel_size)
        out.append(Region(crop.name, by_name[crop.dataset], origin, shape,
                          np.asarray(voxel_size, dtype=float)))
    return out


def plan_regions(todo: list[Region], out: str, overwrite: bool) -> list[Region]:
    """The regions to predict now: all with ``overwrite``; else an error when every one is
    already finished, and otherwise only the unfinished ones (resuming an interrupted run)."""
    if overwrite:
        return todo
    finished = [r.name for r in todo if region_finished(out, r.name)]
    if finished and len(finished) == len(todo):
        raise ConfigError(
            f"--out {out} already holds the finished prediction of {', '.join(finished)}; pass "
            "--overwrite to predict it again, or choose another --out"
        )
    if finished:
        logger.info("resuming %s: keeping the finished region(s) %s; predicting %s", out,
                    ", ".join(finished), ", ".join(r.name for r in todo if r.name not in finished))
    return [r for r in todo if r.name not in finished]


def view_chunking(block, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(block, chunks): 64^3 chunks (smaller along an axis whose block is smaller), and the
    block grown to whole chunks, so every chunk lies in one block (one writing rank)."""
    chunks = tuple(min(c, b) for c, b in zip(VIEW_CHUNKS, block))
    block = tuple(min(s, -(-b // c) * c) for b, c, s in zip(block, chunks, shape))
    return block, chunks


def write_pyramids(root, region: Region, classes: list[str], method: str, levels: int,
                   voxel_size) -> None:
    """Levels s1.. of every class group of a finished region (:func:`write_pyramid`), halving
    the finer axes of anisotropic voxels first (:func:`pyramid_steps`: thin sections keep their
    z until y and x approach it)."""
    for cls in classes:
        group = root[f"{region.name}/{cls}"]
        shape = group["s0"].shape
        wanted = levels or auto_pyramid_levels(shape)
        steps = pyramid_steps(voxel_size, shape, coarsest_side=1, max_levels=wanted)
        write_pyramid(group, len(steps) + 1, "mode" if group["s0"].dtype.kind in "iub" else method,
                      steps=steps)


def _write_group(root, region: Region, cls: str, voxel_size, dtype, chunks):
    """Create ``<region>/<class>`` with OME-NGFF metadata (plus the submission format's plain
    ``voxel_size`` and ``translation``) and an empty ``s0``."""
    translation = (region.origin + np.asarray(voxel_size) / 2).tolist()
    submission = {"voxel_size": list(map(float, voxel_size)), "translation": translation,
                  OWNER_ATTR: True}
    group = create_multiscale_group(root, f"{region.name}/{cls}", voxel_size, translation, 1,
                                    extra_attrs=submission)
    return group.create_array("s0", shape=region.shape, chunks=chunks, dtype=dtype,
                              fill_value=0, overwrite=True)


def inference_options(cfg, args) -> tuple[bool, str, float]:
    """(tta_flips, planes, threshold): the run's ``[inference]`` settings, overridden by
    ``--tta/--no-tta``, ``--planes`` and ``--threshold``; checked against the model and grid
    before any model is built."""
    inf = cfg.inference
    tta = inf.tta_flips if args.tta is None else bool(args.tta)
    threshold = inf.threshold if args.threshold is None else float(args.threshold)
    try:
        planes = resolve_planes(args.planes or inf.planes, len(cfg.model.crop_size),
                                cfg.data.voxel_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return tta, planes, threshold


def predict_regions(args) -> list[str]:
    """Run the whole prediction described by the parsed ``predict.py`` arguments: the run's
    config, the regions to predict, the checked outputs, the model's volume predictor, then
    each region into ``--out`` and, last, the submission."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cfg = load_run_config(args.checkpoint, args.config)
    if args.data:
        cfg.data.dataset_path = args.data
    tta, planes, threshold = inference_options(cfg, args)
    sources = discover(cfg.data.dataset_path)
    set_em_ranges(sources, cfg.data.em_range)
    todo = requested_regions(args, sources, cfg.data.voxel_size)
    requested = [r.name for r in todo]
    check_outputs(args, requested)
    todo = plan_regions(todo, args.out, args.overwrite)
    predictor = build_predictor(args, cfg, tta, planes, world)
    if rank == 0:
        logger.info("predicting %d region(s): window %s, overlap %s, %s blending, tta_flips=%s, "
                    "planes=%s, threshold %s", len(todo), "x".join(map(str, predictor.window)),
                    predictor.overlap, predictor.blend, tta, planes, threshold)
    root = open_output(args.out, args.checkpoint, rank)
    post = PostProcessing.from_config(cfg.inference)
    classes = list(cfg.data.classes)
    written = [predict_region(predictor, root, region, classes, args, threshold, post, rank, world)
               for region in todo]
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    if args.submission and rank == 0:  # after the other ranks are done, so none waits on an error
        written += _write_submission(args, cfg, sources, requested, list(cfg.data.classes))
    return written


def requested_regions(args, sources: list[EMSource], voxel_size) -> list[Region]:
    """The regions the arguments name: a manifest's crops, or label crops, a dataset or an ROI."""
    if args.manifest:
        if args.crops or args.dataset or args.roi:
            raise ConfigError("--manifest predicts the crops it lists; leave out --crops, "
                              "--dataset and --roi")
        return manifest_regions(sources, voxel_size, args.manifest)
    return regions(sources, voxel_size, args.dataset, args.roi, args.crops)


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


def build_predictor(args, cfg, tta: bool, planes: str, world: int) -> VolumePredictor:
    """The trained model on this rank's device (the process group joined under torchrun),
    as a volume predictor with the run's window plan and the arguments' overrides."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        init_process_group(device, cfg.comm.init_timeout_seconds)
    from torchtitan.tasks import SegmentationTask

    if getattr(args, "model", None):  # an export: its weights as the model's logits
        model = exported.exported_predict_module(exported.open_export(args.model), cfg,
                                                 args.weights or "state_dict", device)
    else:
        model = SegmentationTask(cfg).build_model()
        use_attention(model, resolve_attention_backend(cfg.model.attention, device))
        load_weights(model, args.checkpoint)
        model.to(device).eval()
    return VolumePredictor.from_config(model, cfg, device, tta_flips=tta, planes=planes,
                                       batch_size=args.batch_size,
                                       bf16=device.type == "cuda", inference_mode=True)


def open_output(out: str, checkpoint: str, rank: int):
    """The output store's root on rank 0, marked as ours; None on the other ranks (ranks
    creating the same group at once race: only rank 0 creates groups and metadata)."""
    if rank != 0:
        return None
    import zarr

    root = zarr.open_group(out, mode="a", zarr_format=2)
    root.attrs[OWNER_ATTR] = {"checkpoint": str(checkpoint)}
    return root


def region_arrays(root, region: Region, classes: list[str], out: str, dtype: str, chunks,
                  rank: int, world: int) -> dict:
    """Each class's ``s0`` array of ``region``: created (unfinished) by rank 0, opened by the
    other ranks after a barrier."""
    arrays = {}
    if rank == 0:
        root.require_group(region.name).attrs.update({OWNER_ATTR: True, COMPLETE_ATTR: False})
        for cls in classes:
            arrays[cls] = _write_group(root, region, cls, region.voxel_size, dtype, chunks)
    if world > 1:
        dist.barrier()
    if rank != 0:
        import zarr

        arrays = {cls: zarr.open_array(f"{out}/{region.name}/{cls}/s0", mode="r+")
                  for cls in classes}
    return arrays


def region_reader(region: Region):
    """``read_input(lo, hi)`` of the region's EM on the model's grid, normalised as in
    training; zero outside the EM volume, as the sliding window pads."""
    v = region.voxel_size
    level = region.source.levels[closest_level(region.source.levels, v)]

    def read_input(lo, hi):
        origin = region.origin + np.asarray(lo) * v
        img, inside = read_linear(level, origin, v, tuple(h - l for l, h in zip(lo, hi)))
        img = normalize_em(em_to_uint8_scale(img, region.source, level.path, inside))
        img[~inside] = 0.0
        return torch.from_numpy(img)[None]

    return read_input


def predict_region(predictor: VolumePredictor, root, region: Region, classes: list[str], args,
                   threshold: float, post: PostProcessing, rank: int, world: int) -> str:
    """Predict one region into ``--out`` block by block (blocks dealt out to the ranks), then
    post-process, build the viewer pyramid and mark it finished (rank 0)."""
    v = region.voxel_size
    buffers = len(classes) * (2 if predictor.planes == "zyx" else 1)  # outputs (+ running sum)
    block = block_shape_for_budget(region.shape, predictor.block_window(), buffers,
                                   args.max_block_mb * 2**20)
    block, chunks = view_chunking(block, region.shape)
    if rank == 0 and (Path(args.out) / region.name).exists():
        logger.info("%s/%s is unfinished (no completion marker): predicting it again from its "
                    "start", args.out, region.name)
    dtype = "float32" if args.probabilities else "uint8"
    arrays = region_arrays(root, region, classes, args.out, dtype, chunks, rank, world)

    def write_block(lo, hi, probs):
        box = tuple(slice(l, h) for l, h in zip(lo, hi))
        for k, cls in enumerate(classes):
            p = probs[k].numpy()
            arrays[cls][box] = p if args.probabilities else (p > threshold).astype(np.uint8)

    bar = None
    if rank == 0 and args.progress:
        from tqdm import tqdm

        n = int(np.prod([-(-s // b) for s, b in zip(region.shape, block)]))
        bar = tqdm(total=-(-n // world), desc=f"{region.name}", unit="block")
    predictor.predict_blockwise(region_reader(region), write_block, region.shape, block, rank,
                                world, progress=bar.update if bar else None)
    if bar is not None:
        bar.close()
    if world > 1:
        dist.barrier()
    if rank == 0:
        if not args.probabilities and (args.instances or post.enabled):
            _postprocess_masks(root, region, classes, v, chunks, post, args.instances)
        write_pyramids(root, region, classes, "mean" if args.probabilities else "mode",
                       args.pyramid_levels, v)  # viewer levels from the finished s0
        # After every rank's blocks (barrier above) and the instances.
        root.require_group(region.name).attrs[COMPLETE_ATTR] = True
    return f"{args.out}/{region.name}"


def _write_submission(args, cfg, sources, names: list[str], classes: list[str]) -> list[str]:
    """The challenge submission of the predicted crops (``--submission``), checked by the
    linter; an error when the linter would reject it."""
    from torchtitan.tools.submission import (
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


def _postprocess_masks(root, region: Region, classes: list[str], voxel_size, chunks,
                       post: PostProcessing, instances: bool) -> None:
    """Post-process a finished region's masks in memory (meant for crops and regions that fit):
    the run's ``[inference]`` steps (small objects, holes; ``torchtitan/postprocess.py``) on
    every class, then, with ``instances``, replace the masks of instance classes by instance
    ids (``inference.instances``: connected components, found exactly as the scoring command
    finds them, or watershed; with ``inference.boundary_instances``, a class whose membrane
    class is predicted too is cut by that membrane's cleaned mask)."""
    # Classes cut by a membrane class go after it; its cleaned mask is kept for them.
    membranes = {cls: post.membrane(cls, classes) for cls in classes} if instances else {}
    kept: dict[str, np.ndarray] = {}
    for cls in sorted(classes, key=lambda c: membranes.get(c) is not None):
        mask = root[f"{region.name}/{cls}/s0"][:] > 0
        cleaned = clean_mask(mask, cls, voxel_size, post)
        if cls in membranes.values():
            kept[cls] = cleaned
        if instances and cls in INSTANCE_CLASSES:
            membrane = membranes[cls]
            ids, n = separate_instances(cleaned, voxel_size, post, kept.get(membrane))
            arr = _write_group(root, region, cls, voxel_size, "uint32", chunks)
            arr[:] = ids.astype(np.uint32)
            how = post.instances if membrane is None else f"cut by the predicted {membrane}"
            logger.info("%s/%s: %d instances (%s)", region.name, cls, n, how)
        elif not np.array_equal(cleaned, mask):
            root[f"{region.name}/{cls}/s0"][:] = cleaned.astype(np.uint8)
            logger.info("%s/%s: post-processing changed %d voxels", region.name, cls,
                        int(np.count_nonzero(cleaned != mask)))
