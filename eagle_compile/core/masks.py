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


def block_width(tokens: int, local: torch.Tensor | None) -> int:
    """W: how many slots from `base` the block spans (T for a causal block)."""
    return tokens if local is None else local.shape[-1]


def visible_slots(base: torch.Tensor, local: torch.Tensor | None, tokens: int, slots: int) -> torch.Tensor:
    """[B, T, S] bool: which cache slot each query sees (the definition of the module docstring).

    Args:
        base: [B] int64 first block slot per row. local: [B, T, W] bool or None (causal block of `tokens`).
    """
    s = torch.arange(slots, device=base.device)
    j = s[None, :] - base[:, None]                                          # [B, S]: offset into the block
    width = block_width(tokens, local)
    in_block = (j >= 0) & (j < width)
    if local is None:
        block = j[:, None, :] <= torch.arange(tokens, device=base.device)[None, :, None]       # [B, T, S]
    else:
        index = j.clamp(0, width - 1)[:, None, :].expand(-1, tokens, -1)
        block = local.gather(2, index)
    return (j < 0)[:, None, :] | (in_block[:, None, :] & block)
