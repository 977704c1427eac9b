"""The data (floor 3): volumes in world coordinates, from any store, to training samples.

``io/`` reads stores: local folders and remote ones (S3, GCS, HTTP) with TensorStore, and
local zarr chunks directly. ``sources/`` reads the CellMap layout (datasets, EM levels, label
crops, split lists) and offers it to the tasks as one ``VolumeSource``. ``sampling/`` turns
sources into training samples by global index (targets, augmentation, resampling) and batches
(the loader). ``slices/`` is the same for Hugging Face datasets of 2D slices; ``imports/``
writes image stacks and HDF5 volumes as CellMap stores. ``batch.py`` holds the typed hand-offs
from the data to a task (``Sample``, ``Batch``, ``CropVolume``). Nothing here knows a model.
"""
