"""Lossless greedy with real (random-weight) EAGLE-3 / EAGLE 3.1 heads through the captured target program:
4 architectures x a tree and a chain (llama also a wide tree), on a ragged batch of 3 (llama also batch 1) (TESTING.md
invariant 1)."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, greedy_reference, ragged_batch, random_head, tiny_target

import eagle_compile

SHAPES = {
    "tree": {"depth": 4, "top_k": 3, "total_tokens": 12},
    "wide": {"depth": 2, "top_k": 5, "total_tokens": 16},
    "chain": {"chain": 3},
}


CASES = [(arch, shape) for shape in SHAPES for arch in ARCHS if shape != "wide" or arch == "llama"]


@pytest.mark.parametrize(("arch", "shape"), CASES)
def test_speculative_greedy_equals_generate(arch, shape):
    target = tiny_target(arch, seed=11)
    head = random_head(target, flags=shape != "wide", seed=3, reduced=shape == "tree")
    options = {**SHAPES[shape], "prefill_chunk": 8}
    for rows in (1, 3) if arch == "llama" else (3,):            # the ragged batch of 3 covers a row of 7
        ids, mask = ragged_batch(rows, seed=rows)
        ref = greedy_reference(target, ids, attention_mask=mask, max_new_tokens=14)
        out = eagle_compile.generate(target, ids, attention_mask=mask, draft=head, options=options,
                                     max_new_tokens=14, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), (arch, shape, rows)
        assert out.stats.cycles > 0 and out.stats.new_tokens == rows * 14
        assert out.stats.draft_time > 0 and out.stats.verify_time > 0
