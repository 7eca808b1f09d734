"""Find-and-replace of traced reference functions inside a captured graph.

A fused kernel replaces a piece of the step that was written in plain torch (its reference). To find that
piece, the pass captures the reference itself with dynamo on example tensors of the same shapes (so the pattern
is in exactly the IR of the step graph), matches it with `torch.fx`'s `SubgraphMatcher`, and swaps every match
for one call of the custom op. The pattern's placeholders are named after the reference's arguments, which
is how the replacement finds its inputs.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence

import torch
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher

Replacement = Callable[[torch.fx.Graph, dict[str, torch.fx.Node]], Sequence[torch.fx.Node]]


def trace_pattern(fn: Callable, example_args: Sequence) -> torch.fx.GraphModule:
    """Capture `fn(*example_args)` with dynamo (fullgraph, static shapes) and return its graph."""
    captured: list[torch.fx.GraphModule] = []

    def grab(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch.compile(fn, backend=grab, fullgraph=True, dynamic=False, isolate_recompiles=True)(*example_args)
    return _with_mutations_as_outputs(captured[-1])


def _with_mutations_as_outputs(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """In-place writes (e.g. `scatter_` into a cache) have no users; list them as outputs so the matcher does
    not take them for dead code and the replacement covers them."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    dangling = [n for n in gm.graph.nodes if n.op in ("call_method", "call_function") and not n.users]
    if dangling:
        old = output.args[0]
        old = tuple(old) if isinstance(old, (tuple, list)) else ((old,) if old is not None else ())
        output.args = (old + tuple(dangling),)
        gm.recompile()
    return gm


def replace_pattern(gm: torch.fx.GraphModule, pattern: torch.fx.GraphModule, replacement: Replacement) -> int:
    """Replace every non-overlapping match of `pattern` in `gm`; returns the number of matches replaced.

    The replacement is inserted before the first node that uses a matched output (or, for a pattern that only
    mutates its inputs, where the last matched node was); the matched nodes are then erased.
    """
    matcher = SubgraphMatcher(pattern.graph, match_output=False, match_placeholder=False,
                              remove_overlapping_matches=True, ignore_literals=False)
    names = [_arg_name(p) for p in pattern.graph.find_nodes(op="placeholder")]
    matches = matcher.match(gm.graph)
    for match in matches:
        _replace(gm, match, dict(zip(names, match.placeholder_nodes, strict=True)), replacement)
    if matches:
        gm.graph.lint()
        gm.recompile()
    return len(matches)


def _replace(gm: torch.fx.GraphModule, match: InternalMatch, inputs: dict[str, torch.fx.Node],
             replacement: Replacement) -> None:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    matched = sorted({n for p, n in match.nodes_map.items() if p.op not in ("placeholder", "output")},
                     key=order.__getitem__)
    users = [u for r in match.returning_nodes for u in r.users if u not in matched]
    if users:
        point = min(users, key=order.__getitem__)
        ctx = gm.graph.inserting_before(point)
    else:
        ctx = gm.graph.inserting_after(matched[-1])
    latest_input = max(inputs.values(), key=order.__getitem__)
    if users and order[latest_input] >= order[point]:
        raise AssertionError("pattern replacement would use an input before it is computed")
    with ctx:
        outs = replacement(gm.graph, inputs)
    used = [r for r in match.returning_nodes if any(u not in matched for u in r.users)]
    if len(outs) < len(used) or any(r.users for r in match.returning_nodes[len(outs):]):
        raise AssertionError(f"replacement returned {len(outs)} values for {len(match.returning_nodes)} outputs")
    for old, new in zip(match.returning_nodes, outs, strict=False):
        if "example_value" in old.meta:
            new.meta["example_value"] = old.meta["example_value"]
        old.replace_all_uses_with(new)
    for node in reversed(matched):
        if not node.users:
            gm.graph.erase_node(node)


def _arg_name(placeholder: torch.fx.Node) -> str:
    """dynamo names an argument `x` as `l_x_`, closed-over module state `l_/g_..._parameters_..._`."""
    match = re.fullmatch(r"[lg]_(.+?)_", placeholder.name)
    return match.group(1) if match else placeholder.name


def find_input(inputs: dict[str, torch.fx.Node], fragment: str) -> torch.fx.Node:
    """The matched input whose pattern argument name contains `fragment` (exactly one must)."""
    hits = [node for name, node in inputs.items() if fragment in name]
    if len(hits) != 1:
        raise AssertionError(f"pattern input {fragment!r} matched {len(hits)} arguments of {sorted(inputs)}")
    return hits[0]


def call_op_outputs(graph: torch.fx.Graph, op, args: Sequence, picks: Sequence[int]) -> list[torch.fx.Node]:
    """Call a multi-output op and return getitem nodes for the outputs at `picks`."""
    call = graph.call_function(op, tuple(args))
    return [graph.call_function(operator.getitem, (call, i)) for i in picks]
