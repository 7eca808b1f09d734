"""FX passes of the eagle31 backend, one per file, applied in the order of the lists below.

Each pass is `(gm, ctx) -> gm` and records how many sites it rewrote (or verified) in `ctx.counts`.

* `PASSES` run on a target program (prefill chunks, the plain step and verification in the unlowered loop):
  they expose the feature taps as extra outputs, make attention read only the live cache slots and, under
  numerics="batch_invariant", put linears and attention on the batch-invariant kernels and fuse RoPE and the
  RMSNorm tails into exact ops.
* `STEP_PASSES` run on the captured speculative-step program (draft -> verify -> accept -> commit in one
  graph): they resolve the taps inside the graph, check the caches are static, and lower attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.fx

from eagle_compile.passes.accept_subgraph import accept_subgraph
from eagle_compile.passes.batch_invariant import batch_invariant
from eagle_compile.passes.context import PassContext
from eagle_compile.passes.draft_subgraph import draft_subgraph
from eagle_compile.passes.fuse_elementwise import fuse_elementwise
from eagle_compile.passes.locate_layers import locate_layers
from eagle_compile.passes.static_kv import static_kv
from eagle_compile.passes.tap_features import tap_features
from eagle_compile.passes.tree_attention import tree_attention

Pass = Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]

#: The target-program pipeline, in order.
PASSES: tuple[Pass, ...] = (locate_layers, tap_features, tree_attention, batch_invariant, fuse_elementwise)

#: The speculative-step pipeline, in order.
STEP_PASSES: tuple[Pass, ...] = (locate_layers, tap_features, static_kv, draft_subgraph, accept_subgraph,
                                 tree_attention, batch_invariant, fuse_elementwise)


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext, passes: Sequence[Pass] = PASSES) -> torch.fx.GraphModule:
    for p in passes:
        gm = p(gm, ctx)
    return gm


__all__ = ["PASSES", "STEP_PASSES", "PassContext", "accept_subgraph", "batch_invariant", "draft_subgraph",
           "fuse_elementwise", "locate_layers", "run_passes", "static_kv", "tap_features", "tree_attention"]
