"""Prediction of volumes.

The core (floor 4): :mod:`~torchtitan.inference.sliding_window` (sliding-window and blockwise
prediction with blending, the window plan, the ``VolumePredictor`` that validation and
``predict.py`` share). Above the core (floor 6, which the core never imports): ``predict.py``'s
pipeline: :mod:`~torchtitan.inference.predictor` (regions to zarr pyramids, block by block),
:mod:`~torchtitan.inference.regions` (what to predict), :mod:`~torchtitan.inference.store` (the
output store's life), :mod:`~torchtitan.inference.trained_model` (a run made ready to predict
or to leave) and :mod:`~torchtitan.inference.submission` (challenge submissions and their
linter).
"""
