"""`tree.json` beside a draft head: the tree shape chosen for it, and for which device kind and dtype.

`benchmarks/verify_cost.py` measures the verify cost curve c(N)/c(1) and the head's acceptance on one machine
and writes the best shape as eagle31 options plus where it holds:

    {"depth": 3, "top_k": 3, "total_tokens": 8, "chosen_for": {"device": "cpu", "dtype": "float32", ...}}

The cost curve depends on the device kind and the dtype (on our CPUs c(8) ~ 1.7 c(1) in float32 and ~0.9 in
bfloat16; on a GPU c(64) ~ c(1)), so a shape chosen for one is only a default for the same kind: `head_tree`
returns it when `chosen_for` matches the target's device type and dtype, and otherwise says why not. A file
without `chosen_for` is never used as a default (nobody can tell what it was chosen for).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TREE_FILE = "tree.json"
SHAPE_KEYS = ("depth", "top_k", "total_tokens", "chain")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def head_tree(folder: str | Path | None, device: torch.device, dtype: torch.dtype) -> tuple[dict | None, str]:
    """(tree options or None, where they come from / why none) for a head folder and the target's device/dtype."""
    if folder is None:
        return None, "the draft head has no folder (no tree.json to read)"
    path = Path(folder) / TREE_FILE
    if not path.is_file():
        return None, f"no {TREE_FILE} beside the head ({path.parent})"
    raw = json.loads(path.read_text())
    shape = {k: raw[k] for k in SHAPE_KEYS if k in raw}
    chosen = raw.get("chosen_for")
    if not isinstance(chosen, dict):
        return None, f"{path} does not say which device and dtype it was chosen for (no 'chosen_for'); not used"
    want = {"device": torch.device(device).type, "dtype": dtype_name(dtype)}
    got = {k: chosen.get(k) for k in want}
    if got != want:
        return None, f"{path} was chosen for {got}, not this target's {want}; not used"
    return shape, f"{path} (chosen for {want['device']} {want['dtype']})"


def write_tree_file(path: str | Path, shape: dict[str, Any], *, device: str, dtype: torch.dtype,
                    **provenance: Any) -> dict:
    """Write tree.json: `shape` (eagle31 tree options) and `chosen_for` (device kind, dtype, provenance)."""
    record = {**{k: shape[k] for k in SHAPE_KEYS if k in shape},
              "chosen_for": {"device": torch.device(device).type, "dtype": dtype_name(dtype), **provenance}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return record
