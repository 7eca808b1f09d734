"""FX passes of the eagle31 backend, one per file, applied in the order of `PASSES`.

Each pass is `(gm, ctx) -> gm` and records how many sites it rewrote in `ctx.counts`.
Passes planned by DESIGN.md §2 that are not in this list yet (static_kv, tree_attention, draft_subgraph,
accept_subgraph, calibration_checkpoints) are not run: the runtime performs those steps outside the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.fx

from eagle_compile.passes.context import PassContext
from eagle_compile.passes.locate_layers import locate_layers
from eagle_compile.passes.tap_features import tap_features

Pass = Callable[[torch.fx.GraphModule, PassContext], torch.fx.GraphModule]

#: The target-program pipeline, in order.
PASSES: tuple[Pass, ...] = (locate_layers, tap_features)


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext, passes: Sequence[Pass] = PASSES) -> torch.fx.GraphModule:
    for p in passes:
        gm = p(gm, ctx)
    return gm


__all__ = ["PASSES", "PassContext", "locate_layers", "run_passes", "tap_features"]
