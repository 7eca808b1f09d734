"""End to end on the embedded default target (SmolLM2-135M-Instruct, float32) with the shipped EAGLE 3.1 head:
with numerics="eager" speculative greedy equals HF eager greedy on Spec-Bench prompts, and the head is accepted
often enough; with the default batch-invariant numerics a token's logits do not depend on how it is computed, and
speculative greedy (the calibration layer on) equals the plain mode's greedy token for token on Spec-Bench and
long prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from invariance import invariance_failures, invariant_program

import eagle_compile
from eagle_compile.heads import shipped_head
from eagle_compile.options import EAGLE_TREE

pytestmark = pytest.mark.slow
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
QUESTION_IDS = (81, 161, 321)          # MT-bench writing, translation, qa: first turns
# Floors for the shipped head's mean acceptance length on these prompts, per tree: the tree chosen for this CPU
# (tree.json, small because verifying costs c(N) here) and EAGLE's default tree (depth 7, top_k 10, 60 tokens; the
# shape acceptance lengths are usually quoted with, and the one the tau >= 2.0 is held to). The stage-6
# head (see its MODEL_CARD.md) measured 1.66 and 2.02 here (float32, 2 threads; the stage-5 head 1.48 with a chain
# of 3 and 2.10); an untrained head gets 1.00. Its tree.json is depth 4, top-k 2, 8 tokens (verify_cost's choice
# for this CPU), so the tree.json floor follows the chosen tree; raise it with a better-trained head.
TAU_FLOORS = {"tree.json": 1.6, "default tree": 2.0}


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(2)
    return eagle_compile.load_default_target(torch.float32)


def _prompts(tokenizer, question_ids=QUESTION_IDS):
    rows = {r["question_id"]: r for r in map(json.loads, DATA.read_text().splitlines())}
    out = []
    for qid in question_ids:
        messages = [{"role": "user", "content": rows[qid]["turns"][0]}]
        out.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                 return_dict=True)["input_ids"])
    return out


def test_shipped_head_is_exact_and_accepted(target):
    model, tokenizer = target
    head = shipped_head()
    assert head is not None, "no trained head ships in eagle_compile/heads/"
    draft = eagle_compile.load_draft(head, target=model, dtype=torch.float32)
    # no tree keys and calibrate off: the tree.json beside the head (chosen for CPU float32), fixed; the default
    # tree named explicitly (a given tree stays fixed)
    trees = {"tree.json": {"numerics": "eager", "calibrate": "off"},
             "default tree": {**EAGLE_TREE, "numerics": "eager"}}
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
    free = model.generate(ids, max_new_tokens=24, do_sample=False)
    text = tokenizer.decode(free[0, ids.shape[1]:])
    stop = text.split()[4]                         # a word the greedy continuation reaches after a few tokens
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=24, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
        out = eagle_compile.generate(model, ids, draft=draft, options={"chain": 3, "numerics": "eager"},
                                     max_new_tokens=24,
                                     stop_strings=[stop], tokenizer=tokenizer)
    assert ref.shape[1] < free.shape[1]            # the stop string did cut the output
    assert torch.equal(out, ref)


def test_batch_invariant_logits_do_not_depend_on_how_a_token_is_computed(target):
    model, _ = target
    program = invariant_program(model)
    # a chunk of 24, the path of an 8-node tree, the last row of a bucket of 4 (the tiny models check more shapes)
    assert invariance_failures(model, program, chunks=(24,), trees=(8,), batches=((4, 3),)) == []
    assert program.contexts[0].counts["batch_invariant"] == 30 * 7 + 1 + 30      # every linear and attention


def _long_prompt(tokenizer, length: int = 600) -> torch.Tensor:
    with (DATA.parents[1] / "long_context" / "leval" / "meeting_summ.jsonl").open() as f:
        text = json.loads(f.readline())["input"]
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :length]
    assert ids.shape[1] == length
    return ids


def test_batch_invariant_speculation_equals_plain_mode(target, monkeypatch):
    """The default numerics on CPU float32 (batch-invariant, the calibration layer on): speculative greedy
    == plain greedy of the same programs, bit for bit, on a 600-token prompt (two prefill chunks). The policy is
    made to run a plain step, a chain of 1 and the 3x3x8 tree in turn (verify N = 1, 2 and 8, and the re-sync after
    plain steps); docs/BENCHMARKS.md has longer runs of the real policy."""
    from tiny import rotate_programs

    rotate_programs(monkeypatch, order=[0, 1, 4])
    model, tokenizer = target
    draft = eagle_compile.load_draft(shipped_head(), target=model, dtype=torch.float32)
    plain = torch.compile(model, backend="eagle31", options={"speculate": False, "prefill_chunk": 512})
    # the 3x3x8 tree is given with calibrate="on" (the menu adapts around it, whatever the head's tree.json):
    # entry 4 is then that tree, and a verify over a tree mask is covered too
    fast = torch.compile(model, backend="eagle31", options={"draft": draft, "prefill_chunk": 512, "calibrate": "on",
                                                            "depth": 3, "top_k": 3, "total_tokens": 8})
    prompts = [_long_prompt(tokenizer)]
    lengths, chosen = [], set()
    with torch.no_grad():
        for ids in prompts:
            ref = plain.generate(ids, max_new_tokens=32, return_dict_in_generate=True)
            out = fast.generate(ids, max_new_tokens=32, return_dict_in_generate=True)
            assert "numerics batch_invariant" in ref.stats.lowering and "numerics batch_invariant" in out.stats.lowering
            assert torch.equal(out.sequences, ref.sequences)
            lengths += out.stats.acceptance_lengths
            chosen |= set(out.stats.calibration["policy"]["chosen"])
    assert max(lengths) > 1                      # drafts were accepted: the comparison covered verify trees
    assert chosen == {"plain", "chain1", "tree3x3x8"}, chosen   # verify N = 1, 2 and 8, and the re-sync


def test_rows_of_a_ragged_batch_decode_as_if_alone(target):
    """Issue 13 item 1 on the real target: a left-padded batch of a ~600-token prompt and two short chat prompts,
    the shipped head with its tree (fixed), default numerics: each row's tokens *and* acceptance lengths equal
    those of the row decoded alone. The rows' lengths differ enough that the prefill runs in groups."""
    model, tokenizer = target
    draft = eagle_compile.load_draft(shipped_head(), target=model, dtype=torch.float32)
    options = {"calibrate": "off"}
    prompts = [_long_prompt(tokenizer), *_prompts(tokenizer, (81, 321))]
    width = max(p.shape[1] for p in prompts)
    pad = tokenizer.pad_token_id or 0
    ids = torch.stack([torch.cat([torch.full((width - p.shape[1],), pad), p[0]]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - p.shape[1], dtype=torch.long),
                                   torch.ones(p.shape[1], dtype=torch.long)]) for p in prompts])
    with torch.no_grad():
        batch = eagle_compile.generate(model, ids, attention_mask=mask, draft=draft, options=options,
                                       max_new_tokens=32, return_dict_in_generate=True)
        alone = [eagle_compile.generate(model, p, draft=draft, options=options, max_new_tokens=32,
                                        return_dict_in_generate=True) for p in prompts]
    assert "numerics batch_invariant" in batch.stats.lowering and batch.stats.prefill_groups > 1
    accepted = 0
    for b, (p, out) in enumerate(zip(prompts, alone, strict=True)):
        new = out.sequences[0, p.shape[1]:]
        assert torch.equal(batch.sequences[b, width:width + len(new)], new), b
        assert batch.stats.row_acceptance[b] == out.stats.row_acceptance[0], b
        accepted += sum(n - 1 for n in out.stats.row_acceptance[0])
    assert accepted >= 5, "drafts must be accepted for the acceptance lengths to say anything"
