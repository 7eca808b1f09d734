"""Cycle costs observed while decoding, blended into the measured cost table.

A `CostTable` times each menu program alone, a few interleaved rounds when a bucket is first needed. The
cycles the decoder really runs cost more: the host read and the estimates' update, and the draft's catch-up over
the plain steps before the first speculative cycle after a fallback (`runtime/calibration.py`). On the 2-core
CPU a chain-1 cycle measured 1.23 plain steps in its table and took 1.29 plain cycles of the same run, and 1.40
right after plain cycles (timed ad hoc with perf_counter around each cycle on one mt_bench prompt;
docs/BENCHMARKS.md, 2026-12-06): at a 5 % margin, that is the difference between a gain and a loss.
`ObservedCosts` keeps, per cost table and program, a discounted mean of the wall time of the cycles that ran
(the cycle's one host read is its end, so on CUDA too the time is the device's), and `adjust` moves each
program's relative cost from the table's toward observed / observed plain, by how much of both was seen.

Robust to what a wall clock on a shared machine sees: each program's first cycle per table is not counted (it
may capture the program), one cycle counts at most `clip` times the running mean of its program, and a mean's
weight fades with wall time since its last cycle (half-life `half_life_s` seconds, or `half_life_cycles` of the
program's own mean cycle if that is longer). A program's mean moves only while it runs, so without the fade a ratio
can pair a plain mean from one prompt with a chain's from another prompt minutes later, when the machine ran at
another speed: the observed-costs run of 2026-12-06 (docs/BENCHMARKS.md) rated chain 1 at 0.94-0.97 plain steps
that way, impossible for a cycle that does more work. With the fade a stale mean weighs nothing against the table,
and its next cycle replaces it rather than nudging it.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping

from eagle_compile.calibrate.menu import PLAIN


class ObservedCosts:
    """Args:
        prior_cycles: weight of the cost table, in observed cycles (it is a careful measurement; a few noisy
            cycles must not override it).
        decay: weight an older observation of a program keeps per new one (0.95: about 20 cycles).
        clip: one observation counts at most `clip` times (and at least 1 / `clip` of) its program's mean.
        half_life_s, half_life_cycles: a mean's weight halves every max(half_life_s, half_life_cycles * its mean
            cycle) seconds of wall time after its last cycle (2 s is ~60 cycles of SmolLM2-135M on the 2-core CPU;
            a 1 s cycle of a large target keeps 50 cycles).
    """

    def __init__(self, *, prior_cycles: float = 4.0, decay: float = 0.95, clip: float = 2.0,
                 half_life_s: float = 2.0, half_life_cycles: float = 50.0) -> None:
        self.prior_cycles, self.decay, self.clip = prior_cycles, decay, clip
        self.half_life_s, self.half_life_cycles = half_life_s, half_life_cycles
        self._seen: set[tuple[Hashable, str]] = set()          # (table key, program) whose first cycle passed
        self._count: dict[tuple[Hashable, str], float] = {}    # discounted cycles
        self._mean: dict[tuple[Hashable, str], float] = {}     # discounted mean seconds
        self._last: dict[tuple[Hashable, str], float] = {}     # monotonic time of the last counted cycle

    def add(self, key: Hashable, name: str, seconds: float, now: float | None = None) -> None:
        """One cycle of program `name` under cost table `key` took `seconds` (wall time through its host read),
        ending at `now` (time.monotonic() if None)."""
        slot = (key, name)
        if slot not in self._seen:              # the first cycle may include the program's capture
            self._seen.add(slot)
            return
        now = _now(now)
        count, mean = self._weight(slot, now), self._mean.get(slot)
        if mean is not None and count > 0.5:    # a faded mean is no yardstick for clipping
            seconds = min(max(seconds, mean / self.clip), mean * self.clip)
        count = count * self.decay + 1.0
        self._mean[slot] = seconds if mean is None else mean + (seconds - mean) / count
        self._count[slot], self._last[slot] = count, now

    def _weight(self, slot: tuple[Hashable, str], now: float) -> float:
        count = self._count.get(slot, 0.0)
        if not count:
            return 0.0
        half_life = max(self.half_life_s, self.half_life_cycles * self._mean[slot])
        return count * 0.5 ** (max(now - self._last[slot], 0.0) / half_life)

    def cycles(self, key: Hashable, name: str, now: float | None = None) -> float:
        """Discounted observed cycles of `name` under `key`, faded to `now` (time.monotonic() if None)."""
        return self._weight((key, name), _now(now))

    def ratio(self, key: Hashable, name: str) -> float | None:
        """Observed mean cycle of `name` over the observed mean plain cycle (None until both were seen)."""
        mean, plain = self._mean.get((key, name)), self._mean.get((key, PLAIN))
        return None if mean is None or plain is None else mean / plain

    def adjust(self, key: Hashable, relative: Mapping[str, float], now: float | None = None) -> dict[str, float]:
        """The table's relative costs (plain = 1), each moved toward its observed ratio with weight n_s n_p /
        (n_s + n_p) observed cycles, faded to `now` (the ratio is only as sure as the scarcer, or staler, of its
        two means) against the table's `prior_cycles`; never below 1, the plain step's own cost: every program
        runs a target forward of at least the plain step's tokens, so a lower ratio is the clock's noise (the
        always-wrong drafter's chain 2 read 0.70 on a 35-token Spec-Bench translation answer, 2026-12-07, and
        speculated on it)."""
        now = _now(now)
        plain_n = self.cycles(key, PLAIN, now)
        out = dict(relative)
        for name, cost in relative.items():
            ratio = self.ratio(key, name)
            if name == PLAIN or ratio is None:
                continue
            n = self.cycles(key, name, now)
            w = n * plain_n / (n + plain_n) if n + plain_n else 0.0
            out[name] = max((self.prior_cycles * cost + w * ratio) / (self.prior_cycles + w), 1.0)
        return out

    def describe(self, key: Hashable, relative: Mapping[str, float], now: float | None = None) -> str:
        """The costs in use under `key` and what moved them: `name table -> in use (n cycles weighed)`."""
        now = _now(now)
        used = self.adjust(key, relative, now)
        parts = [f"{name} {relative[name]:.2f} -> {used[name]:.2f} ({self.cycles(key, name, now):.0f} cycles)"
                 for name in relative if name != PLAIN]
        return f"observed: plain {self.cycles(key, PLAIN, now):.0f} cycles; " + ", ".join(parts)


def _now(now: float | None) -> float:
    """`now`, or the monotonic clock's reading when the caller gave none."""
    return time.monotonic() if now is None else now
