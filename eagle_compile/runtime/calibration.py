"""The calibration layer at run time (DESIGN.md §4): measured costs, the per-cycle choice, fallback, re-sync.

`Calibration` is owned by a `SpeculativeDecoder` with a menu of programs (`calibrate/menu.py`). Per generate
call and cycle:

1. **Costs.** For the call's batch bucket and the context bucket of its longest row, the cycle time of every
   menu program is looked up in the `CostCache` or measured now (each program run once to capture it, then
   interleaved rounds) on the call's own caches, at a scratch row state placed past every row's committed
   tokens: the writes of a measured cycle land in slots no query reads before a real cycle rewrites them.
   When the longest row crosses into the next context bucket, that bucket's costs are fetched the same way.
2. **Choice.** `CalibrationPolicy.decide` picks the program; the rows that draft and the node floor are copied
   into the row state (masking inside the program, shapes stay static).
3. **Outcome.** One host read per cycle carries the accepted lengths, the emitted tokens, whether the target's
   logits were usable and the per-depth draft confidence (packed into one int64 tensor, `step.read_cycle`);
   estimates and the confidence map are updated from it, leaving out rows that met NaN/+inf logits.
4. **Re-sync.** A plain step leaves the draft behind by one token; its target features are kept on the device,
   and before the next speculative cycle one catch-up forward over all of them brings the draft's KV and seeds
   up to date (EAGLE catch-up, EAGLE31_SPEC.md §4.1): the draft never runs during fallback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from eagle_compile.calibrate.acceptance import AcceptanceEstimates, ConfidenceMap
from eagle_compile.calibrate.costs import (
    CostCache,
    CostKey,
    CostTable,
    context_bucket,
    device_name,
    draft_fingerprint,
    interleaved_times,
    target_fingerprint,
    verify_call,
)
from eagle_compile.calibrate.menu import MenuEntry, copy_family, families
from eagle_compile.calibrate.observed import ObservedCosts
from eagle_compile.calibrate.policy import CalibrationPolicy
from eagle_compile.core.masks import SlotMask
from eagle_compile.core.verify import draw_uniforms
from eagle_compile.runtime.step import CycleRead, StepState, at_last, catch_up_columns, read_cycle

_CONF_SCALE = 1 << 24          # confidence in [0, 1] packed as an int64 beside the tokens: one host read
RESYNC_COLUMNS = 64            # re-sync the draft after this many plain steps even in fallback (bounds memory)


@dataclass
class CalibrationSettings:
    repeats: int = 3               # timed rounds per program when measuring costs
    warmup: int = 1                # untimed rounds (after each program's first, capturing, call)
    min_accept: float = 0.02       # nodes whose calibrated acceptance is below this are not grown


class Calibration:
    def __init__(self, decoder, menu: tuple[MenuEntry, ...], cache: CostCache,
                 settings: CalibrationSettings | None = None) -> None:
        self.decoder = decoder
        self.menu = menu
        self.cache = cache
        self.settings = settings or CalibrationSettings()
        self.estimates = AcceptanceEstimates(families(menu, decoder.options.copy_ngram), rows=0)
        self.confidence = ConfidenceMap()
        self.policy = CalibrationPolicy(menu)
        self.tables: dict[CostKey, CostTable] = {}     # cost tables in use by this decoder (for explain)
        self._stash: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._costs: dict[str, float] = {}              # the current table's relative costs
        self._key: CostKey | None = None
        self.observed = ObservedCosts()                 # cycle times seen (kept across calls, fading with time)
        self._context = 0
        self.measured_seconds = 0.0                     # all cost measurements of this decoder
        self.drift = None                               # the call's draft.drift.DriftTotals, when monitored
        self.shadow_drafting = True                     # False: fallback probes even when greedy (comparisons)

    # -- per call ---------------------------------------------------------------------------------------------
    def begin(self, rows: int) -> None:
        self.estimates.reset_rows(rows)
        self.policy.reset(rows)
        self._stash.clear()
        self._context = 0

    def reset_row(self, row: int) -> None:
        """A new request in `row` of the running batch: its per-row estimates and fallback state start afresh."""
        rows = len(self.policy.row_wait)
        self.select_rows(list(range(rows)), [b == row for b in range(rows)], regrouped=False)

    def select_rows(self, index: list[int], live: list[bool], regrouped: bool = True) -> None:
        """The running batch's rows moved (`DecodeSession.regroup`: new row i is old row index[i] where
        live[i], else fresh), or one was replaced (`regrouped=False`, `live` marking it). A regrouped batch may
        sit in another bucket, so the costs are looked up again at the next cycle. The re-sync stash must be
        empty (the session flushes it first)."""
        if self._stash:
            raise RuntimeError("rows changed with plain-step features still stashed; resync first")
        fresh = [not on for on in live] if regrouped else list(live)
        self.estimates.select_rows(index, fresh)
        self.policy.select_rows(index, fresh)
        if regrouped:
            self._context = 0

    def key(self, batch: int, context: int) -> CostKey:
        d = self.decoder
        param = next(d.model.parameters())
        import eagle_compile

        return CostKey(device=device_name(param.device), dtype=str(param.dtype).removeprefix("torch."),
                       target=target_fingerprint(d.model), draft=draft_fingerprint(d.drafter),
                       lowering=f"{d.lowering.describe()}; kernels={d.options.kernels}; "
                                f"step_program={d.options.step_program}",
                       menu=tuple(e.name for e in self.menu[1:]), batch_bucket=batch,
                       context_bucket=context, package=eagle_compile.__version__, torch=torch.__version__)

    def ensure_costs(self, longest: int, state: StepState, cache, draft_kv, sampling) -> None:
        """The relative costs for the context bucket of `longest` committed tokens (fetched or measured)."""
        bucket = context_bucket(longest)
        if bucket == self._context:
            return
        key = self.key(state.n.shape[0], bucket)
        table = self.cache.get(key)
        if table is None:
            table = self.measure(bucket, state, cache, draft_kv, sampling)
            self.cache.put(key, table)
        self.tables[key] = table
        self._costs, self._key = table.relative(), key
        self._context = bucket

    def measure(self, bucket: int, state: StepState, cache, draft_kv, sampling) -> CostTable:
        """Time every menu program's cycle at this batch and `bucket` tokens of context (clipped to the cache)."""
        t0 = time.perf_counter()
        d = self.decoder
        widest = max(d.cycle_writes(e.shape) for e in self.menu)
        top = int(state.n.max())
        context = max(top, min(bucket, cache.slots - widest - 2))
        batch, device = state.n.shape[0], state.n.device
        scratch = {}
        calls = {}
        for e in self.menu:
            s = StepState(n=torch.full_like(state.n, context + 1), root=state.root.clone(),
                          seed_feedback=state.seed_feedback.clone(), seed_head=state.seed_head.clone(),
                          active=torch.ones_like(state.active),
                          drafting=torch.ones_like(state.active), floor=torch.full((batch,), -torch.inf,
                                                                                   device=device),
                          copy=None if state.copy is None else torch.zeros_like(state.copy),   # every node valid
                          history=None if state.history is None else state.history.clone())
            scratch[e.name] = s
            step = d.step_for(sampling, e)
            depth, width = (e.shape.span, e.shape.width) if e.shape is not None else (0, 0)
            uniforms, final = draw_uniforms(batch, depth, width, device=device)

            h0 = None if s.history is None else s.history.length.clone()

            def call(step=step, s=s, n0=context + 1, h0=h0, u=uniforms, f=final):
                s.n.fill_(n0)
                if h0 is not None:                  # every timed cycle processes the same history
                    s.history.length.copy_(h0)
                return step(s, cache, draft_kv, u, f).accept_len.tolist()

            calls[e.name] = call
            call()                                  # the first call captures the program: not timed
        times = interleaved_times(calls, repeats=self.settings.repeats, warmup=self.settings.warmup,
                                  device=device)
        verify = {}
        if not d.options.step_program:
            sizes = sorted({e.tokens for e in self.menu})
            vcalls = {n: verify_call(d.program, cache, context, n, batch=batch) for n in sizes}
            for fn in vcalls.values():
                fn()
            verify = {n: t["median"] for n, t in interleaved_times(vcalls, repeats=self.settings.repeats,
                                                                   warmup=0, device=device).items()}
        level = self._draft_level(state, draft_kv, cache.slots, context, device)
        seconds = time.perf_counter() - t0
        self.measured_seconds += seconds
        return CostTable(cycle={name: t["median"] for name, t in times.items()}, context=context, verify=verify,
                         draft_level=level, measure_seconds=seconds,
                         source=f"measured now ({self.settings.repeats} interleaved rounds)")

    def _draft_level(self, state, draft_kv, slots: int, context: int, device) -> float | None:
        """Seconds of one draft level of the widest tree in the menu: a draft forward over its frontier + top-k."""
        drafter = self.decoder.drafter
        trees = [e.shape for e in self.menu if e.shape is not None]
        if drafter is None or not trees:
            return None
        k = max(s.top_k for s in trees)
        batch = state.n.shape[0]
        hidden = state.seed_feedback[:, None, :].expand(batch, k, state.seed_feedback.shape[-1])
        tokens = state.root[:, None].expand(batch, k)
        base = torch.full((batch,), context, device=device)
        positions = (base - 1)[:, None].expand(batch, k)
        write = base[:, None] + torch.arange(k, device=device)
        anc = torch.eye(k, dtype=torch.bool, device=device).expand(batch, k, k)
        mask = SlotMask.tree(anc, base, slots)

        def level():
            _, head = drafter.forward(draft_kv, hidden, tokens, positions, write, mask, fuse=False)
            return drafter.top_k(head, k)[0].sum().item()

        level()
        return interleaved_times({"level": level}, repeats=self.settings.repeats, warmup=0,
                                 device=device)["level"]["median"]

    # -- per cycle --------------------------------------------------------------------------------------------
    def cycle(self, state: StepState, cache, draft_kv, sampling, generator, active: torch.Tensor,
              longest: int, matched: torch.Tensor | None = None
              ) -> tuple[CycleRead, MenuEntry]:
        """Run one cycle; returns its host read and the program run. `matched` [B]: the n-gram length each row's
        copy-branch lookup matched (0: none; None: no copy branch). A row whose block met NaN/+inf logits
        teaches the estimates nothing."""
        d = self.decoder
        self.ensure_costs(longest, state, cache, draft_kv, sampling)
        t0, graphs = time.perf_counter(), d.graphs_captured
        costs = self.costs()
        self.policy.shadow = (self.shadow_drafting and not sampling.do_sample   # greedy: re-syncs score the
                              and "chain" in self.estimates.families)          # draft (_score_shadow)
        decision = self.policy.decide(costs, self.estimates, active, matched)
        entry = decision.entry
        if entry.shape is None:
            out = self._plain(state, cache, draft_kv, sampling, generator, active)
            read = read_cycle(out)                        # the one host read of the cycle
            self._observe(entry, t0, graphs)
            if self.policy.shadow_due():             # _plain set state.active
                self.resync(state, draft_kv, cache.slots)
                self.policy.after_shadow(self.costs(), self.estimates, active)
            return read, entry
        self.resync(state, draft_kv, cache.slots)
        state.drafting.copy_(decision.drafting.to(state.drafting.device))
        state.floor.fill_(self.confidence.floor(self.settings.min_accept))
        shape = entry.shape
        uniforms, final = draw_uniforms(state.n.shape[0], shape.span, shape.width, generator=generator,
                                        device=state.n.device)
        state.active.copy_(active)
        out = d.step_for(sampling, entry)(state, cache, draft_kv, uniforms, final)
        conf = (out.confidence.float().nan_to_num(0.0).clamp(0, 1) * _CONF_SCALE).round().long()
        read = read_cycle(out, conf)                      # the one host read of the cycle
        depth = shape.depth
        accept_len = torch.tensor(read.accept_len)
        ran = active & decision.drafting & torch.tensor(read.healthy)
        if self.drift is not None and out.drift is not None:
            self.drift.add(out.drift, ran)
        if entry.copy_only and matched is not None:    # per match length; rows with no match say nothing
            offered = torch.tensor(self.decoder.lookup.lengths)     # a proposal may be shorter than the branch
            for n in sorted(set(matched[ran].tolist()) - {0}):
                self.estimates.update(copy_family(entry, n), offered, accept_len, ran & (matched == n))
        else:
            self.estimates.update(entry.family, entry.depth, accept_len, ran)
        if depth:                                  # the map is the draft's: leave out paths the copy branch won
            drafted = ran if read.copied is None else ran & (torch.tensor(read.copied) == 0)
            self.confidence.update(read.extra.double() / _CONF_SCALE, accept_len.clamp(max=depth), depth, drafted)
        self._observe(entry, t0, graphs)              # catch-up and updates included
        if decision.probe and self.policy.in_fallback:
            self.policy.after_probe(self.costs(), self.estimates, active, matched)
        return read, entry

    def _observe(self, entry: MenuEntry, t0: float, graphs: int) -> None:
        """Count the cycle's wall time in the observed costs, unless it captured a program (a new cache size or
        bucket recaptures each program once, and dynamo's capture is not the program's cost). Before this
        check (and before cost entries were keyed by the head), the first counted cycle of a program on a new
        prompt read 21-36 plain steps in the heads benchmark of 2026-12-07 and sent an always-wrong drafter's
        probes to the 60-node tree (Spec-Bench math, 0.88x the plain mode); which of the two fixes removed
        those readings was not isolated."""
        if self.decoder.graphs_captured == graphs:
            self.observed.add(self._key, entry.name, time.perf_counter() - t0)

    def costs(self) -> dict[str, float]:
        """The relative costs the policy uses now: the table's, moved toward the cycles observed under it."""
        return self.observed.adjust(self._key, self._costs)

    def describe_costs(self, key: CostKey) -> str:
        """The table measured for `key` and how the cycles observed under it moved its costs."""
        table = self.tables[key]
        return f"{table.describe()}; {self.observed.describe(key, table.relative())}"

    def _plain(self, state, cache, draft_kv, sampling, generator, active):
        d = self.decoder
        _, final = draw_uniforms(state.n.shape[0], 0, 0, generator=generator, device=state.n.device)
        state.active.copy_(active)
        out = d.step_for(sampling, self.menu[0])(state, cache, draft_kv, None, final)
        self._stash.append((out.features[:, :1], out.tokens[:, :1]))
        if len(self._stash) >= RESYNC_COLUMNS:
            self.resync(state, draft_kv, cache.slots)
        return out

    def resync(self, state: StepState, draft_kv, slots: int) -> None:
        """Catch the draft up over the plain steps since the last speculative cycle: pairs (feature at p, token
        p+1) for the T positions those steps processed, one draft forward; rows not active keep their seeds."""
        if not self._stash:
            return
        feats = torch.cat([f for f, _ in self._stash], 1)          # [B, T, F]
        tokens = torch.cat([t for _, t in self._stash], 1)         # [B, T]
        self._stash.clear()
        span = tokens.shape[1]
        active = state.active            # a row active now was active in every stashed step (stops are final)
        base = torch.where(active, state.n - 1 - span, state.n - 1)
        last = torch.where(active, state.n - 2, base - 1)
        fb, head = catch_up_columns(self.decoder.drafter, draft_kv, slots, feats, tokens, base, last)
        if self.policy.shadow and span > 1:
            self._score_shadow(head, tokens, active)
        state.seed_feedback.copy_(torch.where(active[:, None], at_last(fb, base, last), state.seed_feedback))
        state.seed_head.copy_(torch.where(active[:, None], at_last(head, base, last), state.seed_head))

    def _score_shadow(self, heads: torch.Tensor, tokens: torch.Tensor, active: torch.Tensor) -> None:
        """Shadow drafting (greedy): the draft's first-level proposal after each caught-up plain step, the top-1
        of column j's head input, is the token a chain cycle there would have offered, and greedy verification
        accepts it iff it equals the token the target emitted next, tokens[:, j + 1]. So the catch-up a re-sync
        runs anyway scores T - 1 proposals for the cost of the draft's top-1 over them, where a probe cycle
        scores one for the cost of a cycle (the last column's proposal is the next cycle's own). One host read
        per re-sync."""
        guess = self.decoder.drafter.top_k(heads[:, :-1], 1)[1][..., 0]
        hits = (guess == tokens[:, 1:]).cpu()
        valid = active.cpu()[:, None].expand_as(hits)
        ones = torch.ones(hits.shape[0], dtype=torch.long)
        for j in range(hits.shape[1]):          # each scored proposal counts as a one-level chain cycle
            self.estimates.update("chain", 1, ones * hits[:, j], valid[:, j], offered_only=True)
        self.policy.stats.shadow_tokens += int(valid.sum())

    # -- report -----------------------------------------------------------------------------------------------
    def summary(self) -> dict:
        est = {}
        for fam in self.estimates.families:
            est[fam] = [round(float(x), 3) for x in self.estimates.head_alpha(fam)]
        return {"menu": [e.name for e in self.menu], "policy": self.policy.stats.as_dict(),
                "node_floor": self.confidence.floor(self.settings.min_accept),
                "head_alpha": est, "confidence_map": [round(float(x), 3) for x in self.confidence.values()],
                "costs": {f"batch {k.batch_bucket}, context {k.context_bucket}": self.describe_costs(k)
                          for k in self.tables},
                "refused_cache_entries": list(self.cache.refused)}

