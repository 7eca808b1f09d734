"""The plain step: one target forward per token, through the same captured program as speculation (no draft).

Speculation off (`speculate=False`) — the floor every speculative setting is measured against, and what the
calibration layer falls back to. It runs the target program of the speculative path with a one-token block
(`SlotMask.causal`: the committed prefix plus the token itself, read only over the live slots), so plain and
speculative decoding share kernels, lowering and caches: a speedup of speculation over this step is
speculation's alone.

Same interface as `SpeculativeStep.__call__` (row state, target cache, an unused draft cache, the cycle's
uniforms), device-side and free of host synchronisation. Sampling draws the token by inverse CDF with the
cycle's `final_uniform`: exactly the target's distribution (HF's warpers, `runtime/sampling.py`), from a
uniform drawn before the step, so a step can be captured as a CUDA graph.
"""

from __future__ import annotations

import torch

from eagle_compile.core.masks import SlotMask
from eagle_compile.core.verify import inverse_cdf
from eagle_compile.runtime.logits_processors import process_next
from eagle_compile.runtime.sampling import SamplingParams, SamplingValues, target_probs
from eagle_compile.runtime.step import StepOutput, StepState, TargetForward, usable_logits


class PlainStep:
    """Emit one token per active row: the target's greedy (or sampled) next token after the root."""

    def __init__(self, sampling: SamplingParams, target_forward: TargetForward, *, keep_features: bool = False,
                 values: SamplingValues | None = None) -> None:
        self.sampling = sampling
        self.values = values                     # as `SpeculativeStep.values`
        self.target_forward = target_forward
        self.keep_features = keep_features       # the calibration layer re-syncs the draft from them later

    def __call__(self, state: StepState, cache, draft_kv, uniforms: torch.Tensor,
                 final_uniform: torch.Tensor) -> StepOutput:
        base = state.n - 1                                                  # [B] the root's slot
        write = torch.where(state.active, base, cache.slots - 1)[:, None]   # inactive rows: sentinel only
        logits, feats = self.target_forward(state.root[:, None], base[:, None], SlotMask.causal(base, cache.slots),
                                            write, cache)
        scores = logits[:, 0].float()
        if self.sampling.processors is not None:         # HF's processors, from the row's history
            scores = process_next(scores, self.sampling.processors, state.history)
        token = self._next(scores, final_uniform)                           # [B]
        usable = usable_logits(logits[:, 0])                                 # [B]
        state.root.copy_(torch.where(state.active, token, state.root))
        state.n.copy_(torch.where(state.active, state.n + 1, state.n))
        if state.history is not None:
            state.history.append(token[:, None], state.active.long())
        return StepOutput(accept_len=torch.zeros_like(base), tokens=token[:, None],
                          features=feats if self.keep_features else None, finite=usable.long())

    def _next(self, logits: torch.Tensor, final_uniform: torch.Tensor) -> torch.Tensor:
        if not self.sampling.do_sample:
            return logits.argmax(-1)
        return inverse_cdf(target_probs(logits, self.sampling, self.values), final_uniform)
