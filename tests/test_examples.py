"""Every script in examples/ runs as a user runs it (a subprocess from the repository root) on a tiny random
target saved as an HF folder, with tiny settings, and reports what it promises (exact output, a head written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import save_random_head, save_tiny_folder, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("examples")
    target = save_tiny_folder(base / "target", tiny_tokenizer())
    save_random_head(base / "head", target)
    data = base / "data"
    data.mkdir()
    lines = [{"id": f"r{i}", "source": "s", "instruction": f"say {i} twice", "input": "",
              "output": f"{i} {i}. and then {i} again."} for i in range(12)]
    (data / "mix.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return base


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, f"examples/{script}", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_every_example_has_a_test():
    assert set(EXAMPLES) == {"compile_and_generate.py", "train_head.py", "benchmark.py", "export_onnx.py"}


def test_compile_and_generate(folders):
    out = _run("compile_and_generate.py", "--target", str(folders / "target"), "--draft", str(folders / "head"),
               "--max-new-tokens", "12", "--stream", "--options", '{"chain": 2}')
    assert "identical to model.generate: yes" in out and "tokens in" in out


def test_train_head(folders):
    run = folders / "run"
    out = _run("train_head.py", "--target", str(folders / "target"), "--data-dir", str(folders / "data"),
               "--data-files", "mix.jsonl", "--steps", "2", "--batch-size", "2", "--max-len", "64",
               "--draft-vocab-size", "32", "--eval-samples", "2", "--out", str(run))
    assert (run / "head" / "config.json").is_file() and (run / "head" / "model.safetensors").is_file()
    assert "identical to model.generate: yes" in out


def test_benchmark(folders):
    out = _run("benchmark.py", "--target", str(folders / "target"), "--draft", str(folders / "head"),
               "--max-new-tokens", "8", "--rounds", "1", "--options", '{"chain": 2}')
    assert "identical to model.generate on 4 of 4 prompts" in out and "eagle31" in out


def test_export_onnx(folders, tmp_path):
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed (scripts/setup.sh installs it)")
    out = _run("export_onnx.py", "--target", str(folders / "target"), "--draft", str(folders / "head"),
               "--out", str(tmp_path / "onnx"), "--tree", '{"chain": 2}', "--max-new-tokens", "10")
    assert "identical to model.generate: yes" in out and (tmp_path / "onnx" / "target.onnx").is_file()
