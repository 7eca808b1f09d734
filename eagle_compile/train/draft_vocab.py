"""Choosing the draft vocabulary from the training data (EAGLE31_SPEC.md §1.4).

The draft vocabulary is the ``draft_vocab_size`` target ids that occur most often among the loss-masked
(assistant) tokens of the training conversations; `eagle_compile.draft.vocab.build_vocab_mapping` turns the
counts into ``d2t`` (offsets, draft id j -> target id j + d2t[j]) and ``t2d`` (membership over the target
vocabulary). Prompt tokens are not counted: the draft only ever proposes reply tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from eagle_compile.draft.vocab import build_vocab_mapping
from eagle_compile.train.data import Sample


def count_reply_tokens(samples: Iterable[Sample], vocab_size: int) -> torch.Tensor:
    """``[V]`` int64: how often each target id occurs where ``loss_mask`` is True."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        ids = s.input_ids[s.loss_mask]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(
                f"sample {s.id} holds token id {int(ids.max())} >= vocab_size {vocab_size}: the tokenizer "
                "does not belong to this target"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_draft_vocab(samples: Iterable[Sample], vocab_size: int,
                       draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d2t [Vd] int64, t2d [V] bool, counts [V] int64)`` of the most frequent reply tokens."""
    counts = count_reply_tokens(samples, vocab_size)
    d2t, t2d = build_vocab_mapping(counts, draft_vocab_size)
    return d2t, t2d, counts


def vocab_coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of the counted reply tokens that the draft vocabulary can propose."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0
