"""The lossless suite with the calibration layer on (TESTING.md invariants 1, 3, 7; DESIGN.md §4): whatever
program a cycle runs, whichever rows and nodes are masked, and across fallback and re-sync, the output is
exactly `model.generate`'s; rows that fall back inside a batch do not change the other rows' tokens."""

from __future__ import annotations

import pytest
import torch
from tiny import (
    ScriptedDrafter,
    continuations,
    force_costs,
    greedy_reference,
    ragged,
    ragged_batch,
    random_head,
    rotate_programs,
    tiny_target,
)

import eagle_compile

ON = {"calibrate": "on", "prefill_chunk": 8, "calibration_cache": "memory"}
TREE = {"depth": 4, "top_k": 3, "total_tokens": 10}


def test_an_always_wrong_drafter_falls_back_with_measured_costs():
    model = tiny_target("llama", seed=3)
    ids, mask = ragged([4, 13, 9], seed=1)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=40)
    drafter = ScriptedDrafter(continuations(ids, mask, ref), 96, "adversarial")
    out = eagle_compile.generate(model, ids, attention_mask=mask, draft=drafter, options={"chain": 2, **ON},
                                 max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    policy = out.stats.calibration["policy"]
    assert sum(policy["chosen"].values()) == out.stats.cycles
    assert policy["plain_cycles"] > out.stats.cycles // 2 and policy["fallbacks"] >= 1   # fallback engaged
    assert "measured now" in next(iter(out.stats.calibration["costs"].values()))


#: relative cycle costs shaped like a GPU's at batch 1 (verifying more tokens costs little)
CHEAP_VERIFY = {"plain": 1.0, "chain1": 1.1, "chain2": 1.15, "chain4": 1.25, "tree4x3x10": 1.4}


def test_an_oracle_gets_the_deepest_program_and_stays_exact(monkeypatch):
    force_costs(monkeypatch, CHEAP_VERIFY)
    model = tiny_target("llama", seed=3)
    ids, mask = ragged([4, 13, 9], seed=1)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=40)
    drafter = ScriptedDrafter(continuations(ids, mask, ref), 96, "oracle")
    out = eagle_compile.generate(model, ids, attention_mask=mask, draft=drafter, options={**TREE, **ON},
                                 max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    chosen = out.stats.calibration["policy"]["chosen"]
    # every depth is accepted: the deepest programs tie on tokens (5 a cycle) and the cheaper one wins
    assert max(chosen, key=chosen.get) == "chain4" and out.stats.tau > 3.0


@pytest.mark.parametrize("arch", ["qwen3"])
def test_random_heads_with_the_menu_and_node_masking(arch, monkeypatch):
    force_costs(monkeypatch, min_accept=0.3)       # speculate every cycle, mask nodes the map rates < 0.3
    target = tiny_target(arch, seed=11)
    head = random_head(target, flags=True, seed=3, reduced=True)
    for rows in (1, 3):
        ids, mask = ragged_batch(rows, seed=rows)
        ref = greedy_reference(target, ids, attention_mask=mask, max_new_tokens=20)
        out = eagle_compile.generate(target, ids, attention_mask=mask, draft=head, options={**TREE, **ON},
                                     max_new_tokens=20, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), (arch, rows)
        assert out.stats.calibration["node_floor"] > -1e9          # masking was on


def test_fallback_and_resync_keep_the_draft_in_step(monkeypatch):
    """Two plain cycles, then the tree, in turn: after every run of plain steps the draft is caught up over them
    (one catch-up forward), and the output stays exact."""
    rotate_programs(monkeypatch, order=[0, 0, 4])
    model = tiny_target("qwen2", seed=2)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(5))
    ref = greedy_reference(model, ids, max_new_tokens=40)
    head = random_head(model, flags=True, seed=0, reduced=False)
    out = eagle_compile.generate(model, ids, draft=head, options={**TREE, **ON}, max_new_tokens=40,
                                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats.calibration["policy"]["chosen"]["plain"] >= 2 * out.stats.calibration["policy"]["chosen"][
        "tree4x3x10"] - 2


class _Stop(Exception):
    pass


def test_resync_gives_the_draft_state_an_always_drafting_decoder_has(monkeypatch):
    """The draft KV and seeds after plain steps + re-sync equal those after the same tokens drafted every cycle:
    an oracle-free check that `Calibration.resync` writes the right pairs (feature at p, token p+1)."""
    import eagle_compile.runtime.calibration as calibration

    model = tiny_target("llama", seed=4)
    head = random_head(model, flags=True, seed=2, reduced=False)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    seeds = []
    original = calibration.Calibration.resync

    def spy(self, state, draft_kv, slots):
        stashed = len(self._stash)
        original(self, state, draft_kv, slots)
        if stashed:
            n = int(state.n[0])
            seeds.append((n, state.seed_head.clone(), draft_kv.keys[:, :, :n - 1].clone()))

    monkeypatch.setattr(calibration.Calibration, "resync", spy)
    rotate_programs(monkeypatch, order=[0, 0, 0, 1])
    eagle_compile.generate(model, ids, draft=head, options={**TREE, **ON}, max_new_tokens=12)
    assert seeds
    n, seed_head, keys = seeds[0]
    # the reference: a prefill of the same n - 1 tokens leaves the draft exactly where the re-sync must
    tokens = eagle_compile.generate(model, ids, draft=head, options={**TREE, **ON}, max_new_tokens=12)[0, :n - 1]
    monkeypatch.undo()
    ref_state = {}

    def capture(self, state, cache, draft_kv, sampling, generator, active, longest, matched=None):
        ref_state["seed"] = state.seed_head.clone()
        ref_state["keys"] = draft_kv.keys[:, :, :n - 1].clone()
        raise _Stop

    monkeypatch.setattr(calibration.Calibration, "cycle", capture)
    with pytest.raises(_Stop):
        eagle_compile.generate(model, tokens[None], draft=head, options={**TREE, **ON, "prefill_chunk": 16},
                               max_new_tokens=4)
    assert torch.allclose(seed_head, ref_state["seed"], atol=1e-10)
    assert torch.allclose(keys, ref_state["keys"], atol=1e-10)


#: only the chain of 1 pays: the oracle rows emit 2 tokens a cycle, so they are still running when row 1's
#: estimate has fallen under row_min_accept
CHAIN1_ONLY = {"plain": 1.0, "chain1": 1.0, "chain2": 9.0, "chain4": 9.0, "tree4x3x10": 9.0}


def test_rows_that_fall_back_do_not_change_other_rows(monkeypatch):
    force_costs(monkeypatch, CHAIN1_ONLY)
    model = tiny_target("llama", seed=7)
    ids, mask = ragged([6, 10, 8], seed=2)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=56)
    good = continuations(ids, mask, ref)
    wrong = [good[0], [t + 1 if t < 95 else 3 for t in good[1]], good[2]]     # row 1's drafts are always wrong
    out = eagle_compile.generate(model, ids, attention_mask=mask, draft=ScriptedDrafter(wrong, 96, "oracle"),
                                 options={**TREE, **ON}, max_new_tokens=56, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    policy = out.stats.calibration["policy"]
    assert policy["row_fallback_cycles"] > 0 and policy["row_probes"] > 0    # row 1 fell back, and probed
    assert policy["chosen"].get("chain1", 0) > 10                               # ...while the others drafted
    alone = eagle_compile.generate(model, ids[:1, -6:], draft=ScriptedDrafter(good[:1], 96, "oracle"),
                                   options={**TREE, **ON}, max_new_tokens=56)
    assert torch.equal(out.sequences[0, -56:], alone[0, -56:])


def test_eos_inside_an_accepted_block_with_calibration(monkeypatch):
    force_costs(monkeypatch, CHEAP_VERIFY)
    model = tiny_target("qwen2", seed=5)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    free = greedy_reference(model, ids, max_new_tokens=24)[0, 6:].tolist()
    eos = free[6]
    ref = greedy_reference(model, ids, max_new_tokens=24, eos_token_id=eos)
    drafter = ScriptedDrafter([ids[0].tolist() + free], 96, "oracle")
    out = eagle_compile.generate(model, ids, draft=drafter, options={**TREE, **ON}, max_new_tokens=24,
                                 eos_token_id=eos, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and out.sequences[0, -1] == eos


def test_the_default_options_adapt_and_a_given_tree_stays_fixed(tmp_path):
    import json

    from eagle_compile.draft.checkpoint import save_draft

    model = tiny_target("llama", seed=1)
    head = random_head(model, flags=True, seed=0, reduced=False)
    save_draft(head, tmp_path / "head")           # the head's tree.json: the menu's largest program
    (tmp_path / "head" / "tree.json").write_text(json.dumps({"chain": 2, "chosen_for": {"device": "cpu",
                                                                                         "dtype": "float64"}}))
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    ref = greedy_reference(model, ids, max_new_tokens=8)
    out = eagle_compile.generate(model, ids, draft=str(tmp_path / "head"), max_new_tokens=8,
                                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats.tree["adaptive"] == ["plain", "chain1", "chain2"] and out.stats.calibration is not None
    assert "tree.json" in out.stats.tree["source"]
    fixed = eagle_compile.generate(model, ids, draft=head, options={"chain": 2}, max_new_tokens=8,
                                   return_dict_in_generate=True)
    assert fixed.stats.calibration is None and "fixed tree" in fixed.stats.tree["fixed"]
    assert torch.equal(fixed.sequences, ref)


def test_greedy_fallback_leaves_on_shadow_drafting_without_probes(monkeypatch):
    """A drafter wrong for the first 24 new tokens and right from then on. Greedy: the layer falls back, scores
    the draft's proposals after the fallback's plain steps when it re-syncs (shadow drafting), leaves fallback
    on that evidence with no probe cycle, speculates again, and the output stays exact. The sampling control
    (acceptance there needs the target's probabilities, which plain steps do not keep) probes instead."""
    force_costs(monkeypatch, CHEAP_VERIFY)
    model = tiny_target("llama", seed=3)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    ref = greedy_reference(model, ids, max_new_tokens=72)
    drafter = ScriptedDrafter(continuations(ids, torch.ones_like(ids), ref), 96, "adversarial", right_from=6 + 24)
    out = eagle_compile.generate(model, ids, draft=drafter, options={**TREE, **ON}, max_new_tokens=72,
                                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    policy = out.stats.calibration["policy"]
    assert policy["fallbacks"] >= 1 and policy["plain_cycles"] >= 4          # the wrong start fell back
    assert policy["probes"] == 0 and policy["shadow_checks"] >= 1 and policy["shadow_tokens"] >= 4
    assert out.stats.tau > 1.5                                                # and the right part speculated
    sampled = eagle_compile.generate(model, ids, draft=drafter, options={**TREE, **ON}, max_new_tokens=72,
                                     do_sample=True, generator=torch.Generator().manual_seed(0),
                                     return_dict_in_generate=True)
    control = sampled.stats.calibration["policy"]
    assert control["fallbacks"] >= 1 and control["probes"] > 0 and control["shadow_checks"] == 0
