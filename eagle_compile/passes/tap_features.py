"""tap_features: expose the EAGLE-3 feature taps.

Capture index k (eagle_compile/capture_indices.py) is the residual stream entering layer k: the output of
layer k-1 found by `locate_layers`, or the embedding output for k = 0. Two graph shapes are handled:

* a target program (verify / prefill): the taps are appended after the graph's original outputs in capture
  order (low, mid, high); `ctx.num_original_outputs` records where the original outputs end;
* a step program: the traced step marks where it needs the features with `eagle31::feature_taps`; each
  marker is replaced by the concatenation of the taps, so the features flow straight into the draft catch-up.
"""

from __future__ import annotations

import torch.fx

from eagle_compile.capture_indices import default_capture_indices, validate_capture_indices
from eagle_compile.errors import UnsupportedModelError
from eagle_compile.passes.context import PassContext


def tap_features(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Append the residual streams at `ctx.capture_indices` to the graph outputs."""
    if not ctx.layer_outputs:
        raise UnsupportedModelError("tap_features needs locate_layers to run first (no decoder layers recorded)")
    num_layers = ctx.num_layers
    if ctx.capture_indices is None:
        ctx.capture_indices = default_capture_indices(num_layers)
    indices = validate_capture_indices(ctx.capture_indices, num_layers)
    taps = [_tap_node(ctx, k) for k in indices]
    markers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _feature_taps_op()]
    if markers:
        return _resolve_markers(gm, ctx, markers, taps, indices)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    original = output.args[0]
    original = tuple(original) if isinstance(original, (tuple, list)) else (original,)
    ctx.num_original_outputs = len(original)
    output.args = (original + tuple(taps),)
    gm.graph.lint()
    gm.recompile()
    ctx.record("tap_features", len(taps), f"capture indices {list(indices)}")
    return gm


def _resolve_markers(gm, ctx: PassContext, markers, taps, indices) -> torch.fx.GraphModule:
    width = sum(t.meta["example_value"].shape[-1] for t in taps)
    for marker in markers:
        if marker.args[1] != width:
            raise UnsupportedModelError(f"the step asks for {marker.args[1]} feature columns but the capture indices "
                                        f"{list(indices)} give {width}")
        with gm.graph.inserting_before(marker):
            cat = gm.graph.call_function(torch.cat, (list(taps), -1))
        cat.meta["example_value"] = marker.meta.get("example_value")
        marker.replace_all_uses_with(cat)
        gm.graph.erase_node(marker)
    gm.graph.lint()
    gm.recompile()
    ctx.record("tap_features", len(taps) * len(markers), f"capture indices {list(indices)}, {len(markers)} marker(s)")
    return gm


def _feature_taps_op():
    import eagle_compile.runtime.step  # noqa: F401  (registers eagle31::feature_taps)

    return torch.ops.eagle31.feature_taps.default


def _tap_node(ctx: PassContext, k: int) -> torch.fx.Node:
    if k == 0:
        if ctx.embedding_output is None:
            raise UnsupportedModelError(
                f"capture index 0 (token embeddings) requested but no embed_tokens node was found in "
                f"{ctx.architecture}'s graph"
            )
        return ctx.embedding_output
    return ctx.layer_outputs[k - 1]
