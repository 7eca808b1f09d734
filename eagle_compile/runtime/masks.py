"""Which cache slots the queries of one forward see: `SlotMask` (docs/INTERNALS.md "KV caches").

Rows are independent and slot == position. Every forward over a static cache — a prefill chunk, a one-token
step, a verify tree, a draft tree level, the draft's catch-up — writes a block of T new tokens into the slots
that start at `base[b]`, and its queries see the committed prefix (slots < base) plus block slots chosen by a
small `local [B, T, W]` mask (tree ancestors and self), or causally (`local=None`). That description, not a
dense `[B, 1, T, S]` mask, is what crosses the runtime: the attention op reads only the live slots
(`eagle_compile/kernels/tree_attention.py`), and the dense mask exists only inside a captured program, for
the HF model, until the `tree_attention` pass removes it.

Padded queries (a chunk's tail, inactive rows) keep whatever the description gives them: every query sees at
least its own slot or the prefix, so no query row is fully masked; their outputs are never used and their
writes go to the sentinel slot, which no query ever sees (slot S - 1, beyond every block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_compile.kernels.tree_attention import visible_slots


@dataclass(frozen=True)
class SlotMask:
    """Query i of row b sees slots `< base[b]` and slot `base[b] + j` when `local[b, i, j]` (None: j <= i)."""

    base: torch.Tensor            # [B] int64: first slot of the block
    local: torch.Tensor | None    # [B, T, W] bool over the block's slots, or None (causal block)
    slots: int                    # S of the cache the mask is for

    @classmethod
    def causal(cls, base: torch.Tensor, slots: int) -> SlotMask:
        """A causal block (prefill chunk, one-token step, catch-up) starting at `base` [B]."""
        return cls(base.to(torch.int64), None, slots)

    @classmethod
    def tree(cls, ancestors: torch.Tensor, base: torch.Tensor, slots: int) -> SlotMask:
        """Tree queries: `ancestors [B, Q, W]` bool over the W block slots that start at `base` [B]."""
        return cls(base.to(torch.int64), ancestors, slots)

    def dense(self, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """The same visibility as an additive `[B, 1, T, S]` mask (0 = attend, -inf = blocked)."""
        return torch.ops.eagle31.slot_mask(self.base, self.local, tokens, self.slots, dtype)

    def visible(self, tokens: int) -> torch.Tensor:
        """[B, T, S] bool."""
        return visible_slots(self.base, self.local, tokens, self.slots)
