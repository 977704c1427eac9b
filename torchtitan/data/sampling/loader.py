"""Distributed, resumable data loading.

The loader is a plain ``torch.utils.data.DataLoader`` over a dataset indexed by global sample
index, driven by :class:`GlobalBatchSampler`, which hands each data-parallel rank its slice of
every global batch. Its only state is the next step, so resuming is exact for any number of
worker processes: restart the sampler at the checkpointed step and the same samples follow.
Items are :class:`~torchtitan.data.sampling.batch.Sample` objects, collated into a
:class:`~torchtitan.data.sampling.batch.Batch` (``batch.collate``).
"""

from __future__ import annotations

import logging

from torch.utils.data import DataLoader, Sampler

from torchtitan.data.sampling.batch import collate
from torchtitan.data.io.stores import tensorstore_used

logger = logging.getLogger(__name__)


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields, for each step from ``start_step`` on, this rank's share of the global batch.

    Global sample indices of step ``s`` are ``s * global_batch + j`` for ``j`` in
    ``[0, global_batch)``; rank ``r`` of ``dp_degree`` takes the contiguous block
    ``[r * local, (r + 1) * local)``.
    """

    def __init__(self, global_batch: int, dp_rank: int, dp_degree: int, start_step: int = 0):
        if global_batch % dp_degree != 0:
            raise ValueError(
                f"training.batch_size={global_batch} is not divisible by the data-parallel degree "
                f"{dp_degree}; choose a multiple of {dp_degree}"
            )
        self.global_batch = global_batch
        self.local = global_batch // dp_degree
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.step = start_step

    def __iter__(self):
        while True:
            base = self.step * self.global_batch + self.dp_rank * self.local
            self.step += 1
            yield list(range(base, base + self.local))

    def __len__(self) -> int:  # infinite; DataLoader only needs it for len(loader)
        return 2**62


def build_loader(dataset, global_batch: int, dp_rank: int, dp_degree: int, start_step: int,
                 num_workers: int, pin_memory: bool = False,
                 multiprocessing_context: str | None = None) -> DataLoader:
    """A DataLoader that yields this rank's :class:`~torchtitan.data.sampling.batch.Batch` of each
    step ``start_step, start_step + 1, ...``.

    Samples depend only on their global index, so the loader can be rebuilt at any step and
    the batches do not depend on ``num_workers``. Workers are persistent and keep
    ``prefetch_factor`` batches each in flight; ``pin_memory`` (set on CUDA; ``Batch.pin_memory``)
    lets the copy to the GPU overlap with compute. Workers start with the platform's default method (fork on
    Linux: 0.2 s, against 3-4 s for forkserver or spawn, which re-import torch); the dataset
    also pickles, for ``multiprocessing_context="spawn"``. Workers need no set-up: every
    sample owns its generator (keyed by its global index), and the store context the dataset
    reads through carries its settings into a spawned worker and opens its own handles in
    each process (``stores.StoreContext``).
    """
    sampler = GlobalBatchSampler(global_batch, dp_rank, dp_degree, start_step)
    workers = num_workers > 0
    if workers and tensorstore_used() and multiprocessing_context in (None, "fork"):
        # TensorStore's threads do not survive fork(): its children abort.
        logger.info("loader workers start with 'spawn' (TensorStore is in use in this process)")
        multiprocessing_context = "spawn"
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=workers,
        prefetch_factor=2 if workers else None,
        multiprocessing_context=multiprocessing_context if workers else None,
    )


# ---------------------------------------------------------------------------------------------
# Crops: discovery checks and the train / validation split
# ---------------------------------------------------------------------------------------------
