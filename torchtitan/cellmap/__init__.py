"""The CellMap domain: the facts every other part of the project asks, each written once.

* :mod:`.classes`  the class table (ids, names, atomic parts) and the instance classes;
* :mod:`.labels`   what a stored label value means (absent, present, unknown, instance id);
* :mod:`.grids`    voxel grids and scale levels placed in the world (nm, z/y/x);
* :mod:`.ome_ngff` reading and writing OME-NGFF ``multiscales`` groups;
* :mod:`.errors`   :class:`DatasetError`, raised for data that breaks these rules.

This is floor 2 of ``DESIGN.md``: it imports nothing of ours except the error base class, so
data loading, evaluation, prediction, plotting and demo-data generation can all import it
without importing each other.
"""
