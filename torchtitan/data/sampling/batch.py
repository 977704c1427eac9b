"""The typed hand-offs of training data: one :class:`Sample` per global index and a
:class:`Batch` after collation (a whole validation crop is a
:class:`~torchtitan.data.volume_source.CropVolume`).

Shapes: a sample's arrays are (C, *spatial), a batch's (B, C, *spatial), with *spatial
(H, W) in 2D and (D, H, W) in 3D. ``image`` has one channel per EM channel, ``target`` and
``valid`` one per class (segmentation) or ``valid`` one (MAE: 0 where the crop leaves the EM
volume).

What the loader workers ship: raw uint8 EM where it lies on the training grid (a quarter of
the bytes; :meth:`Batch.to` normalises it on the device), uint8 masks, and the part of the
augmentation left to the device as one ``augmentation`` payload
(:class:`~torchtitan.data.sampling.augment.DeviceAugmentation`; when it rotates or zooms EM,
``image`` is the box read around the sample, in a buffer of one shape per run). A batch is
made model inputs in two steps::

    batch = Augmenter.device(batch.to(device))
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch.utils.data import default_collate

from torchtitan.data.crops.reader import em_to_model_input
from torchtitan.data.sampling.augment import DeviceAugmentation


@dataclass
class Sample:
    """One training sample, drawn from ``sample_rng(seed, index)`` alone."""

    image: torch.Tensor  # (C, *spatial) float32 or raw uint8 EM; a larger buffer to resample
    valid: torch.Tensor  # (K, *spatial) uint8 / float32: where the loss counts
    target: torch.Tensor | None = None  # (K, *spatial) segmentation targets
    index: int = -1  # the global sample index (set by the dataset's __getitem__)
    resampled: int = 0  # replacements drawn after read errors
    noise: torch.Tensor | None = None  # (num_patches,) MAE masking noise
    augmentation: DeviceAugmentation | None = None  # what is left to the device (augment.py)


@dataclass
class Batch:
    """Samples stacked along a new first axis; the fields of :class:`Sample`, batched."""

    image: torch.Tensor  # (B, C, *spatial)
    valid: torch.Tensor  # (B, K, *spatial)
    index: torch.Tensor  # (B,) int64
    resampled: torch.Tensor  # (B,) int64
    target: torch.Tensor | None = None  # (B, K, *spatial)
    noise: torch.Tensor | None = None  # (B, num_patches)
    augmentation: DeviceAugmentation | None = None  # its fields (B, ...)

    def __len__(self) -> int:
        return int(self.image.shape[0])

    def _map(self, fn, names) -> "Batch":
        return replace(self, **{n: fn(getattr(self, n)) for n in names
                                if getattr(self, n) is not None})

    def pin_memory(self) -> "Batch":
        """Called by the DataLoader's pinning thread (``pin_memory=True``): PyTorch pins
        tensors, mappings and sequences itself, other objects through this method (the
        ``augmentation`` payload through its own)."""
        return self._map(lambda value: value.pin_memory(), [f.name for f in fields(self)])

    def to(self, device) -> "Batch":
        """The batch on ``device`` as model inputs: raw uint8 EM normalised there exactly as
        ``crops.reader.em_to_model_input`` does on the host, uint8 / bool masks made float32. The
        bookkeeping and the ``augmentation`` payload stay on the host: the device step reads
        them there, so that reading them costs no device sync."""

        def move(value: torch.Tensor) -> torch.Tensor:
            value = value.to(device, non_blocking=True)
            return value.float() if value.dtype in (torch.uint8, torch.bool) else value

        out = self._map(move, ("target", "valid", "noise"))
        image = self.image.to(device, non_blocking=True)
        out.image = em_to_model_input(image) if image.dtype == torch.uint8 else image
        return out


def collate(samples: list[Sample]) -> Batch:
    """Stack samples into a :class:`Batch` (the loader's ``collate_fn``). Inside a loader
    worker ``default_collate`` stacks straight into shared memory, so the batch reaches the
    main process without another copy."""
    first = samples[0]
    out = {}
    for f in fields(Sample):
        values = [getattr(s, f.name) for s in samples]
        if getattr(first, f.name) is None:
            if any(v is not None for v in values):
                raise ValueError(f"samples disagree on whether they carry {f.name!r}")
            continue
        if f.name == "augmentation":  # one payload, stacked field by field
            out[f.name] = DeviceAugmentation.collate(values)
        else:
            out[f.name] = default_collate(values)  # ints become an int64 tensor (B,)
    return Batch(**out)
