"""ONNX translations of the eagle31 custom ops that the exported programs contain (COMPILE_FACTS.md §6d).

`torch.onnx.export(..., dynamo=True)` cannot translate `torch.ops.eagle31.*` by itself (a `ConversionError`);
it takes these through `custom_translation_table` (`TRANSLATIONS`). Each is a plain Python function over
onnxscript's opset 18 that the exporter traces: its inputs are the ONNX values of the op's tensor arguments
(SymInt arguments arrive as 0-d INT64 values, a torch dtype as an `ir.DataType`), and it computes what the op's
torch reference computes (`core/masks.visible_slots`, `kernels/tree_attention.tree_attention_reference`) over
every slot of the cache: ONNX has no "read only the live slots", so the visibility mask does that work.

* `eagle31::slot_mask` (the target program: the dense additive mask HF models take);
* `eagle31::tree_attention` (the draft program: attention of a block of queries over the slot cache, GQA).

Both need the block description `local [B, T, W]`: the exported programs always take one (a causal block is
passed as its lower-triangular `local`), so the `local=None` form never reaches a translation.
"""

from __future__ import annotations

import torch
from onnxscript import ir
from onnxscript import opset18 as op

import eagle_compile.kernels  # noqa: F401  (registers torch.ops.eagle31.*)


def _scalar(value):
    """A Python int or a SymInt's ONNX value -> a 0-d INT64 value (what Range and Expand shapes need)."""
    if isinstance(value, int):
        return op.Constant(value_int=value)
    return op.Squeeze(value)


def _dim(value, axis: int):
    """The 0-d INT64 size of `value`'s dimension `axis` (dynamic dims included)."""
    return op.Gather(op.Shape(value), op.Constant(value_int=axis))


def _require_local(local, name: str) -> None:
    if local is None:
        raise NotImplementedError(f"eagle31::{name} with local=None (a causal block) has no ONNX translation: the "
                                  "exported programs take the block as an explicit local [B, T, W] mask")


def visible(base, local, slots):
    """`core/masks.visible_slots` in ONNX: base [B] INT64, local [B, T, W] BOOL, slots 0-d INT64 -> [B, T, S] BOOL."""
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    width, tokens = _dim(local, 2), _dim(local, 1)
    s = op.Range(zero, slots, one)                                                  # [S]
    j = op.Sub(op.Unsqueeze(s, [0]), op.Unsqueeze(base, [1]))                       # [B, S]: offset into the block
    in_block = op.And(op.GreaterOrEqual(j, zero), op.Less(j, width))
    index = op.Clip(j, zero, op.Sub(width, one))
    shape = op.Concat(op.Shape(base), op.Unsqueeze(tokens, [0]), op.Unsqueeze(slots, [0]), axis=0)
    index = op.Expand(op.Unsqueeze(index, [1]), shape)                              # [B, T, S]
    block = op.Cast(op.GatherElements(op.Cast(local, to=ir.DataType.INT32), index, axis=2), to=ir.DataType.BOOL)
    return op.Or(op.Unsqueeze(op.Less(j, zero), [1]), op.And(op.Unsqueeze(in_block, [1]), block))


def slot_mask(base, local, tokens, slots, dtype):
    """eagle31::slot_mask -> [B, 1, T, S] additive (0 attend, -inf blocked) in `dtype`."""
    _require_local(local, "slot_mask")
    seen = op.Unsqueeze(visible(base, local, _scalar(slots)), [1])
    zero = op.Cast(op.Constant(value_float=0.0), to=dtype)
    blocked = op.Cast(op.Constant(value_float=float("-inf")), to=dtype)
    return op.Where(seen, zero, blocked)


def _static(value, axis: int, what: str) -> int:
    dim = value.shape[axis] if value.shape is not None else None
    if not isinstance(dim, int):
        raise NotImplementedError(f"eagle31::tree_attention needs a static {what} to export, got {dim!r}")
    return dim


def tree_attention(q, k_cache, v_cache, base, local, scale):
    """eagle31::tree_attention -> [B, Hq, T, hd]: softmax(q k^T * scale) v over the visible slots, 0 for a query
    that sees none. The G = Hq / Hkv query heads of a KV head are a broadcast axis: K/V are never repeated."""
    _require_local(local, "tree_attention")
    heads, kv_heads = _static(q, 1, "query head count"), _static(k_cache, 1, "KV head count")
    head_dim = _static(q, 3, "head_dim")
    group = heads // kv_heads
    qg = op.Reshape(q, op.Constant(value_ints=[0, kv_heads, group, -1, head_dim]))       # [B, Hkv, G, T, hd]
    keys = op.Unsqueeze(k_cache, [2])                                                     # [B, Hkv, 1, S, hd]
    values = op.Unsqueeze(v_cache, [2])
    scores = op.MatMul(qg, op.Transpose(keys, perm=[0, 1, 2, 4, 3]))                      # [B, Hkv, G, T, S]
    scores = op.Mul(scores, op.CastLike(op.Constant(value_float=float(scale)), scores))
    seen = op.Unsqueeze(visible(base, local, _dim(k_cache, 2)), [1, 2])                 # [B, 1, 1, T, S]
    blocked = op.CastLike(op.Constant(value_float=float("-inf")), scores)
    probs = op.Softmax(op.Where(seen, scores, blocked), axis=-1)
    any_seen = op.Greater(op.ReduceSum(op.Cast(seen, to=ir.DataType.INT64), op.Constant(value_ints=[-1]),
                                       keepdims=1), op.Constant(value_int=0))
    probs = op.Where(any_seen, probs, op.CastLike(op.Constant(value_float=0.0), probs))   # all blocked: 0, not NaN
    out = op.MatMul(probs, values)                                                        # [B, Hkv, G, T, hd]
    return op.Reshape(out, op.Constant(value_ints=[0, heads, -1, head_dim]))


TRANSLATIONS = {
    torch.ops.eagle31.slot_mask.default: slot_mask,
    torch.ops.eagle31.tree_attention.default: tree_attention,
}
