"""The serving engine: one worker thread decodes batches of requests on one `SpeculativeDecoder`.

What the batching does, exactly:

* **Join: between cycles (continuous batching).** The waiting requests start a batch, in the smallest batch
  bucket that holds them; each row keeps its own sampling setting (greedy or its own temperature / top_p /
  top_k: `BatchSampling`). After each cycle, waiting requests join it: each takes a free row (one whose request
  ended, or padding) and is prefilled into that row alone (`DecodeSession.join`); if more wait than rows are
  free, the batch moves to a larger bucket first, and when at most half the bucket is running and nobody
  waits it moves to the smallest bucket that holds its rows (`DecodeSession.regroup`: caches and per-row
  state follow the rows). The caches of a batch hold at least `join_tokens` tokens per row (prompt + max_tokens),
  so requests up to that size can join; a longer one, or a sampled one with a `seed` (decoded alone), waits
  for the batch to end. `cudagraphs=True` batches do not take joins.
* **Leave: between cycles.** A row ends at its own stops (max_tokens, EOS, stop_token_ids, stop strings, checked
  token by token in `RowStops`) or when its client disconnects, at the end of the cycle in which that happens:
  its response goes out at once, and from the next cycle the decoder writes nothing for it (an inactive row
  writes only the sentinel slot) until a joining request takes the row.
* **Speculation fitted to the load.** The decoder runs with `calibrate="on"` unless the options say otherwise:
  for each batch bucket and context bucket it measures (or reads from its cost cache) what every program of
  the menu costs, and each cycle runs the one with the most expected tokens per second for the rows it has.

Greedy output is exactly `eagle_compile.generate`'s greedy output for the request alone (rows never share a
cache row, and padded rows never change real rows: TESTING.md invariants 7 and 9).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable

import torch

from eagle_compile.options import parse_options
from eagle_compile.runtime.generate import decoder_for
from eagle_compile.serve.metrics import ServeMetrics
from eagle_compile.serve.protocol import GenerationRequest, RequestError
from eagle_compile.serve.row import Event, Row
from eagle_compile.serve.scheduler import Scheduler, group_key
from eagle_compile.serve.stops import RowStops

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model, tokenizer, draft, options: dict | None = None, *, model_name: str,
                 max_rows: int | None = None, join_tokens: int = 1024) -> None:
        options = dict(options or {})
        options.setdefault("calibrate", "on")            # the server speculates as much as its load pays for
        self.options = parse_options(options)
        self.model = getattr(model, "_orig_mod", model)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.decoder = decoder_for(self.model, draft if draft is not None else self.options.draft, self.options)
        self.max_rows = min(max_rows or self.options.batch_buckets[-1], self.options.batch_buckets[-1])
        self.eos = _eos_ids(self.model, tokenizer)
        self.window = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        self.vocab = self.model.get_input_embeddings().num_embeddings
        self.metrics = ServeMetrics()
        self.scheduler = Scheduler(self.max_rows)
        self.running: list[Row] = []
        self.join_tokens = join_tokens
        self.joins = self.regroups = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eagle31-engine", daemon=True)
        self.batches = 0

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.scheduler.close()
        for row in list(self.running):
            row.abort()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- requests ----------------------------------------------------------------------------------------------
    def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids: the text tokenized, or the chat template applied to the messages."""
        if request.kind == "chat":
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise RequestError(f"the model {self.model_name!r} has no chat template; use /v1/completions",
                                   param="messages")
            ids = self.tokenizer.apply_chat_template(list(request.messages), add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = self.tokenizer(request.prompt)["input_ids"]
        ids = list(ids)
        if not ids:
            raise RequestError("the prompt tokenizes to no token", param="prompt")
        if self.window is not None and len(ids) + request.max_tokens > self.window:
            raise RequestError(f"the prompt has {len(ids)} tokens and max_tokens is {request.max_tokens}: together "
                               f"more than the model's context window of {self.window} tokens; shorten the prompt "
                               "or lower max_tokens", param="max_tokens")
        if max(ids) >= self.vocab:
            raise RequestError(f"the tokenizer gave id {max(ids)}, outside the model's vocabulary of {self.vocab}",
                               param="prompt")
        return ids

    def submit(self, request: GenerationRequest, sink: Callable[[Event], None]) -> Row:
        """Queue a validated request; its events (deltas, done, error) go to `sink` from the worker thread."""
        ids = self.prompt_ids(request)
        row = Row(request, ids, sink, self.tokenizer, frozenset(self.eos) | frozenset(request.stop_token_ids))
        self.scheduler.submit(row)
        self.metrics.waiting.set(self.scheduler.waiting)
        return row

    # -- the worker ------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            rows = self.scheduler.next_batch(timeout=0.2)
            self.metrics.waiting.set(self.scheduler.waiting)
            if rows:
                self._decode(rows)

    def _decode(self, rows: list[Row]) -> None:
        """Decode one batch until none of its rows runs and no waiting request can join it."""
        bucket = self.decoder.bucket_for(len(rows))
        stops = RowStops(rows + [None] * (bucket - len(rows)))
        self._start(rows, len(rows))
        self.metrics.batch_started(len(rows))
        pad = torch.tensor(rows[0].prompt_ids[:1], dtype=torch.long, device=self._device)
        prompts = [torch.tensor(r.prompt_ids, dtype=torch.long, device=self._device) if r is not None else pad
                   for r in stops.rows]
        request = rows[0].request
        generator = None
        if request.seed is not None and request.sampling.do_sample:
            generator = torch.Generator(self._device).manual_seed(request.seed)
        key = group_key(rows[0])
        session = None
        try:
            settings = [(r or rows[0]).request.sampling for r in stops.rows]    # padding rows: any setting
            session = self.decoder.session(prompts, stops, settings, generator, min_slots=self.cache_room(bucket))
            while True:
                self._release(session, stops)
                if session.joinable is None and not self._stop.is_set():
                    self._admit(session, stops, key)
                if not session.running:
                    break
                session.cycle()
        except Exception as error:      # noqa: BLE001 -- the batch fails and says why; the server keeps serving
            log.error("batch of %d rows failed: %s", len(rows), traceback.format_exc())
            for row in stops.rows:
                if row is not None and row.finish_reason is None:
                    row.fail(f"decoding failed: {error}")
                    self.metrics.requests.labels(row.request.kind, "error").inc()
        else:
            self.metrics.batch(session.finish())
        finally:
            self.running = []
            self.metrics.running.set(0)
            self.batches += 1

    def cache_room(self, bucket: int) -> int:
        """Cache slots a batch of this bucket allocates at least: `join_tokens` per row, for requests joining."""
        return self.decoder.slots_needed(self.join_tokens, 0, bucket)

    def _start(self, rows: list[Row], batch_rows: int) -> None:
        now = time.perf_counter()
        for row in rows:
            row.started, row.batch_rows = now, batch_rows

    def _release(self, session, stops: RowStops) -> None:
        """Rows whose request ended in the last cycle (a stop, an abort, NaN logits) become free."""
        for b, row in enumerate(stops.rows):
            if row is None or bool(session.active[b]):
                continue
            if row.finish_reason is None:        # the decoder ended the row without a stop (NaN logits)
                row.fail(session.stats.errors.pop(b, "the decoder ended the row without a stop"))
            if row.finish_reason not in ("abort", "error"):
                self.metrics.finished(row)
            else:
                self.metrics.requests.labels(row.request.kind, row.finish_reason).inc()
            stops.release(b)
        self.running = [r for r in stops.rows if r is not None]
        self.metrics.running.set(len(self.running))

    def _admit(self, session, stops: RowStops, key: tuple) -> None:
        """Waiting requests of this batch's group join it (a larger bucket first if they need one); with
        nobody joining, a batch that runs in at most half its bucket moves to a smaller one."""
        running = len(self.running)
        joining = self.scheduler.take(key, self.max_rows - running,
                                      lambda r: session.fits(len(r.prompt_ids), r.request.max_tokens))
        self.metrics.waiting.set(self.scheduler.waiting)
        want = self.decoder.bucket_for(max(running + len(joining), 1))
        grow = bool(joining) and want > session.batch
        shrink = not joining and session.running and want <= session.batch // 2
        if grow or shrink:
            order = [b for b in range(session.batch) if bool(session.active[b])]
            session.regroup(order, want)
            self.regroups += 1
            self.metrics.regroups.inc()
        if not joining:
            return
        free = session.free_rows()[:len(joining)]
        for b, row in zip(free, joining, strict=True):
            stops.put(b, row)
        self._start(joining, running + len(joining))
        session.join(free, [torch.tensor(r.prompt_ids, dtype=torch.long, device=self._device) for r in joining],
                     [r.request.sampling for r in joining])
        self.joins += len(joining)
        self.metrics.joins.inc(len(joining))
        self.running = [r for r in stops.rows if r is not None]
        self.metrics.running.set(len(self.running))

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def describe(self) -> dict:
        d = self.decoder
        return {"model": self.model_name, "speculate": d.speculate, "tree": d.tree_stats(),
                "lowering": d.lowering.describe(), "calibrate": self.options.calibrate,
                "batch_buckets": list(self.options.batch_buckets), "max_rows": self.max_rows,
                "batching": f"join and leave between cycles (up to {self.join_tokens} tokens "
                                                                  "per joining row)", "eos_token_ids": sorted(self.eos)}


def _eos_ids(model, tokenizer) -> set[int]:
    """The target's EOS ids (its generation config, else the tokenizer's)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
