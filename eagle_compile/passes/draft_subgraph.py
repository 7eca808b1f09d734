"""draft_subgraph: lower the draft head's pieces inside a step program to fused eagle31 ops.

The traced step contains the draft head unrolled for the static tree depth: the catch-up pass (features ->
fc_norm -> concat -> fc, then the midlayer) and one forward per expanded tree level, each followed by
`lm_head -> log_softmax -> top-k -> d2t`. This pass finds those pieces by matching their own reference code
(`EagleDraftModel.fuse`, `EagleDrafter.top_k`, traced at the step's shapes) and replaces

* fc_norm (EAGLE 3.1 per-feature RMSNorms, or none) + concat + fc  ->  `eagle31::fc_norm_fuse`,
* lm_head + log-softmax + top-k + d2t                              ->  `eagle31::draft_topk`
  (the full draft-vocabulary logits are never materialised by the Triton kernel).

The midlayer calls `eagle31::tree_attention` itself (live slots only). A head with `norm_before_fc` (one norm over
the whole concat) has no fused kernel: its fuse is left as traced and the count says 0.
"""

from __future__ import annotations

import torch

from eagle_compile.passes.context import PassContext
from eagle_compile.passes.patterns import call_op_outputs, find_input, replace_pattern, trace_pattern


def draft_subgraph(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    if ctx.kernels_off("draft_subgraph"):
        return gm
    examples = ctx.step_examples
    drafter = getattr(examples, "drafter", None) if examples is not None else None
    model = getattr(drafter, "model", None)
    if model is None:
        ctx.record("draft_subgraph", 0, "the drafter is not an EagleDraftModel head: nothing to fuse")
        return gm
    import eagle_compile.kernels  # noqa: F401

    fused = 0
    if not model.config.norm_before_fc and model.config.use_aux_hidden_state:
        pattern = trace_pattern(lambda features: model.fuse(features), (examples.features,))
        fused += replace_pattern(gm, pattern, _fc_norm_fuse(model))
    topk = 0
    for head_input in examples.head_inputs:
        pattern = trace_pattern(lambda head_input: drafter.top_k(head_input, examples.top_k), (head_input,))
        topk += replace_pattern(gm, pattern, _draft_topk(examples.top_k))
    ctx.record("draft_subgraph", fused + topk, f"{fused} fc_norm_fuse, {topk} draft_topk")
    return gm


def _fc_norm_fuse(model):
    eps = float(model.config.rms_norm_eps)
    count = model.config.num_features if model.config.fc_norm else 0

    def build(graph: torch.fx.Graph, inputs: dict) -> list[torch.fx.Node]:
        norms = None
        if count:
            weights = [find_input(inputs, f"fc_norm_modules_{i}_") for i in range(count)]
            norms = graph.call_function(torch.stack, (weights, 0))
        fc = find_input(inputs, "modules_fc_parameters_weight")
        return [graph.call_function(torch.ops.eagle31.fc_norm_fuse.default,
                                    (find_input(inputs, "features"), norms, eps, fc))]

    return build


def _draft_topk(k: int):
    def build(graph: torch.fx.Graph, inputs: dict) -> list[torch.fx.Node]:
        args = (find_input(inputs, "head_input"), find_input(inputs, "lm_head_parameters_weight"),
                find_input(inputs, "buffers_d2t"), k)
        return call_op_outputs(graph, torch.ops.eagle31.draft_topk.default, args, picks=(0, 2))

    return build
