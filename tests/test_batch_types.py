"""The typed hand-offs: samples collate into a Batch that pins, moves to a device in one step
and is augmented there in another; both tasks satisfy the Task protocol."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.pin_memory import pin_memory as torch_pin_memory

from torchtitan.config.job_config import JobConfig
from torchtitan.data.sampling.augment import Augmenter, DeviceAugmentation
from torchtitan.data.sampling.batch import Batch, Sample, collate
from torchtitan.data.crops.reader import em_to_model_input
from torchtitan.tasks import MAETask, SegmentationTask, Task, ValidationContext


def _sample(g: int, intensity: bool = False) -> Sample:
    rng = np.random.default_rng(g)
    sample = Sample(image=torch.from_numpy(rng.integers(0, 256, (1, 8, 8), dtype=np.uint8)),
                    valid=torch.ones(2, 8, 8, dtype=torch.uint8),
                    target=torch.from_numpy(rng.integers(0, 2, (2, 8, 8), dtype=np.uint8)),
                    index=g, resampled=g % 2)
    if intensity:
        sample.augmentation = DeviceAugmentation(
            intensity=torch.tensor([1.1, 0.9, 0.1, 0, 0, 0.7], dtype=torch.float32),
            noise_seed=torch.tensor(g, dtype=torch.int64))
    return sample


class _Samples(Dataset):
    def __init__(self, intensity: bool = False):
        self.intensity = intensity

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, g: int) -> Sample:
        return _sample(g, self.intensity)


def test_collate_makes_a_batch_of_named_fields():
    batch = collate([_sample(g) for g in range(3)])
    assert isinstance(batch, Batch) and len(batch) == 3
    assert batch.image.shape == (3, 1, 8, 8) and batch.target.shape == (3, 2, 8, 8)
    assert batch.index.tolist() == [0, 1, 2] and batch.index.dtype == torch.int64
    assert batch.resampled.tolist() == [0, 1, 0]
    assert batch.noise is None and batch.augmentation is None
    with pytest.raises(ValueError, match="augmentation"):
        collate([_sample(0), _sample(1, intensity=True)])
    mixed = _sample(1, intensity=True)
    mixed.augmentation.noise_seed = None
    with pytest.raises(ValueError, match="augmentation.noise_seed"):
        collate([_sample(0, intensity=True), mixed])
    both = collate([_sample(g, intensity=True) for g in range(3)]).augmentation
    assert both.intensity.shape == (3, 6) and both.noise_seed.tolist() == [0, 1, 2]
    assert both.geometry is None and both.label_axes is None


def test_loader_workers_ship_batches_in_shared_memory():
    from torchtitan.data.sampling.loader import build_loader

    loader = build_loader(_Samples(intensity=True), 4, 0, 1, start_step=1, num_workers=1)
    batch = next(iter(loader))
    assert isinstance(batch, Batch) and batch.index.tolist() == [4, 5, 6, 7]
    assert batch.image.is_shared() and batch.valid.is_shared()
    assert batch.augmentation.intensity.is_shared()  # the payload collated in the worker too
    expected = collate([_sample(g, intensity=True) for g in range(4, 8)])
    assert torch.equal(batch.image, expected.image) and batch.augmentation == expected.augmentation


def test_batch_pins_through_the_loaders_pin_function(monkeypatch):
    batch = collate([_sample(g, intensity=True) for g in range(2)])
    if not torch.cuda.is_available():  # a CPU-only build cannot pin: mark instead
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t.clone().fill_(7))
    pinned = torch_pin_memory(batch)  # what the DataLoader's pinning thread calls
    assert isinstance(pinned, Batch) and isinstance(pinned.augmentation, DeviceAugmentation)

    def tensors(b: Batch) -> dict:
        """The batch's fields, its augmentation payload's among them."""
        return {**vars(b), **{f"augmentation.{k}": v for k, v in vars(b.augmentation).items()}}

    originals = tensors(batch)
    for name, value in tensors(pinned).items():
        if value is None or name == "augmentation":
            continue
        if torch.cuda.is_available():
            assert value.is_pinned(), name
            assert torch.equal(value, originals[name]), name
        else:
            assert bool((value == 7).all()), name


def test_batch_moves_to_the_device_then_is_augmented_there():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch = collate([_sample(g, intensity=True) for g in range(2)])
    moved = batch.to(device)
    assert moved.image.device.type == device.type and moved.image.dtype == torch.float32
    expected = torch.from_numpy(em_to_model_input(batch.image.numpy()))
    assert torch.equal(moved.image.cpu(), expected)  # bit for bit the host normalisation
    assert moved.target.dtype == moved.valid.dtype == torch.float32
    # The payload and the bookkeeping stay on the host (read there without a device sync).
    assert moved.augmentation.intensity.device.type == "cpu" and moved.index.device.type == "cpu"
    out = Augmenter.device(moved)
    assert out.augmentation is None
    assert out.image.device.type == device.type and out.image.shape == moved.image.shape
    assert not torch.allclose(out.image, moved.image)
    assert torch.equal(out.target, moved.target) and torch.equal(out.valid, moved.valid)
    plain = collate([_sample(0)]).to(device)
    assert Augmenter.device(plain) is plain  # nothing left to do


def test_both_tasks_satisfy_the_task_protocol():
    cfg = JobConfig()
    for task in (MAETask(cfg), SegmentationTask(cfg)):
        assert isinstance(task, Task), type(task).__name__
        assert isinstance(task.best_metric, str) and isinstance(task.best_higher, bool)
    ctx = ValidationContext(device=torch.device("cpu"), step=3)
    assert ctx.dp_degree == 1 and ctx.dp_group is None and not ctx.sharded and ctx.writes_files
