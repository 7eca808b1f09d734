"""Self-distillation: batched left-padded generation equals per-prompt generation, the replies feed the data
pipeline as generated, and an interrupted run resumes without redoing or duplicating replies."""

from __future__ import annotations

import json

import torch
from tiny import tiny_target, tiny_tokenizer

from eagle_compile.train.data import Record, prompt_ids, read_records, tokenize_records
from eagle_compile.train.regenerate import done_ids, regenerate_responses


def _records(n):
    words = ["hi", "what is 2+2?", "name three colors please", "x", "sum 1 2 3 and then 4", "ok?"]
    return [Record(id=f"q{i}", source="t", instruction=words[i % len(words)], input="" if i % 2 else "be short",
                   output="ref") for i in range(n)]


def test_batched_greedy_equals_single_prompt_greedy_and_resumes(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_target("llama", vocab=len(tok))
    out = tmp_path / "responses.jsonl"
    records = _records(5)
    stats = regenerate_responses(model, tok, records[:3], out, batch_size=2, max_new_tokens=12, progress=False)
    assert stats.written == 3 and stats.skipped == 0
    with out.open("a") as f:
        f.write('{"id": "torn')                     # a write cut short by an interruption
    assert done_ids(out) == {"q0", "q1", "q2"}
    stats = regenerate_responses(model, tok, records, out, batch_size=2, max_new_tokens=12, progress=False)
    assert stats.written == 2 and stats.skipped == 3

    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(x["id"] for x in lines) == [f"q{i}" for i in range(5)]
    by_id = {x["id"]: x for x in lines}
    for rec in records:
        ids = torch.tensor([prompt_ids(tok, rec)])
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=0)
        ref = ref[0, ids.shape[1]:].tolist()
        ref = ref[: ref.index(2) + 1] if 2 in ref else ref
        assert by_id[rec.id]["output_ids"] == ref
        assert by_id[rec.id]["finished"] == (2 in ref)

    # the data pipeline trains on exactly these ids
    samples, _ = tokenize_records(tok, read_records([out]), max_len=200)
    for s in samples:
        assert s.input_ids[s.loss_mask].tolist() == by_id[s.id]["output_ids"]


def test_sampling_is_seeded(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_target("llama", vocab=len(tok))
    runs = []
    for name in ("a", "b"):
        regenerate_responses(model, tok, _records(4), tmp_path / f"{name}.jsonl", batch_size=2, max_new_tokens=10,
                             temperature=0.8, seed=7, progress=False)
        runs.append((tmp_path / f"{name}.jsonl").read_text())
    assert runs[0] == runs[1]
