"""Draft vocabulary from reply-token frequencies: only loss-masked tokens count; d2t offsets and t2d agree."""

from __future__ import annotations

import torch

from eagle_compile.draft.vocab import validate_vocab_mapping
from eagle_compile.train.data import Sample
from eagle_compile.train.draft_vocab import count_reply_tokens, select_draft_vocab, vocab_coverage


def _sample(ids, mask):
    return Sample("x", torch.tensor(ids), torch.tensor(mask, dtype=torch.bool))


def test_counts_only_reply_tokens_and_builds_offsets():
    # prompt tokens 9 (many times) must not count; reply tokens: 7 x3, 3 x2, 5 x1, 2 x1
    samples = [_sample([9, 9, 9, 9, 7, 3, 7], [0, 0, 0, 0, 1, 1, 1]),
               _sample([9, 9, 5, 3, 7, 2], [0, 0, 1, 1, 1, 1])]
    counts = count_reply_tokens(samples, 10)
    assert counts.tolist() == [0, 0, 1, 2, 0, 1, 0, 3, 0, 0]
    d2t, t2d, _ = select_draft_vocab(samples, 10, 3)
    # top 3: 7 (3), 3 (2), then 2 and 5 tie at 1 -> the lower id 2; sorted ascending: used = [2, 3, 7]
    assert t2d.nonzero().flatten().tolist() == [2, 3, 7]
    assert d2t.tolist() == [2 - 0, 3 - 1, 7 - 2]
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 7]       # draft id j -> target id j + d2t[j]
    assert torch.all(d2t[1:] >= d2t[:-1])                        # non-decreasing (§1.4)
    validate_vocab_mapping(d2t, t2d, 10, 3)                      # the loader accepts it
    assert abs(vocab_coverage(counts, t2d) - 6 / 7) < 1e-12


def test_full_vocabulary_is_identity():
    d2t, t2d, _ = select_draft_vocab([_sample([1, 2], [1, 1])], 6, 6)
    assert d2t.tolist() == [0] * 6 and t2d.all()
