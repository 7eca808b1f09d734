"""Static shapes: new prompt lengths and new calls reuse the captured graphs (no recapture per prompt)."""

from __future__ import annotations

import torch
from tiny import ScriptedDrafter, greedy_reference, tiny_target

import eagle_compile


def _graphs_after_each_call(lengths, options) -> list[int]:
    """Graphs captured so far after exact generate calls on prompts of `lengths` (one drafter: one decoder)."""
    model = tiny_target("llama", seed=17)
    drafter = ScriptedDrafter([], 96, "oracle")
    captured = []
    for length in lengths:
        ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(length))
        ref = greedy_reference(model, ids, max_new_tokens=6)
        drafter.continuations = [ref[0].tolist()]
        out = eagle_compile.generate(model, ids, draft=drafter, options=options, max_new_tokens=6,
                                     return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        captured.append(out.stats.graphs_captured)
    return captured


def test_prompts_of_new_lengths_reuse_the_captured_graphs():
    options = {"depth": 3, "top_k": 2, "total_tokens": 5, "prefill_chunk": 8}
    # one prefill-chunk graph + one verify graph, captured by the first call and reused by every later one
    assert _graphs_after_each_call((5, 20, 13, 31), options) == [2, 2, 2, 2]


def test_graphs_stay_bounded_over_many_prompt_lengths():
    options = {"depth": 2, "top_k": 2, "total_tokens": 4, "prefill_chunk": 64, "max_cache_len": 256}
    captured = _graphs_after_each_call((3, 150, 17, 64, 65, 130, 9, 200, 47), options)
    # prefill graphs: one per chunk size (64, 16), each with `keep` (the lm_head at the last prompt position);
    # one verify graph: 3 graphs in all, whatever the lengths
    assert captured[0] == 2 and captured[1:] == [3] * 8
