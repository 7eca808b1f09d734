"""`eagle31 drift`: its prompts (exact lengths, one document growing with the length, three prompt formats), its
summary (pooled tau, the claims it tests, with negative cases), resumption, and the command end to end on a tiny
random target with the real tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import save_tiny_folder
from transformers import AutoTokenizer

from eagle_compile.cli import main
from eagle_compile.draft.checkpoint import save_draft
from eagle_compile.draft.config import DraftConfig
from eagle_compile.draft.model import EagleDraftModel
from eagle_compile.errors import OptionsError
from eagle_compile.reports import drift, drift_cases
from eagle_compile.targets import default_target_folder

DATA = drift_cases.default_data_dir()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_target_folder())


def test_context_cases_have_exact_lengths_and_grow_one_document(tokenizer):
    cases = drift_cases.context_cases(tokenizer, DATA, [100, 300, 9000], documents=2, window=1024, new_tokens=24)
    assert [(c.name, c.length) for c in cases] == [("100", 100), ("300", 300), ("9000", 1000)] * 2
    assert cases[0].prompt_id != cases[3].prompt_id                       # two different documents
    for short, long in ((cases[0], cases[1]), (cases[1], cases[2])):
        common = next(i for i, (a, b) in enumerate(zip(short.ids, long.ids, strict=False)) if a != b)
        assert common >= short.length - 40, "the longer case must extend the same document prefix"
    instruction = tokenizer.decode(list(cases[0].ids))
    assert "<|im_start|>user" in instruction and instruction.endswith("<|im_start|>assistant\n")
    with pytest.raises(OptionsError, match="documents"):
        drift_cases.context_cases(tokenizer, DATA, [512], documents=500, window=8192, new_tokens=64)


def test_prompt_cases_change_only_the_format(tokenizer):
    cases = drift_cases.prompt_cases(tokenizer, DATA, per_set=1)
    assert [c.name for c in cases] == list(drift_cases.VARIANTS) * len(drift_cases.CHAT_SETS)
    for i in range(0, len(cases), 3):
        default, system, template = (tokenizer.decode(list(c.ids)) for c in cases[i:i + 3])
        assert len({default, system, template}) == 3
        assert "SmolLM" in default and drift_cases.SYSTEM_PROMPT in system and "SmolLM" not in system
        assert "<|im_start|>" not in template and template.endswith("### Response:\n")


def _record(head, group, name, pid, lengths, rms=1.0, tokens=1000):
    hist = {str(k): v for k, v in lengths.items()}
    cycles = sum(lengths.values())
    emitted = sum(k * v for k, v in lengths.items())
    return {"head": head, "group": group, "name": name, "prompt_id": pid, "prompt_tokens": tokens,
            "cycles": cycles, "emitted": emitted, "tau": emitted / cycles, "histogram": hist,
            "drift": {"rms_ratio": [None, rms, rms], "sink_mass": [None, 0.1, 0.2], "top1": [0.5, 0.4, 0.3]},
            "wall_s": 0.0}


def test_summary_pools_cycles_and_tests_the_claims():
    flat = [_record("h", "context", "512", "a", {1: 10, 2: 10}), _record("h", "context", "512", "b", {3: 10}),
            _record("h", "context", "4096", "a", {2: 20}, rms=1.05), _record("h", "prompt", "default", "q", {2: 5}),
            _record("h", "prompt", "system", "q", {1: 5})]
    s = drift.summarize(flat)["h"]
    assert s["context"]["512"]["tau"] == pytest.approx(60 / 30)           # pooled over cycles, not per case
    assert s["context"]["512"]["accept_at_depth"] == pytest.approx([20 / 30, 10 / 30], abs=1e-4)
    assert s["context"]["4096"]["tau_rel"] == pytest.approx(1.0)
    assert s["prompt"]["system"]["tau_rel"] == pytest.approx(0.5)
    assert s["claims"]["tau_long_within_10pct"] is True and s["claims"]["rms_flat_within_10pct"] is True
    drop = [*flat[:2], _record("h", "context", "4096", "a", {1: 10, 2: 10}, rms=1.2)]      # tau 2.0 -> 1.5
    claims = drift.summarize(drop)["h"]["claims"]
    assert claims["tau_rel_long"] == {"4096": pytest.approx(0.75)}
    assert claims["tau_long_within_10pct"] is False and claims["rms_flat_within_10pct"] is False


def test_run_resumes_and_refuses_other_settings(tmp_path, monkeypatch):
    calls = []

    def fake(model, head, case, tree, new_tokens):
        calls.append(case.key)
        record = _record("", case.group, case.name, case.prompt_id, {2: 3})
        del record["head"]                                               # measure's records carry no head label
        return record

    monkeypatch.setattr(drift, "measure", fake)
    cases = [drift_cases.DriftCase("context", "512", "d", (1, 2, 3)),
             drift_cases.DriftCase("prompt", "default", "q", (4,))]
    heads = {"h": (None, "head h")}
    records = drift.run(tmp_path, heads, None, cases, {"chain": 2}, 8, log=lambda _: None)
    assert len(calls) == 2 and [r["head"] for r in records] == ["h", "h"]
    drift.run(tmp_path, heads, None, cases, {"chain": 2}, 8, log=lambda _: None)
    assert len(calls) == 2, "a finished case must not run again"
    with pytest.raises(OptionsError, match="--fresh"):
        drift.run(tmp_path, heads, None, cases, {"chain": 3}, 8, log=lambda _: None)
    drift.run(tmp_path, heads, None, cases, {"chain": 3}, 8, fresh=True, log=lambda _: None)
    assert len(calls) == 4


def test_drift_command_end_to_end(tmp_path, tokenizer):
    target = save_tiny_folder(tmp_path / "target", tokenizer)
    torch.manual_seed(0)
    head = EagleDraftModel(DraftConfig.for_target(target.config, 512)).eval()   # EAGLE-3: feedback not normed
    save_draft(head, tmp_path / "head")
    out = tmp_path / "report"
    argv = ["drift", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "head"), "--tree",
            '{"depth": 3, "top_k": 2, "total_tokens": 6}', "--lengths", "96,192", "--documents", "1",
            "--sections", "context", "--new-tokens", "8", "--threads", "1", "--out", str(out)]
    assert main(argv) == 0
    records = drift.read_records(out / drift.RECORDS)
    assert [(r["name"], r["prompt_tokens"]) for r in records] == [("96", 96), ("192", 192)]
    for r in records:
        assert r["new_tokens"] == 8 and r["cycles"] >= 1
        rms, sink = r["drift"]["rms_ratio"], r["drift"]["sink_mass"]
        assert rms[0] is None and all(x is not None and x > 0 for x in rms[1:3])
        assert all(0 <= x <= 1 for x in sink[1:3])
    summary = json.loads((out / "drift.json").read_text())["summary"]
    assert set(summary["head"]["context"]) == {"96", "192"}
    text = (out / "drift.md").read_text()
    assert "| 192 | 192 | 1 |" in text and "The claims, measured" in text
    assert (out / "tau_vs_context.png").stat().st_size > 1000
    assert main(argv) == 0                                                 # resumes: nothing left to run
    assert len(drift.read_records(out / drift.RECORDS)) == 2


def test_the_command_leaves_the_callers_grad_mode_alone(tmp_path, monkeypatch):
    """`eagle31 drift` called in-process (as tests do) must not switch autograd off for the rest of the process:
    it did once, and every later training test in that pytest worker failed."""
    monkeypatch.setattr(drift, "run", lambda *a, **k: [])
    monkeypatch.setattr(drift_cases, "context_cases", lambda *a, **k: [])
    monkeypatch.setattr("eagle_compile.reports.drift_render.write", lambda *a, **k: [])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / drift.RUN_FILE).write_text("{}")
    assert torch.is_grad_enabled()
    main(["drift", "--sections", "context", "--tree", '{"chain": 2}', "--out", str(tmp_path / "out")])
    assert torch.is_grad_enabled()
