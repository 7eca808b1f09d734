"""Static shapes: new prompt lengths and new calls reuse the captured graphs (no recapture per prompt)."""

from __future__ import annotations

import torch
from tiny import ScriptedDrafter, greedy_reference, tiny_target

import eagle_compile


def test_prompts_of_new_lengths_reuse_the_captured_graphs():
    model = tiny_target("llama", seed=17)
    options = {"depth": 3, "top_k": 2, "total_tokens": 5, "prefill_chunk": 8}
    captured = []
    drafter = ScriptedDrafter([], 96, "oracle")     # one drafter: one decoder, reused by every call
    for length in (5, 20, 13, 31):
        ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(length))
        ref = greedy_reference(model, ids, max_new_tokens=6)
        drafter.continuations = [ref[0].tolist()]
        out = eagle_compile.generate(model, ids, draft=drafter, options=options, max_new_tokens=6,
                                     return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        captured.append(out.stats.graphs_captured)
    # one prefill-chunk graph + one verify graph, captured by the first call and reused by every later one
    assert captured == [2, 2, 2, 2]
