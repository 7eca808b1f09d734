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
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(torch.ops.eagle31.tree_attention.default,
                                         (args["query"], args["key"], args["value"], args["attn_mask"], float(scale)))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        rewritten += 1
    gm.graph.lint()
    gm.recompile()
    ctx.record("tree_attention", rewritten, f"{skipped} unmasked/causal SDPA left alone" if skipped else "")
    return gm


def _sdpa_args(node: torch.fx.Node) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    args = dict(zip(names, node.args, strict=False))
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    return {**defaults, **args, **node.kwargs}
