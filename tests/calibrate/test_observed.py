"""Observed cycle costs (calibrate/observed.py): the first cycle of a program is not counted, a ratio needs both
means, the table's cost moves toward the observed ratio by how much was seen, one outlier moves it by at most the
clip, cost tables stay apart, a mean fades with wall time (a plain mean from minutes ago does not rate today's
chain), and the adjusted costs change the policy's choice where the table's would lose."""

from __future__ import annotations

import pytest
import torch

from eagle_compile.calibrate.acceptance import AcceptanceEstimates
from eagle_compile.calibrate.menu import default_menu, families
from eagle_compile.calibrate.observed import ObservedCosts
from eagle_compile.calibrate.policy import CalibrationPolicy
from eagle_compile.core.tree import TreeShape

TABLE = {"plain": 1.0, "chain1": 1.2}


def _feed(obs: ObservedCosts, key, name: str, seconds: float, cycles: int, now: float = 0.0) -> None:
    for _ in range(cycles):
        obs.add(key, name, seconds, now=now)


def test_the_first_cycle_is_not_counted_and_a_ratio_needs_both_programs():
    obs = ObservedCosts()
    obs.add("k", "chain1", 5.0, now=0.0)                       # a capture: not counted
    assert obs.cycles("k", "chain1", now=0.0) == 0 and obs.ratio("k", "chain1") is None
    _feed(obs, "k", "chain1", 0.014, 3)
    assert obs.cycles("k", "chain1", now=0.0) > 2.5 and obs.ratio("k", "chain1") is None     # no plain cycle yet
    assert obs.adjust("k", TABLE, now=0.0) == TABLE
    _feed(obs, "k", "plain", 0.010, 4)                # the first of them skipped
    assert obs.ratio("k", "chain1") == pytest.approx(1.4)


def test_the_table_cost_moves_toward_the_observed_ratio_with_the_cycles_seen():
    obs = ObservedCosts(prior_cycles=4.0)
    _feed(obs, "k", "plain", 0.010, 2)
    _feed(obs, "k", "chain1", 0.014, 2)               # one counted cycle each: weight 1/2 against 4
    few = obs.adjust("k", TABLE, now=0.0)["chain1"]
    assert few == pytest.approx((4 * 1.2 + 0.5 * 1.4) / 4.5)
    _feed(obs, "k", "plain", 0.010, 60)
    _feed(obs, "k", "chain1", 0.014, 60)
    many = obs.adjust("k", TABLE, now=0.0)["chain1"]
    n = (1 - 0.95 ** 61) / 0.05                       # 61 counted cycles each, discounted (they saturate at 20)
    assert obs.cycles("k", "chain1", now=0.0) == pytest.approx(n)
    assert 1.2 < few < many < 1.4 and many == pytest.approx((4 * 1.2 + n / 2 * 1.4) / (4 + n / 2))
    assert obs.adjust("k", TABLE, now=0.0)["plain"] == 1.0
    described = obs.describe("k", TABLE, now=0.0)
    assert "chain1 1.20 -> " in described and "observed: plain" in described


def test_an_adjusted_cost_is_never_below_the_plain_step():
    """A speculative program runs at least a plain step's target forward: a ratio under 1 is the clock's noise
    (plain cycles slowed by the machine, a draft program timed while it ran fast) and must not make a useless head
    look cheap. The negative control: the same observations with a ratio above 1 move the cost freely."""
    obs = ObservedCosts(prior_cycles=1.0)
    _feed(obs, "k", "plain", 0.020, 40)
    _feed(obs, "k", "chain1", 0.010, 40)                       # observed ratio 0.5
    assert obs.ratio("k", "chain1") == pytest.approx(0.5)
    assert obs.adjust("k", TABLE, now=0.0)["chain1"] == 1.0
    above = ObservedCosts(prior_cycles=1.0)
    _feed(above, "k", "plain", 0.010, 40)
    _feed(above, "k", "chain1", 0.011, 40)                     # observed ratio 1.1: below the table's 1.2
    assert 1.0 < above.adjust("k", TABLE, now=0.0)["chain1"] < 1.12


def test_one_outlier_moves_a_mean_by_at_most_the_clip():
    obs = ObservedCosts(clip=2.0)
    _feed(obs, "k", "plain", 0.010, 21)
    before = obs._mean[("k", "plain")]
    obs.add("k", "plain", 10.0, now=0.0)                       # a stall of the shared machine, 1000x
    after_clip = obs._mean[("k", "plain")]
    unclipped = ObservedCosts(clip=float("inf"))
    _feed(unclipped, "k", "plain", 0.010, 21)
    unclipped.add("k", "plain", 10.0, now=0.0)                 # the negative control: no clip
    assert before == pytest.approx(0.010)
    assert after_clip < 0.0111 < unclipped._mean[("k", "plain")]


def test_cost_tables_are_kept_apart():
    obs = ObservedCosts()
    _feed(obs, "batch1", "plain", 0.010, 5)
    _feed(obs, "batch1", "chain1", 0.020, 5)
    _feed(obs, "batch4", "plain", 0.010, 5)
    assert obs.ratio("batch1", "chain1") == pytest.approx(2.0)
    assert obs.ratio("batch4", "chain1") is None and obs.adjust("batch4", TABLE, now=0.0) == TABLE


def test_a_stale_mean_fades_and_its_next_cycle_replaces_it():
    """The benchmark's failure: plain cycles timed on one prompt, chain-1 cycles a minute later on another when
    the machine ran faster, rated chain 1 under a plain step. Faded, the old plain mean weighs nothing and the
    table's cost stands; the negative control (both at the same time) moves the cost as before."""
    stale = ObservedCosts(half_life_s=2.0, half_life_cycles=0.0)
    _feed(stale, "k", "plain", 0.010, 40, now=0.0)
    _feed(stale, "k", "chain1", 0.0095, 40, now=60.0)
    assert stale.ratio("k", "chain1") == pytest.approx(0.95)                 # the mixed ratio itself
    assert stale.cycles("k", "plain", now=60.0) < 1e-6
    assert stale.adjust("k", TABLE, now=60.0)["chain1"] == pytest.approx(1.2, abs=1e-5)
    fresh = ObservedCosts(half_life_s=2.0, half_life_cycles=0.0)
    _feed(fresh, "k", "plain", 0.010, 40, now=60.0)
    _feed(fresh, "k", "chain1", 0.0095, 40, now=60.0)
    assert fresh.adjust("k", TABLE, now=60.0)["chain1"] < 1.05              # negative control: no fade, moved
    _feed(stale, "k", "plain", 0.008, 2, now=60.0)                           # plain again, on the faster machine
    assert stale._mean[("k", "plain")] == pytest.approx(0.008, rel=0.05)     # replaced, not nudged (and not clipped)


def test_the_half_life_is_at_least_the_programs_own_cycles():
    obs = ObservedCosts(half_life_s=2.0, half_life_cycles=50.0)
    _feed(obs, "k", "plain", 1.0, 10, now=0.0)                               # a large target: 1 s per cycle
    assert obs.cycles("k", "plain", now=50.0) == pytest.approx(obs.cycles("k", "plain", now=0.0) / 2)


def test_observed_costs_turn_a_losing_chain_into_plain_decoding():
    """A head whose first draft token is accepted 25 % of the time: a chain-1 cycle emits 1.25 tokens. At the
    table's 1.2 plain steps it looks like a gain (1.04 tokens per plain step); at the 1.4 observed it is a loss
    (0.89), and the policy given the adjusted costs picks the plain step, while the table's costs (the negative
    control) keep the chain."""
    menu = default_menu(TreeShape.chain(1), chains=(1,))
    assert [e.name for e in menu] == ["plain", "chain1"]
    obs = ObservedCosts()
    _feed(obs, "k", "plain", 0.010, 80)
    _feed(obs, "k", "chain1", 0.014, 80)

    def first_choice(costs):
        est = AcceptanceEstimates(families(menu), 1)
        for _ in range(200):                          # the estimates have seen 25 % acceptance at depth 1
            est.update("chain", 1, torch.tensor([int(torch.rand(()) < 0.25)]), torch.ones(1, dtype=torch.bool))
        policy = CalibrationPolicy(menu)
        policy.reset(1)
        return policy.decide(costs, est, torch.ones(1, dtype=torch.bool)).entry.name

    torch.manual_seed(0)
    assert first_choice(TABLE) == "chain1"
    torch.manual_seed(0)
    assert first_choice(obs.adjust("k", TABLE, now=0.0)) == "plain"
