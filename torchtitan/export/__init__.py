"""Trained models exported for use outside the project (floor 6): a run made ready to leave
(:mod:`~torchtitan.export.trained_model`: the network, its test window, its weights in each
format, the model card), the hub folder and the bioimage.io package of one run
(:mod:`~torchtitan.export.writer`, behind ``helpers/export_model.py``;
:mod:`~torchtitan.export.bioimageio`). The network they hold is read back by
:mod:`torchtitan.prediction.exported`."""
