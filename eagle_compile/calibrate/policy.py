"""The decision rule: which menu program runs this cycle, which rows draft inside it, when to fall back.

Each cycle, with measured costs t_s (a cycle of program s, in plain steps: t_plain = 1) and the rows' expected
tokens E_{s,r} (`acceptance.AcceptanceEstimates`), the batch runs the program with the most expected tokens per
unit of measured time,

    rate_s = sum_r E_{s,r} / t_s        (rows that do not draft count E = 1; plain: rate = rows),

which is vLLM's "accepted tokens per millisecond" and SpecDec++'s stop rule in batch form: at a large batch
t_s grows with the tokens verified, so speculation shrinks by itself. Rows draft inside the batch's program
only while their own chance of accepting the first draft token is at least `row_min_accept` (below it, E - 1 <=
D * alpha_1 is next to nothing); the others are masked (static shapes) and emit the plain token, with their own
probes.

Which draft program to try and whether to speculate at all are two questions. The first is answered with an
upper confidence bound on each program's rate (`optimism` standard errors on every alpha_d,
`AcceptanceEstimates.optimistic_alpha`): without it, what was seen first locks the choice in. A tree's alpha
is borrowed from the chain's until the tree has run, so a top-2 tree that accepts far more than the chain is
never tried (Spec-Bench qa with the stage-6 head, 2026-12-07: the 4x2x8 tree fixed ran 1.34x the plain mode,
the adaptive layer 1.00x, rating that tree from chain 1's alpha 0.23); and a few early failures at depth 2 pin
depths 2-4 low while the probes, always chain 1, never look again. The second is answered by the means when
speculation starts (the picked program runs only if its mean rate beats the plain step's by the margin, else the
best mean does, else the plain step) and by the bound while it runs (hysteresis, below); optimism never keeps a
useless head out of fallback: its alpha near 0 gets almost no bonus. Probes run the picked program.

Hysteresis, so the choice does not flap on noise: the running program is replaced only by one whose rate is
`margin` higher; speculation starts only when a program's mean rate is `margin` above the plain step's (a gain
inside the margin is inside the costs' noise) and, once running, stops only when even its upper bound is not (a
few failures of a head accepted 35 % of the time must not cost a fallback). Fallback: when the plain step wins,
the batch decodes plainly; after `backoff` plain cycles it probes (the picked draft program, to refresh the
estimates that plain cycles cannot update). A probe is a run of up to `probe_cycles` cycles: it ends as soon as a
speculative program wins back (the backoff resets), and only a whole run that does not win back doubles the
backoff, up to `max_backoff`, or to `useful_max_backoff` while the head may pay (below): a prompt whose first
tokens are hard for a good head must not lose its easy middle to a 64-cycle wait. One cycle says little: a head
whose first draft token is accepted half the time fails a one-cycle probe half the time, and five failed probes
in a row kept such a prompt (Spec-Bench qa, tau 1.88 with the head's fixed chain) in plain decoding for 121 of
its 127 cycles. That reason holds only for a head that may pay somewhere: when even the head-wide estimate
(every row and call so far) raised by `probe_optimism` standard errors says no draft program beats the plain
step, a failed probe cycle ends its run and the backoff grows to `max_backoff` (an untrained head's three-cycle
runs: Spec-Bench mt_bench 0.94x the plain mode, 2026-12-07). A batch probe drafts every row and so re-checks
each row's own mask. Rows in fallback inside a speculative batch probe one cycle at a time, each on its own
schedule, and stay masked until their probe.

Shadow drafting (`shadow`, greedy calls; the runtime sets it): the re-sync's catch-up over fallback's plain
steps scores the draft's first-level proposal after each of them, so greedy fallback needs no probe. Every
fallback cycle is plain; after `backoff` plain cycles (`shadow_due`) the runtime scores them and `after_shadow`
leaves fallback for the shallowest chain (the one depth observed) when its mean rate wins by the margin, else
backs off as a failed probe run does. Sampling keeps the probes (its acceptance needs the target's
probabilities, which plain steps do not keep).

The copy branch (prompt lookup, `draft/lookup.py`) is known before the cycle: a copy-only program gains only
on rows whose lookup matched, estimated per match length (`menu.copy_family`; each length is tried `explore`
times first, since nothing else predicts it), and it is weighed even in fallback: a cycle whose matches make it
beat the plain step by the margin runs it (the draft's worth is unknown there, the matches are not).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from eagle_compile.calibrate.acceptance import AcceptanceEstimates
from eagle_compile.calibrate.costs import expected_tokens
from eagle_compile.calibrate.menu import PLAIN, MenuEntry, copy_family


@dataclass
class Decision:
    entry: MenuEntry
    drafting: torch.Tensor        # [rows] bool: rows whose draft nodes may be accepted this cycle
    probe: bool                   # a fallback probe (the batch's or some row's)
    rates: dict[str, float]       # expected tokens per plain-step time of every program


@dataclass
class PolicyStats:
    chosen: Counter = field(default_factory=Counter)   # cycles per program name
    plain_cycles: int = 0                              # batch cycles in fallback (plain steps)
    probes: int = 0                                    # batch probes out of fallback
    row_probes: int = 0                                # per-row probes inside speculative cycles
    row_fallback_cycles: int = 0                       # row-cycles masked to plain inside a speculative program
    switches: int = 0                                  # changes of program between consecutive cycles
    fallbacks: int = 0                                 # entries into batch fallback
    fallback_copies: int = 0                           # copy-branch cycles run while in fallback (a match won)
    explorations: int = 0                              # copy cycles run to learn a match length's acceptance
    shadow_checks: int = 0                             # fallback checks from shadow drafting (greedy: no probe)
    shadow_tokens: int = 0                             # draft proposals scored against plain steps' tokens

    def as_dict(self) -> dict:
        return {"chosen": dict(self.chosen), "plain_cycles": self.plain_cycles, "probes": self.probes,
                "row_probes": self.row_probes, "row_fallback_cycles": self.row_fallback_cycles,
                "switches": self.switches, "fallbacks": self.fallbacks, "fallback_copies": self.fallback_copies,
                "explorations": self.explorations, "shadow_checks": self.shadow_checks,
                "shadow_tokens": self.shadow_tokens}


class CalibrationPolicy:
    def __init__(self, menu: tuple[MenuEntry, ...], *, margin: float = 0.05, row_min_accept: float = 0.08,
                 min_backoff: int = 4, max_backoff: int = 128, useful_max_backoff: int = 16,
                 explore: float = 1.5, probe_cycles: int = 3, optimism: float = 0.5,
                 probe_optimism: float = 2.0) -> None:
        if menu[0].shape is not None:
            raise ValueError("the menu's first entry must be the plain step")
        self.menu = menu
        self.margin, self.row_min_accept = margin, row_min_accept
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.useful_max_backoff = useful_max_backoff    # the cap while the head may pay elsewhere (_head_may_pay)
        self.probe_cycles = probe_cycles
        self.explore = explore          # discounted copy cycles a match length needs (1.5: two) first
        self.optimism = optimism        # standard errors added to alpha when picking which draft program to try
        self.probe_optimism = probe_optimism    # ... to the head-wide alpha when deciding to go on probing
        self.shadow = False             # greedy: fallback is left on shadow drafting's evidence, never probed
        self.reset(0)

    def reset(self, rows: int) -> None:
        """A new generate call of `rows` rows: no current program, no fallback, fresh statistics."""
        self.stats = PolicyStats()
        self.current: MenuEntry | None = None
        self.in_fallback = False
        self.backoff = self.min_backoff
        self.wait = 0
        self.probe_left = 0             # cycles left in the running probe run (0: none running)
        self.probe_entry: MenuEntry | None = None
        self.row_backoff = torch.full((rows,), self.min_backoff, dtype=torch.long)
        self.row_wait = torch.zeros(rows, dtype=torch.long)
        self.row_plain = torch.zeros(rows, dtype=torch.bool)

    def select_rows(self, index: list[int], fresh: list[bool]) -> None:
        """Rows moved or replaced in a running batch (as `AcceptanceEstimates.select_rows`)."""
        idx, new = torch.tensor(index), torch.tensor(fresh)
        self.row_backoff = torch.where(new, self.min_backoff, self.row_backoff[idx])
        self.row_wait = torch.where(new, 0, self.row_wait[idx])
        self.row_plain = torch.where(new, False, self.row_plain[idx])

    # -- the rule ---------------------------------------------------------------------------------------------
    def rates(self, costs: dict[str, float], est: AcceptanceEstimates, active: torch.Tensor,
              drafting: torch.Tensor, matched: torch.Tensor | None = None,
              entries: list[MenuEntry] | None = None, optimism: float = 0.0) -> dict[str, float]:
        """Expected tokens per plain-step time of the plain step and of `entries` (default: the whole menu's
        speculative programs). A copy-only program gains only on rows whose lookup found a match (`matched`;
        None: every row). `optimism` > 0: the draft programs' upper confidence bounds
        (`AcceptanceEstimates.optimistic_alpha`; copies keep their means, they have their own exploration)."""
        rows = float(active.sum())
        out = {PLAIN: rows / costs[PLAIN]}
        live = active & drafting
        for e in self.menu[1:] if entries is None else entries:
            gain = float(torch.where(live, self._expected(est, e, matched, optimism) - 1.0, 0.0).sum())
            out[e.name] = (rows + gain) / costs[e.name]          # rows not drafting count E = 1
        return out

    def _expected(self, est: AcceptanceEstimates, entry: MenuEntry, matched: torch.Tensor | None,
                  optimism: float = 0.0) -> torch.Tensor:
        """[rows] expected tokens of a cycle of `entry`; a copy-only program's from each row's match length
        (1 where the lookup found nothing)."""
        if not entry.copy_only:
            return est.expected_tokens(entry.family, entry.depth, optimism)
        if matched is None:
            return est.expected_tokens(entry.family, entry.depth)
        out = torch.ones(matched.shape[0], dtype=torch.float64)
        for n in sorted(set(matched.tolist()) - {0}):
            out = torch.where(matched == n, est.expected_tokens(copy_family(entry, n), entry.depth), out)
        return out

    def decide(self, costs: dict[str, float], est: AcceptanceEstimates, active: torch.Tensor,
               matched: torch.Tensor | None = None) -> Decision:
        """The program for this cycle. costs: {name: cycle time in plain steps}; active: [rows] bool;
        matched: [rows] the n-gram length each row's copy-branch lookup matched this cycle (0: none; None: no
        lookup)."""
        explore = self._copy_to_explore(est, active, matched)
        if explore is not None:
            return explore
        if self.in_fallback:           # a copy match that pays runs first (a probe due or running waits for it)
            copy = self._copy_in_fallback(costs, est, active, matched)
            if copy is not None:
                self.wait += self.probe_left == 0
                return copy
        if self.in_fallback and self.probe_left == 0 and (self.shadow or self.wait + 1 < self.backoff):
            # between probes; with shadow drafting every fallback cycle is plain (`after_shadow` ends it)
            self.wait += 1
            self._book(self.menu[0], False)
            return Decision(entry=self.menu[0], drafting=torch.zeros_like(active), probe=False, rates={})
        by_name = {e.name: e for e in self.menu}
        spec = list(self.menu[1:])
        best_spec = max(spec, key=lambda e: self._row_free_rate(costs, est, active, e, matched))
        drafting = self._rows_drafting(est, best_spec, active)
        rates = self.rates(costs, est, active, drafting, matched)
        bound = self.rates(costs, est, active, drafting, matched, optimism=self.optimism) if self.optimism else rates
        pick = max(spec, key=lambda e: bound[e.name])        # the draft program most worth trying
        probe = False
        if self.in_fallback:
            if self.probe_left == 0:
                self.wait += 1
            if self.probe_left > 0 or self.wait >= self.backoff:     # a probe run of the best draft program
                if self.probe_left == 0:                             # (copies need no probe)
                    drafts = [e for e in spec if not e.copy_only] or spec
                    probe_bound = self.rates(costs, est, active, active, matched, drafts, self.optimism)
                    self.probe_entry = max(drafts, key=lambda e: probe_bound[e.name])
                    self.probe_left = self.probe_cycles
                self.probe_left -= 1
                chosen, probe = self.probe_entry, True
                drafting = active.clone()
                # a batch probe drafts every row, so each row's own mask is re-checked against its estimate
                # afterwards (kept, a row masked while the batch fell back would pull the batch straight back)
                self.row_plain &= ~active
            else:
                chosen = by_name[PLAIN]
        else:
            cur = self.current
            if cur is None or cur.shape is None or bound[pick.name] > bound[cur.name] * (1 + self.margin):
                chosen = pick
            else:
                chosen = cur
            # whether to speculate at all: starting a call, the best mean must beat the plain step by the
            # margin; once speculating, the layer stays until even the bound fails to (hysteresis: a few
            # failures of a head accepted 35 % of the time must not cost a fallback, its backoff and re-sync)
            gate = bound if cur is not None and cur.shape is not None else rates
            if gate[chosen.name] <= rates[PLAIN] * (1 + self.margin):
                chosen = max(spec, key=lambda e: gate[e.name])
                if gate[chosen.name] <= rates[PLAIN] * (1 + self.margin):
                    chosen = by_name[PLAIN]
            if chosen.shape is None:
                self.in_fallback, self.wait = True, 0
                self.stats.fallbacks += 1
        if chosen.copy_only:
            drafting = _matched_rows(active, matched)
        elif chosen.shape is not None and not probe:
            probe = self._row_probes(drafting, active)
        self._book(chosen, probe and self.in_fallback)
        return Decision(entry=chosen, drafting=drafting & active, probe=probe, rates=rates)

    def after_probe(self, costs: dict[str, float], est: AcceptanceEstimates, active: torch.Tensor,
                    matched: torch.Tensor | None = None) -> None:
        """After a batch probe cycle's outcome was recorded: leave fallback if a speculative program now wins by
        the margin; else the probe run goes on, or, when it is over, back off further."""
        if self._won_back(costs, est, active, matched):
            return
        may_pay = self._head_may_pay(costs, est)
        if self.probe_left > 0 and not may_pay:
            self.probe_left = 0          # nothing says the failure was bad luck: the run ends after one cycle
        if self.probe_left == 0:
            self._back_off(may_pay)

    def shadow_due(self) -> bool:
        """Whether the plain steps since the last check should be caught up and scored now (shadow drafting)."""
        return self.shadow and self.in_fallback and self.wait >= self.backoff

    def after_shadow(self, costs: dict[str, float], est: AcceptanceEstimates, active: torch.Tensor) -> None:
        """After the fallback's plain steps were caught up and their first-level draft proposals scored (as
        one-level chain cycles): leave fallback for the shallowest chain if its mean rate now beats the plain
        step by the margin; else wait twice as long for the next check, up to the probe backoff's caps.

        Only the shallowest chain: shadow drafting observes depth 1 alone, and a deeper program's rate would
        rest on depths it never saw (borrowed from depth 1, with their counts decayed by the scored columns).
        Leaving for chain 4 on that evidence ran 0.50x the plain mode on an alpaca chat prompt (2026-12-07);
        once out of fallback, the running program's own outcomes say whether deeper programs pay."""
        self.stats.shadow_checks += 1
        # the scored steps re-checked every active row's first depth, as a batch probe does: a row masked
        # before the fallback is released (kept, it would send the batch straight back to plain steps)
        self.row_plain &= ~active
        chains = [e for e in self.menu[1:] if e.family == "chain"]
        if not self._won_back(costs, est, active, entries=[min(chains, key=lambda e: e.depth)]):
            self._back_off(self._head_may_pay(costs, est))

    def _won_back(self, costs, est, active, matched=None, entries: list[MenuEntry] | None = None) -> bool:
        """Leave fallback for the best of `entries` (default: every speculative program) if its mean rate beats
        the plain step by the margin."""
        entries = list(self.menu[1:]) if entries is None else entries
        rates = self.rates(costs, est, active, torch.ones_like(active), matched, entries)
        best = max(entries, key=lambda e: rates[e.name])
        if rates[best.name] <= rates[PLAIN] * (1 + self.margin):
            return False
        self.in_fallback, self.backoff, self.current, self.probe_left = False, self.min_backoff, best, 0
        return True

    def _back_off(self, may_pay: bool) -> None:
        """Wait twice as long before the next probe or shadow check, up to the cap for this head."""
        cap = self.useful_max_backoff if may_pay else self.max_backoff
        self.backoff = min(2 * self.backoff, max(cap, self.min_backoff))
        self.wait = 0

    # -- parts ------------------------------------------------------------------------------------------------
    def _head_may_pay(self, costs: dict[str, float], est: AcceptanceEstimates) -> bool:
        """Whether some draft program could beat the plain step by the margin on the head-wide estimate (what
        this head does on this target over every row and call so far), raised by `probe_optimism` standard
        errors: the reason a failed probe cycle may be bad luck worth more probe cycles. A head shown useless
        everywhere gets one-cycle probes; a young estimate keeps whole runs."""
        drafts = [e for e in self.menu[1:] if not e.copy_only]
        return any(expected_tokens(est.head_optimistic_alpha(e.family, self.probe_optimism)[:e.depth].tolist())
                   / costs[e.name] > (1 + self.margin) / costs[PLAIN] for e in drafts)

    def _row_free_rate(self, costs, est, active, entry: MenuEntry, matched=None) -> float:
        gain = self._expected(est, entry, matched)
        return float(torch.where(active, gain, 0.0).sum()) / costs[entry.name]

    def _copy_to_explore(self, est, active, matched) -> Decision | None:
        """A copy-only program for a cycle where some row matched an n-gram length whose copies were tried fewer
        than `explore` times: its estimate must come from copies, since nothing else predicts it."""
        if matched is None:
            return None
        for e in self.menu[1:]:
            if not e.copy_only:
                continue
            fresh = [n for n in set(matched[active].tolist()) - {0} if est.observed(copy_family(e, n)) < self.explore]
            if fresh:
                self.stats.explorations += 1
                return self._copy_cycle(e, active, matched, {})
        return None

    def _copy_in_fallback(self, costs, est, active, matched) -> Decision | None:
        """In fallback, a copy-only program still runs for a cycle whose matches make it beat the plain step by
        the margin (the lookup's matches are known before the cycle; the draft's worth is not)."""
        copies = [e for e in self.menu[1:] if e.copy_only]
        if not copies or matched is None or not bool(((matched > 0) & active).any()):
            return None
        rates = self.rates(costs, est, active, torch.ones_like(active), matched, copies)
        best = max(copies, key=lambda e: rates[e.name])
        if rates[best.name] <= rates[PLAIN] * (1 + self.margin):
            return None
        self.stats.fallback_copies += 1
        return self._copy_cycle(best, active, matched, rates)

    def _copy_cycle(self, entry: MenuEntry, active, matched, rates) -> Decision:
        """A copy-only cycle outside the normal rule (exploration, fallback): counted, the current program and
        the fallback schedule left as they are."""
        self.stats.chosen[entry.name] += 1
        return Decision(entry=entry, drafting=_matched_rows(active, matched), probe=False, rates=rates)

    def _rows_drafting(self, est: AcceptanceEstimates, entry: MenuEntry, active: torch.Tensor) -> torch.Tensor:
        """Rows whose first draft token is accepted often enough; the others fall back (masked). A copy-only
        program masks nothing here: its rows are the ones whose lookup matched."""
        if entry.copy_only:
            return torch.ones_like(active)
        # a masked row stays masked until its probe (`_row_probes` releases it for one re-check): the others'
        # successes move its shrunk estimate, its own cycles do not, so without this it would flap at the edge
        now_plain = (est.alpha(entry.family)[:, 0] < self.row_min_accept) | self.row_plain
        entering = now_plain & ~self.row_plain
        self.row_wait = torch.where(entering, 0, self.row_wait)
        self.row_backoff = torch.where(~now_plain, self.min_backoff, self.row_backoff)
        self.row_plain = now_plain
        return ~now_plain

    def _row_probes(self, drafting: torch.Tensor, active: torch.Tensor) -> bool:
        """Rows in fallback count their cycles and draft again once their backoff is up (then back off more)."""
        masked = active & ~drafting
        self.row_wait = torch.where(masked, self.row_wait + 1, self.row_wait)
        due = masked & (self.row_wait >= self.row_backoff)
        if not bool(due.any()):
            self.stats.row_fallback_cycles += int(masked.sum())
            return False
        drafting |= due
        self.row_plain &= ~due                    # re-checked against its estimate after this probe
        self.row_wait = torch.where(due, 0, self.row_wait)
        self.row_backoff = torch.where(due, (2 * self.row_backoff).clamp(max=self.max_backoff), self.row_backoff)
        self.stats.row_probes += int(due.sum())
        self.stats.row_fallback_cycles += int((masked & ~due).sum())
        return True

    def _book(self, chosen: MenuEntry, batch_probe: bool) -> None:
        if self.current is not None and chosen.name != self.current.name and not batch_probe:
            self.stats.switches += 1
        self.stats.chosen[chosen.name] += 1
        if chosen.shape is None:
            self.stats.plain_cycles += 1
        if batch_probe:
            self.stats.probes += 1
        else:
            self.current = chosen


def _matched_rows(active: torch.Tensor, matched: torch.Tensor | None) -> torch.Tensor:
    """The rows a copy-only cycle drafts: those whose lookup matched (every active row when nothing says)."""
    return active & (matched > 0) if matched is not None else active.clone()
