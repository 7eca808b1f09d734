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
    def __init__(self, rows: Sequence[Row]) -> None:
        super().__init__([torch.tensor(r.prompt_ids, dtype=torch.long) for r in rows],
                         max_new_tokens=max(r.request.max_tokens for r in rows), eos_token_ids=())
        self.rows = list(rows)
        self._reason: list[str | None] = [None] * len(rows)

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
