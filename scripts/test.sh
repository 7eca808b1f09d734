#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: set up .venv (scripts/setup.sh), then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/passes -x). The tests run in EAGLE31_TEST_WORKERS
# processes (pytest-xdist; default 2, one per core of the CI machine: most tests are single-threaded Python,
# dynamo capture of tiny models; 0 runs them in this process). Each worker gets its share of the cores as torch
# intra-op threads (tests/conftest.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${EAGLE31_TEST_WORKERS:-2}" "$@"
