"""The speculative-step program: one `SpeculativeStep` captured by dynamo and rewritten by the step passes.

`torch.compile(step, fullgraph=True, dynamic=False)` traces draft -> verify -> accept -> commit, target model
included, into one FX graph per static shape (batch bucket, cache slots); `fullgraph=True` is also the proof
that the cycle has no host synchronisation (any `.item()`, `.cpu()` or data-dependent shape breaks the graph
and fails the capture). `STEP_PASSES` then resolve the feature taps, check the caches are static, swap the
draft head's pieces, verification and KV compaction for fused eagle31 ops, and lower attention; the result
runs as the FX graph or through inductor (the decoder's `Lowering`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eagle_compile.lowering import Lowering, eager_lowering
from eagle_compile.passes import STEP_PASSES, PassContext, run_passes
from eagle_compile.runtime.program_lifetime import WeakBackend, own_code
from eagle_compile.runtime.step import SpeculativeStep, StepState


@dataclass
class StepExamples:
    """Tensors shaped like the step's internals, for tracing the reference patterns the passes look for."""

    drafter: Any
    top_k: int
    max_depth: int
    sampling: bool
    features: torch.Tensor            # [B, D+1, A*Ht] catch-up input
    head_inputs: list[torch.Tensor]   # [B, H] (level 1), [B, K, H] (deeper levels)
    tree: tuple                       # tokens, parents, depth, valid, ancestors
    logits: torch.Tensor              # [B, M, V] float32
    probs: torch.Tensor               # [B, M, V] float32
    uniforms: torch.Tensor            # [B, D, K]
    final_uniform: torch.Tensor       # [B]
    compact: tuple                    # keys, values, base, path


class StepProgram:
    """Callable with the signature of `SpeculativeStep.__call__`, running the captured, rewritten step."""

    def __init__(self, step: SpeculativeStep, capture_indices: tuple[int, ...] | None, architecture: str, *,
                 feature_width: int, vocab_size: int, lowering: Lowering | None = None, kernels: str = "auto",
                 recompile_limit: int = 64) -> None:
        self.step = step
        self.capture_indices = capture_indices
        self.architecture = architecture
        self.feature_width = feature_width
        self.vocab_size = vocab_size
        self.lowering = lowering or eager_lowering()
        self.kernels = kernels
        self.contexts: list[PassContext] = []
        self._args: tuple | None = None
        # the step's own code object and a weak backend: its graphs live and die with it (program_lifetime.py)
        self._compiled = torch.compile(own_code(step.__call__), backend=WeakBackend(self._backend), fullgraph=True,
                                       dynamic=False, recompile_limit=recompile_limit, isolate_recompiles=True)

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        state, cache, uniforms = self._args
        use, reason = use_kernels(self.kernels, state.n.device)
        ctx = PassContext(capture_indices=self.capture_indices, architecture=self.architecture,
                          step_examples=self._make_examples(state, cache, uniforms), use_kernels=use,
                          kernels=self.kernels, kernels_reason=reason, numerics=self.lowering.numerics)
        gm = run_passes(gm, ctx, STEP_PASSES)
        ctx.step_examples = None      # only the passes read them: [B, M, V] logits and probs, KV-sized tensors
        self.contexts.append(ctx)
        return self.lowering.compile(gm, example_inputs)

    def __call__(self, state: StepState, cache, draft_kv, uniforms, final_uniform):
        self._args = (state, cache, uniforms)      # read only if this call (re)captures the graph
        try:
            with self.lowering.tracing():
                return self._compiled(state, cache, draft_kv, uniforms, final_uniform)
        finally:
            self._args = None

    def _make_examples(self, state: StepState, cache, uniforms) -> StepExamples:
        shape = self.step.shape
        B, H = state.seed_head.shape
        D, K, M = shape.depth, shape.top_k, shape.total_tokens
        dev, dtype = state.n.device, state.seed_head.dtype
        parents = torch.arange(-1, M - 1, device=dev).expand(B, M)
        depth = torch.arange(M, device=dev).clamp(max=D).expand(B, M)
        tree = (torch.zeros(B, M, dtype=torch.long, device=dev), parents, depth,
                torch.ones(B, M, dtype=torch.bool, device=dev), torch.ones(B, M, M, dtype=torch.bool, device=dev))
        logits = torch.zeros(B, M, self.vocab_size, device=dev)
        layer = cache.layers[0]
        heads = [torch.zeros(B, H, dtype=dtype, device=dev)] + ([torch.zeros(B, K, H, dtype=dtype, device=dev)]
                                                                 if D > 1 else [])
        return StepExamples(
            drafter=self.step.drafter, top_k=K, max_depth=D, sampling=self.step.sampling.do_sample,
            features=torch.zeros(B, D + 1, self.feature_width, dtype=dtype, device=dev), head_inputs=heads,
            tree=tree, logits=logits, probs=torch.full_like(logits, 1.0 / self.vocab_size),
            uniforms=torch.zeros_like(uniforms), final_uniform=torch.zeros(B, dtype=uniforms.dtype, device=dev),
            compact=(torch.zeros_like(layer.keys), torch.zeros_like(layer.values),
                     torch.zeros(B, dtype=torch.long, device=dev),
                     torch.zeros(B, D + 1, dtype=torch.long, device=dev)))

    @property
    def graphs_captured(self) -> int:
        return len(self.contexts)


def use_kernels(setting: str, device: torch.device) -> tuple[bool, str]:
    """Whether the step passes substitute the eagle31 fused ops, and why."""
    from eagle_compile.kernels._dispatch import interpreter_requested

    if setting == "on":
        return True, "kernels='on'"
    if setting == "off":
        return False, "kernels='off'"
    if device.type == "cuda":
        return True, "CUDA: the Triton kernels run"
    if interpreter_requested():
        return True, "EAGLE31_TRITON_INTERPRET=1: the Triton kernels run through the interpreter"
    return False, (f"kernels='auto' on {device.type}: the ops would run their torch references, which are no "
                   "faster than the traced code they replace")
