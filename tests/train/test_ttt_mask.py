"""The block-diagonal TTT attention: the worked example of the docstring, and block_attention == dense
attention with that mask over the concatenated keys of all steps (padding included)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle_compile.train.ttt import block_attention, causal_visibility, shift_left, ttt_attention_mask


def test_worked_example_t3_step2():
    mask = ttt_attention_mask(torch.ones(1, 3, dtype=torch.bool), 2)[0].int()
    expected = torch.tensor([
        # step-0 keys  step-1    step-2
        [1, 0, 0,      1, 0, 0,  1, 0, 0],
        [1, 1, 0,      0, 1, 0,  0, 1, 0],
        [1, 1, 1,      0, 0, 1,  0, 0, 1],
    ])
    assert mask.shape == (3, 9)
    assert torch.equal(mask, expected)


def test_mask_matches_flex_form_and_padding():
    t, step = 5, 3
    attention = torch.tensor([[True] * 5, [True, True, True, False, False]])
    mask = ttt_attention_mask(attention, step)
    q = torch.arange(t)[:, None]
    kv = torch.arange((step + 1) * t)[None, :]
    flex = ((kv < t) & (q >= kv)) | ((kv >= t) & ((kv - q) % t == 0))
    assert torch.equal(mask[0], flex)
    # row 1: real queries never see padded step-0 keys (3, 4); the own keys of later steps stay visible
    assert not mask[1, :3, 3:5].any()
    assert torch.equal(mask[1, :3, t:], flex[:3, t:])
    assert mask.sum(-1).min() > 0  # no empty row (a padded query would otherwise produce NaN)


def test_block_attention_equals_dense_masked_attention():
    gen = torch.Generator().manual_seed(0)
    b, nh, nkv, t, hd, step = 2, 4, 2, 6, 8, 3
    attention = torch.tensor([[True] * t, [True] * 4 + [False] * 2])
    q = torch.randn(b, nh, t, hd, generator=gen, dtype=torch.float64)
    keys = [torch.randn(b, nkv, t, hd, generator=gen, dtype=torch.float64) for _ in range(step + 1)]
    values = [torch.randn(b, nkv, t, hd, generator=gen, dtype=torch.float64) for _ in range(step + 1)]
    out = block_attention(q, keys, values, causal_visibility(attention))
    dense_k = torch.cat(keys, dim=2).repeat_interleave(nh // nkv, dim=1)
    dense_v = torch.cat(values, dim=2).repeat_interleave(nh // nkv, dim=1)
    ref = F.scaled_dot_product_attention(q, dense_k, dense_v, attn_mask=ttt_attention_mask(attention, step)[:, None])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)


def test_shift_left_zero_pads():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 0).tolist() == [[1, 2, 3, 4]]
    assert shift_left(x, 1).tolist() == [[2, 3, 4, 0]]
    assert shift_left(x, 3).tolist() == [[4, 0, 0, 0]]
    assert shift_left(x, 6).tolist() == [[0, 0, 0, 0]]
