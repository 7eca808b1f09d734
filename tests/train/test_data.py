"""Conversations: chat template, assistant-only loss mask, drop/truncate, sources, held-out split, batch plans,
and the refusal of evaluation data."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_tokenizer

from eagle_compile.errors import OptionsError
from eagle_compile.train.config import TrainConfig
from eagle_compile.train.data import (
    Record,
    collate,
    plan_epoch,
    prompt_ids,
    read_records,
    split_eval,
    tokenize_records,
)

EOS = 2


def _record(i=0, output="four.", **kw):
    return Record(id=f"r{i}", source=kw.pop("source", "math"), instruction=kw.pop("instruction", "what is 2+2?"),
                  input=kw.pop("input", ""), output=output, **kw)


def test_loss_mask_is_the_reply_up_to_eos():
    tok = tiny_tokenizer()
    rec = _record(input="be brief")
    samples, stats = tokenize_records(tok, [rec], max_len=200)
    s = samples[0]
    prompt = prompt_ids(tok, rec)
    assert tok.decode(prompt) == "<|im_start|>user\nwhat is 2+2?\n\nbe brief<|im_end|>\n<|im_start|>assistant\n"
    assert s.input_ids[: len(prompt)].tolist() == prompt           # the prompt exactly as inference feeds it
    assert not s.loss_mask[: len(prompt)].any()
    reply = s.input_ids[s.loss_mask].tolist()
    assert tok.decode(reply) == "four.<|im_end|>"                   # reply + EOS; ChatML's trailing "\n" dropped
    assert reply[-1] == EOS and len(s) == len(prompt) + len(reply)
    assert stats.loss_tokens == len(reply) and stats.kept == 1


def test_regenerated_output_ids_are_used_as_generated():
    tok = tiny_tokenizer()
    ids = tok("abc", add_special_tokens=False)["input_ids"] + [EOS, 7, 7]   # junk after EOS is cut
    samples, _ = tokenize_records(tok, [_record(output="ignored", output_ids=tuple(ids))], max_len=200)
    assert samples[0].input_ids[samples[0].loss_mask].tolist() == ids[:4]


def test_too_long_conversations_are_dropped_or_truncated():
    tok = tiny_tokenizer()
    recs = [_record(0, output="x" * 10), _record(1, output="y" * 80)]
    prompt_len = len(prompt_ids(tok, recs[0]))
    limit = prompt_len + 20
    kept, stats = tokenize_records(tok, recs, max_len=limit)
    assert [s.id for s in kept] == ["r0"] and stats.dropped_too_long == 1
    kept, stats = tokenize_records(tok, recs, max_len=limit, truncate=True)
    assert [len(s) for s in kept] == [prompt_len + 11, limit] and stats.truncated == 1
    assert kept[1].loss_mask.sum() == 20 and kept[1].input_ids[-1] != EOS


def test_read_records_filters_sources(tmp_path):
    path = tmp_path / "mix.jsonl"
    rows = [{"id": f"a{i}", "source": src, "instruction": "q", "input": "", "output": "a"}
            for i, src in enumerate(["gsm", "code", "gsm"])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r.id for r in read_records([path], ["gsm"])] == ["a0", "a2"]
    assert len(read_records([path])) == 3
    with pytest.raises(OptionsError, match="do not occur"):
        read_records([path], ["chat"])


def test_evaluation_data_is_refused(tmp_path):
    bench = tmp_path / "shared" / "data" / "spec_bench"
    bench.mkdir(parents=True)
    with pytest.raises(OptionsError, match="evaluation-only"):
        TrainConfig(data_dir=str(bench), data_files=("question.jsonl",))
    with pytest.raises(OptionsError, match="evaluation-only"):
        TrainConfig(responses=str(tmp_path / "mt_bench" / "answers.jsonl"))


def test_default_data_dir_is_shared_train(monkeypatch):
    monkeypatch.delenv("EAGLE_COMPILE_TRAIN_DATA", raising=False)
    cfg = TrainConfig()
    assert cfg.data_paths()[0].parts[-4:] == ("shared", "data", "train", "instruct_mix.jsonl")
    monkeypatch.setenv("EAGLE_COMPILE_TRAIN_DATA", "/somewhere/else")
    assert TrainConfig().data_dir == "/somewhere/else"


def test_split_eval_is_stable_under_filtering():
    tok = tiny_tokenizer()
    samples, _ = tokenize_records(tok, [_record(i, output="ab" * (i + 1)) for i in range(20)], max_len=500)
    train, held = split_eval(samples, 4)
    assert len(held) == 4 and sorted(train + held) == list(range(20))
    held_ids = {samples[i].id for i in held}
    subset = [s for s in samples if s.id in held_ids or int(s.id[1:]) % 2]
    _, held2 = split_eval(subset, 4)
    assert {subset[i].id for i in held2} == held_ids


@pytest.mark.parametrize("groups", [None, [i // 7 for i in range(30)]])
def test_plan_epoch_covers_every_sample_once_and_is_deterministic(groups):
    lengths = [int(x) for x in torch.randint(5, 50, (30,), generator=torch.Generator().manual_seed(0))]
    plan = plan_epoch(lengths, 4, seed=3, epoch=1, groups=groups, group_batches=2)
    assert sorted(i for b in plan for i in b) == list(range(30))
    assert plan == plan_epoch(lengths, 4, seed=3, epoch=1, groups=groups, group_batches=2)
    assert plan != plan_epoch(lengths, 4, seed=3, epoch=2, groups=groups, group_batches=2)
    if groups is not None:
        assert all(len({groups[i] for i in b}) == 1 for b in plan)  # a batch never spans two shards


def test_collate_right_pads():
    tok = tiny_tokenizer()
    samples, _ = tokenize_records(tok, [_record(0, output="a"), _record(1, output="abcdef")], max_len=200)
    batch = collate(samples, pad_multiple=8, rows=3)
    assert batch.input_ids.shape[0] == 3 and batch.input_ids.shape[1] % 8 == 0
    for r, s in enumerate(samples):
        n = len(s)
        assert torch.equal(batch.input_ids[r, :n], s.input_ids) and batch.attention_mask[r, :n].all()
        assert not batch.attention_mask[r, n:].any() and not batch.loss_mask[r, n:].any()
    assert not batch.attention_mask[2].any()
