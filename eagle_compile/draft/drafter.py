"""The interface between the speculative runtime and whatever proposes draft tokens.

The runtime never calls the draft head directly: it goes through a `Drafter`, so that tests can plug in an
oracle (proposes the target's own continuation) or an adversarial drafter with the same tree, masks and slots,
and so that the head can later be swapped for its lowered (fused) form.

A draft forward takes, per position, a hidden input (target features for catch-up, `fuse=True`; the previous
step's feedback otherwise), the next token, its RoPE position, the draft-cache slot it writes, and an additive
mask over draft-cache slots. It returns the feedback carried to the next step and the head input (`norm(o)`),
from which `top_k` gives the k most likely next tokens (log-probabilities over the draft vocabulary, best
first, and the tokens mapped to target ids through d2t). `fill` writes only the draft KV of positions whose
outputs nobody reads (the prompt's catch-up, all but its last position).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class Drafter(Protocol):
    draft_vocab_size: int

    def new_state(self, batch: int, slots: int, *, dtype: torch.dtype, device: torch.device) -> Any: ...

    def forward(self, state: Any, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                write_slots: torch.Tensor, mask: torch.Tensor, *, fuse: bool
                ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def fill(self, state: Any, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             write_slots: torch.Tensor) -> None: ...

    def top_k(self, head_input: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class EagleDrafter:
    """`Drafter` backed by an `EagleDraftModel` (EAGLE-3 / EAGLE 3.1 head).

    `numerics="batch_invariant"` runs the head's eager forward on the batch-invariant kernels (a draft token's
    scores then do not depend on the tree level's width or the batch); inside a captured step program the
    batch_invariant pass does the same swap, so the mode is not entered while dynamo traces. The mode reads
    weights whose values all fit float16 (a float16 head run in float32) from exact 16-bit copies: the same
    bits, half the bytes per level."""

    model: torch.nn.Module
    numerics: str = "eager"
    _narrow: Any = field(default=None, init=False, repr=False)

    def _numerics(self):
        if self.numerics != "batch_invariant" or torch.compiler.is_compiling():
            return contextlib.nullcontext()
        from eagle_compile.kernels.batch_invariant import BatchInvariantMode, NarrowWeights

        if self._narrow is None:
            self._narrow = NarrowWeights()   # a float16 head run in float32 streams its weights in 16 bits
        return BatchInvariantMode(self._narrow)

    @property
    def draft_vocab_size(self) -> int:
        return self.model.config.draft_vocab_size

    def target_vocab(self) -> torch.Tensor:
        """The target ids this head can propose: its draft vocabulary through d2t."""
        return self.model.draft_to_target(torch.arange(self.draft_vocab_size, device=self.model.d2t.device))

    def new_state(self, batch: int, slots: int, *, dtype: torch.dtype, device: torch.device):
        return self.model.new_kv(batch, slots, dtype=dtype, device=device)

    @torch.no_grad()
    def forward(self, state, hidden, tokens, positions, write_slots, mask, *, fuse):
        with self._numerics():
            if fuse:
                hidden = self.model.fuse(hidden)   # [B, T, A*Ht] -> [B, T, H]
            out = self.model(tokens, hidden, positions, state, write_slots, mask)
        return out.feedback, out.normed

    @torch.no_grad()
    def fill(self, state, hidden, tokens, positions, write_slots) -> None:
        """The K/V of target features `hidden [B, T, A*Ht]` at these positions (fused first), nothing else."""
        with self._numerics():
            self.model.fill(tokens, self.model.fuse(hidden), positions, state, write_slots)

    @torch.no_grad()
    def top_k(self, head_input: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., H] -> (log-probs [..., k] best first, target ids [..., k]); the `draft_subgraph` pass replaces
        this whole function with `eagle31::draft_topk` in a step program."""
        with self._numerics():
            logits = self.model.logits(head_input, small_rows_product=self.numerics != "batch_invariant")
        logp = torch.log_softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, -1)
        scores, ids = torch.topk(logp, k, dim=-1, sorted=True)
        return scores, self.model.draft_to_target(ids)
