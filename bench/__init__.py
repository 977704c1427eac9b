"""Benchmarks, run as ``python bench/<script>.py``; results go to BENCHMARKS.md with the commands
that made them. A package (installed with the project, see pyproject.toml) so that tests can
import ``bench.shipped_configs`` without editing the import path."""
