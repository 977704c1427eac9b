"""``python -m torchtitan.scoring``: score a prediction store (see :mod:`torchtitan.scoring.stores`)."""

import sys

from torchtitan.scoring.stores import main

sys.exit(main())
