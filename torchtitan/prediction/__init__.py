"""``predict.py``'s pipeline (floor 6, above the core's :mod:`torchtitan.inference`):
:mod:`~torchtitan.prediction.predictor` (regions to zarr pyramids, block by block),
:mod:`~torchtitan.prediction.regions` (what to predict), :mod:`~torchtitan.prediction.store`
(the output store's life), :mod:`~torchtitan.prediction.exported` (an exported model read back
as a network, for ``predict.py --model`` and the packages that export writes) and
:mod:`~torchtitan.prediction.submission` (challenge submissions and their linter)."""
