"""The copy branch (prompt lookup, `draft/lookup.py`; option `copy`): proposals from a row's own history,
verified like every other tree node, so the output stays exactly greedy decoding's (TESTING.md invariant 1)
while accepted copies may carry tokens the draft vocabulary cannot propose."""

from __future__ import annotations

import pytest
import torch
from tiny import ScriptedDrafter, continuations, force_costs, greedy_reference, random_head, tiny_target

import eagle_compile
from eagle_compile.core.tree import DraftTree, TreeShape, ancestor_matrix, with_copy_branch
from eagle_compile.core.verify import verify_greedy
from eagle_compile.draft.lookup import PromptLookup, RowLookup
from eagle_compile.errors import OptionsError
from eagle_compile.options import parse_options

#: a prompt that repeats itself, so the tiny target's continuation has earlier occurrences to copy
LOOPED = torch.tensor([[5, 9, 3, 12, 7, 40, 41, 5, 9, 3, 12, 7, 40, 41, 5, 9]])


# -- the lookup ---------------------------------------------------------------------------------------------------
def test_lookup_copies_after_the_latest_occurrence_of_the_longest_suffix():
    row = RowLookup(max_ngram=3, min_ngram=1)
    row.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    # suffix (1, 2, 3) occurred at 0: its continuation; (2, 3) alone would have picked the later 5, 6
    assert row.propose(3) == [4, 9, 2]
    row.extend([7])
    assert row.propose(4) == []                   # (3, 7), (7): never seen before
    row.extend([5])
    assert row.propose(2) == [6, 1]               # unigram (5,) at 7
    row.extend([6, 1])
    assert row.propose(9) == [2, 3, 7, 5, 6, 1]   # (5, 6, 1) at 7: the continuation runs to the end


def test_incremental_indexing_equals_indexing_at_once():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=gen).tolist()
    lookup = PromptLookup(5, max_ngram=3)
    lookup.begin([tokens[:20]])
    for end in range(21, 300, 7):
        (got,), (n,) = lookup.proposals([tokens[20:end]], [True])
        fresh = RowLookup(3, 1)
        fresh.extend(tokens[:end])
        want, want_n = fresh.match(5)
        assert got == want + [-1] * (5 - len(want)) and n == want_n
    assert lookup.proposals([tokens[20:]], [False]) == ([[-1] * 5], [0])      # an inactive row proposes nothing


def test_lookup_settings_are_checked():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(4, max_ngram=1, min_ngram=2)
    for bad in ({"copy": -1}, {"copy": 2.5}, {"copy_ngram": 0}, {"copy": 4, "step_program": True}):
        with pytest.raises(OptionsError):
            parse_options(bad)
    with pytest.raises(OptionsError, match="copy branch alone"):
        TreeShape(0, 2, 1, copy=3)


# -- the tree -----------------------------------------------------------------------------------------------------
def test_a_copy_branch_is_verified_like_any_other_path():
    # draft: root -> 1 (wrong) ; copy branch: nodes 2, 3, 4 carry target argmaxes 7, 8 then a wrong 0
    parents = torch.tensor([[-1, 0]])
    tree = DraftTree(tokens=torch.tensor([[5, 6]]), parents=parents, depth=torch.tensor([[0, 1]]),
                     valid=torch.ones(1, 2, dtype=torch.bool), ancestors=ancestor_matrix(parents, 1), max_depth=1,
                     scores=torch.zeros(1, 2))
    tree = with_copy_branch(tree, torch.tensor([[7, 8, 0]]))
    assert tree.parents.tolist() == [[-1, 0, 0, 2, 3]] and tree.depth.tolist() == [[0, 1, 1, 2, 3]]
    assert tree.max_depth == 3 and tree.ancestors[0, 4].tolist() == [True, False, True, True, True]
    argmax = torch.tensor([7, 1, 8, 9, 3])                 # target argmax at each node
    logits = torch.nn.functional.one_hot(argmax, 16).double()[None]
    acc = verify_greedy(tree, logits)
    assert acc.accept_len.tolist() == [2] and acc.tokens.tolist() == [[7, 8, 9, -1]]
    assert acc.path.tolist() == [[0, 2, 3, 3]]
    # a -1 proposal ends the branch: nodes from it on are never valid, whatever their token matches
    cut = with_copy_branch(DraftTree(tokens=torch.tensor([[5]]), parents=torch.tensor([[-1]]),
                                     depth=torch.tensor([[0]]), valid=torch.ones(1, 1, dtype=torch.bool),
                                     ancestors=torch.ones(1, 1, 1, dtype=torch.bool), max_depth=0),
                           torch.tensor([[7, -1, 9]]))
    assert cut.valid.tolist() == [[True, True, False, False]]


# -- end to end ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{"depth": 3, "top_k": 2, "total_tokens": 6, "copy": 5},
                                     {"chain": 2, "copy": 8}], ids=["tree+copy5", "chain2+copy8"])
def test_a_random_head_with_a_copy_branch_stays_exact_and_copies(options):
    model = tiny_target("llama", seed=3)
    ref = greedy_reference(model, LOOPED, max_new_tokens=40)
    head = random_head(model, flags=True, seed=0, reduced=True)
    out = eagle_compile.generate(model, LOOPED, draft=head, options={**options, "prefill_chunk": 8},
                                 max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats.copied_tokens >= 10                               # the copy branch really was accepted
    assert out.stats.tau > 1.5
    vocab = set(head_vocab(head))
    outside = [t for t in ref[0, LOOPED.shape[1]:].tolist() if t not in vocab]
    assert out.stats.outside_draft_vocab == len(outside)
    assert out.stats.copied_outside_draft_vocab > 0                    # tokens the draft could never propose


def head_vocab(head) -> list[int]:
    return (torch.arange(head.config.draft_vocab_size) + head.d2t).tolist()


def test_wrong_proposals_are_rejected_in_a_ragged_batch(monkeypatch):
    """An adversarial lookup (every proposal off by one id) in a ragged batch with an adversarial drafter: the
    output is still exactly greedy, and nothing was accepted from the copy branch (negative control of the
    acceptance count above)."""
    from tiny import ragged

    model = tiny_target("qwen3", seed=5)
    ids, mask = ragged([4, 13, 9], seed=2)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=24)
    drafter = ScriptedDrafter(continuations(ids, mask, ref), 96, "adversarial")
    honest = RowLookup.match

    def off_by_one(self, length):
        tokens, n = honest(self, length)
        return [(t + 1) % 96 for t in tokens], n

    monkeypatch.setattr(RowLookup, "match", off_by_one)
    out = eagle_compile.generate(model, ids, attention_mask=mask, draft=drafter,
                                 options={"depth": 3, "top_k": 2, "total_tokens": 6, "copy": 4, "prefill_chunk": 8},
                                 max_new_tokens=24, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats.copied_tokens == 0 and out.stats.tau == 1.0


#: the copy-only program as cheap as the plain step: the policy runs it whenever a row has a match
COPY_CHEAP = {"plain": 1.0, "chain1": 1.5, "chain2": 1.6, "chain4": 1.8, "tree3x2x6": 2.0, "copy6": 1.0}


def test_calibration_runs_the_copy_program_when_the_lookup_matches(monkeypatch):
    """An always-wrong drafter puts the batch in fallback; the copy-only program still runs on the cycles whose
    lookup matched (fallback_copies), exactly."""
    force_costs(monkeypatch, COPY_CHEAP)
    model = tiny_target("llama", seed=3)
    ref = greedy_reference(model, LOOPED, max_new_tokens=40)
    drafter = ScriptedDrafter(continuations(LOOPED, torch.ones_like(LOOPED), ref), 96, "adversarial")
    out = eagle_compile.generate(model, LOOPED, draft=drafter,
                                 options={"depth": 3, "top_k": 2, "total_tokens": 6, "copy": 6, "calibrate": "on",
                                          "prefill_chunk": 8, "calibration_cache": "memory"},
                                 max_new_tokens=40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    policy = out.stats.calibration["policy"]
    assert "copy6" in out.stats.calibration["menu"] and policy["chosen"].get("copy6", 0) >= 3
    assert policy["fallbacks"] >= 1 and policy["fallback_copies"] >= 1
    assert out.stats.copied_tokens >= 10
