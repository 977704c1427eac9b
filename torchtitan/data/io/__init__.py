"""Store I/O: ``stores`` (locations local or remote, metadata, listings, TensorStore arrays) and
``zarr_chunks`` (local zarr arrays read chunk file by chunk file)."""
