"""tree_attention: replace each SDPA whose mask is an `eagle31::slot_mask` with `eagle31::tree_attention`.

A captured program hands the HF model a dense additive mask `[B, 1, T, S]` built by `eagle31::slot_mask(base,
local, T, S)` (core/masks.py), so the graph computes the right thing as traced: SDPA over all S slots of the
static cache, with K/V repeated to the query-head count (HF's `repeat_kv`). Both are work the mask's
description makes unnecessary. For every SDPA whose `attn_mask` is that mask (through HF's slice to the key
length and dtype casts), the pass calls `eagle31::tree_attention(q, k, v, base, local, scale)` instead, on the
cache's KV heads: it reads only the slots below each row's block end (the committed prefix plus the block),
never the rest of the allocated cache, and never copies K/V (`kernels/tree_attention.py`). The dense mask and
the K/V expansion become dead code and are erased.

SDPA calls whose mask is something else, or that have `is_causal=True` or dropout, are left alone and counted
as skipped. Unlike the other fused-op passes this one also applies on CPU under `kernels="auto"`: the op's CPU
path (torch's flash attention over the live slots) is faster than the traced SDPA, not only a reference;
`kernels="off"` keeps the graph as traced.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eagle_compile.passes.context import PassContext

_SDPA = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention,
         torch.ops.aten.scaled_dot_product_attention.default}
_MASK_VIEWS = ("getitem", "to", "contiguous", "type_as", "float")


def tree_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Swap SDPA over a `slot_mask` for the live-slot eagle31 attention op."""
    if ctx.kernels == "off":
        ctx.record("tree_attention", 0, "kernels='off': attention over the dense mask, as traced")
        return gm
    import eagle_compile.kernels  # noqa: F401  (registers torch.ops.eagle31.*)

    rewritten = skipped = 0
    masks = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        args = _sdpa_args(node)
        mask = _slot_mask_source(args["attn_mask"], args["key"])
        if mask is None or args["is_causal"] or args["dropout_p"] not in (0, 0.0):
            skipped += 1
            continue
        scale = args["scale"]
        if scale is None:
            scale = 1.0 / math.sqrt(args["query"].meta["example_value"].shape[-1])
        key, value = _kv_heads(args["key"]), _kv_heads(args["value"])
        base, local = mask.args[0], mask.args[1]
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.eagle31.tree_attention.default,
                                         (args["query"], key, value, base, local, float(scale)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        for dead in (args["key"], args["value"], args["attn_mask"]):
            _erase_dead_chain(gm.graph, dead)
        masks.add(mask)
        rewritten += 1
    for mask in masks:
        if not mask.users:
            gm.graph.erase_node(mask)
    gm.graph.lint()
    gm.recompile()
    ctx.record("tree_attention", rewritten, f"{skipped} SDPA without a slot mask left alone" if skipped else "")
    return gm


def _slot_mask_source(node, key) -> torch.fx.Node | None:
    """The `eagle31::slot_mask` node `node` is (looking through casts and a slice to the full key length)."""
    while isinstance(node, torch.fx.Node):
        if node.op == "call_function" and node.target in (torch.ops.eagle31.slot_mask,
                                                           torch.ops.eagle31.slot_mask.default):
            return node
        if not any(_is(node, name) for name in _MASK_VIEWS) or not _keeps_slots(node, key):
            return None
        node = node.args[0]
    return None


def _keeps_slots(node: torch.fx.Node, key: torch.fx.Node) -> bool:
    """A view of the mask is harmless only if it keeps every slot (HF slices to `key.shape[-2]` == S)."""
    if not _is(node, "getitem"):
        return True
    before, after = (n.meta.get("example_value") for n in (node.args[0], node))
    slots = key.meta.get("example_value").shape[-2] if isinstance(key, torch.fx.Node) else None
    return (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.shape == after.shape
            and before.shape[-1] == slots)


def _kv_heads(node: torch.fx.Node) -> torch.fx.Node:
    """Look through the grouped-query expansion in front of SDPA to the cache's KV-head tensor.

    HF's `repeat_kv` is `x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)`; a module may also
    use `repeat_interleave(n_rep, dim=1)`. Both copy the whole cache at query-head width; the op reads the KV
    heads directly (GQA), so the expansion becomes dead code.
    """
    if _is(node, "reshape") and isinstance(node.args[0], torch.fx.Node) and _is(node.args[0], "expand"):
        inner = node.args[0].args[0]
        if isinstance(inner, torch.fx.Node) and _is_unsqueeze_2(inner):
            return inner.args[0]
    if _is(node, "repeat_interleave"):
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None)
        if dim == 1 and isinstance(node.args[0], torch.fx.Node):
            return node.args[0]
    return node


_PURE_VIEWS = ("reshape", "expand", "getitem", "repeat_interleave", "unsqueeze", "to", "contiguous", "type_as",
               "float")


def _erase_dead_chain(graph: torch.fx.Graph, node) -> None:
    """Erase an expansion or mask view left without users, walking up through pure view/copy ops only
    (not `graph.eliminate_dead_code`: it would also drop in-place cache writes, which have no users)."""
    while isinstance(node, torch.fx.Node) and not node.users and any(_is(node, n) for n in _PURE_VIEWS):
        parent = node.args[0] if node.args else None
        graph.erase_node(node)
        node = parent


def _is(node: torch.fx.Node, name: str) -> bool:
    if node.op == "call_method":
        return node.target == name
    return node.op == "call_function" and getattr(node.target, "__name__", "") == name


def _is_unsqueeze_2(node: torch.fx.Node) -> bool:
    """`x[:, :, None]` (getitem with None at position 2) or `x.unsqueeze(2)`."""
    if node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem":
        index = node.args[1]
        return isinstance(index, tuple) and len(index) >= 3 and index[2] is None and all(
            isinstance(i, slice) and i == slice(None) for i in index[:2])
    return _is(node, "unsqueeze") and node.args[1:] == (2,)


def _sdpa_args(node: torch.fx.Node) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = dict(zip(names, node.args, strict=False))
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    return {**defaults, **args, **node.kwargs}
