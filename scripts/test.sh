#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: set up .venv (scripts/setup.sh), then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/passes -x). The tests run in EAGLE31_TEST_WORKERS
# processes (pytest-xdist; default 2, one per core of the CI machine: most tests are single-threaded Python,
# dynamo capture of tiny models; 0 runs them in this process). Each worker gets its share of the cores as torch
# intra-op threads (OMP_NUM_THREADS, unless set): two workers of two threads each on two cores ran
# tests/runtime/test_plain_path.py + test_calibrated_lossless.py in 186 s against 155 s with one thread each
# (2026-12-07); the whole suite ran 32:13 against 33:23 (one run each; the real-target tests, which set 2
# threads themselves, took longer in that run: not isolated).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export TORCHINDUCTOR_COMPILE_THREADS="${TORCHINDUCTOR_COMPILE_THREADS:-1}"
workers="${EAGLE31_TEST_WORKERS:-2}"
if [ "$workers" -gt 0 ]; then
    cores="$(nproc)"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores > workers ? cores / workers : 1 ))}"
    exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" "$@"
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
