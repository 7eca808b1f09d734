"""Prefill in groups of rows of neighbouring lengths (`prefill_plan.prefill_groups`): a ragged batch no longer pads
every row to the longest prompt, and each row's tokens and acceptance lengths stay those of the one-block
prefill (and HF greedy of the row alone). Grouping is proven to happen (`stats.prefill_groups`); the control runs
the same batch with grouping off."""

from __future__ import annotations

import random

import pytest
import torch
from test_nan_logits import poisoned
from tiny import continuations, greedy_reference, ragged, random_head, rotate_programs, tiny_target

import eagle_compile
import eagle_compile.runtime.decoder as decoder_module
from eagle_compile.runtime.prefill_plan import GROUP_OVERHEAD_TOKENS, prefill_cost, prefill_groups, prefill_plan

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
LENGTHS = [70, 6, 9, 64, 5, 40, 3, 12]          # two long rows, one middle, five short: grouping pays
MAX_NEW = 10


def bucket(rows: int) -> int:
    return next(b for b in BUCKETS if b >= rows)


# -- the plan ---------------------------------------------------------------------------------------------------
def test_groups_partition_the_rows_and_cost_no_more_than_one_block():
    rng = random.Random(0)
    for trial in range(200):
        rows = rng.randint(1, 40)
        lengths = [rng.randint(1, rng.choice([20, 300, 1500])) for _ in range(rows)]
        largest = rng.choice([64, 512])
        groups = prefill_groups(lengths, largest, bucket)
        assert sorted(b for g in groups for b in g) == list(range(rows)), trial
        assert all(g == sorted(g) and g for g in groups)
        whole = prefill_cost(max(lengths), largest, bucket(rows))
        split = sum(prefill_cost(max(lengths[b] for b in g), largest, bucket(len(g))) + GROUP_OVERHEAD_TOKENS
                    for g in groups)
        assert len(groups) == 1 or split < whole, (lengths, groups)


def test_similar_lengths_stay_one_block_and_spread_lengths_split_longest_first():
    assert prefill_groups([100, 90, 110, 95], 512, bucket) == [[0, 1, 2, 3]]
    assert prefill_groups([7], 512, bucket) == [[0]]
    groups = prefill_groups([400, 20, 30, 380, 25, 390, 22, 18], 512, bucket)
    assert groups[-1] == [1, 2, 4, 6, 7]                   # the short rows together, after the long ones
    assert sorted(b for g in groups[:-1] for b in g) == [0, 3, 5]
    # three long rows in a bucket of 4 would pay a padding row: two groups of 2 and 1 cost less
    assert groups[:-1] == [[0, 5], [3]]
    assert (prefill_cost(400, 512, 4) + GROUP_OVERHEAD_TOKENS
            > prefill_cost(400, 512, 2) + prefill_cost(380, 512, 1) + 2 * GROUP_OVERHEAD_TOKENS)


def test_no_group_covers_past_the_span_limit():
    lengths = [40, 3, 4, 2, 5, 3, 2, 4]
    free = prefill_groups(lengths, 4096, bucket)
    assert len(free) > 1                                   # the long row alone would take one chunk of 64
    whole_span = sum(size for _, size in prefill_plan(40, 4096, rows=8))
    spans = [sum(size for _, size in prefill_plan(max(lengths[b] for b in g), 4096, rows=bucket(len(g))))
             for g in free]
    assert max(spans) > whole_span                         # without the limit a group covers past it
    limited = prefill_groups(lengths, 4096, bucket, span_limit=whole_span)
    for g in limited:
        plan = prefill_plan(max(lengths[b] for b in g), 4096, rows=bucket(len(g)))
        assert len(limited) == 1 or plan[-1][0] + plan[-1][1] <= whole_span


# -- decoding ---------------------------------------------------------------------------------------------------
def _one_block(monkeypatch) -> None:
    monkeypatch.setattr(decoder_module, "prefill_groups", lambda lengths, *a, **k: [list(range(len(lengths)))])


def _generate(model, ids, mask, options, **kwargs):
    return eagle_compile.generate(model, ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                  return_dict_in_generate=True, options={"prefill_chunk": 16, **options}, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["plain", "calibrated"])
def test_grouped_prefill_keeps_every_row_exact(arch, mode, monkeypatch):
    model = tiny_target(arch, seed=7)
    ids, mask = ragged(LENGTHS, seed=3)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    options = {"speculate": False} if mode == "plain" else {
        "draft": random_head(model, flags=True, seed=1, reduced=True), "depth": 3, "top_k": 2, "total_tokens": 6,
        "calibrate": "on", "calibration_cache": "memory"}
    if mode == "calibrated":
        rotate_programs(monkeypatch, [0, 4])
    grouped = _generate(model, ids, mask, options)
    assert grouped.stats.prefill_groups > 1                        # the stress happened
    assert continuations(ids, mask, grouped.sequences) == continuations(ids, mask, ref)
    _one_block(monkeypatch)
    block = _generate(model, ids, mask, options)
    assert block.stats.prefill_groups == 1                          # the control ran one block
    assert torch.equal(grouped.sequences, block.sequences)
    assert grouped.stats.row_acceptance == block.stats.row_acceptance
    assert grouped.stats.acceptance_lengths == block.stats.acceptance_lengths


def test_a_poisoned_prompt_in_one_group_ends_only_its_row():
    model = tiny_target("llama", seed=5)
    ids, mask = ragged(LENGTHS, seed=2)
    row, others = 3, [b for b in range(len(LENGTHS)) if b != 3]        # a long row, in a group of its own
    clean = _generate(model, ids, mask, {"speculate": False})
    x = max(set(range(96)) - set(clean.sequences.flatten().tolist()))   # no row reads it, clean
    bad = ids.clone()
    bad[row, -2] = x
    with poisoned(model, x):
        out = _generate(model, bad, mask, {"speculate": False})
    assert out.stats.prefill_groups > 1
    assert list(out.stats.errors) == [row] and "in the prefill" in out.stats.errors[row]
    new, ref = out.sequences[:, ids.shape[1]:], clean.sequences[:, ids.shape[1]:]
    assert torch.equal(new[others], ref[others])
    assert out.attention_mask[row, ids.shape[1]:].sum() == 0


def test_greedy_rows_beside_sampled_rows_stay_exact_in_groups():
    from eagle_compile.options import parse_options
    from eagle_compile.runtime.generate import decoder_for
    from eagle_compile.runtime.sampling import SamplingParams
    from eagle_compile.runtime.stopping import StopChecker

    model = tiny_target("llama", seed=9)
    ids, mask = ragged(LENGTHS, seed=4)
    ref = continuations(ids, mask, greedy_reference(model, ids, attention_mask=mask, max_new_tokens=MAX_NEW))
    prompts = [ids[b][mask[b].bool()] for b in range(len(LENGTHS))]
    sampled = SamplingParams(do_sample=True, temperature=1.3, top_k=8)
    settings = [sampled if b % 2 else SamplingParams() for b in range(len(LENGTHS))]
    decoder = decoder_for(model, None, parse_options({"speculate": False, "prefill_chunk": 16}))
    stopper = StopChecker(prompts, max_new_tokens=MAX_NEW, eos_token_ids=())
    session = decoder.session(prompts, stopper, settings, torch.Generator().manual_seed(0))
    while session.running:
        session.cycle()
    stats = session.finish()
    assert stats.prefill_groups > 1
    for b in range(0, len(LENGTHS), 2):
        assert prompts[b].tolist() + stopper.generated[b] == ref[b]
    assert all(len(stopper.generated[b]) == MAX_NEW for b in range(1, len(LENGTHS), 2))


def test_a_batch_short_of_its_bucket_groups_its_padding_rows_too():
    """5 rows in a bucket of 8: the session's 3 padding rows (no stop-checker row) fall in the last group."""
    model = tiny_target("mistral", seed=2)
    ids, mask = ragged([66, 4, 58, 7, 5], seed=6)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    out = _generate(model, ids, mask, {"speculate": False})
    assert out.stats.prefill_groups > 1
    assert torch.equal(out.sequences, ref)
