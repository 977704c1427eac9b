"""Pictures (floor 6): class colours and overlays (:mod:`~torchtitan.pictures.drawing`), the
GIFs and TensorBoard images of validation (:mod:`~torchtitan.pictures.visualization`, handed to
the tasks by the entry scripts) and viewer links (:mod:`~torchtitan.pictures.viewer`)."""
