"""Hugging Face datasets of 2D EM slices: ``index`` (opening one, its schema and rows),
``samples`` (training samples and validation crops from them) and ``original`` (the schema of
the original torchtitan-segmentation slice datasets)."""
