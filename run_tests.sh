#!/usr/bin/env bash
# Command 2: set up the environment (once) and run the test suite.
#   ./run_tests.sh              all tests except the slow suite
#   ./run_tests.sh -m slow      the slow suite (full parallelism matrix)
#   ./run_tests.sh tests/test_config.py -k bool    any pytest arguments
set -euo pipefail
cd "$(dirname "$0")"
source helpers/setup_env.sh
exec python -m pytest "$@"
