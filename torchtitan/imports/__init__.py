"""Image stacks and HDF5 volumes written as CellMap stores (``helpers/import_stack.py``):
``image_stack`` (sections and their labels), ``stack_labels`` (value maps and crops),
``volume_files`` (HDF5 read slab by slab) and ``id_labels`` (object ids as classes)."""
