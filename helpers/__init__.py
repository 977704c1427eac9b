"""Command-line helpers, run as ``python helpers/<script>.py``: demo data, plots, slice datasets,
checkpoint conversion. Thin: they parse arguments and call ``torchtitan``. A package (installed
with the project, see pyproject.toml) so that they and the tests can import each other's
functions without editing the import path."""
