"""One request inside the engine: its prompt ids, its tokens so far, its text as streamed, its timings.

The engine's worker thread appends tokens (`add`) and finishes the row (`finish`); each change goes out as an
event through `sink`, a callable the app makes thread-safe (it hands events to the asyncio loop). Text is
decoded from all tokens so far and only the part that can no longer change is sent: a trailing incomplete
UTF-8 character ("\\ufffd") and the last `len(longest stop string) - 1` characters wait, so a stop string that
completes later is never streamed (the streamed text equals the returned text).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from eagle_compile.serve.protocol import GenerationRequest

Event = dict


class Row:
    def __init__(self, request: GenerationRequest, prompt_ids: list[int], sink: Callable[[Event], None],
                 tokenizer, stop_ids: frozenset[int]) -> None:
        self.request = request
        self.prompt_ids = prompt_ids
        self.sink = sink
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids                      # EOS and the request's stop_token_ids: not part of the text
        self.tokens: list[int] = []
        self.blocks: list[int] = []                   # acceptance length of each cycle (the prefill's token excluded)
        self.sent = ""
        self.stop_at: int | None = None               # where a stop string starts in the text
        self.finish_reason: str | None = None
        self.arrived = time.perf_counter()
        self.started: float | None = None             # joined a batch
        self.first_token: float | None = None
        self.finished: float | None = None
        self.batch_rows = 0
        self._abort = threading.Event()

    # -- set by the app ----------------------------------------------------------------------------------------
    def abort(self) -> None:
        """The client went away: the row ends at its next cycle and sends nothing more."""
        self._abort.set()

    @property
    def aborted(self) -> bool:
        return self._abort.is_set()

    # -- set by the engine ---------------------------------------------------------------------------------------
    def text(self, tokens: list[int] | None = None) -> str:
        """The text of `tokens` (default: the row's tokens so far), a final EOS / stop token id left out."""
        ids = self.tokens if tokens is None else tokens
        ids = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stop_string_hit(self, tokens: list[int]) -> bool:
        """Whether one of the request's stop strings is in the text of `tokens` (records where the first starts)."""
        if not self.request.stop:
            return False
        text = self.text(tokens)
        hits = [i for i in (text.find(s) for s in self.request.stop) if i >= 0]
        if hits:
            self.stop_at = min(hits)
        return bool(hits)

    def add(self, new: list[int], block: int | None) -> None:
        """Tokens the decoder kept for this row (after stops); `block`: how many the cycle emitted before the stop
        checks (its acceptance length), None for the prefill's first token."""
        if self.first_token is None and new:
            self.first_token = time.perf_counter()
        if block is not None:
            self.blocks.append(block)
        self.tokens.extend(new)
        if self.request.stream and self.finish_reason is None:
            text = self.text()
            if self.stop_at is not None:          # this block completed a stop string: finish() sends the rest
                text = text[:self.stop_at]
            hold = max((len(s) for s in self.request.stop), default=1) - 1
            ready = text[:len(text) - hold] if hold else text
            ready = ready.rstrip("\ufffd")
            if len(ready) > len(self.sent) and ready.startswith(self.sent):
                self.sink({"type": "delta", "text": ready[len(self.sent):]})
                self.sent = ready

    def finish(self, reason: str) -> None:
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        self.finished = time.perf_counter()
        if self.aborted:
            return
        text = self.text()
        if self.stop_at is not None:
            text = text[:self.stop_at]
        rest = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sink({"type": "done", "text": text, "rest": rest, "finish_reason": reason, "usage": self.usage()})

    def fail(self, message: str) -> None:
        self.finish_reason = "error"
        self.finished = time.perf_counter()
        self.sink({"type": "error", "message": message})

    def usage(self) -> dict:
        """OpenAI's token counts plus this server's own: tau (tokens per speculative cycle), cycles, times."""
        done = self.finished or time.perf_counter()
        start = self.started or self.arrived
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.tokens),
                "total_tokens": len(self.prompt_ids) + len(self.tokens),
                "tau": sum(self.blocks) / len(self.blocks) if self.blocks else None,
                "cycles": len(self.blocks), "queue_time": round(start - self.arrived, 6),
                "time_to_first_token": round((self.first_token or done) - self.arrived, 6),
                "decode_time": round(done - start, 6), "total_time": round(done - self.arrived, 6),
                "batch_rows": self.batch_rows}
