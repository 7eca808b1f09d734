"""Which waiting requests decode together: the next batch, and who joins a running one.

Rows of a batch each keep their own sampling setting (greedy, or their temperature / top_p / top_k: the step
reads one number per row, `runtime/sampling.py` `BatchSampling`), so requests of any settings share a batch:
the next batch takes the waiting requests in arrival order up to `max_rows` (the largest batch bucket), and
while it runs `take` hands it, between cycles, the waiting requests that fit its caches (continuous batching:
`serve/engine.py`). Two kinds of request keep to their own group: a sampled request with a `seed` decodes in
a batch of its own with its own generator, so its tokens depend on nothing but its seed and prompt (in a
shared batch the uniforms drawn would depend on its neighbours); and requests with different logits processors
(code in the step, not numbers) never share a batch. Aborted requests still waiting are dropped here and never
reach the decoder.
"""

from __future__ import annotations

import threading
from collections import deque

from eagle_compile.serve.row import Row


def group_key(row: Row) -> tuple:
    """Requests of one key may share a batch: same logits processors, and no seeded sampling (alone)."""
    request = row.request
    return (request.sampling.processors,
            id(row) if request.seed is not None and request.sampling.do_sample else None)


class Scheduler:
    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._waiting: deque[Row] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def submit(self, row: Row) -> None:
        with self._cond:
            self._waiting.append(row)
            self._cond.notify()

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _drop_aborted(self) -> None:
        for row in [r for r in self._waiting if r.aborted]:
            self._waiting.remove(row)
            row.finish("abort")

    def take(self, key: tuple, limit: int, fits) -> list[Row]:
        """Up to `limit` waiting requests of group `key`, in arrival order, for which `fits(row)` holds (rows
        joining a running batch); the others keep their place."""
        with self._cond:
            self._drop_aborted()
            taken = []
            for row in list(self._waiting):
                if len(taken) >= limit:
                    break
                if group_key(row) == key and fits(row):
                    self._waiting.remove(row)
                    taken.append(row)
            return taken

    def next_batch(self, timeout: float) -> list[Row]:
        """The next batch (the oldest request's group, arrival order); empty after `timeout` seconds or on close."""
        with self._cond:
            self._cond.wait_for(lambda: self._waiting or self._closed, timeout=timeout)
            self._drop_aborted()
            if not self._waiting or self._closed:
                return []
            key = group_key(self._waiting[0])
            batch = [r for r in self._waiting if group_key(r) == key][:self.max_rows]
            for row in batch:
                self._waiting.remove(row)
            return batch
