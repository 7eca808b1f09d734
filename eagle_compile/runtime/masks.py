"""Additive attention masks over static caches (0 = attend, -inf = blocked), `[B, 1, T, S]`.

Rows are independent and slot == position. A padded query (a chunk's tail, a row past its accepted length)
attends to slot 0 only, which every row fills in its first prefill chunk, so no query row is ever fully masked
(SDPA would return 0 and eager attention NaN, COMPILE_FACTS.md §3); its own writes go to the sentinel slot.
"""

from __future__ import annotations

import torch


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (True = attend) -> float mask: 0 where visible, -inf elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, torch.tensor(float("-inf"), dtype=dtype, device=visible.device))


def causal_mask(positions: torch.Tensor, real: torch.Tensor, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """Query at position p sees slots 0..p; padded queries see slot 0.

    Args:
        positions: [B, T] position (= slot) of each query. real: [B, T] bool, False for padding.
    """
    s = torch.arange(slots, device=positions.device)
    visible = s[None, None, :] <= positions[:, :, None]                      # [B, T, S]
    visible = torch.where(real[:, :, None], visible, s[None, None, :] == 0)
    return additive_mask(visible[:, None], dtype)


def tree_mask(ancestors: torch.Tensor, base: torch.Tensor, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """Tree attention: query i sees the committed prefix (slots < base) and tree slots base + j where
    `ancestors[b, i, j]` (its ancestors and itself). Used for target verification (queries = tree nodes) and
    for draft tree levels (queries = frontier nodes, columns = tree slots of the expanded levels).

    Args:
        ancestors: [B, Q, T] bool over the T tree slots that start at `base`.
        base: [B] first tree slot of each row.
    """
    B, Q, T = ancestors.shape
    s = torch.arange(slots, device=base.device)
    visible = (s[None, :] < base[:, None])[:, None, :].expand(B, Q, slots).clone()
    cols = (base[:, None] + torch.arange(T, device=base.device))[:, None, :].expand(B, Q, T)
    visible.scatter_(2, cols, ancestors)
    return additive_mask(visible[:, None], dtype)
