"""The data (floor 3): volumes in world coordinates, from any store, to training samples.

``io/`` reads stores: local folders and remote ones (S3, GCS, HTTP) with TensorStore, and
local zarr chunks directly. ``crops/`` finds the CellMap layout's datasets, EM levels and label
crops (a folder or a split list), chooses what a run reads, and holds the one reader of a
crop's EM and labels on the training grid. ``sampling/`` turns them into training samples by
global index (augmentation, resampling) and batches (the loader). ``slices/`` is the same for
Hugging Face datasets of 2D slices; ``imports/`` writes image stacks and HDF5 volumes as
CellMap stores. ``volume_source.py`` is the seam the tasks take their data from (samples,
validation crops as ``CropVolume``, the read errors a run survives). Nothing here knows a
model.
"""
