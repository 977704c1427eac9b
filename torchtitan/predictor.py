"""Blockwise prediction of whole EM volumes, regions or label crops with a trained model.

Used by ``predict.py``. The model is rebuilt from the run's ``config.toml`` and its weights
are loaded from a DCP checkpoint (a step folder, or a run's checkpoint folder for its latest
step) or from an exported ``.pth``. Input is read from zarr window by window and the output
is written block by block (:func:`torchtitan.inference.predict_blockwise`), so volumes far
larger than host or device memory work. Under ``torchrun`` the blocks are split across ranks.

Output (OME-NGFF 0.4, zarr format 2), one group per predicted region and class::

    PRED.zarr/<region>/<class>/s0      uint8 masks (0/1), float32 probabilities, or
                                       uint32 instance ids (instance classes, --instances)

where ``<region>`` is ``crop<N>`` for label crops (the CellMap submission layout) or the
dataset name for a whole volume / ROI. Each class group has ``multiscales`` (scale = the
model's voxel size, translation = centre of voxel 0, nm) and the plain ``voxel_size`` and
``translation`` attributes of the submission format.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from torchtitan.checkpoint import CheckpointError, complete_steps, load_model_weights
from torchtitan.config_manager import ConfigError, ConfigManager
from torchtitan.datasets.cellmap import (
    DatasetError,
    EMSource,
    closest_level,
    discover,
    read_linear,
)
from torchtitan.datasets.samples import crop_grid, normalize_em
from torchtitan.inference import block_shape_for_budget, predict_blockwise
from torchtitan.models import predict_probabilities

logger = logging.getLogger(__name__)

# CellMap classes scored as instances (connected components give instance ids).
INSTANCE_CLASSES = ("nuc", "ves", "endo", "lyso", "ld", "perox", "mito", "np", "mt", "cell")


@dataclass
class Region:
    """A box of the model's voxel grid inside one EM volume."""

    name: str
    source: EMSource
    origin: np.ndarray  # nm, corner of voxel 0
    shape: tuple[int, int, int]


def load_run_config(checkpoint: str, config: str | None):
    """The run's JobConfig: ``config`` or the ``config.toml`` of the checkpoint's run."""
    path = Path(config) if config else None
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
    if path.suffix == ".pth":
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} does not exist")
        state = torch.load(path, map_location="cpu", weights_only=True)
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
                    out.append(Region(c.name, s, origin, shape))
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
    return [Region(dataset, source, lo, shape)]  # type: ignore[arg-type]


def _write_group(root, region: Region, cls: str, voxel_size, dtype, chunks):
    """Create ``<region>/<class>`` with OME-NGFF metadata and an empty ``s0``."""
    group = root.require_group(f"{region.name}/{cls}")
    translation = (region.origin + np.asarray(voxel_size) / 2).tolist()
    group.attrs.update({
        "multiscales": [{
            "version": "0.4", "name": cls,
            "axes": [{"name": a, "type": "space", "unit": "nanometer"} for a in "zyx"],
            "datasets": [{"path": "s0", "coordinateTransformations": [
                {"type": "scale", "scale": list(map(float, voxel_size))},
                {"type": "translation", "translation": translation}]}],
        }],
        "voxel_size": list(map(float, voxel_size)),
        "translation": translation,
    })
    return group.create_array("s0", shape=region.shape, chunks=chunks, dtype=dtype,
                              fill_value=0, overwrite=True)


def predict_regions(args) -> list[str]:
    """Run the whole prediction described by the parsed ``predict.py`` arguments."""
    import zarr

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cfg = load_run_config(args.checkpoint, args.config)
    if args.data:
        cfg.data.dataset_path = args.data
    from torchtitan.tasks import SegmentationTask

    task = SegmentationTask(cfg)
    classes = list(cfg.data.classes)
    todo = regions(discover(cfg.data.dataset_path), cfg.data.voxel_size, args.dataset, args.roi,
                   args.crops)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if torch.cuda.is_available() else torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model = task.build_model()
    load_weights(model, args.checkpoint)
    model.to(device).eval()
    use_bf16 = device.type == "cuda"
    v = np.asarray(cfg.data.voxel_size, dtype=float)
    window = tuple(cfg.model.crop_size)
    window3 = window if len(window) == 3 else (1, *window)

    def predict(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            return predict_probabilities(model(x.to(device)).float(), cfg.model.loss)

    root = zarr.open_group(args.out, mode="a", zarr_format=2)
    written = []
    for region in todo:
        block = block_shape_for_budget(region.shape, window3, len(classes),
                                       args.max_block_mb * 2**20)
        level = region.source.levels[closest_level(region.source.levels, v)]

        def read_input(lo, hi, region=region, level=level):
            origin = region.origin + np.asarray(lo) * v
            img, _ = read_linear(level, origin, v, tuple(h - l for l, h in zip(lo, hi)))
            return torch.from_numpy(normalize_em(img))[None]

        dtype = "float32" if args.probabilities else "uint8"
        arrays = {}
        if rank == 0:
            for cls in classes:
                arrays[cls] = _write_group(root, region, cls, v, dtype, block)
        if world > 1:
            dist.barrier()
        if rank != 0:
            arrays = {cls: zarr.open_array(f"{args.out}/{region.name}/{cls}/s0", mode="r+")
                      for cls in classes}

        def write_block(lo, hi, probs, arrays=arrays):
            box = tuple(slice(l, h) for l, h in zip(lo, hi))
            for k, cls in enumerate(classes):
                p = probs[k].numpy()
                arrays[cls][box] = p if args.probabilities else (p > args.threshold).astype(np.uint8)

        bar = None
        if rank == 0 and args.progress:
            from tqdm import tqdm

            n = int(np.prod([-(-s // b) for s, b in zip(region.shape, block)]))
            bar = tqdm(total=-(-n // world), desc=f"{region.name}", unit="block")
        predict_blockwise(predict, read_input, write_block, region.shape, window, len(classes),
                          overlap=cfg.inference.overlap, blend=cfg.inference.blend,
                          batch_size=args.batch_size or cfg.inference.batch_size,
                          block_shape=block, rank=rank, world_size=world,
                          progress=bar.update if bar else None)
        if bar is not None:
            bar.close()
        if world > 1:
            dist.barrier()
        if args.instances and rank == 0 and not args.probabilities:
            _label_instances(root, region, classes, v, block)
        written.append(f"{args.out}/{region.name}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return written


def _label_instances(root, region: Region, classes: list[str], voxel_size, chunks) -> None:
    """Replace the masks of instance classes by connected-component ids (in memory: meant for
    crops and regions that fit; whole volumes keep their masks)."""
    import scipy.ndimage as ndi

    for cls in classes:
        if cls not in INSTANCE_CLASSES:
            continue
        mask = root[f"{region.name}/{cls}/s0"][:]
        ids, n = ndi.label(mask, structure=np.ones((3, 3, 3)))
        arr = _write_group(root, region, cls, voxel_size, "uint32", chunks)
        arr[:] = ids.astype(np.uint32)
        logger.info("%s/%s: %d instances", region.name, cls, n)
