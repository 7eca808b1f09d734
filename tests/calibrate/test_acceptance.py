"""Online acceptance estimates and the confidence map, on synthetic outcomes."""

from __future__ import annotations

import math

import torch

from eagle_compile.calibrate.acceptance import AcceptanceEstimates, ConfidenceMap


def test_per_row_estimates_follow_the_outcomes_and_chains_share_a_family():
    est = AcceptanceEstimates({"chain": 4, "tree": 3}, rows=2)
    both = torch.ones(2, dtype=torch.bool)
    for _ in range(40):
        est.update("chain", 4, torch.tensor([4, 0]), both)      # row 0: everything accepted; row 1: nothing
    alpha = est.alpha("chain")
    assert alpha[0].min() > 0.85 and alpha[1, 0] < 0.15
    e2, e4 = est.expected_tokens("chain", 2), est.expected_tokens("chain", 4)
    assert e4[0] > e2[0] > 2.5                                # chain 2 reads the same depths as chain 4
    # row 1 never reached depth 2: deeper depths borrow the head-wide estimate, but all sit behind depth 1
    assert e4[1] <= 1 + 4 * alpha[1, 0] + 1e-9
    # a family never run leans on the chains' head-wide estimate at each depth
    assert torch.allclose(est.alpha("tree")[0], est.head_alpha("chain")[:3])
    assert torch.equal(est.alpha("tree")[0], est.alpha("tree")[1])


def test_rows_not_drafting_keep_their_estimates():
    est = AcceptanceEstimates({"chain": 2}, rows=2)
    est.update("chain", 2, torch.tensor([2, 2]), torch.tensor([True, True]))
    for _ in range(10):
        est.update("chain", 2, torch.tensor([0, 0]), torch.tensor([True, False]))
    assert est.reached["chain"][1, 0] == 1.0 and est.passed["chain"][1, 0] == 1.0   # row 1's counts held
    assert est.alpha("chain")[0, 0] < 0.3 < est.alpha("chain")[1, 0]


def test_the_head_wide_estimate_carries_over_to_new_rows():
    est = AcceptanceEstimates({"chain": 2}, rows=3)
    for _ in range(30):
        est.update("chain", 2, torch.tensor([0, 0, 0]), torch.ones(3, dtype=torch.bool))
    est.reset_rows(1)
    assert est.alpha("chain")[0, 0] < 0.1                     # a new call starts from what this head does


def test_the_optimistic_estimate_is_above_the_mean_by_less_as_evidence_grows():
    est = AcceptanceEstimates({"chain": 2, "tree": 2}, rows=1)
    fresh_bonus = est.optimistic_alpha("tree", 0.5) - est.alpha("tree")          # nothing seen: alpha 0.5
    assert torch.allclose(fresh_bonus, torch.full((1, 2), 0.25, dtype=torch.float64))
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):                                      # depth 1 accepted about half the time
        est.update("tree", 2, (torch.rand(1, generator=gen) < 0.5).long(), torch.ones(1, dtype=torch.bool))
    bonus = est.optimistic_alpha("tree", 0.5) - est.alpha("tree")
    assert 0 < bonus[0, 0] < fresh_bonus[0, 0] / 3           # n ~ 50 head-wide + ~10 row cycles at depth 1
    assert torch.equal(est.optimistic_alpha("tree", 0.0), est.alpha("tree"))
    assert est.expected_tokens("tree", 2, 0.5)[0] > est.expected_tokens("tree", 2)[0]
    for _ in range(60):                                      # a head that is never right earns no bonus
        est.update("chain", 2, torch.tensor([0]), torch.ones(1, dtype=torch.bool))
    useless = est.optimistic_alpha("chain", 0.5)[0, 0]
    assert useless - est.alpha("chain")[0, 0] < 0.02 and useless < 0.05


def test_confidence_map_is_refitted_monotone_and_gives_a_floor():
    cmap = ConfidenceMap()
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        conf = torch.rand(8, 3, generator=gen)
        # the truth: a depth is accepted with probability conf**2 (the draft is over-confident)
        ok = torch.rand(8, 3, generator=gen) < conf ** 2
        accept = torch.where(ok.all(1), 3, ok.float().argmin(1))
        cmap.update(conf, accept, 3, torch.ones(8, dtype=torch.bool))
    values = cmap.values()
    assert torch.all(values[1:] >= values[:-1])
    assert cmap(torch.tensor([0.05])).item() < 0.05 < cmap(torch.tensor([0.95])).item()
    floor = cmap.floor(0.05)
    assert math.isfinite(floor) and -4.0 < floor < math.log(0.5)
    assert ConfidenceMap().floor(0.0) == -math.inf            # nothing is masked without evidence


def test_a_shorter_offer_is_not_counted_as_a_rejection():
    """A copy branch of 4 nodes whose proposal held 2 tokens, both accepted: depths 3 and 4 were never offered,
    so they are neither reached nor rejected (per-row `depth`); a full offer of 4 with 2 accepted rejects 3."""
    est = AcceptanceEstimates({"copy4@2": 4}, rows=2)
    est.update("copy4@2", torch.tensor([2, 4]), torch.tensor([2, 2]), torch.tensor([True, True]))
    assert est.reached["copy4@2"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert est.passed["copy4@2"].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]
