"""The demo data (floor 6): :mod:`~torchtitan.demo.data` writes the synthetic CellMap-layout set
that ``run_demo.sh`` and the tests train on, from the scenes of :mod:`~torchtitan.demo.scene`
and the cells of :mod:`~torchtitan.demo.cells`."""
