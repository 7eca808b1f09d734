"""The draft vocabulary: ``d2t`` offsets and the ``t2d`` membership mask (EAGLE31_SPEC.md §1.4).

* ``d2t``: int64 ``[Vd]``, **offsets**: draft id ``j`` is target id ``j + d2t[j]``.
* ``t2d``: bool ``[V]``, True exactly for the target ids that are in the draft vocabulary.

A wrong mapping does not crash anything: it silently proposes wrong tokens and acceptance collapses. So
every checkpoint's mapping is checked here, and refused with what is wrong, the value seen and the fix.
"""

from __future__ import annotations

import torch

from eagle_compile.errors import CheckpointError

_SHOW = 5  # how many offending entries an error message lists


def identity_vocab_mapping(vocab_size: int, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t = 0``, ``t2d`` True for the first ``draft_vocab_size`` ids: draft id j is target id j."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[:draft_vocab_size] = True
    return torch.zeros(draft_vocab_size, dtype=torch.int64), t2d


def validate_vocab_mapping(
    d2t: torch.Tensor | None,  # [Vd] int64 offsets
    t2d: torch.Tensor | None,  # [V] bool
    vocab_size: int,
    draft_vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a checkpoint's mapping and return ``(d2t, t2d)``.

    No ``d2t`` is only allowed for a full vocabulary (``Vd == V``: identity). A missing ``t2d`` is derived
    from ``d2t`` (engines only use ``d2t`` at inference).
    """
    if draft_vocab_size > vocab_size:
        raise CheckpointError(
            f"draft_vocab_size {draft_vocab_size} exceeds the target vocab_size {vocab_size}; the draft "
            "vocabulary must be a subset of the target's. Check both values in config.json."
        )
    if d2t is None:
        if draft_vocab_size < vocab_size:
            raise CheckpointError(
                f"the checkpoint has no d2t but its draft vocabulary is reduced (draft_vocab_size "
                f"{draft_vocab_size} < vocab_size {vocab_size}): draft ids cannot be mapped to target ids. "
                "Add the d2t tensor (offsets, int64 [draft_vocab_size]) the trainer produced."
            )
        if t2d is not None and not bool(t2d.all()):
            raise CheckpointError(
                f"the checkpoint has no d2t (identity mapping) but t2d marks only {int(t2d.sum())} of "
                f"{vocab_size} target ids; add d2t or drop t2d"
            )
        return identity_vocab_mapping(vocab_size, draft_vocab_size)

    if d2t.dtype != torch.int64:
        raise CheckpointError(
            f"d2t has dtype {d2t.dtype}; it must be int64 offsets (target id = j + d2t[j]). "
            "Convert with d2t.long() if the values are offsets."
        )
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise CheckpointError(
            f"d2t has shape {list(d2t.shape)}, expected [{draft_vocab_size}] (one offset per draft id, "
            "draft_vocab_size in config.json)"
        )
    targets = torch.arange(draft_vocab_size, device=d2t.device) + d2t
    negative = (targets < 0).nonzero().flatten()
    if negative.numel():
        js = negative[:_SHOW].tolist()
        raise CheckpointError(
            f"d2t maps {negative.numel()} draft ids to negative target ids (j + d2t[j] < 0), e.g. draft ids "
            f"{js} with d2t {d2t[js].tolist()}. d2t holds offsets, not target ids; a sign error is likely "
            "(the trainer writes d2t[j] = used[j] - j)."
        )
    too_big = (targets >= vocab_size).nonzero().flatten()
    if too_big.numel():
        js = too_big[:_SHOW].tolist()
        raise CheckpointError(
            f"d2t maps {too_big.numel()} draft ids to target ids >= vocab_size {vocab_size} (out of range), "
            f"e.g. draft ids {js} -> target ids {targets[js].tolist()}. The head belongs to a target with "
            "another vocabulary, or d2t holds absolute ids instead of offsets."
        )
    counts = torch.bincount(targets, minlength=vocab_size)
    dup = (counts > 1).nonzero().flatten()
    if dup.numel():
        raise CheckpointError(
            f"d2t maps several draft ids to the same target ids (duplicate targets), e.g. target ids "
            f"{dup[:_SHOW].tolist()}; each draft id must name a distinct target id. The mapping is corrupt."
        )
    expected = counts > 0  # [V] bool: the target ids d2t reaches
    if t2d is None:
        return d2t, expected
    if t2d.dtype != torch.bool:
        raise CheckpointError(f"t2d has dtype {t2d.dtype}; it must be a bool mask over the target vocabulary")
    if tuple(t2d.shape) != (vocab_size,):
        raise CheckpointError(
            f"t2d has shape {list(t2d.shape)}, expected [{vocab_size}] (one flag per target id, vocab_size)"
        )
    marked = int(t2d.sum())
    if marked != draft_vocab_size:
        raise CheckpointError(
            f"t2d count mismatch: t2d marks {marked} target ids but draft_vocab_size is {draft_vocab_size}; "
            "t2d must mark exactly the draft vocabulary"
        )
    wrong = (t2d != expected.to(t2d.device)).nonzero().flatten()
    if wrong.numel():
        raise CheckpointError(
            f"t2d does not match d2t at {wrong.numel()} target ids, e.g. {wrong[:_SHOW].tolist()}: t2d must "
            "be True exactly for the target ids j + d2t[j]. Rebuild t2d from d2t."
        )
    return d2t, t2d


def build_vocab_mapping(
    token_counts: torch.Tensor,  # [V] counts of each target id among the loss-masked training tokens
    draft_vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft vocabulary of the ``draft_vocab_size`` most frequent target ids (§1.4).

    Ties are broken by the lower id; the chosen ids are sorted ascending into ``used``, so
    ``d2t[i] = used[i] - i`` is non-decreasing and ``t2d[v] = v in used``. ``token_counts`` is ``[V]``.
    """
    if token_counts.dim() != 1:
        raise ValueError(f"token_counts must be 1-D [vocab_size], got shape {list(token_counts.shape)}")
    vocab_size = token_counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be in [1, {vocab_size}], got {draft_vocab_size}")
    # stable sort on descending counts keeps lower ids first among equal counts
    order = torch.sort(token_counts.cpu(), descending=True, stable=True).indices
    used = order[:draft_vocab_size].sort().values.to(torch.int64)
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d
