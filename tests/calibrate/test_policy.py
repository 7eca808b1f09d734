"""The decision rule on synthetic costs and acceptance (DESIGN.md §4): a useless head falls back to plain
decoding and probes with growing backoff, an oracle gets the deepest tree that pays, the hysteresis bounds
switching, and in a batch a row without gain is masked while the others draft."""

from __future__ import annotations

import torch

from eagle_compile.calibrate.acceptance import AcceptanceEstimates
from eagle_compile.calibrate.menu import default_menu, families
from eagle_compile.calibrate.policy import CalibrationPolicy
from eagle_compile.core.tree import TreeShape

DEEP = TreeShape(7, 4, 24)
MENU = default_menu(DEEP)                       # plain, chain1, chain2, chain4, tree7x4x24
COSTS = {"plain": 1.0, "chain1": 1.15, "chain2": 1.25, "chain4": 1.5, "tree7x4x24": 2.0}


def _run(outcome, cycles: int, rows: int = 1, costs=COSTS, menu=MENU, **policy_args):
    """Drive the policy for `cycles` cycles; outcome(entry, row) -> accepted draft tokens of that row."""
    est = AcceptanceEstimates(families(menu), rows)
    policy = CalibrationPolicy(menu, **policy_args)
    policy.reset(rows)
    active = torch.ones(rows, dtype=torch.bool)
    trace = []
    for _ in range(cycles):
        d = policy.decide(costs, est, active)
        trace.append((d.entry.name, d.drafting.clone(), d.probe))
        if d.entry.shape is not None:
            a = torch.tensor([outcome(d.entry, r) if bool(d.drafting[r]) else 0 for r in range(rows)])
            est.update(d.entry.family, d.entry.depth, a, d.drafting)
            if d.probe and policy.in_fallback:
                policy.after_probe(costs, est, active)
    return policy, est, trace


def test_a_useless_head_falls_back_to_plain_and_probes_with_backoff():
    policy, est, trace = _run(lambda e, r: 0, 300)
    names = [t[0] for t in trace]
    assert names[-1] == "plain" and policy.in_fallback
    assert policy.stats.plain_cycles > 270                    # almost every cycle plain
    probes = [i for i, t in enumerate(trace) if t[2]]
    assert probes and policy.stats.probes == len(probes)
    runs = [i for i in probes if i - 1 not in probes]
    lengths = [sum(1 for j in probes if r <= j < r + policy.probe_cycles) for r in runs]
    assert lengths[0] == policy.probe_cycles            # a young estimate: the first failures may be bad luck
    assert lengths == sorted(lengths, reverse=True) and lengths[-3:] == [1, 1, 1]   # then one-cycle probes
    gaps = [b - a for a, b in zip(runs, runs[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] >= 64            # the backoff grows (doubling up to 128)
    assert len(runs) <= 9


def test_a_row_failing_a_head_that_pays_elsewhere_gets_whole_probe_runs():
    """The negative control of the one-cycle probes above: the same always-failing row, but the head-wide
    estimate (other rows and calls) says the head is accepted 60 % of the time, so a failed probe cycle may be
    bad luck: every probe run lasts `probe_cycles` cycles, and the wait between runs stays short."""
    est = AcceptanceEstimates(families(MENU), 1)
    for fam, depth in families(MENU).items():
        est.head_reached[fam] = torch.full((depth,), 1000.0, dtype=torch.float64)
        est.head_passed[fam] = torch.full((depth,), 600.0, dtype=torch.float64)
    policy = CalibrationPolicy(MENU)
    policy.reset(1)
    active = torch.ones(1, dtype=torch.bool)
    probes = []
    for i in range(200):
        d = policy.decide(COSTS, est, active)
        if d.entry.shape is not None:
            est.update(d.entry.family, d.entry.depth, torch.zeros(1, dtype=torch.long), d.drafting)
            if d.probe and policy.in_fallback:
                probes.append(i)
                policy.after_probe(COSTS, est, active)
    runs = [i for i in probes if i - 1 not in probes]
    assert len(runs) >= 6
    assert all(sum(1 for j in probes if r <= j < r + policy.probe_cycles) == policy.probe_cycles for r in runs[:-1])
    # and the backoff stops at `useful_max_backoff` (the useless head's above reaches 64 and more)
    assert max(b - a for a, b in zip(runs, runs[1:], strict=False)) <= policy.useful_max_backoff + policy.probe_cycles


def _speculating(alpha: float, seeds: int = 20, cycles: int = 150, **policy_args) -> tuple[float, float]:
    """Mean cycles speculated and mean fallbacks over `seeds` runs of a head accepted `alpha` at every depth."""
    spec = fallbacks = 0
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        policy, _, trace = _run(lambda e, r, gen=gen: _geometric(gen, e.depth, alpha), cycles, **policy_args)
        spec += sum(t[0] != "plain" for t in trace)
        fallbacks += policy.stats.fallbacks
    return spec / seeds, fallbacks / seeds


def test_probe_runs_keep_a_useful_but_noisy_head_speculating():
    """A head accepted 30 % of the time at every depth (chain 1: 1.3 tokens for 1.15 plain steps, worth it) over
    20 seeds of 150 cycles: with runs of 3 probe cycles the layer speculates in most cycles; one-cycle probes
    (the negative control), which fail 70 % of the time, leave it in fallback far more often."""
    runs, single = _speculating(0.3)[0], _speculating(0.3, probe_cycles=1)[0]
    assert runs > 0.65 * 150
    assert single < runs - 15


def test_once_speculating_only_the_bound_failing_brings_fallback():
    """Hysteresis between speculating and falling back: a speculating layer stays while the upper confidence
    bound of its rate beats the plain step, so the same useful but noisy head (30 %) falls back less, and
    speculates more, than when the mean alone decides (optimism 0, the negative control)."""
    (spec, fallbacks), (spec0, fallbacks0) = _speculating(0.3), _speculating(0.3, optimism=0.0)
    assert fallbacks < fallbacks0 - 0.8
    assert spec > spec0 + 8


def test_an_oracle_gets_the_deepest_tree():
    policy, est, trace = _run(lambda e, r: e.depth, 60)
    names = [t[0] for t in trace]
    assert names[-20:] == ["tree7x4x24"] * 20                 # E = 8 tokens for 2 plain steps: 4x
    assert policy.stats.plain_cycles < 5


def test_a_chain_wins_when_the_tree_costs_too_much():
    costs = {**COSTS, "tree7x4x24": 6.0}
    policy, _, trace = _run(lambda e, r: e.depth, 60, costs=costs)
    assert [t[0] for t in trace][-10:] == ["chain4"] * 10


def test_a_tree_that_accepts_more_than_its_chain_is_tried_and_kept():
    """The 2-core CPU's costs (2026-12-07) and a head whose chain accepts 0.5 per depth while its top-2 tree
    accepts 0.75 (E 3.05 for 1.72 plain steps against chain 2's 1.75 for 1.47). The tree's alpha is borrowed
    from the chain's until it runs, so the upper confidence bound is what gets it tried: with it the tree runs in
    nearly all of the last 50 cycles of 9 seeds in 10 or more (17 of 20 seeds in a wider run); without it
    (optimism 0, the negative control) in at most 2 (6 of 20 partly, 2 wholly, in the wider run)."""
    menu = default_menu(TreeShape(4, 2, 8))              # plain, chain1, chain2, chain4, tree4x2x8
    costs = {"plain": 1.0, "chain1": 1.28, "chain2": 1.47, "chain4": 1.70, "tree4x2x8": 1.72}

    def tree_cycles(optimism: float) -> list[int]:
        out = []
        for seed in range(10):
            gen = torch.Generator().manual_seed(seed)
            _, _, trace = _run(lambda e, r, gen=gen: _geometric(gen, e.depth, 0.75 if e.shape.top_k > 1 else 0.5),
                               150, costs=costs, menu=menu, optimism=optimism)
            out.append(sum(t[0] == "tree4x2x8" for t in trace[-50:]))
        return out

    found, control = tree_cycles(0.5), tree_cycles(0.0)
    assert sum(c >= 45 for c in found) >= 9
    assert sum(c >= 45 for c in control) <= 2 and sum(control) < sum(found) / 3


def test_optimism_does_not_keep_a_useless_head_speculating():
    """The bound picks which program to try, never whether to speculate: a head accepted 3 % of the time stays
    in fallback as with no optimism (its alpha near 0 earns almost no bonus)."""
    gen = torch.Generator().manual_seed(0)
    with_bound, _, _ = _run(lambda e, r: _geometric(gen, e.depth, 0.03), 300)
    without, _, _ = _run(lambda e, r: _geometric(gen, e.depth, 0.03), 300, optimism=0.0)
    assert with_bound.in_fallback and with_bound.stats.plain_cycles > 260
    assert with_bound.stats.plain_cycles >= without.stats.plain_cycles - 5


def _geometric(gen, depth: int, alpha: float = 0.6) -> int:
    a = 0
    while a < depth and torch.rand((), generator=gen) < alpha:
        a += 1
    return a


def _switches(margin: float) -> int:
    """300 cycles of noisy acceptance (alpha 0.6 at every depth) where several programs have nearly equal
    rates, so the estimates' noise alone keeps reordering them."""
    close = {"plain": 1.0, "chain1": 1.1, "chain2": 1.25, "chain4": 1.5, "tree7x4x24": 1.55}
    gen = torch.Generator().manual_seed(0)
    policy = CalibrationPolicy(MENU, margin=margin)
    policy.reset(1)
    est = AcceptanceEstimates(families(MENU), 1)
    active = torch.ones(1, dtype=torch.bool)
    for _ in range(300):
        d = policy.decide(close, est, active)
        if d.entry.shape is not None:
            est.update(d.entry.family, d.entry.depth, torch.tensor([_geometric(gen, d.entry.depth)]), d.drafting)
    return policy.stats.switches


def test_switching_is_bounded_by_the_hysteresis():
    with_margin, without = _switches(0.05), _switches(0.0)
    assert with_margin <= 15
    assert without >= 2 * with_margin         # negative control: with no margin the choice flaps more


def test_a_row_without_gain_is_masked_while_the_others_draft():
    policy, est, trace = _run(lambda e, r: e.depth if r == 0 else 0, 120, rows=2)
    spec = [t for t in trace if t[0] != "plain"]
    assert spec and spec[-1][0] == "tree7x4x24"
    masked = [t for t in spec[20:] if not bool(t[1][1])]
    assert len(masked) > len(spec[20:]) * 0.8                 # row 1 is masked most of the time
    assert all(bool(t[1][0]) for t in spec[20:])              # row 0 always drafts
    assert policy.stats.row_probes > 0 and policy.stats.row_fallback_cycles > 0


def test_a_large_batch_shrinks_speculation():
    """Costs that grow with the batch (verify of N tokens x B rows) move the choice to a smaller program."""
    small_batch = {"plain": 1.0, "chain1": 1.1, "chain2": 1.2, "chain4": 1.4, "tree7x4x24": 1.9}
    big_batch = {"plain": 1.0, "chain1": 1.5, "chain2": 2.0, "chain4": 3.0, "tree7x4x24": 12.0}

    def half(e, r):
        return min(e.depth, 1)               # the first draft token is accepted, nothing deeper

    _, _, t_small = _run(half, 80, rows=4, costs=small_batch)
    _, _, t_big = _run(half, 80, rows=4, costs=big_batch)
    assert t_small[-1][0] in ("chain1", "chain2") and t_big[-1][0] == "chain1"
    big_plain = {**big_batch, "chain1": 2.2}
    p, _, t = _run(half, 80, rows=4, costs=big_plain)
    assert t[-1][0] == "plain" and p.in_fallback


COPY_MENU = default_menu(TreeShape(3, 2, 6), copy=8)  # plain, chain1, chain2, chain4, tree3x2x6, copy8
COPY_COSTS = {"plain": 1.0, "chain1": 1.15, "chain2": 1.25, "chain4": 1.5, "tree3x2x6": 1.6, "copy8": 1.5}


def test_copies_run_for_the_match_lengths_that_pay():
    """A useless draft; copies after a 3-token match are always right (8 tokens), after a 1-token match always
    wrong. Each match length is explored, then the copy program runs exactly when a 3-token match is there
    (also while the batch is in fallback), and never when nothing matched."""
    est = AcceptanceEstimates(families(COPY_MENU, 3), 1)
    policy = CalibrationPolicy(COPY_MENU)
    policy.reset(1)
    active = torch.ones(1, dtype=torch.bool)
    runs = {0: [], 1: [], 3: []}
    for cycle in range(300):
        n = (0, 1, 3)[cycle % 3]
        matched = torch.tensor([n])
        d = policy.decide(COPY_COSTS, est, active, matched)
        runs[n].append(d.entry.name)
        if d.entry.shape is None:
            continue
        if d.entry.copy_only:
            est.update(f"copy8@{n}", 8, torch.tensor([8 if n == 3 else 0]), d.drafting)
        else:
            est.update(d.entry.family, d.entry.depth, torch.tensor([0]), d.drafting)
        if d.probe and policy.in_fallback:
            policy.after_probe(COPY_COSTS, est, active, matched)
    assert "copy8" not in runs[0]                                  # nothing to copy: never the copy program
    assert runs[3][-50:] == ["copy8"] * 50                         # E = 9 tokens for 1.5 plain steps
    assert runs[1][:2] == ["copy8", "copy8"] and "copy8" not in runs[1][-50:]   # explored, then left alone
    assert policy.in_fallback and policy.stats.fallback_copies > 50 and policy.stats.explorations == 4


def _shadowed(first_right: int, cycles: int, shadow: bool = True):
    """A head wrong on the first `first_right` tokens and right from then on. With `shadow`, fallback's plain
    steps are scored as the runtime's re-sync scores them (each a one-level chain outcome, at each
    `shadow_due` check); without, the policy probes. Returns the policy, the trace of (program, token) and the
    (program, token) of each shadow check that left fallback."""
    est = AcceptanceEstimates(families(MENU), 1)
    policy = CalibrationPolicy(MENU)
    policy.reset(1)
    policy.shadow = shadow
    active, token, unscored, trace, exits = torch.ones(1, dtype=torch.bool), 0, [], [], []
    for _ in range(cycles):
        d = policy.decide(COSTS, est, active)
        trace.append((d.entry.name, token))
        if d.entry.shape is None:
            unscored.append(token >= first_right)
            token += 1
            if policy.shadow_due():
                for hit in unscored[:-1]:       # the last step's proposal is the next cycle's own
                    est.update("chain", 1, torch.tensor([int(hit)]), active, offered_only=True)
                unscored = unscored[-1:]
                policy.after_shadow(COSTS, est, active)
                if not policy.in_fallback:
                    exits.append((policy.current.name, token))
            continue
        unscored = []
        a = d.entry.depth if token >= first_right else 0
        est.update(d.entry.family, d.entry.depth, torch.tensor([a]), d.drafting)
        token += a + 1
        if d.probe and policy.in_fallback:
            policy.after_probe(COSTS, est, active)
    return policy, trace, exits


def test_shadow_drafting_leaves_fallback_without_a_probe_and_only_for_the_shallowest_chain():
    """Greedy fallback with shadow drafting: a head wrong for its first 40 tokens, then right, falls back, runs
    no probe at all (every fallback cycle is a plain step), and a shadow check leaves fallback within two
    backoff caps of the head turning right, for chain 1: the one depth that evidence covers (leaving for chain
    4 on borrowed deeper depths ran 0.50x the plain mode on a chat prompt); from there the running program's
    own outcomes take the layer deeper. The negative control without shadow drafting probes."""
    policy, trace, exits = _shadowed(first_right=40, cycles=120)
    assert policy.stats.fallbacks >= 1 and policy.stats.probes == 0
    assert policy.stats.shadow_checks >= 2
    assert len(exits) == 1
    name, tok = exits[0]
    assert name == "chain1" and 40 <= tok <= 40 + 2 * policy.useful_max_backoff
    after = [n for n, t in trace if t >= tok]
    assert "plain" not in after and after.count("tree7x4x24") > 20        # speculating, and deep, from then on
    control, _, control_exits = _shadowed(first_right=40, cycles=120, shadow=False)
    assert control.stats.probes > 0 and control.stats.shadow_checks == 0 and not control_exits


def test_shadow_drafting_keeps_a_useless_head_in_fallback_with_growing_checks():
    """A head that is never right: shadow checks leave it in fallback and their interval grows to the cap."""
    policy, trace, exits = _shadowed(first_right=10**9, cycles=400)
    names = [t[0] for t in trace]
    assert policy.in_fallback and policy.stats.probes == 0 and not exits
    assert names.count("plain") > 390
    assert policy.backoff == policy.max_backoff and 3 <= policy.stats.shadow_checks <= 8
