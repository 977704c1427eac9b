"""``python -m torchtitan.tools.scoring``: the scoring command under its first name; it runs
``python -m torchtitan.scoring`` (:mod:`torchtitan.scoring.stores`)."""

import sys

from torchtitan.scoring.stores import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m torchtitan.tools.scoring"))
