"""A static KV cache whose writes go to explicit per-row slots.

HF's StaticCache writes every row at one shared `cumulative_length`; speculative decoding needs rows that
advance by different amounts each cycle and tree tokens that land in temporary slots before the accepted path
is compacted. `SlotKVCache` keeps the HF `Cache` interface (so the unmodified HF model runs on it and dynamo
captures it as an in-place write to static buffers) but each layer's `update` writes the new K/V to
`write_slots [B, T]`, passed through the model's forward kwargs, with `eagle31::kv_write` (in place through
every lowering), and returns the whole buffer; the mask (`core/masks.py`) decides what each query sees and
the attention op reads only the live slots. Slot == RoPE position of the token in its row; slot `S - 1` is the
sentinel.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer

import eagle_compile.kernels.kv_write  # noqa: F401  (registers torch.ops.eagle31.kv_write)
from eagle_compile.core.compaction import compact_layer


class SlotLayer(StaticLayer):
    """One layer of `SlotKVCache`: buffers `[B, Hkv, S, hd]`, allocated up front at a static address."""

    def __init__(self, batch: int, kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(max_cache_len=slots)
        self.keys = torch.zeros(batch, kv_heads, slots, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.device, self.batch_size, self.num_heads = device, batch, kv_heads
        self.k_head_dim = self.v_head_dim = head_dim
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        torch.ops.eagle31.kv_write(self.keys, self.values, _write_slots(kwargs), key_states, value_states)
        return self.keys, self.values


def _write_slots(kwargs: dict) -> torch.Tensor:
    inner = kwargs.get("kwargs") or {}
    slots = inner.get("write_slots", kwargs.get("write_slots"))
    if slots is None:
        raise ValueError("SlotKVCache.update needs write_slots=[B, T] passed through the model's forward kwargs")
    return slots


class SlotKVCache(Cache):
    """Per-row-slot static KV cache for an HF decoder-only model."""

    def __init__(self, config, batch: int, slots: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        device = torch.device(device)
        layers = [SlotLayer(batch, kv_heads, slots, head_dim, dtype, device)
                  for _ in range(text_config.num_hidden_layers)]
        super().__init__(layers=layers)
        self.batch, self.slots = batch, slots

    @property
    def sentinel(self) -> int:
        return self.slots - 1

    def compact(self, base: torch.Tensor, path: torch.Tensor) -> None:
        """Move the accepted path's K/V into place: slot base+j <- slot base+path[j] (gather, then write).

        Args:
            base: [B] first tree slot of each row (the root's slot).
            path: [B, P] node offsets, non-decreasing, path[:, j] >= j.
        """
        for layer in self.layers:
            compact_layer(layer.keys, layer.values, base, path)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError("SlotKVCache has per-row lengths; pass position_ids and a 4-D mask explicitly")
