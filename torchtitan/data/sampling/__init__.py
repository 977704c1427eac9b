"""Training samples and batches: ``samples`` and ``mae_samples`` (a sample per global index),
``targets`` (binary targets and validity of the classes), ``augment`` (what is drawn per sample
and applied on the host and the device) with ``resampling`` (the host's affine kernels), and
``loader`` (the sampler and DataLoader of each rank)."""
