"""The batch-invariant CPU kernels themselves: `eagle31::bi_linear` and `eagle31::bi_tree_attention` give a row
(a query) the same bits whatever else the call carries and however many threads run it, and stay within float32
rounding of `F.linear` and the dense attention oracle. The whole-program checks are in
tests/runtime/test_batch_invariance.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle_compile.kernels import batch_invariant as bi
from eagle_compile.kernels.tree_attention import tree_attention_reference


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("k, n, bias", [(64, 40, False), (37, 13, True), (200, 96, True)])   # 37, 13: tails
def test_bi_linear_rows_do_not_depend_on_the_other_rows_or_threads(k, n, bias):
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(n, k, generator=g), torch.randn(21, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    torch.set_num_threads(1)
    alone = torch.cat([bi.bi_linear(x[i:i + 1], w, b) for i in range(21)])
    assert torch.allclose(alone, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for m in (2, 3, 5, 8, 21):
            assert torch.equal(bi.bi_linear(x[:m], w, b), alone[:m]), (m, threads)
        assert torch.equal(bi.bi_linear(x[5:13], w, b), alone[5:13])              # rows at other tile offsets
    assert bi.bi_linear(x.view(3, 7, k), w, b).shape == (3, 7, n)



@pytest.mark.parametrize("narrow", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k, n", [(64, 40), (37, 13)])                                       # 37, 13: tails
def test_a_16_bit_weight_gives_the_bits_of_the_float32_weight_of_its_values(narrow, k, n):
    """bi_linear widens a float16/bfloat16 weight exactly as it loads it: the float32 weight holding the same
    values computes the same bits, for every row count and thread count (NarrowWeights relies on it)."""
    g = torch.Generator().manual_seed(k)
    w16 = torch.randn(n, k, generator=g).to(narrow)
    x, b = torch.randn(21, k, generator=g), torch.randn(n, generator=g)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for m in (1, 2, 3, 8, 21):
            assert torch.equal(bi.bi_linear(x[:m], w16, b), bi.bi_linear(x[:m], w16.float(), b)), (m, threads)
    wider = w16.float() + torch.randn(n, k, generator=g) * 1e-3                 # other values: other bits
    assert not torch.equal(bi.bi_linear(x, wider, b), bi.bi_linear(x, w16, b))


def test_narrow_weights_copy_only_weights_whose_every_value_fits():
    g = torch.Generator().manual_seed(0)
    half_values = torch.randn(8, 16, generator=g).half().float()
    bf16_values = torch.randn(8, 16, generator=g).bfloat16().float()
    bf16_values[0, 0] = 2.0 ** 20                                       # beyond float16's range, a bfloat16 value
    neither = half_values + 1e-4                                        # float32 mantissas
    narrow = bi.NarrowWeights()
    assert narrow(half_values).dtype == torch.float16 and narrow(half_values) is narrow(half_values)   # kept
    assert narrow(bf16_values).dtype == torch.bfloat16
    assert narrow(neither) is neither
    assert narrow(torch.randn(16)).dtype == torch.float32 and len(narrow) == 2     # 1-D tensors are never copied
    half_values.add_(1e-4)                        # changed in place: checked again, never a stale copy
    assert narrow(half_values) is half_values and len(narrow) == 1


def test_the_mode_runs_a_float16_head_in_16_bits_with_the_float32_bits():
    """BatchInvariantMode with NarrowWeights computes F.linear of float16-valued float32 weights from their
    16-bit copies, to the same bits as without them."""
    g = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(40, 24).half().float()
    x = torch.randn(3, 40, generator=g)
    with torch.no_grad(), bi.BatchInvariantMode():
        plain = layer(x)
    narrow = bi.NarrowWeights()
    with torch.no_grad(), bi.BatchInvariantMode(narrow):
        out = layer(x)
    assert torch.equal(out, plain) and len(narrow) == 1               # the weight went through its copy (bias: 1-D)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_packed_layout_gives_bi_linears_bits(dtype):
    """bi_linear_packed over pack_weight's panels runs bi_linear's sequence per element: identical bits for any
    row count, bias or not, 1 or 2 threads (the pass and the draft pick either freely)."""
    bi.load()
    g = torch.Generator().manual_seed(3)
    for n, k in ((40, 64), (12, 200), (96, 24)):
        w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g)
        packed = bi.pack_weight(w, panels=False)
        assert packed.shape == (n // 4, k // 8, 4, 8)
        x = torch.randn(2, 11, k, generator=g)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 3, 8, 11):
                for bias in (None, b):
                    got = torch.ops.eagle31.bi_linear_packed(x[:, :m], packed, bias)
                    assert torch.equal(got, bi.bi_linear(x[:, :m], w, bias)), (n, k, m, threads)
    assert bi.pack_weight(torch.randn(6, 16)) is None and bi.pack_weight(torch.randn(8, 12)) is None  # N%4, K%8
    with pytest.raises(RuntimeError, match=r"\[N/4, K/8, 4, 8\]"):
        torch.ops.eagle31.bi_linear_packed(torch.randn(2, 16), torch.randn(4, 16), None)


def test_the_panel_layout_gives_bi_linears_bits():
    """bi_linear_panels over 16-column panels (vectors across columns, the eight lanes of k as eight passes) runs
    bi_linear's sequence per element: identical bits for row counts that use every row tile (8, 4, 2, 1), panel
    groups of 3, 2 and 1, bias or not, 1 or 2 threads. On a build without AVX-512 the op runs the same loops on
    portable arrays (pack_weight then picks the 4-column layout by default)."""
    bi.load()
    g = torch.Generator().manual_seed(4)
    for n, k in ((48, 64), (16, 200), (96, 24), (80, 8)):
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        panels = bi.pack_weight(w, panels=True)
        assert panels.shape == (n // 16, 8, k // 8, 16)
        x = torch.randn(2, 17, k, generator=g)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 3, 5, 8, 15, 17):
                for bias in (None, b):
                    got = bi.packed_linear(x[:, :m], panels, bias)
                    assert torch.equal(got, bi.bi_linear(x[:, :m], w, bias)), (n, k, m, threads)
    assert bi.pack_weight(torch.randn(40, 16), panels=True).shape == (10, 2, 4, 8)      # N % 16: 4-column panels
    assert bi.pack_weight(torch.randn(32, 16).half(), panels=True).shape == (8, 2, 4, 8)   # 16-bit: 4-column
    with pytest.raises(RuntimeError, match=r"\[N/16, 8, K/8, 16\]"):
        torch.ops.eagle31.bi_linear_panels(torch.randn(2, 16), torch.randn(1, 8, 3, 16), None)


def test_packed_weights_keep_a_budget_follow_in_place_changes_and_free_dead_weights():
    bi.load()
    w1, w2, odd = torch.randn(8, 16), torch.randn(8, 16), torch.randn(6, 16)
    packs = bi.PackedWeights(budget=w1.numel() * 4)                   # room for one of the two
    assert packs(w1) is not None and packs(w1) is packs(w1) and packs.holds(w1)
    assert packs(w2) is None and packs.declined == 1 and not packs.holds(w2)    # past the budget: unpacked
    assert packs(odd) is None and packs.declined == 1                              # a shape that does not pack
    x = torch.randn(3, 16)
    w1.mul_(2.0)                                                      # changed in place: packed again, not stale
    assert not packs.holds(w1)
    assert torch.equal(bi.packed_linear(x, packs(w1), None), bi.bi_linear(x, w1))
    assert len(packs) == 1 and packs.bytes == w1.numel() * 4
    del w1
    assert len(packs) == 0 and packs.bytes == 0                       # freed with its weight
    w3 = torch.randn(8, 16)
    assert packs(w3) is not None and packs(w2) is None    # room again for a new weight; a declined one stays so
    assert torch.equal(bi.linear(x, w3), bi.bi_linear(x, w3))         # the public entry: the same bits
    packs.clear()
    assert len(packs) == 0 and packs.bytes == 0 and packs(w3) is not None    # made again on next use


def test_bi_tree_attention_matches_the_oracle_and_a_token_sees_the_same_bits_everywhere():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 120, 16, generator=g), torch.randn(2, 2, 120, 16, generator=g)
    q, base = torch.randn(2, 4, 12, 16, generator=g), torch.tensor([50, 7])
    local = torch.rand(2, 12, 12, generator=g) < 0.5
    for loc in (None, local):
        ref = tree_attention_reference(q, k, v, base, loc, 0.25)
        assert torch.allclose(bi.bi_tree_attention(q, k, v, base, loc, 0.25), ref, atol=1e-5)
    # one query at position p = 60: decoded alone, inside a causal chunk, on the path of a tree
    p, query = 60, q[:1, :, :1]
    one = bi.bi_tree_attention(query, k[:1], v[:1], torch.tensor([p]), None, 0.25)
    chunk = torch.randn(1, 4, 6, 16, generator=g)
    chunk[:, :, 3] = query[:, :, 0]
    assert torch.equal(bi.bi_tree_attention(chunk, k[:1], v[:1], torch.tensor([p - 3]), None, 0.25)[:, :, 3:4], one)
    kt, vt = k[:1].clone(), v[:1].clone()                   # the path p-2, p-1, p at block slots 0, 2, 4
    for j, pos in ((0, p - 2), (2, p - 1), (4, p)):
        kt[:, :, p - 2 + j], vt[:, :, p - 2 + j] = k[:1, :, pos], v[:1, :, pos]
    tree = torch.randn(1, 4, 6, 16, generator=g)
    tree[:, :, 4] = query[:, :, 0]
    mask = torch.eye(6, dtype=torch.bool)[None].clone()
    mask[0, 4, [0, 2]] = True
    for threads in (1, 2):
        torch.set_num_threads(threads)
        out = bi.bi_tree_attention(tree, kt, vt, torch.tensor([p - 2]), mask, 0.25)[:, :, 4:5]
        assert torch.equal(out, one), threads


@pytest.mark.skipif(not bi.panel_layout(), reason="the wide attention path is built only where AVX-512 is")
@pytest.mark.parametrize("d, hq, hkv, t, bases, tree", [
    (64, 9, 3, 40, [100, 3], False),       # SmolLM2's heads: a prefill chunk (several query tiles, a partial one)
    (64, 9, 3, 24, [70, 0], True),         # a verify tree: the block's slots seen selectively
    (16, 4, 2, 33, [5], False),
    (80, 6, 3, 16, [31], True),
    (128, 4, 1, 12, [0], False),
])
def test_the_wide_path_gives_each_query_the_bits_it_gets_alone(d, hq, hkv, t, bases, tree):
    """A call of many queries runs the wide path (vectors across keys); each query's output equals, bit for bit,
    a one-query call with the same visibility (which runs attention_tile), at 1 and 2 threads."""
    g = torch.Generator().manual_seed(d + t)
    b, slots = len(bases), max(bases) + t + 3
    k, v = torch.randn(b, hkv, slots, d, generator=g), torch.randn(b, hkv, slots, d, generator=g)
    q, base = torch.randn(b, hq, t, d, generator=g), torch.tensor(bases)
    local = (torch.rand(b, t, t, generator=g) < 0.4) | torch.eye(t, dtype=torch.bool) if tree else None
    for threads in (1, 2):
        torch.set_num_threads(threads)
        before = bi.wide_attention_calls()
        out = bi.bi_tree_attention(q, k, v, base, local, 0.125)
        assert bi.wide_attention_calls() == before + 1, "the call did not run the wide path"
        assert torch.allclose(out, tree_attention_reference(q, k, v, base, local, 0.125), atol=1e-5)
        for i in range(t):
            one = bi.bi_tree_attention(q[:, :, i:i + 1], k, v, base + (0 if tree else i),
                                       None if local is None else local[:, i:i + 1], 0.125)
            assert torch.equal(one[:, :, 0], out[:, :, i]), (threads, i)
        assert bi.wide_attention_calls() == before + 1, "a one-query call ran the wide path"


@pytest.mark.skipif(not bi.panel_layout(), reason="the wide attention path is built only where AVX-512 is")
def test_the_wide_path_keeps_nan_to_the_rows_that_see_it():
    q, k = torch.randn(1, 3, 24, 16), torch.randn(1, 1, 40, 16)
    k[0, 0, 12, 0] = float("nan")                       # block slot 2: queries 2.. see it, 0 and 1 do not
    before = bi.wide_attention_calls()
    out = bi.bi_tree_attention(q, k, k, torch.tensor([10]), None, 0.3)
    assert bi.wide_attention_calls() == before + 1
    assert not out[:, :, :2].isnan().any() and out[:, :, 2:].isnan().all()


def test_the_kernels_refuse_what_they_do_not_compute():
    with pytest.raises(RuntimeError, match="float32"):
        bi.bi_linear(torch.randn(2, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"\[N, K\]"):
        bi.bi_linear(torch.randn(2, 4), torch.randn(3, 5))
    k = torch.randn(1, 1, 8, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        bi.bi_tree_attention(torch.randn(1, 2, 4, 16), k, k, torch.tensor([6]), None, 0.25)


def test_edge_cases_follow_the_reference():
    """An empty reduction gives the bias; a NaN key makes the rows that see it NaN (not a silent finite value)."""
    out = bi.bi_linear(torch.randn(2, 3, 0), torch.randn(4, 0), torch.arange(4.0))
    assert torch.equal(out, torch.arange(4.0).expand(2, 3, 4))
    q, k = torch.randn(1, 2, 2, 8), torch.randn(1, 1, 6, 8)
    k[0, 0, 3, 0] = float("nan")
    out = bi.bi_tree_attention(q, k, k, torch.tensor([3]), None, 0.3)   # query 0 sees slots 0-3, 1 sees 0-4
    assert out.isnan().all()
    assert not bi.bi_tree_attention(q, k, k, torch.tensor([1]), None, 0.3).isnan().any()   # slots 0-2 only
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        torch.ops.eagle31.bi_tree_attention.default(torch.randn(1, 2, 1, 8), torch.randn(1, 3, 5, 8),
                                                    torch.randn(1, 3, 5, 8), torch.tensor([4]), None, 0.3)


def test_the_mode_takes_keyword_arguments():
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with bi.BatchInvariantMode():
        assert torch.equal(F.linear(input=x, weight=w), bi.bi_linear(x, w))
        assert torch.equal(F.linear(x, w, bias=torch.ones(5)), bi.bi_linear(x, w, torch.ones(5)))
