"""batch_invariant: give every linear and every live-slot attention of a program batch-invariant rounding.

Under `numerics="batch_invariant"` (kernels/batch_invariant.py) a token's logits and feature taps must be
bit-identical whether the program carries it alone, in a verify tree, in a prefill chunk or in another batch
row. The traced graph's reductions over more than one element are its linears (`F.linear`: projections, MLP,
lm_head), its attention (already `eagle31::tree_attention` after the tree_attention pass) and its norms; the
first two are swapped for `eagle31::bi_linear` / `eagle31::bi_tree_attention`. Torch's CPU norms (mean over the
last dim) reduce each row by itself in a fixed order and are left as traced; the tests check that claim on
every program shape.

A program that keeps a reduction the pass cannot make invariant (a dense SDPA because kernels="off", a matmul,
einsum or tensordot over a reduced dimension > 1) raises: numerics="batch_invariant" is a promise, so it is
never silently broken; so does a linear with a quantised weight (torchao's subclasses, targets/quantized.py). The
one recorded exception is the draft's fused ops under kernels="on" (their own GEMMs only change which tokens the
draft proposes, never the output).
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from eagle_compile.passes.context import PassContext
from eagle_compile.passes.tree_attention import _SDPA
from eagle_compile.targets.quantized import quantized_kind

BATCH_INVARIANT = "batch_invariant"

_LINEAR = {torch._C._nn.linear, F.linear, torch.ops.aten.linear.default}
#: products whose first matrix operand is argument 0, or argument 1 for the ones that add a term first
_MATMUL = {torch.matmul: 0, operator.matmul: 0, torch.bmm: 0, torch.mm: 0, torch.ops.aten.mm.default: 0,
           torch.ops.aten.bmm.default: 0, torch.ops.aten.matmul.default: 0, torch.addmm: 1, torch.baddbmm: 1,
           torch.addbmm: 1, torch.ops.aten.addmm.default: 1, torch.ops.aten.baddbmm.default: 1}
_MATMUL_METHODS = {"matmul": 0, "mm": 0, "bmm": 0, "__matmul__": 0, "addmm": 1, "baddbmm": 1, "addbmm": 1}
_OPAQUE_PRODUCTS = {torch.einsum, torch.tensordot, torch.ops.aten.einsum.default}
#: fused draft ops (kernels="on") that do their own GEMMs: the target stays invariant, the draft's scores not
_FUSED_DRAFT = ("fc_norm_fuse", "draft_topk")


class NotBatchInvariant(RuntimeError):
    """A program keeps a reduction whose rounding would depend on the batch or token count."""


def batch_invariant(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Swap linears and tree attention for the batch-invariant kernels when ctx.numerics asks for them."""
    if ctx.numerics != BATCH_INVARIANT:
        ctx.record("batch_invariant", 0, f"numerics={ctx.numerics!r}")
        return gm
    from eagle_compile.kernels import batch_invariant as kernels

    kernels.load()
    attention = {torch.ops.eagle31.tree_attention, torch.ops.eagle31.tree_attention.default}
    sites, fused = 0, []
    for node in list(gm.graph.nodes):
        if node.op == "call_method" and node.target in _MATMUL_METHODS:
            _refuse_reducing(node, _MATMUL_METHODS[node.target])
        if node.op != "call_function":
            continue
        if node.target in _LINEAR:
            _refuse_quantized(node)
            _retarget(node, torch.ops.eagle31.bi_linear.default, kernels.LINEAR_ARGS)
            sites += 1
        elif node.target in attention:
            _retarget(node, torch.ops.eagle31.bi_tree_attention.default, kernels.ATTENTION_ARGS)
            sites += 1
        elif node.target in _SDPA:
            raise NotBatchInvariant("numerics='batch_invariant': an attention over a dense mask is left in the "
                                    "program (kernels='off' keeps SDPA as traced); use kernels='auto' or "
                                    "numerics='eager'")
        elif node.target in _MATMUL:
            _refuse_reducing(node, _MATMUL[node.target])
        elif node.target in _OPAQUE_PRODUCTS:
            _refuse(node)
        elif any(name in str(node.target) for name in _FUSED_DRAFT):
            fused.append(str(node.target))
    gm.graph.lint()
    gm.recompile()
    detail = "linears and attention on the batch-invariant kernels"
    if fused:
        detail += (f"; the fused draft ops {sorted(set(fused))} (kernels='on') keep their own GEMMs: the target's "
                   "logits stay invariant (output stays exact), the draft's scores may vary with the tree width")
    ctx.record("batch_invariant", sites, detail)
    return gm


def _retarget(node: torch.fx.Node, target, names: tuple[str, ...]) -> None:
    args = tuple(node.args[i] if i < len(node.args) else node.kwargs.get(name) for i, name in enumerate(names))
    node.target, node.args, node.kwargs = target, args, {}


def _refuse_quantized(node: torch.fx.Node) -> None:
    """Raise for a linear whose weight is a quantised tensor (targets/quantized.py): bi_linear takes plain weights,
    and resolve_numerics already keeps quantised targets on numerics='eager'; this is the backstop."""
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    kind = quantized_kind(weight.meta.get("example_value")) if isinstance(weight, torch.fx.Node) else None
    if kind is not None:
        raise NotBatchInvariant(f"numerics='batch_invariant': {node.format_node()} has a quantised weight ({kind}); "
                                "the batch-invariant kernels take plain float weights: use numerics='eager'")


def _refuse_reducing(node: torch.fx.Node, operand: int) -> None:
    """Raise unless the product sums over one element only (K = 1: RoPE's position x inverse frequency is one
    rounding per element whatever the batch)."""
    first = node.args[operand] if len(node.args) > operand else None
    value = first.meta.get("example_value") if isinstance(first, torch.fx.Node) else None
    if value is None or value.dim() == 0 or value.shape[-1] > 1:
        _refuse(node)


def _refuse(node: torch.fx.Node) -> None:
    raise NotBatchInvariant(f"numerics='batch_invariant': {node.format_node()} reduces over a dimension the pass "
                            "has no batch-invariant kernel for; use numerics='eager'")
