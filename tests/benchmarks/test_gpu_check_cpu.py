"""benchmarks/gpu_check.py on a machine without a GPU: the clear message and its exit codes, and the dry run of
the kernel section (Triton interpreter, tiny shapes), which passes, with a negative control that must fail.

The dry run of the CUDA-graph and speed sections takes minutes on a 2-core CPU (dynamo captures of the step
program), so only the kernel section and the long-context soak (host-loop step, tiny shapes) run here;
`python benchmarks/gpu_check.py --dry-run-cpu` runs them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA device")


def run_script(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "EAGLE31_TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


def output(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    done = run_script(tmp_path, "--out", str(tmp_path / "out"))
    assert done.returncode == 0, output(done)
    assert "no CUDA device is present" in done.stdout
    assert "Nothing was checked" in done.stdout
    for what in ("(a)", "(b)", "(c)", "(l)", "--dry-run-cpu", "--require-gpu", "python benchmarks/gpu_check.py"):
        assert what in done.stdout, f"the message should mention {what!r}"
    assert not (tmp_path / "out").exists(), "nothing is written when nothing ran"


def test_require_gpu_makes_a_missing_gpu_exit_2(tmp_path):
    done = run_script(tmp_path, "--require-gpu")
    assert done.returncode == 2, output(done)
    assert "no CUDA device is present" in done.stdout


def _dry_run(tmp_path: Path, section: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    pytest.importorskip("triton")
    out = tmp_path / "out"
    done = run_script(tmp_path, "--dry-run-cpu", "--sections", section, "--out", str(out), *extra)
    report = json.loads((out / "gpu_check.json").read_text())
    assert (out / "gpu_check.md").is_file()
    assert report["complete"] and report["mode"] == "dry"
    return done, report


def test_dry_run_checks_every_kernel_against_its_reference(tmp_path):
    from eagle_compile.kernels import KERNELS, TORCH_ONLY

    done, report = _dry_run(tmp_path, "a")
    assert done.returncode == 0, output(done)
    rows = report["rows"]["a"]
    assert {r["op"] for r in rows} == set(KERNELS) - set(TORCH_ONLY)
    float_ops = [name for name, (_, float_only) in KERNELS.items() if float_only]
    for op in float_ops:
        assert {r["dtype"] for r in rows if r["op"] == op} == {"float16", "bfloat16", "float32"}
    assert all(r["ok"] and r["triton_ms"] is not None for r in rows)
    assert len(report["checks"]) == len(rows) and all(c["ok"] for c in report["checks"])
    assert "ALL CHECKS PASSED" in done.stdout


def test_dry_run_negative_control_fails_every_kernel_check(tmp_path):
    done, report = _dry_run(tmp_path, "a", "--negative-control")
    assert done.returncode == 1, output(done)
    assert report["checks"] and not any(c["ok"] for c in report["checks"])
    assert "CHECK(S) FAILED" in done.stdout


def test_dry_run_long_context_soak_with_its_negative_control(tmp_path):
    """Section (l) at tiny shapes with --negative-control (one prompt token of the plain-mode call changed): two
    contexts and the plain mode ran, every memory check passed (peak within KV + allowance, linear growth) and the
    exactness check failed, and only it. One run (a second process pays the first call's captures again, ~40 s);
    the same run without the flag passes every check (`--dry-run-cpu --sections l`)."""
    done, report = _dry_run(tmp_path, "l", "--negative-control")
    assert done.returncode == 1, output(done)
    rows = report["rows"]["l"]
    assert [(r["mode"], r["context"]) for r in rows] == [("speculative", 256), ("speculative", 1024),
                                                         ("plain", 1024)]
    assert all(r["new_tokens"] == 12 and r["cycles"] > 0 and r["peak_bytes"] >= r["kv_bytes"] > 0 for r in rows)
    names = [c["name"] for c in report["checks"]]
    assert len(names) == 8 and any("grows linearly" in n for n in names)
    failed = [c["name"] for c in report["checks"] if not c["ok"]]
    assert len(failed) == 1 and "== plain mode" in failed[0], report["checks"]
