"""Scoring segmentations with the CellMap challenge's metrics (floor 3).

``metrics`` holds the metrics of one crop and their combination (semantic IoU and Dice;
instance accuracy, Hausdorff distance and the 2024 and 2025 definitions), which validation
logs; ``hausdorff`` and ``neuron_metrics`` the distances and the VOI / adapted Rand error they
use; ``stores`` scores a prediction store against ground truth on disk, the command
``python -m torchtitan.scoring``.
"""
