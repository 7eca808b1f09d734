"""End to end on the embedded default target (SmolLM2-135M-Instruct, float32) with the shipped EAGLE 3.1 head:
speculative greedy equals plain greedy on Spec-Bench prompts, and the head is accepted often enough."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import eagle_compile
from eagle_compile.heads import shipped_head
from eagle_compile.options import EAGLE_TREE

pytestmark = pytest.mark.slow
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
QUESTION_IDS = (81, 161, 321)          # MT-bench writing, translation, qa: first turns
# Floors for the shipped head's mean acceptance length on these prompts, per tree: the tree chosen for this CPU
# (tree.json, small because verifying costs c(N) here) and EAGLE's default tree (depth 7, top_k 10, 60 tokens; the
# shape acceptance lengths are usually quoted with, and the one the tau >= 2.0 is held to). The head (see
# its MODEL_CARD.md) measured 1.66 and 2.04 here (float32, 2 threads); an untrained head gets 1.00. Raise the
# tree.json floor with a better-trained head.
TAU_FLOORS = {"tree.json": 1.55, "default tree": 2.0}


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(2)
    return eagle_compile.load_default_target(torch.float32)


def _prompts(tokenizer):
    rows = {r["question_id"]: r for r in map(json.loads, DATA.read_text().splitlines())}
    out = []
    for qid in QUESTION_IDS:
        messages = [{"role": "user", "content": rows[qid]["turns"][0]}]
        out.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                 return_dict=True)["input_ids"])
    return out


def test_shipped_head_is_exact_and_accepted(target):
    model, tokenizer = target
    head = shipped_head()
    assert head is not None, "no trained head ships in eagle_compile/heads/"
    draft = eagle_compile.load_draft(head, target=model, dtype=torch.float32)
    # no tree keys: the tree.json beside the head (chosen for CPU float32); the default tree named explicitly
    trees = {"tree.json": {}, "default tree": dict(EAGLE_TREE)}
    prompts = _prompts(tokenizer)
    with torch.no_grad():
        refs = [model.generate(ids, max_new_tokens=64, do_sample=False) for ids in prompts]
    for name, options in trees.items():
        lengths = []
        with torch.no_grad():
            for ids, ref in zip(prompts, refs, strict=True):
                out = eagle_compile.generate(model, ids, draft=draft, options=options, max_new_tokens=64,
                                             return_dict_in_generate=True)
                assert torch.equal(out.sequences, ref), name
                if name == "tree.json":
                    assert out.stats.tree["source"].startswith(str(head / "tree.json")), out.stats.tree
                lengths += out.stats.acceptance_lengths
        tau = sum(lengths) / len(lengths)
        assert tau >= TAU_FLOORS[name], f"{name}: mean acceptance length {tau:.2f} over 3 Spec-Bench prompts"


def test_stop_strings_end_the_output_like_hf(target):
    model, tokenizer = target
    draft = eagle_compile.load_draft(shipped_head(), target=model, dtype=torch.float32)
    ids = _prompts(tokenizer)[0]
    free = model.generate(ids, max_new_tokens=40, do_sample=False)
    text = tokenizer.decode(free[0, ids.shape[1]:])
    stop = text.split()[5]                         # a word the greedy continuation reaches after a few tokens
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
        out = eagle_compile.generate(model, ids, draft=draft, options={"chain": 3}, max_new_tokens=40,
                                     stop_strings=[stop], tokenizer=tokenizer)
    assert ref.shape[1] < free.shape[1]            # the stop string did cut the output
    assert torch.equal(out, ref)
