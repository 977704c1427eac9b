"""Training samples and batches: ``samples`` and ``mae_samples`` (a sample per global index),
``augment`` (what is drawn per sample and applied on the host and the device) with
``resampling`` (the host's affine kernels), ``batch`` (``Sample`` and ``Batch``, what the loader
hands the trainer) and ``loader`` (the sampler and DataLoader of each rank)."""
