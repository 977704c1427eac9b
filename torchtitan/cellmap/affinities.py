"""Affinities of instance classes: is voxel ``v`` in the same object as voxel ``v + offset``?

Connectomics cuts neurons from an affinity graph rather than from a boundary mask (Turaga et
al. 2010; Lee et al. 2017; Funke et al. 2018): for each *offset* (z, y, x) in voxels of the
training grid, channel ``i`` at voxel ``v`` says whether ``v`` and ``v + offsets[i]`` belong to
the same object. Nearest-neighbour offsets (one voxel along each axis) draw the boundaries;
long-range ones (several voxels) let the model say "two different objects" across a gap that it
cannot see as membrane, which the mutex watershed uses as repulsive edges (Wolf et al. 2018).

The rule, in one place (:func:`affinities`), for training targets and tests alike:

* the target is 1 where both voxels hold the same object id, that id not background (0);
* it is valid (counted by the loss) where both voxels are annotated (not unknown) and the
  partner lies inside the box; a voxel whose partner leaves the box has no target.

The channel layout of a segmentation model (:func:`output_channels`): the semantic classes of
``data.classes`` first, then, for each class of ``affinities.classes``, one channel per offset
named ``<class>_aff_<z>_<y>_<x>`` (:func:`channel_name`). Every consumer (the task's model, the loss, validation,
prediction and export) takes the layout from here.

Floor 2: numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from torchtitan.choices import parse_offset

Offset = tuple[int, ...]

# Stored affinities (predict.py) are uint16: the probability times 65535. Bytes are too coarse
# for the cuts, which order edges by their affinity: on the medulla validation crop the neurons
# cut from affinities rounded to 1/255 score VOI 2.43 bits (mutex) and 2.53 (mutex_graph),
# from 1/65535 1.80 and 1.93 (docs/benchmarks/findings.md).
STORED_DTYPE = np.uint16


def to_stored(probabilities: np.ndarray) -> np.ndarray:
    """Affinity probabilities in [0, 1] as stored (:data:`STORED_DTYPE`)."""
    top = np.iinfo(STORED_DTYPE).max
    return np.rint(np.asarray(probabilities, np.float32) * top).astype(STORED_DTYPE)


def from_stored(values: np.ndarray) -> np.ndarray:
    """Stored affinities as float32 probabilities: integers of any width by their full scale
    (stores written with bytes read right too), floats as they are."""
    values = np.asarray(values)
    if values.dtype.kind in "ui":
        return values.astype(np.float32) / np.float32(np.iinfo(values.dtype).max)
    return values.astype(np.float32)

# Long-range offsets of the default neighbourhood, in voxels of the finest axis: about 3 and 9
# voxels, enough to span a gap of a few voxels in a membrane while staying well inside a
# training window of 32 or more voxels.
LONG_RANGE = (3, 9)


def default_offsets(voxel_size: Sequence[float], ndim: int,
                    crop_size: Sequence[int] | None = None) -> tuple[Offset, ...]:
    """The default neighbourhood of a grid: the nearest neighbour along each axis, then each of
    :data:`LONG_RANGE` along each axis, scaled by the axis's voxel size so that a long-range
    offset spans about the same distance in nm on every axis (an anisotropic axis, e.g. z of
    serial-section EM, gets shorter offsets, and none that would repeat its nearest
    neighbour). ``voxel_size``: (z, y, x) nm; a 2D model (``ndim`` 2) uses its (y, x). With
    ``crop_size`` (the model's window), long-range offsets of half the window or more are
    left out (most of the window would have no target for them)."""
    sizes = np.asarray(voxel_size, dtype=float)[-ndim:]
    window = None if crop_size is None else [int(c) for c in crop_size][-ndim:]
    finest = float(sizes.min())
    out: list[Offset] = []
    for distance in (1, *LONG_RANGE):
        for axis in range(ndim):
            step = 1 if distance == 1 else int(round(distance * finest / sizes[axis]))
            offset = tuple(step if a == axis else 0 for a in range(ndim))
            if distance > 1 and (step <= 1 or (window and 2 * step >= window[axis])):
                continue
            if offset not in out:
                out.append(offset)
    return tuple(out)


def is_nearest(offset: Sequence[int]) -> bool:
    """Whether ``offset`` joins face neighbours (one voxel along one axis)."""
    return sum(abs(int(o)) for o in offset) == 1


def channel_name(cls: str, offset: Sequence[int]) -> str:
    """The name of the affinity channel of ``cls`` along ``offset`` (``m`` for a minus, so that
    the name is an identifier: ``cell_aff_0_0_1``, ``cell_aff_m1_0_0``)."""
    return f"{cls}_aff_" + "_".join(str(int(o)).replace("-", "m") for o in offset)


@dataclass(frozen=True)
class AffinitySpec:
    """Which instance classes get affinity channels, and along which offsets (voxels)."""

    classes: tuple[str, ...] = ()
    offsets: tuple[Offset, ...] = ()

    @classmethod
    def from_config(cls, cfg) -> AffinitySpec:
        """The ``[affinities]`` section of a JobConfig; empty offsets take
        :func:`default_offsets` of ``data.voxel_size`` and ``model.ndim``."""
        section = cfg.affinities
        offsets = tuple(parse_offset(o) for o in section.offsets)
        if section.classes and not offsets:
            offsets = default_offsets(cfg.data.voxel_size, cfg.model.ndim, cfg.model.crop_size)
        return cls(tuple(section.classes), offsets if section.classes else ())

    def __len__(self) -> int:
        return len(self.classes) * len(self.offsets)

    def as_config(self) -> dict:
        """The ``[affinities]`` section that gives this spec on any grid (offsets resolved)."""
        return {"classes": list(self.classes),
                "offsets": [":".join(str(v) for v in o) for o in self.offsets]}

    def channel_names(self) -> list[str]:
        return [channel_name(c, o) for c in self.classes for o in self.offsets]

    def channels_of(self, cls: str, first: int) -> slice:
        """The channels of ``cls`` in a layout whose affinity channels start at ``first``."""
        k = self.classes.index(cls)
        return slice(first + k * len(self.offsets), first + (k + 1) * len(self.offsets))


def output_channels(classes: Sequence[str], spec: AffinitySpec) -> list[str]:
    """Names of a segmentation model's output channels (module docstring)."""
    return [*classes, *spec.channel_names()]


def channel_offsets(classes: Sequence[str], spec: AffinitySpec) -> tuple:
    """Per output channel of :func:`output_channels`: its offset, None for a class's mask."""
    return (None,) * len(classes) + tuple(o for _ in spec.classes for o in spec.offsets)


def face_channels(classes: Sequence[str], spec: AffinitySpec, cls: str) -> list[tuple[int, int]]:
    """(output channel, axis) of each face-neighbour affinity of ``cls`` (offset 1 along one
    axis) in the layout of :func:`output_channels`."""
    first = spec.channels_of(cls, len(classes)).start
    out = []
    for i, offset in enumerate(spec.offsets):
        if sorted(offset) == [0] * (len(offset) - 1) + [1]:
            out.append((first + i, offset.index(1)))
    return out


def config_outputs(cfg) -> list[str]:
    """The output channels of the segmentation model of a JobConfig."""
    return output_channels(cfg.data.classes, AffinitySpec.from_config(cfg))


def split_outputs(outputs, classes: Sequence[str], spec: AffinitySpec):
    """Model outputs (C, *spatial) in the layout of :func:`output_channels` as (the classes'
    channels, ``{class: (its affinity channels, offsets)}``)."""
    k = len(classes)
    return outputs[:k], {c: (outputs[spec.channels_of(c, k)], spec.offsets) for c in spec.classes}


def _pair_slices(shape: Sequence[int], offset: Sequence[int]):
    """(slices of v, slices of v + offset) over the voxels whose partner lies in ``shape``."""
    here, there = [], []
    for n, o in zip(shape, offset):
        o = int(o)
        if abs(o) >= n:
            return None
        here.append(slice(max(0, -o), n - max(0, o)))
        there.append(slice(max(0, o), n - max(0, -o)))
    return tuple(here), tuple(there)


def affinities(ids: np.ndarray, known: np.ndarray, offsets: Sequence[Sequence[int]],
               out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """uint8 0/1 (target, valid) of shape (len(offsets), *ids.shape) (module docstring).

    ``ids``: object ids, 0 for background (absent, or unknown); ``known``: boolean, where the
    labels are annotated. ``offsets`` have one entry per axis of ``ids``. ``out``: uint8 arrays
    of that shape to write into.
    """
    ids = np.asarray(ids)
    known = np.asarray(known, dtype=bool)
    shape = (len(offsets), *ids.shape)
    target, valid = out if out is not None else (np.empty(shape, np.uint8), np.empty(shape, np.uint8))
    target[...] = 0
    valid[...] = 0
    for i, offset in enumerate(offsets):
        if len(offset) != ids.ndim:
            raise ValueError(f"offset {tuple(offset)} has {len(offset)} entries for a "
                             f"{ids.ndim}-D volume")
        pairs = _pair_slices(ids.shape, offset)
        if pairs is None:
            continue  # no partner inside the box: nothing is known
        here, there = pairs
        a, b = ids[here], ids[there]
        t, v = target[i][here].view(bool), valid[i][here].view(bool)
        np.equal(a, b, out=t)
        t &= a != 0
        np.logical_and(known[here], known[there], out=v)
        t &= v
    return target, valid
