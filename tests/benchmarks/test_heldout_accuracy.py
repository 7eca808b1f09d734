"""benchmarks/heldout_accuracy.py: a folder that is not a training run is refused with the fix named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "heldout_accuracy.py"


def test_a_folder_without_train_config_is_refused(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--run", str(tmp_path), "--heads", "h"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "train_config.json does not exist" in done.stderr and "training run's output folder" in done.stderr
