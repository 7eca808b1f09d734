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

Hysteresis, so the choice does not flap on noise: the running program is replaced only by one whose rate is
`margin` higher. Fallback: when the plain step wins, the batch decodes plainly; after `backoff` plain cycles it
probes (one cycle of the best speculative program, to refresh the estimates that plain cycles cannot update);
a probe that does not win back doubles the backoff (up to `max_backoff`), one that does resets it. Rows in
fallback inside a speculative batch probe the same way, each on its own schedule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from eagle_compile.calibrate.acceptance import AcceptanceEstimates
from eagle_compile.calibrate.menu import PLAIN, MenuEntry


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

    def as_dict(self) -> dict:
        return {"chosen": dict(self.chosen), "plain_cycles": self.plain_cycles, "probes": self.probes,
                "row_probes": self.row_probes, "row_fallback_cycles": self.row_fallback_cycles,
                "switches": self.switches, "fallbacks": self.fallbacks}


class CalibrationPolicy:
    def __init__(self, menu: tuple[MenuEntry, ...], *, margin: float = 0.05, row_min_accept: float = 0.08,
                 min_backoff: int = 4, max_backoff: int = 128) -> None:
        if menu[0].shape is not None:
            raise ValueError("the menu's first entry must be the plain step")
        self.menu = menu
        self.margin, self.row_min_accept = margin, row_min_accept
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.reset(0)

    def reset(self, rows: int) -> None:
        """A new generate call of `rows` rows: no current program, no fallback, fresh statistics."""
        self.stats = PolicyStats()
        self.current: MenuEntry | None = None
        self.in_fallback = False
        self.backoff = self.min_backoff
        self.wait = 0
        self.row_backoff = torch.full((rows,), self.min_backoff, dtype=torch.long)
        self.row_wait = torch.zeros(rows, dtype=torch.long)
        self.row_plain = torch.zeros(rows, dtype=torch.bool)

    # -- the rule ---------------------------------------------------------------------------------------------
    def rates(self, costs: dict[str, float], est: AcceptanceEstimates, active: torch.Tensor,
              drafting: torch.Tensor) -> dict[str, float]:
        rows = float(active.sum())
        out = {PLAIN: rows / costs[PLAIN]}
        live = active & drafting
        for e in self.menu[1:]:
            gain = float(torch.where(live, est.expected_tokens(e.family, e.depth) - 1.0, 0.0).sum())
            out[e.name] = (rows + gain) / costs[e.name]          # rows not drafting count E = 1
        return out

    def decide(self, costs: dict[str, float], est: AcceptanceEstimates, active: torch.Tensor) -> Decision:
        """The program for this cycle. costs: {name: cycle time in plain steps}; active: [rows] bool."""
        if self.in_fallback and self.wait + 1 < self.backoff:      # a plain cycle between probes: nothing to weigh
            self.wait += 1
            self._book(self.menu[0], False)
            return Decision(entry=self.menu[0], drafting=torch.zeros_like(active), probe=False, rates={})
        by_name = {e.name: e for e in self.menu}
        spec = list(self.menu[1:])
        best_spec = max(spec, key=lambda e: self._row_free_rate(costs, est, active, e))
        drafting = self._rows_drafting(est, best_spec, active)
        rates = self.rates(costs, est, active, drafting)
        best = max(self.menu, key=lambda e: rates[e.name])
        probe = False
        if self.in_fallback:
            self.wait += 1
            if self.wait >= self.backoff:             # probe the best speculative program once
                chosen, probe = max(spec, key=lambda e: rates[e.name]), True
                drafting = active.clone()
            else:
                chosen = by_name[PLAIN]
        else:
            cur = self.current
            if cur is None or rates[best.name] > rates[cur.name] * (1 + self.margin):
                chosen = best
            else:
                chosen = cur
            if chosen.shape is None:
                self.in_fallback, self.wait = True, 0
                self.stats.fallbacks += 1
        if chosen.shape is not None and not probe:
            probe = self._row_probes(drafting, active)
        self._book(chosen, probe and self.in_fallback)
        return Decision(entry=chosen, drafting=drafting & active, probe=probe, rates=rates)

    def after_probe(self, costs: dict[str, float], est: AcceptanceEstimates, active: torch.Tensor) -> None:
        """After a batch probe's outcome was recorded: leave fallback if a speculative program now wins by the
        margin, else back off further."""
        rates = self.rates(costs, est, active, torch.ones_like(active))
        best = max(self.menu[1:], key=lambda e: rates[e.name])
        if rates[best.name] > rates[PLAIN] * (1 + self.margin):
            self.in_fallback, self.backoff, self.current = False, self.min_backoff, best
        else:
            self.backoff = min(2 * self.backoff, self.max_backoff)
            self.wait = 0

    # -- parts ------------------------------------------------------------------------------------------------
    def _row_free_rate(self, costs, est, active, entry: MenuEntry) -> float:
        gain = est.expected_tokens(entry.family, entry.depth)
        return float(torch.where(active, gain, 0.0).sum()) / costs[entry.name]

    def _rows_drafting(self, est: AcceptanceEstimates, entry: MenuEntry, active: torch.Tensor) -> torch.Tensor:
        """Rows whose first draft token is accepted often enough; the others fall back (masked)."""
        now_plain = est.alpha(entry.family)[:, 0] < self.row_min_accept
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
