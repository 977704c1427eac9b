"""Training tasks: what differs between MAE pretraining and segmentation.

A task is a :class:`Task` (``tasks/base.py``): ``prepare()`` (read and check the data before
any process group exists), ``build_model()`` (called once per start, under the meta device;
each rank initialises its own shards), ``flops_per_sample(model)``, ``train_dataset()``,
``loss_terms(model, batch) -> (sum, count)``, ``validate(model, ctx) -> scores`` with a
:class:`ValidationContext` (not the trainer), ``best_metric`` / ``best_higher`` and
``summary(scores)``. The trainer does everything else, so a new task touches no loop code.
Pictures are handed in: ``SegmentationTask(cfg, visuals=...)``, ``MAETask(cfg, visuals=...)``
take a picture writer (:class:`SegmentationVisuals`, :class:`MAEVisuals`; the entry scripts
pass the product's) and write none without one.
"""

from torchtitan.tasks.base import MAEVisuals, SegmentationVisuals, Task, ValidationContext
from torchtitan.tasks.mae import MAETask
from torchtitan.tasks.segmentation import SegmentationTask

__all__ = ["MAETask", "MAEVisuals", "SegmentationTask", "SegmentationVisuals", "Task",
           "ValidationContext"]
