"""EM segmentation and MAE pretraining with DINOv3-architecture ViTs, in the style of torchtitan."""

import sys

# Python >= 3.11 is needed (the config reader uses the standard library's tomllib). Checked
# at the first import of the package, so that `python train_mae.py` on an older interpreter
# stops with one clear line (SystemExit prints its message, no traceback) instead of a
# ModuleNotFoundError deep inside. This file must stay parseable by older Pythons.
if sys.version_info < (3, 11):
    raise SystemExit(
        "error: this project needs Python >= 3.11 (it uses the standard library's tomllib), "
        "but it was started with Python %d.%d (%s). Run it with the project's virtual "
        "environment (`source helpers/setup_env.sh`; choose its interpreter with "
        "PYTHON=python3.11) or with python3.11 or newer."
        % (sys.version_info[0], sys.version_info[1], sys.executable)
    )
