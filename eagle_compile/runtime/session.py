"""One running batch of a `SpeculativeDecoder`: prefill, cycles, and rows that join, leave and regroup between cycles.

`SpeculativeDecoder.generate` is a session run to the end: `DecodeSession(...)`, `cycle()` until no row is
active, `finish()`. A server keeps the session open instead (`serve/engine.py`, continuous batching):

* **Join** (`join`): a new request takes a free row of the bucket (a row that stopped, or padding) between
  cycles. Its prompt is prefilled into that row alone (the bucket's prefill program with every other row
  writing only the sentinel slot), the draft is caught up over it, its first token is sampled, and the row's
  per-row state starts afresh: its stop checker row, its copy-branch history, its calibration estimates and
  fallback state. Rows never share a cache row, so the other rows decode on exactly as before.
* **Regroup** (`regroup`): the rows move to another batch bucket, in a given order (the caches, the row
  state, the stop checker, the copy branch and the calibration's per-row state follow them): to a larger
  bucket when requests wait and no row is free, to a smaller one when few rows are left.

Rows may each have their own sampling setting (`sampling`: one per prompt, and one per joining prompt): the
session runs each cycle with `BatchSampling.of` the running rows' settings, so a batch whose rows agree runs the
uniform programs and a mixed one the per-row programs (`runtime/sampling.py`); the settings follow the rows.

Before either, the calibration's re-sync stash (the features of plain steps the draft has not seen) is
flushed: the stash assumes rows that were active in every stashed step. What a session cannot do, it says
(`joinable`): CUDA graphs (static buffers per bucket), HF logits processors (a history per row), or a drafter
whose cache is not a `DraftKV`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch

from eagle_compile.draft.drift import DriftTotals
from eagle_compile.draft.model import DraftKV
from eagle_compile.errors import UnsupportedGenerationError
from eagle_compile.runtime.kv_cache import SlotKVCache
from eagle_compile.runtime.sampling import BatchSampling, SamplingParams
from eagle_compile.runtime.stats import GenerationStats
from eagle_compile.runtime.step import put_rows
from eagle_compile.runtime.stopping import StopChecker

_ROW_FIELDS = ("n", "root", "seed_feedback", "seed_head", "active", "drafting", "floor", "copy")

RowSettings = SamplingParams | Sequence[SamplingParams]    # one setting for every row, or one per prompt


class DecodeSession:
    """A batch in flight on `decoder`. `rows`: the batch bucket to start in (default: the smallest that holds
    the prompts); `min_slots`: cache slots to allocate at least (room for prompts that join later)."""

    def __init__(self, decoder, prompts: list[torch.Tensor], stopper: StopChecker, sampling: RowSettings,
                 generator: torch.Generator | None = None, inputs=None, *, rows: int | None = None,
                 min_slots: int = 0) -> None:
        d = self.decoder = decoder
        self.stopper, self.generator = stopper, generator
        self.stats = stats = GenerationStats(tree=d.tree_stats(), lowering=d.lowering.describe(),
                                             speculate=d.speculate)
        real = len(prompts)
        batch = d._bucket(max(real, rows or 0))
        self.settings: list[SamplingParams | None] = _row_settings(sampling, real) + [None] * (batch - real)
        self._default = self.settings[0]         # a joining row's setting when `join` is given none
        sampling = BatchSampling.of(self.settings)
        prompts = prompts + [prompts[0][:1]] * (batch - real)
        self.active = torch.tensor([not f for f in stopper.finished] + [False] * (batch - real))
        longest = max(len(p) for p in prompts)
        d.window.check(longest, stopper.max_new_tokens, d._reach(longest, stopper.max_new_tokens))
        history = d._history(sampling, inputs, batch, longest, stopper.max_new_tokens)
        slots = max(d._slots(prompts, stopper.max_new_tokens), min_slots)
        device = self.device = prompts[0].device
        graphed = self.graphed = d._graphed(sampling, device, stats)
        buffers = self.buffers = d._buffers(batch, slots, device) if graphed else None
        self.cache, self.draft_kv = (buffers.cache, buffers.draft_kv) if graphed else d._caches(batch, slots, device)

        d.drift = DriftTotals() if d.options.drift_monitors and d.speculate else None
        if d.calibration is not None:
            d.calibration.drift = d.drift
        self._timings_before = dict(d.timings)
        self._replays_before = graphed.replays if graphed else 0
        t0 = time.perf_counter()
        state = d._prefill(prompts, self.cache, self.draft_kv, sampling, generator, stopper, self.active, stats,
                           history)
        stats.prefill_time = time.perf_counter() - t0
        if graphed:
            state = buffers.hold(state)
        self.active &= torch.tensor([not f for f in stopper.finished] + [False] * (batch - real))
        if d.lookup is not None:
            d.lookup.begin([p.tolist() for p in prompts])
            state.copy = torch.full((batch, d.lookup.length), -1, dtype=torch.long, device=device)
        if d.calibration is not None:
            self._measured_before = d.calibration.measured_seconds
            d.calibration.begin(batch)
            state.drafting = torch.ones_like(state.active)
            state.floor = torch.full(state.n.shape, -math.inf, device=device)
        self.state = state
        self.lengths = [len(p) for p in prompts]
        self.joins = self.regroups = 0

    # -- properties ------------------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return int(self.state.n.shape[0])

    @property
    def sampling(self) -> SamplingParams | BatchSampling:
        """The settings of the running rows (free rows count as none): what the next cycle decodes with. A graphed
        session keeps the key its CUDA graphs were captured for: every row's, as at the start (it takes no joins)."""
        if self.graphed:
            return BatchSampling.of(self.settings)
        active = self.active.tolist()
        return BatchSampling.of([p if on else None for p, on in zip(self.settings, active, strict=True)])

    @property
    def running(self) -> bool:
        return bool(self.active.any())

    @property
    def joinable(self) -> str | None:
        """Why rows cannot join or regroup (None: they can)."""
        if self.graphed:
            return "cudagraphs=True keeps static buffers per bucket"
        if self.state.history is not None:
            return "HF logits processors keep a token history per row"
        if self.draft_kv is not None and not isinstance(self.draft_kv, DraftKV):
            return f"the drafter's cache is a {type(self.draft_kv).__name__}, not a DraftKV"
        return None

    def free_rows(self) -> list[int]:
        """Rows of the bucket that hold no running request (stopped rows and padding)."""
        return [b for b in range(self.batch) if not bool(self.active[b])]

    def fits(self, prompt_len: int, max_new: int) -> bool:
        """Whether a request of this prompt length and token budget fits the session's caches and window."""
        d = self.decoder
        try:
            d.window.check(prompt_len, max_new, d._reach(prompt_len, max_new))
        except UnsupportedGenerationError:
            return False          # a batch of its own says why
        return d.slots_needed(prompt_len, max_new, self.batch) <= self.cache.slots

    # -- cycles ----------------------------------------------------------------------------------------------
    def cycle(self) -> None:
        """One cycle over the active rows (the caller checks `running` first)."""
        d, s = self.decoder, self.state
        if d.calibration is not None:
            d._calibrated_cycle(s, self.cache, self.draft_kv, self.sampling, self.generator, self.stopper,
                                self.active, self.stats, self.lengths)
        else:
            d._cycle(s, self.cache, self.draft_kv, self.sampling, self.generator, self.stopper, self.active,
                     self.stats, self.buffers)

    # -- rows joining --------------------------------------------------------------------------------------------
    def join(self, rows: Sequence[int], prompts: Sequence[torch.Tensor], sampling: RowSettings | None = None
             ) -> None:
        """Prefill `prompts` into the free `rows` (the stop checker's rows already replaced by the caller:
        `StopChecker.replace`); each then decodes as if it had been alone from the start. `sampling`: their
        setting, or one per prompt (default: the setting the session started with for its first row)."""
        why = self.joinable
        if why is not None:
            raise RuntimeError(f"rows cannot join this batch: {why}")
        d, s = self.decoder, self.state
        busy = [b for b in rows if bool(self.active[b])]
        if busy:
            raise ValueError(f"rows {busy} are still decoding; join only into free_rows()")
        for b, p in zip(rows, prompts, strict=True):
            if not self.fits(len(p), self.stopper.row_max_new(b)):
                raise ValueError(f"a prompt of {len(p)} tokens with {self.stopper.row_max_new(b)} new tokens does "
                                 f"not fit this batch's {self.cache.slots} cache slots; start a new batch for it")
            self._leave(b)
        settings = _row_settings(self._default if sampling is None else sampling, len(rows))
        self._flush()
        t0 = time.perf_counter()
        new, ran = d.prefill_rows(list(rows), list(prompts), BatchSampling.of(settings), [True] * len(rows),
                                  self.cache, self.draft_kv, self.generator, self.stopper, self.stats)
        put_rows(s, new, list(rows))
        if s.drafting is not None:
            s.drafting[torch.tensor(list(rows), device=self.device)] = True
        self.stats.prefill_time += time.perf_counter() - t0
        for i, (b, p) in enumerate(zip(rows, prompts, strict=True)):
            self.lengths[b] = len(p)
            self.settings[b] = settings[i]
            self.active[b] = ran[i] and not self.stopper.finished[b]    # False if poisoned
            if d.lookup is not None:
                d.lookup.replace(b, p.tolist())
            if d.calibration is not None:
                d.calibration.reset_row(b)
        self.joins += len(rows)

    def _leave(self, b: int) -> None:
        """Row `b`'s request has left the session: its row statistics go (the stop checker counts its tokens)."""
        self.stats.row_acceptance.pop(b, None)

    def _flush(self) -> None:
        """Bring the draft up to date over the plain steps the calibration stashed (rows change after this)."""
        d = self.decoder
        if d.calibration is not None and d.speculate:
            d.calibration.resync(self.state, self.draft_kv, self.cache.slots)

    # -- regrouping ----------------------------------------------------------------------------------------------
    def regroup(self, order: Sequence[int | None], rows: int | None = None) -> None:
        """Move to the bucket of `rows` (default len(order)) rows: new row i is old row `order[i]` (None, and
        every row past `order`: a free padding row). Rows not in `order` must have stopped."""
        why = self.joinable
        if why is not None:
            raise RuntimeError(f"the batch cannot regroup: {why}")
        d = self.decoder
        batch = d._bucket(max(rows or 0, len(order)))
        kept = {b for b in order if b is not None}
        dropped = [b for b in range(self.batch) if b not in kept]
        if any(bool(self.active[b]) for b in dropped):
            raise ValueError(f"regroup would drop running rows {[b for b in dropped if bool(self.active[b])]}")
        for b in dropped:
            self._leave(b)
        self._flush()
        index = [0 if b is None else b for b in order] + [0] * (batch - len(order))
        live = torch.tensor([b is not None for b in order] + [False] * (batch - len(order)))
        idx = torch.tensor(index, device=self.device)
        cache = SlotKVCache(d.model.config, batch, self.cache.slots, dtype=self.cache.layers[0].keys.dtype,
                            device=self.device)
        for new, old in zip(cache.layers, self.cache.layers, strict=True):
            new.keys.copy_(old.keys.index_select(0, idx))
            new.values.copy_(old.values.index_select(0, idx))
        self.cache = cache
        if self.draft_kv is not None:
            self.draft_kv = DraftKV(keys=self.draft_kv.keys.index_select(0, idx).contiguous(),
                                    values=self.draft_kv.values.index_select(0, idx).contiguous())
        s = self.state
        for name in _ROW_FIELDS:
            value = getattr(s, name)
            if value is not None:
                setattr(s, name, value.index_select(0, idx.to(value.device)).contiguous())
        s.active &= live.to(s.active.device)
        self.active = self.active[torch.tensor(index)] & live
        self.lengths = [self.lengths[i] if on else 1 for i, on in zip(index, live.tolist(), strict=True)]
        self.settings = [self.settings[i] if on else None for i, on in zip(index, live.tolist(), strict=True)]
        self.stopper.select(index, live.tolist())
        self.stats.row_acceptance = {i: self.stats.row_acceptance[b] for i, b in enumerate(order)
                                     if b is not None and b in self.stats.row_acceptance}
        self.stats.errors = {i: self.stats.errors[b] for i, b in enumerate(order)
                             if b is not None and b in self.stats.errors}
        if d.lookup is not None:
            d.lookup.select(index, live.tolist())
        if d.calibration is not None:
            d.calibration.select_rows(index, live.tolist())
        self.regroups += 1

    # -- the end ---------------------------------------------------------------------------------------------------
    def finish(self) -> GenerationStats:
        """The call's statistics (the loop has ended: no row active)."""
        d, stats, stopper = self.decoder, self.stats, self.stopper
        if d.calibration is not None:
            stats.calibration = d.calibration.summary()
            stats.calibration_time = d.calibration.measured_seconds - self._measured_before
        if self.graphed:
            stats.cuda_graph_replays = self.graphed.replays - self._replays_before
        if d.drift is not None:
            stats.drift = d.drift.read()
        if stats.errors:
            d._report_errors(stats, self.buffers)
        stats.new_tokens = stopper.retired_tokens + sum(len(g) for g in stopper.generated)
        reached = max([stopper.retired_longest]
                      + [n + len(g) for n, g in zip(self.lengths, stopper.generated, strict=False)])
        for kind, note in d.window.notes(reached, drafted=d.speculate).items():
            d._note(stats, kind, note)
        for phase, seconds in d.timings.items():
            setattr(stats, f"{phase}_time", seconds - self._timings_before.get(phase, 0.0))
        stats.graphs_captured = d.graphs_captured
        stats.compile_time = d.lowering.compile_seconds
        return stats


def _row_settings(sampling: RowSettings, rows: int) -> list[SamplingParams]:
    """One `SamplingParams` per row, from one for all or a sequence of one per row."""
    if isinstance(sampling, SamplingParams):
        return [sampling] * rows
    settings = list(sampling)
    if len(settings) != rows or not all(isinstance(p, SamplingParams) for p in settings):
        raise ValueError(f"sampling: one SamplingParams for every row, or a sequence of {rows} (one per prompt); "
                         f"got {sampling!r}")
    return settings
