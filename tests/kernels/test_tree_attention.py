"""tree_attention: the Triton kernel (interpreter on CPU) against SDPA, on tree masks over a static cache."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import assert_close, poisoned

from eagle_compile.kernels.tree_attention import tree_attention_reference, tree_attention_triton

pytest.importorskip("triton")


def tree_mask(batch: int, tokens: int, slots: int, prefix: list[int], dtype: torch.dtype,
              seed: int = 0) -> torch.Tensor:
    """[B, 1, T, S] additive mask: prefix visible; tree nodes (random parents, at slots prefix..) see their
    ancestors and themselves.

    Row 0's last query is a padding row (everything blocked) and row 0 cannot see slots 0..15, so with
    block_n=16 its first KV tile is blocked for every query (the skipped-tile path).
    """
    g = torch.Generator().manual_seed(seed)
    mask = torch.full((batch, 1, tokens, slots), float("-inf"))
    for b in range(batch):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, tokens)]
        for t in range(tokens):
            mask[b, 0, t, : prefix[b]] = 0.0
            node = t
            while node >= 0:
                mask[b, 0, t, prefix[b] + node] = 0.0
                node = parents[node]
    mask[0, 0, :, :16] = float("-inf")
    mask[0, 0, -1] = float("-inf")
    return mask.to(dtype)


def run(batch, q_heads, kv_heads, tokens, slots, head_dim, dtype, *, block_n=16, prefix=None,
        broadcast_mask=False):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch, q_heads, tokens, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, slots, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, slots, head_dim, generator=g).to(dtype)
    prefix = prefix or [slots - tokens - 1 - b for b in range(batch)]
    mask = tree_mask(1 if broadcast_mask else batch, tokens, slots, prefix, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    out = tree_attention_triton(q, k, v, mask, scale, out=poisoned(q.shape, dtype), block_n=block_n)
    expected = tree_attention_reference(q.float(), k.float(), v.float(), mask.float(), scale)
    assert_close(out.float(), expected, dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gqa_tree_matches_sdpa(dtype):
    # G = 2 query heads per KV head; S = 37 and T = 5 are not multiples of the 16-wide tiles; hd 24 -> tile 32
    out = run(2, 4, 2, 5, 37, 24, dtype)
    assert (out[0, :, -1] == 0).all(), "a fully masked query row gives 0 (like SDPA with -inf)"


@pytest.mark.parametrize("head_dim", [16, 64, 96, 128])
def test_head_dims_of_supported_models(head_dim):
    run(1, 3, 1, 3, 21, head_dim, torch.float32, block_n=16)


def test_no_grouping_broadcast_mask_and_default_tiles():
    run(2, 2, 2, 4, 23, 16, torch.float16, block_n=None, broadcast_mask=True)


def test_bf16_runs_with_fp32_dots_in_the_interpreter():
    # the interpreter's bf16 tl.dot multiplies bit patterns (COMPILE_FACTS.md §5); the kernel upcasts there
    run(1, 4, 2, 3, 19, 16, torch.bfloat16)


def test_packed_rows_span_several_programs():
    # G*T = 4*9 = 36 packed rows over 16-row programs: three programs, the last one partly masked
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 8, 9, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 30, 16, generator=g)
    mask = tree_mask(1, 9, 30, [20], torch.float32)
    out = tree_attention_triton(q, k, v, mask, 0.25, out=poisoned(q.shape, torch.float32), block_m=16,
                                block_n=16)
    assert_close(out, tree_attention_reference(q, k, v, mask, 0.25), torch.float32)


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 5, 4, 16, generator=g).transpose(1, 2)  # [1, 4, 5, 16] view
    k, v = (torch.randn(1, 30, 2, 16, generator=g).transpose(1, 2) for _ in range(2))
    mask = tree_mask(1, 5, 30, [20], torch.float32)
    out = tree_attention_triton(q, k, v, mask, 0.25, out=poisoned(q.shape, torch.float32))
    assert_close(out, tree_attention_reference(q, k, v, mask, 0.25), torch.float32)


def test_reference_zeroes_fully_masked_rows_and_matches_math():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 3, 8, generator=g)
    k, v = torch.randn(2, 1, 1, 6, 8, generator=g)
    mask = torch.zeros(1, 1, 3, 6)
    mask[0, 0, 1] = float("-inf")
    mask[0, 0, 2, 4:] = float("-inf")
    out = tree_attention_reference(q, k, v, mask, 0.5)
    k2, v2 = k.expand(1, 2, 6, 8), v.expand(1, 2, 6, 8)
    weights = torch.softmax(q @ k2.transpose(-1, -2) * 0.5 + mask, dim=-1)
    expected = torch.nan_to_num(weights) @ v2
    torch.testing.assert_close(out, expected)
    assert (out[0, :, 1] == 0).all()


def test_bad_shapes_are_refused():
    q = torch.randn(1, 3, 2, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        tree_attention_reference(q, k, k, torch.zeros(1, 1, 2, 8), 1.0)
    with pytest.raises(ValueError, match="additive float mask"):
        tree_attention_reference(q[:, :2], k, k, torch.ones(1, 1, 2, 8, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match="head_dim 288"):
        tree_attention_triton(torch.randn(1, 1, 1, 288), torch.randn(1, 1, 4, 288), torch.randn(1, 1, 4, 288),
                              torch.zeros(1, 1, 1, 4), 1.0)
