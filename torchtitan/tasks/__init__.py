"""Training tasks: what differs between MAE pretraining and segmentation.

A task supplies ``build_model()`` (called under the meta device and once on the CPU for the
reference initialisation), ``flops_per_sample(model)``, ``prepare()`` (read and check the data
before any process group exists), ``train_dataset()``, ``loss_terms(model, batch) -> (sum,
count)``, ``validate(model, trainer) -> scores`` and ``summary(scores)``. The trainer does
everything else, so a new task touches no loop code.
"""

from torchtitan.tasks.mae import MAETask
from torchtitan.tasks.segmentation import SegmentationTask

__all__ = ["MAETask", "SegmentationTask"]
