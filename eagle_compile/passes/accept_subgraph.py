"""accept_subgraph: lower verification and KV compaction inside a step program to eagle31 ops.

Matches the step's own reference code at the step's shapes and replaces

* greedy path matching + bonus token (`core/verify.verify_greedy`)  ->  `eagle31::accept_greedy`,
* lossless tree sampling + bonus token (`core/verify.verify_sample`) ->  `eagle31::accept_sample`,
* one layer's accepted-path KV move (`core/compaction.compact_layer`) ->  `eagle31::kv_compact` (in place).

All three stay on the device: the cycle has no host synchronisation (the capture itself is `fullgraph=True`).
"""

from __future__ import annotations

import torch

from eagle_compile.core.compaction import compact_layer
from eagle_compile.core.tree import DraftTree
from eagle_compile.core.verify import verify_greedy, verify_sample
from eagle_compile.passes.context import PassContext
from eagle_compile.passes.patterns import call_op_outputs, find_input, replace_pattern, trace_pattern

_TREE = ("tokens", "parents", "depth", "valid")


def accept_subgraph(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    if ctx.kernels_off("accept_subgraph"):
        return gm
    ex = ctx.step_examples
    if ex is None:
        ctx.record("accept_subgraph", 0, "no step examples: not a step program")
        return gm
    import eagle_compile.kernels  # noqa: F401

    depth = ex.max_depth
    if ex.sampling:
        def sample(tokens, parents, node_depth, valid, ancestors, probs, uniforms, final_uniform):
            tree = DraftTree(tokens, parents, node_depth, valid, ancestors, depth)
            acc = verify_sample(tree, probs, uniforms, final_uniform)
            return acc.accept_len, acc.path, acc.tokens

        pattern = trace_pattern(sample, (*ex.tree, ex.probs, ex.uniforms, ex.final_uniform))
        accepts = replace_pattern(gm, pattern, _accept(torch.ops.eagle31.accept_sample.default, depth,
                                                       ("probs", "uniforms", "final_uniform")))
    else:
        def greedy(tokens, parents, node_depth, valid, ancestors, logits):
            acc = verify_greedy(DraftTree(tokens, parents, node_depth, valid, ancestors, depth), logits)
            return acc.accept_len, acc.path, acc.tokens

        pattern = trace_pattern(greedy, (*ex.tree, ex.logits))
        accepts = replace_pattern(gm, pattern, _accept(torch.ops.eagle31.accept_greedy.default, depth, ("logits",)))
    compact = trace_pattern(compact_layer, ex.compact)
    moves = replace_pattern(gm, compact, _kv_compact)
    ctx.record("accept_subgraph", accepts + moves, f"{accepts} accept, {moves} kv_compact")
    return gm


def _accept(op, max_depth: int, extra: tuple[str, ...]):
    def build(graph: torch.fx.Graph, inputs: dict) -> list[torch.fx.Node]:
        names = ("tokens", "parents", "node_depth", "valid", *extra)
        args = [_exact(inputs, n) for n in names]
        return call_op_outputs(graph, op, (*args, max_depth), picks=(0, 1, 2))

    return build


def _kv_compact(graph: torch.fx.Graph, inputs: dict) -> list[torch.fx.Node]:
    args = tuple(find_input(inputs, n) for n in ("keys", "values", "base", "path"))
    graph.call_function(torch.ops.eagle31.kv_compact.default, args)
    return []


def _exact(inputs: dict, name: str) -> torch.fx.Node:
    if name not in inputs:
        raise AssertionError(f"pattern argument {name!r} not among {sorted(inputs)}")
    return inputs[name]
