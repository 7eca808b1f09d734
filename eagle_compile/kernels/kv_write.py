"""`eagle31::kv_write`: write new K/V into a static slot cache at explicit per-row slots, in place.

`SlotKVCache` (the target's) and the draft head's cache both write through this op. As an opaque op that
mutates its cache arguments it keeps the write in place through every lowering: traced as `scatter_` on a
graph input, inductor's functionalization would copy each layer's whole cache buffer every step to apply the
mutation (measured: 60 copies of the full cache per SmolLM2 step). Padded tokens write the sentinel slot.

There is no Triton kernel: a scatter of a few rows is bandwidth-trivial and torch's runs on every device.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


def _check(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor) -> None:
    if keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"kv_write: expected keys and values [B, Hkv, S, hd], got {tuple(keys.shape)} and "
                         f"{tuple(values.shape)}")
    b, h, _, hd = keys.shape
    if slots.dim() != 2 or slots.shape[0] != b or slots.dtype != torch.int64:
        raise ValueError(f"kv_write: slots must be [B, T] = [{b}, T] int64, got {tuple(slots.shape)} {slots.dtype}")
    want = (b, h, slots.shape[1], hd)
    if tuple(k.shape) != want or v.shape != k.shape:
        raise ValueError(f"kv_write: new keys/values must be [B, Hkv, T, hd] = {list(want)}, got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")


def kv_write_reference(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> None:
    """keys[b, :, slots[b, t]] = k[b, :, t] (and values), in place.

    Args:
        keys, values: [B, Hkv, S, hd] cache buffers. slots: [B, T] int64. k, v: [B, Hkv, T, hd].
    """
    index = slots[:, None, :, None].expand_as(k)
    keys.scatter_(2, index, k.to(keys.dtype))
    values.scatter_(2, index, v.to(values.dtype))


kv_write = torch.library.custom_op("eagle31::kv_write", kv_write_reference, mutates_args=("keys", "values"))


@kv_write.register_fake
def _(keys, values, slots, k, v):
    _check(keys, values, slots, k, v)


def write(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """`eagle31::kv_write` where code is traced (dynamo, export, any dispatch mode: the opaque in-place op that
    every lowering keeps), its Python body where code runs eagerly: the custom op's own dispatch (its mutation
    bookkeeping and Python wrappers) is most of a call's cost (torch.profiler on a draft level, not a committed
    benchmark: ~100 us against ~5 us a scatter), and the draft head writes its cache once per draft level; the
    committed figure for the level is verify_cost.py's (docs/BENCHMARKS.md). Autograd through the write also
    keeps the op (as before)."""
    traced = torch.compiler.is_compiling() or torch.jit.is_tracing() or _get_current_dispatch_mode() is not None
    if traced or (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)):
        torch.ops.eagle31.kv_write(keys, values, slots, k, v)
    else:
        kv_write_reference(keys, values, slots, k, v)
