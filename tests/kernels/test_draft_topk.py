"""draft_topk: the two Triton kernels (Triton interpreter on CPU) against a full log-softmax + stable sort."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import POISON_INT, poisoned

from eagle_compile.kernels.draft_topk import draft_topk_reference, draft_topk_triton

pytest.importorskip("triton")


def inputs(rows, hidden, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    normed = torch.randn(rows, hidden, generator=g).to(dtype)
    lm_head = torch.randn(vocab, hidden, generator=g).to(dtype)
    d2t = torch.randint(0, 5, (vocab,), generator=g).cumsum(0)  # offsets: ordered subset of a larger vocab
    return normed, lm_head, d2t


def poisoned_outputs(shape):
    return poisoned(shape, torch.float32), poisoned(shape, torch.int64), poisoned(shape, torch.int64)


def check(got, expected, atol):
    logp, draft_ids, target_ids = got
    ref_logp, ref_draft, ref_target = expected
    assert not logp.isnan().any() and (draft_ids != POISON_INT).all() and (target_ids != POISON_INT).all()
    assert torch.equal(draft_ids, ref_draft)
    assert torch.equal(target_ids, ref_target)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [1, 4])
def test_matches_reference(dtype, k):
    # Vd = 100 over 32-wide tiles (last tile 4 wide, fewer than k real columns), H = 24 over 16-wide steps
    normed, lm_head, d2t = inputs(5, 24, 100, dtype)
    got = draft_topk_triton(normed, lm_head, d2t, k, out=poisoned_outputs((5, k)), block_v=32, block_k=16)
    check(got, draft_topk_reference(normed, lm_head, d2t, k), atol=1e-5)
    logp, draft_ids, target_ids = got
    assert (logp[:, :-1] >= logp[:, 1:]).all(), "descending"
    assert torch.equal(target_ids, draft_ids + d2t[draft_ids])


def test_k_equal_to_vocab_and_tiles_wider_than_vocab():
    normed, lm_head, d2t = inputs(3, 16, 20, torch.float32, seed=1)
    got = draft_topk_triton(normed, lm_head, d2t, 20, out=poisoned_outputs((3, 20)), block_v=32)
    check(got, draft_topk_reference(normed, lm_head, d2t, 20), atol=1e-5)
    assert torch.equal(got[1].sort(dim=1).values, torch.arange(20).expand(3, 20)), "every draft id once"


def test_default_tiles_and_leading_dims():
    normed, lm_head, d2t = inputs(6, 40, 300, torch.float16, seed=2)
    normed = normed.view(2, 3, 40)
    got = draft_topk_triton(normed, lm_head, d2t, 3, out=poisoned_outputs((2, 3, 3)))
    check(got, draft_topk_reference(normed, lm_head, d2t, 3), atol=1e-5)


def test_ties_take_the_lower_draft_id_first():
    # small integers: every logit is exact in fp32, so equal logits really are equal, across tiles too
    g = torch.Generator().manual_seed(3)
    normed = torch.randint(-2, 3, (4, 8), generator=g).float()
    lm_head = torch.randint(-1, 2, (40, 8), generator=g).float()
    lm_head[25] = lm_head[6]  # a guaranteed tie between tiles 0 and 1
    d2t = torch.zeros(40, dtype=torch.long)
    got = draft_topk_triton(normed, lm_head, d2t, 8, out=poisoned_outputs((4, 8)), block_v=16, block_k=16)
    expected = draft_topk_reference(normed, lm_head, d2t, 8)
    check(got, expected, atol=1e-6)
    logits = normed @ lm_head.T
    for row in range(4):  # brute force: order by (-logit, draft id)
        order = sorted(range(40), key=lambda j: (-logits[row, j].item(), j))[:8]
        assert expected[1][row].tolist() == order
    assert (expected[0][:, :-1] == expected[0][:, 1:]).any(), "the selected tokens do contain ties"
    assert (logits[:, 6] == logits[:, 25]).all()


def test_reference_log_probs():
    normed, lm_head, d2t = inputs(2, 8, 30, torch.float64, seed=4)
    logp, draft_ids, target_ids = draft_topk_reference(normed, lm_head, d2t, 5)
    full = torch.log_softmax(normed @ lm_head.T, dim=-1)
    torch.testing.assert_close(logp.double(), full.gather(1, draft_ids), rtol=0, atol=1e-5)
    assert torch.equal(draft_ids, full.topk(5).indices)


def test_bad_arguments_are_refused():
    normed, lm_head, d2t = inputs(2, 8, 30, torch.float32)
    with pytest.raises(ValueError, match="1 <= k <= draft vocabulary size 30"):
        draft_topk_reference(normed, lm_head, d2t, 31)
    with pytest.raises(ValueError, match="int64 offsets"):
        draft_topk_reference(normed, lm_head, d2t.int(), 3)
    with pytest.raises(ValueError, match="does not fit lm_head_weight"):
        draft_topk_reference(normed[:, :7], lm_head, d2t, 3)
