"""``python -m torchtitan.evaluation``: the scoring command under the name earlier releases
documented; it runs ``python -m torchtitan.scoring`` (:mod:`torchtitan.scoring.stores`)."""

import sys

from torchtitan.scoring.stores import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m torchtitan.evaluation"))
