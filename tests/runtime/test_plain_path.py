"""The plain path: plain mode (speculation off), chunked prefill of long prompts over the live slots (graph
counts: test_graph_reuse.py), and the tree shape read from tree.json beside a head (TESTING.md 1, 7)."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import ARCHS, ScriptedDrafter, greedy_reference, ragged, random_head, tiny_target

import eagle_compile
from eagle_compile.draft.checkpoint import save_draft
from eagle_compile.options import EagleOptions, OptionsError
from eagle_compile.runtime import decoder
from eagle_compile.runtime.prefill_plan import (
    CHUNK_OVERHEAD_TOKENS,
    CPU_FORWARD_TOKENS,
    largest_chunk,
    prefill_chunk_sizes,
    prefill_plan,
)


def _continuations(ids, mask, ref):
    width = ids.shape[1]
    return [[t for t, m in zip(ids[i].tolist(), mask[i].tolist(), strict=True) if m] + ref[i, width:].tolist()
            for i in range(ids.shape[0])]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("lengths", [[9], [3, 40, 17]])
def test_plain_mode_equals_hf_greedy_without_a_draft(arch, lengths):
    model = tiny_target(arch, seed=11)
    ids, mask = ragged(lengths, seed=4)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=14)
    out = eagle_compile.generate(model, ids, attention_mask=mask, max_new_tokens=14, return_dict_in_generate=True,
                                 options={"speculate": False, "prefill_chunk": 16})
    assert torch.equal(out.sequences, ref)
    stats = out.stats
    assert not stats.speculate and stats.tree == {"speculate": False}
    assert set(stats.acceptance_lengths) == {1} and stats.cycles == 13    # one token a step after the prefill's
    assert stats.draft_time is None


def test_plain_mode_through_compile_ignores_the_draft_and_says_so():
    model = tiny_target("qwen3", seed=2)
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    ref = greedy_reference(model, ids, max_new_tokens=10)
    drafter = ScriptedDrafter([ref[0].tolist()], 96, "oracle")
    compiled = torch.compile(model, backend="eagle31", options={"draft": drafter, "speculate": False})
    out = compiled.generate(ids, max_new_tokens=10, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert max(out.stats.histogram) == 1, "the oracle drafter was not run"


def test_prefill_plan_uses_a_bounded_menu_of_chunk_sizes():
    assert prefill_chunk_sizes(512) == (512, 128, 32)
    assert prefill_chunk_sizes(16) == (16,)
    assert prefill_plan(600, 512) == [(0, 512), (512, 128)]      # two chunks, not 512 + 3 x 32
    assert prefill_plan(5, 512) == [(0, 32)]
    assert prefill_plan(60, 4096) == [(0, 64)]                  # one padded chunk, not four chunks of 16
    assert prefill_plan(1030, 1024) == [(0, 1024), (1024, 16)]   # a few tokens over: a small last chunk
    # padding costs every row, the weight pass once per chunk: a batch pads less
    assert prefill_plan(40, 4096) == [(0, 64)]
    assert prefill_plan(40, 4096, rows=8) == [(0, 16), (16, 16), (32, 16)]
    for largest in (512, 4096):
        sizes = prefill_chunk_sizes(largest)
        for length in range(1, 3 * largest, 37):
            plan = prefill_plan(length, largest)
            assert plan[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(plan, plan[1:], strict=False))
            covered = plan[-1][0] + plan[-1][1]
            assert covered >= length and {size for _, size in plan} <= set(sizes)
            greedy = _greedy_cost(length, sizes)
            assert _cost(plan) <= greedy, f"length {length}: the plan costs more than greedy cutting"


def _cost(plan) -> int:
    return sum(CHUNK_OVERHEAD_TOKENS + size for _, size in plan)


def _greedy_cost(length: int, sizes: tuple[int, ...]) -> int:
    """The old plan, as a negative control: the largest size that fits the rest, padding only the last chunk."""
    cost, start = 0, 0
    while start < length:
        size = next((s for s in sizes if s <= length - start), sizes[-1])
        cost, start = cost + CHUNK_OVERHEAD_TOKENS + size, start + size
    return cost


def test_prefill_plan_beats_greedy_cutting_where_it_should():
    """The negative control can fail: on a 60-token prompt greedy cutting pays four chunks."""
    assert _greedy_cost(60, prefill_chunk_sizes(4096)) > _cost(prefill_plan(60, 4096))


def test_a_prefill_forward_carries_at_most_forward_tokens_over_its_rows():
    assert largest_chunk(4096, 1, 1024) == 1024 and largest_chunk(4096, 8, 1024) == 64
    assert largest_chunk(4096, 64, 1024) == 16 and largest_chunk(4096, 8) == 4096    # the smallest; no cap
    for rows in (1, 2, 8, 64):
        for length in range(1, 5000, 163):
            plan = prefill_plan(length, 4096, rows, forward_tokens=1024)
            sizes = {size for _, size in plan}
            assert sizes <= set(prefill_chunk_sizes(4096)) and plan[-1][0] + plan[-1][1] >= length
            assert all(size * rows <= 1024 for size in sizes) or sizes == {16}, (rows, length, plan)
    assert prefill_plan(6144, 4096, forward_tokens=1024) == [(i * 1024, 1024) for i in range(6)]
    assert prefill_plan(6144, 4096) == [(0, 4096), (4096, 1024), (5120, 1024)]       # without the cap


def test_prefill_tokens_is_1024_on_a_cpu_unless_given():
    assert decoder.forward_tokens(EagleOptions(), torch.device("cpu")) == CPU_FORWARD_TOKENS == 1024
    assert decoder.forward_tokens(EagleOptions(), torch.device("cuda")) is None
    assert decoder.forward_tokens(EagleOptions(prefill_tokens=64), torch.device("cpu")) == 64
    with pytest.raises(OptionsError, match="prefill_tokens=0"):
        EagleOptions(prefill_tokens=0)


def test_a_capped_prefill_uses_smaller_chunks_and_stays_exact(monkeypatch):
    """prefill_tokens=32 on a batch bucket of 4 rows: chunks of 16 instead of 64, the same tokens as HF."""
    plans = []

    def spy(*args, **kwargs):
        plans.append(plan := prefill_plan(*args, **kwargs))
        return plan

    monkeypatch.setattr(decoder, "prefill_plan", spy)
    model = tiny_target("llama", seed=21)
    ids, mask = ragged([50, 47, 44], seed=8)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=8)
    draft = random_head(model, flags=True, seed=3, reduced=True)
    options = {"chain": 2, "prefill_chunk": 64, "prefill_tokens": 32}
    out = eagle_compile.generate(model, ids, attention_mask=mask, draft=draft, options=options, max_new_tokens=8)
    assert torch.equal(out, ref)
    assert plans and all(size == 16 for plan in plans for _, size in plan), plans


@pytest.mark.parametrize("drafter_kind", ["oracle", "random head"])
def test_long_ragged_prompts_span_several_chunks_and_stay_exact(drafter_kind):
    """Rows of very different lengths (several chunks of each size for the longest, one short chunk for the
    shortest), through a speculative decoder: the output equals HF greedy row by row."""
    model = tiny_target("llama", seed=21)
    ids, mask = ragged([5, 203, 71], seed=8)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=12)
    if drafter_kind == "oracle":
        draft = ScriptedDrafter(_continuations(ids, mask, ref), 96, "oracle")
    else:
        draft = random_head(model, flags=True, seed=3, reduced=True)
    options = {"depth": 3, "top_k": 2, "total_tokens": 6, "prefill_chunk": 64}   # chunks of 64 and 16
    out = eagle_compile.generate(model, ids, attention_mask=mask, draft=draft, options=options, max_new_tokens=12,
                                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    if drafter_kind == "oracle":
        assert max(out.stats.histogram) == 4, "the oracle was accepted: the draft's catch-up over the chunks is right"
    for b, row in enumerate(_continuations(ids, mask, ref)):    # and each row alone gives its own output
        alone = torch.tensor([row[:int(mask[b].sum())]])
        single = eagle_compile.generate(model, alone, draft=draft, options=options, max_new_tokens=12)
        assert single[0].tolist() == row


def _head_folder(tmp_path, model, tree: dict | None):
    head = random_head(model, flags=True, seed=5, reduced=False)
    folder = tmp_path / "head"
    save_draft(head, folder)
    if tree is not None:
        (folder / "tree.json").write_text(json.dumps(tree))
    return folder


@pytest.mark.parametrize(("tree", "used"), [
    ({"depth": 2, "top_k": 2, "total_tokens": 5, "chosen_for": {"device": "cpu", "dtype": "float64"}}, True),
    ({"chain": 3, "chosen_for": {"device": "cpu", "dtype": "float64"}}, True),
    ({"depth": 2, "top_k": 2, "total_tokens": 5, "chosen_for": {"device": "cuda", "dtype": "float64"}}, False),
    (None, False),
])
def test_the_heads_tree_is_the_default_when_chosen_for_this_device_and_dtype(tmp_path, tree, used):
    model = tiny_target("llama", seed=6)
    folder = _head_folder(tmp_path, model, tree)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    ref = greedy_reference(model, ids, max_new_tokens=8)
    forms = [str(folder), eagle_compile.load_draft(folder, target=model, dtype=torch.float64)]
    for draft in forms if used else forms[:1]:     # EAGLE's 60-node default tree is slow: the folder form only
        # calibrate off: the tree this picks is the calibration menu's largest program (tested in
        # tests/runtime/test_calibrated_lossless.py); here only which shape it is and where it came from
        out = eagle_compile.generate(model, ids, draft=draft, max_new_tokens=8, return_dict_in_generate=True,
                                     options={"calibrate": "off"})
        assert torch.equal(out.sequences, ref)
        shape = {k: out.stats.tree[k] for k in ("depth", "top_k", "total_tokens")}
        source = out.stats.tree["source"]
        if used and "chain" in tree:
            assert shape == {"depth": 3, "top_k": 1, "total_tokens": 4}
        elif used:
            assert shape == {k: tree[k] for k in shape}
        else:
            assert shape == {"depth": 7, "top_k": 10, "total_tokens": 60}
        assert (str(folder / "tree.json") in source) == (tree is not None), source
        assert source.startswith("EAGLE defaults") != used, source
    explicit = eagle_compile.generate(model, ids, draft=str(folder), options={"chain": 2}, max_new_tokens=8,
                                      return_dict_in_generate=True)
    assert explicit.stats.tree["source"] == "options" and explicit.stats.tree["depth"] == 2
