"""Acceptance measured online: per row, per menu program and per depth, and how draft confidence predicts it.

`AcceptanceEstimates` keeps, for every row and program family, discounted counts of cycles that reached draft
depth d and of those whose depth d was accepted; alpha_d = P(depth d accepted | depths < d accepted) is their
ratio, shrunk toward the head-wide estimate (shared by all rows and kept across generate calls: what this head
does on this target), which at depths it has seen little of leans on the depth above (`head_alpha`). Expected
tokens of a cycle of depth D are E = 1 + sum_j prod_{d<=j} alpha_d (EAGLE31_SPEC.md §4.3; `costs.expected_tokens`).
All chains share one family: chain k's depths are chain D's first k depths, the same events.

`ConfidenceMap` is the calibrated map from the draft's confidence at a depth (the largest cumulative draft
probability among that depth's tree nodes) to the probability that the accepted path reaches that depth,
refitted from every cycle's outcome (binned, discounted counts, made monotone). It says which nodes are not
worth growing: a node whose cumulative probability maps below `min_accept` is masked out of the tree.

Everything here is host arithmetic on the numbers the decoder reads once per cycle anyway.
"""

from __future__ import annotations

import math

import torch

#: bin edges over the draft's cumulative probability (finer near 0, where most low-confidence nodes sit)
CONFIDENCE_EDGES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class AcceptanceEstimates:
    """Per-row, per-family running estimates of conditional acceptance per depth.

    Args:
        families: {family name: its deepest depth}.
        rows: batch rows tracked.
        decay: weight an older observation keeps per new one of the same row and family (0.9: ~10 cycles).
        prior: conditional acceptance the head-wide estimate starts from; prior_weight its pseudo-count.
    """

    def __init__(self, families: dict[str, int], rows: int, *, decay: float = 0.9, prior: float = 0.5,
                 prior_weight: float = 1.0, shrink: float = 1.0, head_decay: float = 0.98) -> None:
        self.families = dict(families)
        self.decay, self.shrink, self.head_decay = decay, shrink, head_decay
        self.prior, self.prior_weight = prior, prior_weight
        self.reached = {f: torch.zeros(rows, d, dtype=torch.float64) for f, d in families.items()}
        self.passed = {f: torch.zeros(rows, d, dtype=torch.float64) for f, d in families.items()}
        self.head_reached = {f: torch.zeros(d, dtype=torch.float64) for f, d in families.items()}
        self.head_passed = {f: torch.zeros(d, dtype=torch.float64) for f, d in families.items()}
        self._cache: dict = {}        # alphas of the current counts (cleared by every update)

    def reset_rows(self, rows: int) -> None:
        """A new generate call: fresh per-row counts (the head-wide estimate carries over)."""
        for f, d in self.families.items():
            self.reached[f] = torch.zeros(rows, d, dtype=torch.float64)
            self.passed[f] = torch.zeros(rows, d, dtype=torch.float64)
        self._cache.clear()

    def select_rows(self, index: list[int], fresh: list[bool]) -> None:
        """Rows moved or replaced in a running batch: new row i keeps old row index[i]'s counts, or starts
        afresh where fresh[i] (a request that joined, or padding)."""
        idx, keep = torch.tensor(index), ~torch.tensor(fresh)[:, None]
        for f in self.families:
            self.reached[f] = torch.where(keep, self.reached[f][idx], 0.0)
            self.passed[f] = torch.where(keep, self.passed[f][idx], 0.0)
        self._cache.clear()

    def alpha(self, family: str) -> torch.Tensor:
        """[rows, D] conditional acceptance per depth."""
        key = ("rows", family)
        if key not in self._cache:
            head = self.head_alpha(family)
            self._cache[key] = (self.passed[family] + self.shrink * head) / (self.reached[family] + self.shrink)
        return self._cache[key]

    def head_alpha(self, family: str) -> torch.Tensor:
        """[D] the head-wide estimate. A depth with few observations leans on the depth above it (acceptance
        changes slowly with depth), and a tree's depth with few observations on the chains' estimate at that
        depth (a tree holds more candidates than the chain), so an unexplored program is predicted from what
        was seen, not from a constant: an oracle's first chain cycles make deeper programs look as good as they
        are, a useless head's make every program look useless. Copy families (`menu.copy_family`, "@" in the
        name) owe nothing to the draft: they start from `prior`."""
        key = ("head", family)
        if key in self._cache:
            return self._cache[key]
        borrows = family != "chain" and "chain" in self.families and "@" not in family   # copies: not the draft's
        chain = self.head_alpha("chain").tolist() if borrows else None
        reached, passed = self.head_reached[family].tolist(), self.head_passed[family].tolist()
        out, above = [], self.prior
        for d in range(len(reached)):                       # host floats: a handful of depths
            prior = above if chain is None else chain[min(d, len(chain) - 1)]
            above = (passed[d] + self.prior_weight * prior) / (reached[d] + self.prior_weight)
            out.append(above)
        self._cache[key] = torch.tensor(out, dtype=torch.float64)
        return self._cache[key]

    def observed(self, family: str) -> float:
        """Discounted head-wide cycles of `family` so far (its first depth's count)."""
        return float(self.head_reached[family][0])

    def optimistic_alpha(self, family: str, optimism: float) -> torch.Tensor:
        """[rows, D] `alpha` raised by `optimism` standard errors: alpha + optimism * sqrt(alpha (1 - alpha) /
        (n + 1)), n the discounted cycles that reached the depth (the row's and the head-wide ones), capped at 1.
        A depth or a tree seen little gets the benefit of the doubt until it is observed (the bonus shrinks as
        its counts grow; counts decay only while their family runs, so a family left alone keeps its bonus);
        a depth near 0 or 1 gets little."""
        alpha = self.alpha(family)
        if optimism <= 0:
            return alpha
        key = ("optimistic", family, optimism)
        if key not in self._cache:
            n = self.reached[family] + self.head_reached[family][None, :]
            self._cache[key] = _raised(alpha, n, optimism)
        return self._cache[key]

    def head_optimistic_alpha(self, family: str, optimism: float) -> torch.Tensor:
        """[D] `head_alpha` raised by `optimism` standard errors of its own discounted head-wide counts (as
        `optimistic_alpha`, for the head as a whole: could this head pay anywhere?)."""
        return _raised(self.head_alpha(family), self.head_reached[family], optimism)

    def expected_tokens(self, family: str, depth: int, optimism: float = 0.0) -> torch.Tensor:
        """[rows] E[tokens per cycle] of a program of `depth` draft levels in `family`; with `optimism` > 0 from
        `optimistic_alpha` (an upper confidence bound, for choosing which program to try)."""
        key = ("expected", family, depth, optimism)
        if key not in self._cache:
            alpha = self.optimistic_alpha(family, optimism)[:, :depth]
            self._cache[key] = 1.0 + torch.cumprod(alpha, dim=1).sum(dim=1)
        return self._cache[key]

    def update(self, family: str, depth: int | torch.Tensor, accept_len: torch.Tensor, rows: torch.Tensor, *,
               offered_only: bool = False) -> None:
        """One cycle's outcome. accept_len: [rows] accepted draft tokens; rows: [rows] bool, which rows ran
        this family's tree this cycle (active and not masked); depth: the deepest node the cycle offered, for
        all rows or per row ([rows]: a copy branch whose proposal was shorter than the branch).

        offered_only: discount only the depths up to `depth` (an int). For outcomes that say nothing of the
        deeper depths, whose evidence must not fade with them: shadow drafting scores a run of first-level
        proposals at once, and discounting depths 2-4 once per proposal emptied their counts (0.98^57 of the
        head-wide ones after 57), so their optimism bonus drew the layer into chain 4 straight after fallback."""
        self._cache.clear()
        d = torch.arange(1, self.families[family] + 1, dtype=torch.float64)
        a = accept_len.to(torch.float64)[:, None]
        offered = torch.as_tensor(depth, dtype=torch.float64).reshape(-1, 1)
        reached = (d <= torch.minimum(a + 1, offered)) & rows[:, None]
        passed = (d <= a) & rows[:, None]
        decays = (d <= offered[0]) if offered_only else torch.ones_like(d, dtype=torch.bool)
        keep = torch.where(rows[:, None] & decays, self.decay, 1.0)
        self.reached[family] = self.reached[family] * keep + reached
        self.passed[family] = self.passed[family] * keep + passed
        if bool(rows.any()):
            head_keep = torch.where(decays, self.head_decay, 1.0)
            self.head_reached[family] = self.head_reached[family] * head_keep + reached.sum(0)
            self.head_passed[family] = self.head_passed[family] * head_keep + passed.sum(0)


def _raised(alpha: torch.Tensor, n: torch.Tensor, optimism: float) -> torch.Tensor:
    """alpha + optimism * sqrt(alpha (1 - alpha) / (n + 1)), capped at 1: `optimism` standard errors of a rate
    estimated from n (discounted) observations."""
    return (alpha + optimism * torch.sqrt(alpha * (1 - alpha) / (n + 1))).clamp(max=1.0)


class ConfidenceMap:
    """P(the accepted path reaches depth d | the draft's best cumulative probability at depth d), binned."""

    def __init__(self, *, decay: float = 0.995, prior_weight: float = 2.0) -> None:
        self.edges = torch.tensor(CONFIDENCE_EDGES, dtype=torch.float64)
        mids = (self.edges[1:] + self.edges[:-1]) / 2
        self.decay = decay
        self.reached = torch.full_like(mids, prior_weight)
        self.passed = mids * prior_weight                  # prior: the draft is calibrated
        self.observations = 0

    def _bin(self, conf: torch.Tensor) -> torch.Tensor:
        return (torch.bucketize(conf.to(torch.float64), self.edges[1:-1], right=True)).clamp(0, len(self.edges) - 2)

    def values(self) -> torch.Tensor:
        """[bins] the map, made non-decreasing (a more confident draft is not less often right)."""
        return torch.cummax(self.passed / self.reached, dim=0).values

    def __call__(self, conf: torch.Tensor) -> torch.Tensor:
        return self.values()[self._bin(conf)]

    def update(self, conf: torch.Tensor, accept_len: torch.Tensor, depth: int, rows: torch.Tensor) -> None:
        """conf: [rows, D] best cumulative draft probability per depth; accept_len: [rows]; rows: [rows] bool."""
        d = torch.arange(1, conf.shape[1] + 1)
        a = accept_len[:, None]
        reached = (d <= torch.clamp(a + 1, max=depth)) & rows[:, None]
        bins = self._bin(conf)
        self.reached *= self.decay
        self.passed *= self.decay
        self.reached.index_add_(0, bins[reached], torch.ones(int(reached.sum()), dtype=torch.float64))
        self.passed.index_add_(0, bins[reached & (d <= a)], torch.ones(int((reached & (d <= a)).sum()),
                                                                        dtype=torch.float64))
        self.observations += int(reached.sum())

    def floor(self, min_accept: float) -> float:
        """The log cumulative probability below which a node maps under `min_accept` (-inf: mask nothing)."""
        below = (self.values() < min_accept).nonzero()
        if below.numel() == 0:
            return -math.inf
        edge = float(self.edges[int(below[-1]) + 1])
        return math.log(edge) if edge > 0 else -math.inf
