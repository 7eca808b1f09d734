#!/usr/bin/env bash
# Run the demo on the embedded default target (SmolLM2-135M-Instruct) on a fresh machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/eagle31 demo "$@"
