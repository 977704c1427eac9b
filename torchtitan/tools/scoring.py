"""``python -m torchtitan.tools.scoring``: the scoring command under its earlier name.

Scoring a prediction store against ground truth is evaluation (floor 3): it lives in
:mod:`torchtitan.scoring` and runs as ``python -m torchtitan.evaluation``. This module keeps
the old command and imports working; it adds nothing.
"""

from __future__ import annotations

import sys

from torchtitan.scoring import (  # noqa: F401 - re-exported for callers of the old name
    METRIC_VERSIONS,
    SubmissionError,
    format_table,
    open_submission,
    prediction_level,
    read_truth,
    resample_prediction,
    score_submission,
)
from torchtitan.scoring import main as _main


def main(argv=None) -> int:
    return _main(argv, prog="python -m torchtitan.tools.scoring")


if __name__ == "__main__":
    sys.exit(main())
