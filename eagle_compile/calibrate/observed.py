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
may capture the program), and one cycle counts at most `clip` times the running mean of its program. Not robust
to a slow drift of the machine's speed: a program's mean moves only while it runs, so two means may come from
different prompts minutes apart (docs/BENCHMARKS.md, the observed-costs run of 2026-12-06).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from eagle_compile.calibrate.menu import PLAIN


class ObservedCosts:
    """Args:
        prior_cycles: weight of the cost table, in observed cycles (it is a careful measurement; a few noisy
            cycles must not override it).
        decay: weight an older observation of a program keeps per new one (0.95: about 20 cycles).
        clip: one observation counts at most `clip` times (and at least 1 / `clip` of) its program's mean.
    """

    def __init__(self, *, prior_cycles: float = 4.0, decay: float = 0.95, clip: float = 2.0) -> None:
        self.prior_cycles, self.decay, self.clip = prior_cycles, decay, clip
        self._seen: set[tuple[Hashable, str]] = set()          # (table key, program) whose first cycle passed
        self._count: dict[tuple[Hashable, str], float] = {}    # discounted cycles
        self._mean: dict[tuple[Hashable, str], float] = {}     # discounted mean seconds

    def add(self, key: Hashable, name: str, seconds: float) -> None:
        """One cycle of program `name` under cost table `key` took `seconds` (wall time through its host read)."""
        slot = (key, name)
        if slot not in self._seen:              # the first cycle may include the program's capture
            self._seen.add(slot)
            return
        count, mean = self._count.get(slot, 0.0), self._mean.get(slot)
        if mean is not None:
            seconds = min(max(seconds, mean / self.clip), mean * self.clip)
        count = count * self.decay + 1.0
        self._mean[slot] = seconds if mean is None else mean + (seconds - mean) / count
        self._count[slot] = count

    def cycles(self, key: Hashable, name: str) -> float:
        """Discounted observed cycles of `name` under `key`."""
        return self._count.get((key, name), 0.0)

    def ratio(self, key: Hashable, name: str) -> float | None:
        """Observed mean cycle of `name` over the observed mean plain cycle (None until both were seen)."""
        mean, plain = self._mean.get((key, name)), self._mean.get((key, PLAIN))
        return None if mean is None or plain is None else mean / plain

    def adjust(self, key: Hashable, relative: Mapping[str, float]) -> dict[str, float]:
        """The table's relative costs (plain = 1), each moved toward its observed ratio with weight n_s n_p /
        (n_s + n_p) observed cycles (the ratio is only as sure as the scarcer of its two means) against the
        table's `prior_cycles`."""
        plain_n = self.cycles(key, PLAIN)
        out = dict(relative)
        for name, cost in relative.items():
            ratio = self.ratio(key, name)
            if name == PLAIN or ratio is None:
                continue
            n = self.cycles(key, name)
            w = n * plain_n / (n + plain_n)
            out[name] = (self.prior_cycles * cost + w * ratio) / (self.prior_cycles + w)
        return out

    def describe(self, key: Hashable, relative: Mapping[str, float]) -> str:
        """The costs in use under `key` and what moved them: `name table -> in use (n cycles seen)`."""
        used = self.adjust(key, relative)
        parts = [f"{name} {relative[name]:.2f} -> {used[name]:.2f} ({self.cycles(key, name):.0f} cycles)"
                 for name in relative if name != PLAIN]
        return f"observed: plain {self.cycles(key, PLAIN):.0f} cycles; " + ", ".join(parts)
