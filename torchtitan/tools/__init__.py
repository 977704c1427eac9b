"""Tools: the floor above the core (floor 6 of the house plan).

Demo data (``demo_data``, with its simulator in ``demo_scene`` and ``demo_cells``), pictures
and GIFs (``visualization``, drawn with ``drawing``), what the helper scripts share (``cli``,
``label_crops``), scoring a submission (``scoring``: ``python -m
torchtitan.tools.scoring``) and prediction I/O (``predictor``, behind ``predict.py``). They
import the core (config, domain, data, models, metrics, inference, tasks); the core never
imports them (``tests/test_floors.py``). Where the core needs a tool's work, such as the
validation pictures of a task, the entry script hands it in (see ``train_segmentation.py``).
"""
