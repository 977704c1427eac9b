"""Prediction of volumes, the core (floor 4): :mod:`~torchtitan.inference.sliding_window`
(sliding-window and blockwise prediction with blending, the window plan, the
``VolumePredictor`` that validation and ``predict.py`` share). ``predict.py``'s pipeline above
it is :mod:`torchtitan.prediction`."""
