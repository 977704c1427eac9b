"""Trained models exported for use outside the project (floor 6): the hub folder and the
bioimage.io package of one run (:mod:`~torchtitan.export.writer`, behind
``helpers/export_model.py``; :mod:`~torchtitan.export.bioimageio`), and the exported network
with its reader (:mod:`~torchtitan.export.network`, for ``predict.py --model``)."""
