"""benchmarks/spec_bench_compare.py: the table reads each run's own summary, and runs over other prompts are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "spec_bench_compare.py"


def write_run(folder: Path, question_ids: list[int], tau: float, speedup: float) -> None:
    folder.mkdir()
    summary = {c: {"tau": tau, "speedup_vs_plain": speedup} for c in ("mt_bench", "all")}
    meta = {"head": {"folder": "heads/h"}, "options": {"chain": 3},
            "environment": {"git": {"commit": "abcdef0123", "dirty": False}, "command": "spec_bench.py"}}
    records = [{"question_id": q} for q in question_ids]
    (folder / "spec_bench.json").write_text(json.dumps({"meta": meta, "summary": summary, "records": records}))


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_table_has_each_runs_tau_and_speedup(tmp_path):
    write_run(tmp_path / "a", [81, 161], 1.37, 1.13)
    write_run(tmp_path / "b", [161, 81], 1.43, 1.15)
    out = tmp_path / "cmp.md"
    done = run(f"old={tmp_path / 'a'}", f"new={tmp_path / 'b'}", "--out", str(out))
    assert done.returncode == 0, done.stderr
    table = out.read_text()
    assert "| mt_bench | 1.37 | 1.43 | 1.13x | 1.15x |" in table
    assert "| all | 1.37 | 1.43 | 1.13x | 1.15x |" in table
    assert "tree `{\"chain\": 3}`" in table and "abcdef0" in table


def test_runs_over_other_prompts_are_refused(tmp_path):
    write_run(tmp_path / "a", [81, 161], 1.37, 1.13)
    write_run(tmp_path / "b", [81, 162], 1.43, 1.15)
    done = run(f"old={tmp_path / 'a'}", f"new={tmp_path / 'b'}")
    assert done.returncode != 0
    assert "other prompts" in done.stderr


def test_missing_run_names_the_fix(tmp_path):
    done = run(f"x={tmp_path / 'nowhere'}")
    assert done.returncode != 0 and "run benchmarks/spec_bench.py --out" in done.stderr
