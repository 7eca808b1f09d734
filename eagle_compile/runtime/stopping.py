"""Stops applied token by token to each row's emitted block: EOS, max_new_tokens, and HF stopping criteria.

A cycle emits up to D+1 tokens at once; HF decoding would have checked its criteria after every single token.
We replay exactly that: walk the block token by token and cut right after the first token that stops the
row, so nothing after an EOS / stop string / the token budget is ever returned.

A Hugging Face streamer (`streamer=`) is fed here too, with exactly what each `extend` kept: what a stream
shows is what the call returns, never a token of a block after its cut. `extend` takes the tokens the
decoder already read on the host (its one read per cycle), so streaming adds no device synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from eagle_compile.errors import UnsupportedGenerationError


class StopChecker:
    """Per-row bookkeeping of generated tokens and the stop decision; `streamer` (HF `BaseStreamer`, one row
    only) gets `put([1, n] int64 cpu)` of every non-empty block kept."""

    def __init__(self, prompts: Sequence[torch.Tensor], *, max_new_tokens: int, eos_token_ids: Iterable[int],
                 criteria: Sequence = (), streamer=None) -> None:
        if streamer is not None and len(prompts) != 1:
            raise UnsupportedGenerationError(
                "streamer= supports batch size 1 only, like Hugging Face's streamers (\"TextStreamer only "
                f"supports batch size 1\"); input_ids has {len(prompts)} rows: call generate once per prompt to "
                "stream each, or drop streamer= to generate the batch")
        self.prompts = list(prompts)
        self.streamer = streamer
        self.max_new_tokens = max_new_tokens
        self.eos = {int(t) for t in eos_token_ids}
        self.criteria = list(criteria)
        self.generated: list[list[int]] = [[] for _ in prompts]
        self.finished = [max_new_tokens <= 0 for _ in prompts]
        self.retired_tokens = 0         # tokens of rows whose request left (`replace`, `select`)
        self.retired_longest = 0        # the longest of those rows, prompt included

    def extend(self, row: int, block: Sequence[int]) -> bool:
        """Append `block` to `row` up to and including its first stopping token; return True if the row stopped."""
        out = self.generated[row]
        start, stopped = len(out), False
        for token in block:
            out.append(int(token))
            if self._stops(row, int(token)):
                self.finished[row] = stopped = True
                break
        if self.streamer is not None and len(out) > start:
            self.streamer.put(torch.tensor([out[start:]], dtype=torch.long))
        return stopped

    def _stops(self, row: int, token: int) -> bool:
        if token in self.eos or len(self.generated[row]) >= self.max_new_tokens:
            return True
        if not self.criteria:
            return False
        prompt = self.prompts[row]
        seq = torch.cat([prompt, torch.tensor(self.generated[row], dtype=prompt.dtype, device=prompt.device)])[None]
        return any(bool(torch.as_tensor(c(seq, None)).reshape(-1)[0]) for c in self.criteria)

    # -- a running batch's rows change (runtime/session.py) -------------------------------------------------------
    def row_max_new(self, row: int) -> int:
        """The most new tokens `row` may produce (its own budget where rows differ: serve/stops.py)."""
        return self.max_new_tokens

    def replace(self, row: int, prompt: torch.Tensor) -> None:
        """A new request takes `row`: an empty, unfinished row of `prompt`."""
        if self.streamer is not None:
            raise ValueError("a streamed call has one row; nothing joins it")
        self._retire(row)
        self.prompts[row] = prompt
        self.generated[row] = []
        self.finished[row] = self.row_max_new(row) <= 0

    def select(self, index: Sequence[int], live: Sequence[bool]) -> None:
        """The rows regrouped: new row i is old row index[i] where live[i], else a finished padding row."""
        pad = self.prompts[0][:1]
        for row in set(range(len(self.prompts))) - {i for i, on in zip(index, live, strict=True) if on}:
            self._retire(row)
        self.prompts = [self.prompts[i] if on else pad for i, on in zip(index, live, strict=True)]
        self.generated = [self.generated[i] if on else [] for i, on in zip(index, live, strict=True)]
        self.finished = [self.finished[i] if on else True for i, on in zip(index, live, strict=True)]

    def _retire(self, row: int) -> None:
        self.retired_tokens += len(self.generated[row])
        self.retired_longest = max(self.retired_longest, len(self.prompts[row]) + len(self.generated[row]))

    @property
    def all_finished(self) -> bool:
        return all(self.finished)


class RowView:
    """A `StopChecker`'s `rows`, seen as rows 0..k-1: for rows prefilled as a batch of their own (joining rows,
    prefill groups)."""

    def __init__(self, stopper: StopChecker, rows: list[int]) -> None:
        self.stopper, self.rows = stopper, rows

    @property
    def generated(self) -> list[list[int]]:
        return [self.stopper.generated[r] for r in self.rows]

    def extend(self, row: int, block) -> bool:
        return self.stopper.extend(self.rows[row], block)
