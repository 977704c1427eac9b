"""The train state a checkpoint holds beside the model and optimizer: the step (which is also
the data position: samples are keyed by global index), the CPU generator, the best validation
score and the steps skipped as non-finite."""

from __future__ import annotations

import logging
import math

import torch

from torchtitan.errors import CheckpointError

logger = logging.getLogger("torchtitan")


class TrainState:
    """Step counter, data position, best validation and skipped steps, checkpointed with the
    model. The best score is stored signed so that higher is better (see Trainer._is_best);
    without it a resumed run would take its first validation as the best one."""

    def __init__(self, global_batch: int, dp_degree: int):
        self.step = 0
        self.global_batch = global_batch
        self.dp_degree = dp_degree
        self.best_score: float | None = None
        self.best_step: int | None = None
        self.skipped_steps = 0

    def state_dict(self) -> dict:
        return {
            "step": torch.tensor(self.step),
            "global_batch": torch.tensor(self.global_batch),
            "dp_degree": torch.tensor(self.dp_degree),
            "rng_cpu": torch.get_rng_state(),
            # NaN / -1: no validation has scored yet.
            "best_score": torch.tensor(math.nan if self.best_score is None else self.best_score,
                                       dtype=torch.float64),
            "best_step": torch.tensor(-1 if self.best_step is None else self.best_step),
            "skipped_steps": torch.tensor(self.skipped_steps),
        }

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        best = float(sd["best_score"])
        self.best_score = None if math.isnan(best) else best
        self.best_step = None if int(sd["best_step"]) < 0 else int(sd["best_step"])
        self.skipped_steps = int(sd["skipped_steps"])
        if int(sd["global_batch"]) != self.global_batch:
            raise CheckpointError(
                f"the checkpoint was trained with training.batch_size={int(sd['global_batch'])} "
                f"but this run asks for {self.global_batch}; samples are keyed by global batch "
                "position, so resume with the same global batch size (or start a new dump_folder)"
            )
        if int(sd["dp_degree"]) != self.dp_degree:
            # Samples are keyed by global index, so every step still sees the same global
            # batch, only split differently; losses match up to reduction order.
            logger.warning("resuming with data-parallel degree %d (checkpoint: %d); the global "
                           "batches are unchanged", self.dp_degree, int(sd["dp_degree"]))
        torch.set_rng_state(sd["rng_cpu"])
