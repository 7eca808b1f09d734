"""Nothing lost to NaN: a row whose target logits go NaN/+inf ends with an error in its statistics, keeping the
tokens decided before, while the other rows finish exactly as if decoded alone (HF greedy of each row by itself,
float64).

Poisoning: the embedding row of one token X is set to NaN, so a row goes NaN exactly when its target forward
reads X. X is chosen in row 1's greedy continuation (at new-token index K), in no other row's prompt or
continuation, and outside the random head's draft vocabulary (so no draft proposes it: a proposal's NaN K/V
would poison its own row's tree, see `test_a_draft_that_proposes_a_poisoned_token_ends_only_its_row`). Row 1
then emits X from finite logits and meets NaN on the next forward: it keeps exactly K + 1 new tokens.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from test_graph_books import _graphed_decoder
from tiny import ScriptedDrafter, continuations, greedy_reference, ragged, random_head, rotate_programs, tiny_target

import eagle_compile
from eagle_compile.runtime.cuda_graphs import BucketBuffers
from eagle_compile.runtime.step import finite_prefix

LENGTHS = [6, 8, 5]
MAX_NEW = 16
X, K = 46, 5                          # row 1's new token K is X (asserted in the fixture)
PAD = 0
BASE = {"prefill_chunk": 16, "calibration_cache": "memory"}
TREE = {"depth": 3, "top_k": 2, "total_tokens": 6}
# the fixed tree runs in the two tests further down (eager step; step program with CUDA-graph books)
MODES = {"plain": {"speculate": False}, "calibrated": {**TREE, "calibrate": "on"}}
ROTATION = [0, 4]                     # calibrated: the menu's plain step and its tree in turn (rotate_programs)


@pytest.fixture(scope="module")
def setup():
    model = tiny_target("llama", seed=5)
    ids, mask = ragged(LENGTHS, seed=2)
    alone = [_alone(model, ids[i:i + 1, ids.shape[1] - n:]) for i, n in enumerate(LENGTHS)]
    head = random_head(model, flags=True, seed=0, reduced=True)
    prompts = [ids[i][mask[i].bool()].tolist() for i in range(len(LENGTHS))]
    assert alone[1][K] == X and X not in alone[1][:K] and X not in prompts[1]
    assert all(X not in prompts[i] + alone[i] for i in (0, 2))
    assert X not in set((head.d2t + torch.arange(len(head.d2t))).tolist())     # the draft vocabulary
    return model, ids, mask, alone, head


@pytest.fixture(scope="module")
def unread(setup) -> int:
    """A token in no row's prompt or continuation: poisoning it must change nothing (negative control)."""
    _, ids, _, alone, _ = setup
    return max(set(range(96)) - set(ids.flatten().tolist()) - {t for row in alone for t in row})


def _alone(model, ids) -> list[int]:
    return greedy_reference(model, ids, max_new_tokens=MAX_NEW)[0, ids.shape[1]:].tolist()


@contextlib.contextmanager
def poisoned(model, token: int = X):
    """The target's (and the tied draft's) embedding row of `token` is NaN inside the block."""
    weight = model.get_input_embeddings().weight
    saved = weight[token].clone()
    with torch.no_grad():
        weight[token] = float("nan")
    try:
        yield
    finally:
        with torch.no_grad():
            weight[token] = saved


def _run(model, ids, mask, draft, options, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = eagle_compile.generate(model, ids, attention_mask=mask, draft=draft, options={**BASE, **options},
                                     max_new_tokens=MAX_NEW, return_dict_in_generate=True, **kwargs)
    return out, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _new(out, ids) -> list[list[int]]:
    return out.sequences[:, ids.shape[1]:].tolist()


# -- NaN/inf logits end their row only ----------------------------------------------------------------------------
def test_finite_prefix_counts_the_emitted_tokens_that_usable_logits_decided():
    nan, inf = float("nan"), float("inf")
    logits = torch.zeros(5, 4, 3)
    logits[1, 2, 0] = nan                  # row 1: the path's third node
    logits[2, 0, 1] = inf                  # row 2: the root, +inf
    logits[3, 1] = -inf                    # row 3: -inf is probability 0, not an error
    logits[4, 3, 2] = nan                  # row 4: a node off the path
    path = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 1], [0, 2, 2]])      # [B, D + 1]
    assert finite_prefix(logits, path).tolist() == [3, 2, 0, 3, 3]


def _check_row_1_poisoned(out, ids, alone, warned) -> None:
    """Rows 0 and 2 as decoded alone; row 1 up to X (the last token its finite logits decided), then padding."""
    new = _new(out, ids)
    assert new[0] == alone[0] and new[2] == alone[2]
    assert new[1] == alone[1][:K + 1] + [PAD] * (MAX_NEW - K - 1)
    assert out.attention_mask[1, ids.shape[1]:].tolist() == [1] * (K + 1) + [0] * (MAX_NEW - K - 1)
    assert list(out.stats.errors) == [1]
    assert f"NaN or +inf for new token {K + 2}" in out.stats.errors[1]
    assert f"keeps its {K + 1} new tokens" in out.stats.errors[1]
    assert len(warned) == 1 and "rows [1] stopped early" in warned[0]       # not silent without return_dict


@pytest.mark.parametrize("mode", list(MODES))
def test_nan_logits_end_their_row_and_the_others_finish_as_if_alone(setup, unread, mode, monkeypatch):
    model, ids, mask, alone, head = setup
    if mode == "calibrated":
        rotate_programs(monkeypatch, ROTATION)
    with poisoned(model):
        out, warned = _run(model, ids, mask, None if mode == "plain" else head, MODES[mode])
    _check_row_1_poisoned(out, ids, alone, warned)
    assert out.stats.as_dict()["errors"] == out.stats.errors
    if mode == "calibrated":
        assert set(out.stats.calibration["policy"]["chosen"]) == {"plain", "tree3x2x6"}
    with poisoned(model, unread):     # negative control: a token no row reads changes nothing, and says nothing
        clean, warned = _run(model, ids, mask, None if mode == "plain" else head, MODES[mode])
    assert _new(clean, ids) == alone and not clean.stats.errors and not warned


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_prompt_holding_a_nan_token_ends_its_row_at_the_prefill(setup, do_sample):
    model, ids, mask, alone, _ = setup
    bad = ids.clone()
    bad[1, -2] = X
    # Without the guard a sampled first token fails for the whole batch: multinomial refuses a NaN row.
    with pytest.raises(RuntimeError, match="probability tensor"):
        torch.multinomial(torch.tensor([[0.5, 0.5], [float("nan")] * 2]), 1)
    kwargs = {"do_sample": True, "top_k": 5, "generator": torch.Generator().manual_seed(0)} if do_sample else {}
    with poisoned(model):
        out, warned = _run(model, bad, mask, None, MODES["plain"], **kwargs)
    new = _new(out, bad)
    assert new[1] == [PAD] * MAX_NEW and out.attention_mask[1, bad.shape[1]:].sum() == 0
    assert list(out.stats.errors) == [1] and "in the prefill" in out.stats.errors[1]
    assert "keeps its 0 new tokens" in out.stats.errors[1] and len(warned) == 1
    if do_sample:
        assert all(0 <= t < 96 for t in new[0] + new[2]) and out.attention_mask[[0, 2], bad.shape[1]:].all()
    else:
        assert new[0] == alone[0] and new[2] == alone[2]


class PoisonProposer(ScriptedDrafter):
    """The oracle drafter, except that row 0 always proposes X first (wrong: X is never row 0's next token)."""

    def _log_probs(self, head):
        proposals = super()._log_probs(head)
        x_first = torch.full_like(proposals, -50.0).index_fill(-1, torch.tensor([X]), 0.0).log_softmax(-1)
        return torch.where((head[..., 0] == 0)[..., None], x_first, proposals)


def test_a_draft_that_proposes_a_poisoned_token_ends_only_its_row(setup):
    """A known limit, pinned: a draft token is verified in the same forward as its siblings, and its NaN K/V
    reach them through the mask (a masked weight is 0, and 0 * NaN is NaN). So a row whose draft proposes X
    ends with the error although plain decoding would never read X; the other rows are untouched."""
    model, ids, mask, alone, _ = setup
    ref = torch.cat([ids, torch.tensor(alone)], 1)
    drafter = PoisonProposer(continuations(ids, mask, ref), 96, "oracle")
    with poisoned(model):
        out, warned = _run(model, ids, mask, drafter, TREE)
    new = _new(out, ids)
    assert list(out.stats.errors) == [0, 1] and len(warned) == 1
    assert new[0] == alone[0][:1] + [PAD] * (MAX_NEW - 1)          # only the prefill's token: cycle 1 went NaN
    assert new[2] == alone[2]


def test_cuda_graph_buffers_forget_a_poisoned_row(setup, monkeypatch):
    """The captured step program under CUDA-graph books (host replay). Bucket buffers outlive the call; a NaN
    left in row 1's slots would end the next call's row 1 (its masked reads see it). The negative control leaves
    the NaN in place, and the next call's row 1 fails."""
    model, ids, mask, alone, head = setup
    options = {**TREE, "batch_buckets": (1, 2, 4), "cudagraphs": True, "step_program": True}
    _graphed_decoder(model, head, {**BASE, **options})
    short, short_mask = ragged([6, 3, 20], seed=7)        # row 1 now shorter than its poisoned past, row 2 longer
    short_alone = [_alone(model, short[i:i + 1, short.shape[1] - n:]) for i, n in enumerate([6, 3, 20])]
    for cleared in (True, False):
        if not cleared:
            monkeypatch.setattr(BucketBuffers, "clear_rows", lambda self, rows: None)
        with poisoned(model):
            out, warned = _run(model, ids, mask, head, options)
        _check_row_1_poisoned(out, ids, alone, warned)
        assert out.stats.cuda_graph_replays > 0
        after, warned = _run(model, short, short_mask, head, options)
        if cleared:
            assert _new(after, short) == short_alone and not after.stats.errors and not warned
        else:
            assert list(after.stats.errors) == [1]
