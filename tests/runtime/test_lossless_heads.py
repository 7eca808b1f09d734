"""Lossless greedy with real (random-weight) EAGLE-3 / EAGLE 3.1 heads through the captured target program:
4 architectures x 3 tree shapes (one a chain) x batch 1 and a ragged batch of 3 (TESTING.md invariant 1)."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, greedy_reference, tiny_target

import eagle_compile
from eagle_compile.draft.config import DraftConfig
from eagle_compile.draft.model import EagleDraftModel
from eagle_compile.draft.vocab import build_vocab_mapping

SHAPES = {
    "tree": {"depth": 4, "top_k": 3, "total_tokens": 12},
    "wide": {"depth": 2, "top_k": 5, "total_tokens": 16},
    "chain": {"chain": 3},
}


def _head(target, *, flags: bool, seed: int, reduced: bool) -> EagleDraftModel:
    vocab = target.config.vocab_size
    cfg = DraftConfig.for_target(target.config, 48 if reduced else vocab,
                                 **({"fc_norm": True, "norm_output": True} if flags else {}))
    torch.manual_seed(seed)
    head = EagleDraftModel(cfg).to(torch.float64).eval()
    if reduced:
        counts = torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(seed))
        d2t, t2d = build_vocab_mapping(counts, 48)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    head.tie_target_embedding(target)
    return head


def _batch(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = [7] if rows == 1 else [3, 12, 7]
    width = max(lengths)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, 96, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_speculative_greedy_equals_generate(arch, shape):
    target = tiny_target(arch, seed=11)
    head = _head(target, flags=shape != "wide", seed=3, reduced=shape == "tree")
    options = {**SHAPES[shape], "prefill_chunk": 8}
    for rows in (1, 3):
        ids, mask = _batch(rows, seed=rows)
        ref = greedy_reference(target, ids, attention_mask=mask, max_new_tokens=14)
        out = eagle_compile.generate(target, ids, attention_mask=mask, draft=head, options=options,
                                     max_new_tokens=14, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), (arch, shape, rows)
        assert out.stats.cycles > 0 and out.stats.new_tokens == rows * 14
