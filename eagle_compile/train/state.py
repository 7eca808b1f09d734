"""Training-state checkpoints: everything a run needs to continue exactly where it stopped.

``<output_dir>/checkpoints/step_<N>.pt`` holds the head's state dict, the optimizer and scheduler state, the
number of completed optimizer steps (which determines the data position: the epoch plans are a pure
function of the seed), the RNG states, the training config and a fingerprint of the data. Files are written
under a temporary name and renamed, so a checkpoint that exists is complete; the newest ``keep`` are kept.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_DIR = "checkpoints"
FORMAT = "eagle_compile.train_state"
_NAME = re.compile(r"step_(\d+)\.pt$")


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = Path(output_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.search(p.name))]
    return [p for _, p in sorted(found)]


def save_state(output_dir: str | Path, step: int, payload: dict[str, Any], keep: int) -> Path:
    folder = Path(output_dir) / CHECKPOINT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:07d}.pt"
    tmp = folder / f".{path.name}.tmp"
    torch.save({"format": FORMAT, "step": step, **payload}, tmp)
    os.replace(tmp, path)
    for old in checkpoints(output_dir)[:-keep]:
        old.unlink()
    return path


def load_state(path: str | Path) -> dict[str, Any]:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not an eagle_compile training checkpoint")
    return state
