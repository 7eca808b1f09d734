"""batch_invariant: give every linear and every live-slot attention of a program batch-invariant rounding.

Under `numerics="batch_invariant"` (kernels/batch_invariant.py) a token's logits and feature taps must be
bit-identical whether the program carries it alone, in a verify tree, in a prefill chunk or in another batch
row. The traced graph's reductions over more than one element are its linears (`F.linear`: projections, MLP,
lm_head), its attention (already `eagle31::tree_attention` after the tree_attention pass) and its norms; the
first two are swapped for `eagle31::bi_linear` / `eagle31::bi_tree_attention`. Torch's CPU norms (mean over the
last dim) reduce each row by itself in a fixed order and are left as traced; the tests check that claim on
every program shape.

A program that keeps a reduction the pass cannot make invariant (a dense SDPA because kernels="off", a matmul
over a reduced dimension > 1) raises: numerics="batch_invariant" is a promise, so it is never silently broken.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from eagle_compile.passes.context import PassContext
from eagle_compile.passes.tree_attention import _SDPA

BATCH_INVARIANT = "batch_invariant"

_LINEAR = {torch._C._nn.linear, F.linear, torch.ops.aten.linear.default}
_MATMUL = {torch.matmul, operator.matmul, torch.bmm, torch.mm, torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.addmm.default, torch.ops.aten.matmul.default}


class NotBatchInvariant(RuntimeError):
    """A program keeps a reduction whose rounding would depend on the batch or token count."""


def batch_invariant(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Swap linears and tree attention for the batch-invariant kernels when ctx.numerics asks for them."""
    if ctx.numerics != BATCH_INVARIANT:
        ctx.record("batch_invariant", 0, f"numerics={ctx.numerics!r}")
        return gm
    from eagle_compile.kernels import batch_invariant as kernels

    kernels.load()
    sites = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _LINEAR:
            args = list(node.args) + [None] * (3 - len(node.args))
            x, weight, bias = args[0], node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
            _retarget(node, torch.ops.eagle31.bi_linear.default, (x, weight, bias))
            sites += 1
        elif node.target is torch.ops.eagle31.tree_attention.default:
            _retarget(node, torch.ops.eagle31.bi_tree_attention.default, tuple(node.args))
            sites += 1
        elif node.target in _SDPA:
            raise NotBatchInvariant("numerics='batch_invariant': an attention over a dense mask is left in the "
                                    "program (kernels='off' keeps SDPA as traced); use kernels='auto' or "
                                    "numerics='eager'")
        elif node.target in _MATMUL and _reduces(node):
            raise NotBatchInvariant(f"numerics='batch_invariant': {node.format_node()} reduces over a dimension "
                                    "the pass has no batch-invariant kernel for; use numerics='eager'")
    gm.graph.lint()
    gm.recompile()
    ctx.record("batch_invariant", sites, "linears and attention on the batch-invariant kernels")
    return gm


def _retarget(node: torch.fx.Node, target, args: tuple) -> None:
    node.target = target
    node.args = args
    node.kwargs = {}


def _reduces(node: torch.fx.Node) -> bool:
    """Whether a matmul sums over more than one element (K > 1); a K = 1 product (RoPE's position x inverse
    frequency) is one rounding per element whatever the batch."""
    first = node.args[0] if node.args else None
    value = first.meta.get("example_value") if isinstance(first, torch.fx.Node) else None
    if value is None:
        return True
    return value.shape[-1] > 1
