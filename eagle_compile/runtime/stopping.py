"""Stops applied token by token to each row's emitted block: EOS, max_new_tokens, and HF stopping criteria.

A cycle emits up to D+1 tokens at once; HF decoding would have checked its criteria after every single token.
We replay exactly that: walk the block token by token and cut right after the first token that stops the
row, so nothing after an EOS / stop string / the token budget is ever returned.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class StopChecker:
    """Per-row bookkeeping of generated tokens and the stop decision."""

    def __init__(self, prompts: Sequence[torch.Tensor], *, max_new_tokens: int, eos_token_ids: Iterable[int],
                 criteria: Sequence = ()) -> None:
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        self.eos = {int(t) for t in eos_token_ids}
        self.criteria = list(criteria)
        self.generated: list[list[int]] = [[] for _ in prompts]
        self.finished = [max_new_tokens <= 0 for _ in prompts]

    def extend(self, row: int, block: Sequence[int]) -> bool:
        """Append `block` to `row` up to and including its first stopping token; return True if the row stopped."""
        out = self.generated[row]
        for token in block:
            out.append(int(token))
            if self._stops(row, int(token)):
                self.finished[row] = True
                return True
        return False

    def _stops(self, row: int, token: int) -> bool:
        if token in self.eos or len(self.generated[row]) >= self.max_new_tokens:
            return True
        if not self.criteria:
            return False
        prompt = self.prompts[row]
        seq = torch.cat([prompt, torch.tensor(self.generated[row], dtype=prompt.dtype, device=prompt.device)])[None]
        return any(bool(torch.as_tensor(c(seq, None)).reshape(-1)[0]) for c in self.criteria)

    @property
    def all_finished(self) -> bool:
        return all(self.finished)
