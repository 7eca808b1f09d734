"""KV compaction of the accepted path: the reference of `eagle31::kv_compact` and of `SlotKVCache.compact`.

After verification the accepted path's K/V sit at scattered tree slots base + path[j]; they move to the slots
base + j of the committed prefix (EAGLE31_SPEC.md §4.4), every other tree slot of the cycle is dead.
"""

from __future__ import annotations

import torch


def compact_layer(keys: torch.Tensor, values: torch.Tensor, base: torch.Tensor, path: torch.Tensor) -> None:
    """One layer of `SlotKVCache.compact` (the reference of `eagle31::kv_compact`, which the accept_subgraph
    pass substitutes for it in a step program).

    Args:
        keys, values: [B, Hkv, S, hd] cache buffers, updated in place.
        base: [B]; path: [B, P] (see `SlotKVCache.compact`).
    """
    src = (base[:, None] + path)[:, None, :, None]                                        # [B, 1, P, 1]
    dst = (base[:, None] + torch.arange(path.shape[1], device=path.device))[:, None, :, None]
    for buf in (keys, values):
        idx = src.expand(-1, buf.shape[1], -1, buf.shape[3])
        moved = buf.gather(2, idx)
        buf.scatter_(2, dst.expand_as(idx), moved)
