"""tree_attention: replace every masked `scaled_dot_product_attention` with `eagle31::tree_attention`.

In a captured target or step program, attention appears as one SDPA call per layer whose `attn_mask` is the
additive tree / causal mask over the static cache (COMPILE_FACTS.md §2.2, §9). The custom op computes the same
thing (queries over all cache slots plus the mask, grouped-query aware) with a Triton kernel on CUDA and the
torch reference elsewhere (`eagle_compile/kernels/tree_attention.py`). SDPA calls without a mask, with
`is_causal=True` or with dropout are left alone and counted as skipped.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eagle_compile.passes.context import PassContext

_SDPA = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention,
         torch.ops.aten.scaled_dot_product_attention.default}


def tree_attention(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Swap masked SDPA nodes for the eagle31 tree-attention op."""
    if ctx.kernels_off("tree_attention"):
        return gm
    import eagle_compile.kernels  # noqa: F401  (registers torch.ops.eagle31.*)

    rewritten = skipped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _SDPA:
            continue
        args = _sdpa_args(node)
        if args["attn_mask"] is None or args["is_causal"] or args["dropout_p"] not in (0, 0.0):
            skipped += 1
            continue
        scale = args["scale"]
        if scale is None:
            scale = 1.0 / math.sqrt(args["query"].meta["example_value"].shape[-1])
        key, value = _kv_heads(args["key"]), _kv_heads(args["value"])
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.eagle31.tree_attention.default,
                                         (args["query"], key, value, args["attn_mask"], float(scale)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        for expanded in (args["key"], args["value"]):
            _erase_dead_chain(gm.graph, expanded)
        rewritten += 1
    gm.graph.lint()
    gm.recompile()
    ctx.record("tree_attention", rewritten, f"{skipped} unmasked/causal SDPA left alone" if skipped else "")
    return gm


def _kv_heads(node: torch.fx.Node) -> torch.fx.Node:
    """Look through the grouped-query expansion in front of SDPA to the cache's KV-head tensor.

    HF's `repeat_kv` is `x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)`; the draft head
    uses `repeat_interleave(n_rep, dim=1)`. Both copy the whole cache at query-head width; the op reads the
    KV heads directly (GQA), so the expansion becomes dead code.
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


_PURE_VIEWS = ("reshape", "expand", "getitem", "repeat_interleave", "unsqueeze", "to")


def _erase_dead_chain(graph: torch.fx.Graph, node) -> None:
    """Erase a grouped-query expansion left without users, walking up through pure view/copy ops only
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
