"""What a task is to the trainer (:class:`Task`), what it gets to validate with
(:class:`ValidationContext`) instead of the trainer itself, and the picture writers a task may
be handed (:class:`SegmentationVisuals`, :class:`MAEVisuals`).

Pictures are a product (``torchtitan/pictures/visualization.py``), above the core: a task never
imports them. The entry script hands the task a writer, e.g.
``run(partial(SegmentationTask, visuals=write_validation_visuals))``; a task built without
one (``visuals=None``, as in most tests) validates the same and writes no pictures."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from torchtitan.data.sampling.batch import Batch


@dataclass(frozen=True)
class ValidationContext:
    """Where and how this rank validates; built by the trainer for each validation."""

    device: torch.device
    step: int  # the training step being validated
    dp_rank: int = 0  # this rank's share of the validation set: dp_rank of dp_degree
    dp_degree: int = 1
    dp_group: Any = None  # the data-parallel process group (None: one data-parallel rank)
    # Sharded (FSDP) forwards all-gather parameters, so every data-parallel rank must run the
    # same number of them: ranks with less work pad with idle forwards (see most_forwards).
    sharded: bool = False
    writer: Any = None  # TensorBoard SummaryWriter on the rank that logs, else None
    writes_files: bool = True  # whether this rank writes pictures (one per tensor-parallel group)


@runtime_checkable
class Task(Protocol):
    """What differs between training jobs (MAE pretraining, segmentation); the trainer does the
    rest. A new task implements these and touches no loop code."""

    name: str
    best_metric: str | None  # the validation score that marks the best checkpoint, or None
    best_higher: bool  # whether a higher best_metric is better

    def prepare(self) -> None:
        """Read and check the data, before any process group exists."""

    def build_model(self) -> nn.Module:
        """The model; called once per start, under the meta device (each rank then initialises
        its own shards, tensor by tensor, with the model's ``init_weights``)."""

    def flops_per_sample(self, model: nn.Module) -> float:
        """Training FLOPs (forward and backward) of one sample."""

    def train_dataset(self) -> Dataset:
        """The training samples, indexed by global sample index."""

    def loss_terms(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum, count) of the loss over this rank's batch (on the device, augmented); the
        trainer divides by the global count."""

    def validate(self, model: nn.Module, ctx: ValidationContext) -> dict[str, float]:
        """Scores (``val/...``) of this validation; every rank returns the same."""

    def summary(self, scores: dict[str, float]) -> None:
        """Printed by rank 0 when training finishes."""


class SegmentationVisuals(Protocol):
    """Writes the pictures of one validation crop (the entry script hands in
    ``torchtitan.pictures.visualization.write_validation_visuals``)."""

    def __call__(self, out_dir: Path, name: str, step: int, em: np.ndarray, truth: np.ndarray,
                 pred: np.ndarray, classes: list[str], valid: np.ndarray | None = None,
                 writer: Any = None) -> Any:
        """``em`` (D, H, W); ``truth``, ``pred``, ``valid`` (K, D, H, W), one channel per
        class of ``classes``; ``writer``: the TensorBoard SummaryWriter or None."""


class MAEVisuals(Protocol):
    """Writes the picture of a few held-out MAE samples (the entry script hands in
    ``torchtitan.pictures.visualization.write_mae_visuals``)."""

    def __call__(self, out_dir: Path, step: int, image: torch.Tensor, masked_image: torch.Tensor,
                 reconstruction: torch.Tensor, writer: Any = None) -> Any:
        """Input, input with hidden patches NaN, and reconstruction (hidden patches predicted),
        each (N, C, *spatial): N samples."""
