"""fuse_elementwise: a traced layer's RoPE and RMSNorm tails become one exact op each; no-op casts go.

A program that runs as FX code pays a Python line and a dispatch for every node, and a SmolLM2 step has ~2,000
of them around its 211 linears, most in elementwise chains HF writes op by op. Under numerics="batch_invariant"
(float32 CPU, the C++ kernels built) this pass rewrites three shapes of them, each into something that computes
the same bits:

* `x.to(dtype)` where x already has that dtype: the cast returns x itself; its uses read x.
* RMSNorm's tail, `weight * (x * rsqrt(mean(x.pow(2), -1, keepdim=True) + eps))`: the mean stays torch's (its
  reduction order is torch's), the rest becomes `eagle31::rms_scale(x, variance, weight, eps)`.
* RoPE, `q * cos + cat(-q[..., h:], q[..., :h]) * sin`: `eagle31::rope(q, cos, sin)`.

The ops (kernels/cpu/elementwise.cpp) perform the chains' own float32 operations in their order, with no fused
multiply-add, so logits and taps are bit-identical with and without this pass (tests/passes/test_fuse_elementwise.py
on four architectures and the real target). Patterns that do not match exactly (another norm, a partial rotary
dimension, other dtypes) are left as traced. A SmolLM2 step program gets 121 rewrites (61 norms, 60 RoPE of q
or k, each 4-7 nodes) and loses its float32 -> float32 casts.
"""

from __future__ import annotations

import operator

import torch

from eagle_compile.passes.batch_invariant import BATCH_INVARIANT
from eagle_compile.passes.context import PassContext

Node = torch.fx.Node


def fuse_elementwise(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Rewrite no-op casts, RMSNorm tails and RoPE (see the module docstring)."""
    if ctx.numerics != BATCH_INVARIANT:
        ctx.record("fuse_elementwise", 0, f"numerics={ctx.numerics!r}")
        return gm
    casts = norms = ropes = 0
    for node in list(gm.graph.nodes):
        if _is_noop_cast(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            casts += 1
    for node in list(gm.graph.nodes):
        if (match := _rms_tail(node)) is not None:
            _replace(gm, node, torch.ops.eagle31.rms_scale.default, match)
            norms += 1
        elif (match := _rope(node)) is not None:
            _replace(gm, node, torch.ops.eagle31.rope.default, match)
            ropes += 1
    gm.graph.lint()
    gm.recompile()
    ctx.record("fuse_elementwise", norms + ropes,
               f"{norms} RMSNorm tails -> eagle31::rms_scale, {ropes} RoPE -> eagle31::rope, {casts} no-op casts "
               "dropped (the same bits)")
    return gm


def _replace(gm: torch.fx.GraphModule, node: Node, op, args: tuple) -> None:
    """`node` -> `op(*args)`; the nodes only it used are erased."""
    with gm.graph.inserting_before(node):
        fused = gm.graph.call_function(op, args)
    fused.meta.update(node.meta)
    node.replace_all_uses_with(fused)
    dead = [node]
    while dead:
        n = dead.pop()
        if n.users or n.op != "call_function" and n.op != "call_method":
            continue
        inputs = list(n.all_input_nodes)
        gm.graph.erase_node(n)
        dead.extend(inputs)


def _value(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _float32(*nodes) -> bool:
    values = [_value(n) for n in nodes]
    return all(v is not None and v.dtype == torch.float32 and v.device.type == "cpu" and 1 <= v.dim() <= 4
               for v in values)


def _call(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _method(node, name: str) -> bool:
    return isinstance(node, Node) and node.op == "call_method" and node.target == name


def _is_noop_cast(node: Node) -> bool:
    """`x.to(dtype)` or `x.to(dtype=dtype)` where x has that dtype (torch returns x itself)."""
    if not _method(node, "to"):
        return False
    if len(node.args) == 2 and not node.kwargs:
        dtype = node.args[1]
    elif len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        dtype = node.kwargs["dtype"]
    else:
        return False
    value = _value(node.args[0])
    return isinstance(dtype, torch.dtype) and value is not None and value.dtype == dtype


def _operands(node: Node, target) -> list[tuple]:
    """Both orders of a binary call's arguments (for commutative `target`), or none."""
    if not _call(node, target) or len(node.args) != 2 or node.kwargs:
        return []
    a, b = node.args
    return [(a, b), (b, a)]


def _rms_tail(node: Node) -> tuple | None:
    """(x, variance, weight, eps) when `node` is `weight * (x * rsqrt(mean(x.pow(2), -1, keepdim=True) + eps))`."""
    for weight, scaled in _operands(node, operator.mul):
        for x, inv in _operands(scaled, operator.mul):
            root = inv.args[0] if _call(inv, torch.rsqrt) or _method(inv, "rsqrt") else None
            for variance, eps in _operands(root, operator.add):
                if not isinstance(eps, float | int) or not _is_mean_square(variance, x):
                    continue
                w, xv = _value(weight), _value(x)
                if (_float32(x, variance, weight, node) and w.dim() == 1 and w.shape[0] == xv.shape[-1]
                        and _value(node).shape == xv.shape and len(scaled.users) == 1):
                    return (x, variance, weight, float(eps))
    return None


def _is_mean_square(variance, x) -> bool:
    """`variance` is `x.pow(2).mean(-1, keepdim=True)` (dim as the last index, or -1)."""
    if not _method(variance, "mean"):
        return False
    square = variance.args[0]
    dims = variance.args[1] if len(variance.args) > 1 else variance.kwargs.get("dim")
    keep = variance.args[2] if len(variance.args) > 2 else variance.kwargs.get("keepdim", False)
    xv = _value(x)
    last = (-1, xv.dim() - 1) if xv is not None else (-1,)
    dims = dims[0] if isinstance(dims, list | tuple) and len(dims) == 1 else dims
    return (keep is True and dims in last and _method(square, "pow") and square.args[0] is x
            and len(square.args) == 2 and square.args[1] == 2 and not square.kwargs)


def _rope(node: Node) -> tuple | None:
    """(q, cos, sin) when `node` is `q * cos + cat((-q[..., h:], q[..., :h]), -1) * sin`, h = D / 2."""
    for first, second in _operands(node, operator.add):
        for q, cos in _operands(first, operator.mul):
            for rotated, sin in _operands(second, operator.mul):
                if _is_rotate_half(rotated, q) and _float32(q, cos, sin, node) and _broadcasts(q, cos, sin, node):
                    return (q, cos, sin)
    return None


def _is_rotate_half(node, q) -> bool:
    if not _call(node, torch.cat):
        return False
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    qv = _value(q)
    if qv is None or dim not in (-1, qv.dim() - 1) or not isinstance(parts, list | tuple) or len(parts) != 2:
        return False
    neg, low = parts
    if not _call(neg, operator.neg) or len(neg.args) != 1:
        return False
    half = qv.shape[-1] // 2
    return (qv.shape[-1] % 2 == 0 and _is_last_slice(neg.args[0], q, half, None)
            and _is_last_slice(low, q, None, half))


def _is_last_slice(node, q, start, stop) -> bool:
    """`node` is `q[..., start:stop]`."""
    if not _call(node, operator.getitem) or node.args[0] is not q:
        return False
    index = node.args[1]
    return (isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and isinstance(index[1], slice)
            and index[1].start == start and index[1].stop == stop and index[1].step is None)


def _broadcasts(q, cos, sin, out) -> bool:
    shape = _value(q).shape
    try:
        return (torch.broadcast_shapes(shape, _value(cos).shape, _value(sin).shape) == shape
                and _value(out).shape == shape)
    except RuntimeError:
        return False
