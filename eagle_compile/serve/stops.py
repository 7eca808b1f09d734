"""The stop checker of a served batch: each row stops on its own request's settings.

`StopChecker` (runtime/stopping.py) holds one `max_new_tokens` and one set of criteria for the whole batch; a
served batch mixes requests, so `RowStops` keeps the batch-wide `max_new_tokens` (the largest request's: the
decoder sizes the caches from it) and cuts each row token by token at its own `max_tokens`, its EOS and
`stop_token_ids`, and its stop strings. It also is where the decoder hands every row its kept tokens once per
cycle (the decoder's one host read), so it feeds each `Row` (streaming) and ends a row whose client went away:
an aborted row returns "stopped" at its next cycle and the decoder stops computing it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eagle_compile.runtime.stopping import StopChecker
from eagle_compile.serve.row import Row


class RowStops(StopChecker):
    """`rows`: the batch's requests, one per row of its bucket (None: a free row, finished)."""

    def __init__(self, rows: Sequence[Row | None]) -> None:
        live = [r for r in rows if r is not None]
        pad = torch.tensor(live[0].prompt_ids[:1], dtype=torch.long)
        super().__init__([pad if r is None else torch.tensor(r.prompt_ids, dtype=torch.long) for r in rows],
                         max_new_tokens=max(r.request.max_tokens for r in live), eos_token_ids=())
        self.rows = list(rows)
        self._reason: list[str | None] = [None] * len(rows)
        self.finished = [r is None for r in rows]

    def row_max_new(self, row: int) -> int:
        r = self.rows[row]
        return 0 if r is None else r.request.max_tokens

    def put(self, row: int, request: Row) -> None:
        """`request` joins the batch in the free `row` (its prefill follows: `DecodeSession.join`)."""
        self.rows[row], self._reason[row] = request, None
        self.replace(row, torch.tensor(request.prompt_ids, dtype=torch.long))

    def release(self, row: int) -> None:
        """The row's request has left: the row is free."""
        self.rows[row], self._reason[row] = None, None
        self.finished[row] = True

    def select(self, index: Sequence[int], live: Sequence[bool]) -> None:
        super().select(index, live)
        self.rows = [self.rows[i] if on else None for i, on in zip(index, live, strict=True)]
        self._reason = [self._reason[i] if on else None for i, on in zip(index, live, strict=True)]

    def extend(self, row: int, block: Sequence[int]) -> bool:
        r = self.rows[row]
        if r.aborted:
            self.finished[row] = True
            r.finish("abort")
            return True
        start = len(self.generated[row])
        first = start == 0
        stopped = super().extend(row, block)
        r.add(self.generated[row][start:], None if first else len(block))
        if stopped:
            r.finish(self._reason[row] or "stop")
        return stopped

    def _stops(self, row: int, token: int) -> bool:
        r = self.rows[row]
        if token in r.stop_ids:
            self._reason[row] = "stop"
            return True
        if r.stop_string_hit(self.generated[row]):      # the row's tokens up to and including `token`
            self._reason[row] = "stop"
            return True
        if len(self.generated[row]) >= r.request.max_tokens:
            self._reason[row] = "length"
            return True
        return False
