"""tree_attention: the CPU path and the Triton kernel (interpreter on CPU) against the dense SDPA oracle, on
prefix + tree / causal blocks over a static cache; slots past a block's end are never read."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import assert_close, poisoned

from eagle_compile.core.masks import visible_slots
from eagle_compile.kernels.tree_attention import (
    slot_mask,
    tree_attention_cpu,
    tree_attention_reference,
    tree_attention_triton,
)


def random_tree(batch: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """[B, T, T] ancestor masks (self included) of random trees in topological order."""
    g = torch.Generator().manual_seed(seed)
    local = torch.zeros(batch, tokens, tokens, dtype=torch.bool)
    for b in range(batch):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, tokens)]
        for t in range(tokens):
            node = t
            while node >= 0:
                local[b, t, node] = True
                node = parents[node]
    return local


def inputs(batch, q_heads, kv_heads, tokens, slots, head_dim, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, tokens, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, slots, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, slots, head_dim, generator=g).to(dtype)
    return q, k, v


def poison_dead_slots(k, v, base, width, value=float("nan")):
    """`value` in every slot at or past each row's block end. NaN: any read of them makes the output NaN. A huge
    finite value: a read that is masked contributes exactly 0, one that is used wrecks the output."""
    for b, start in enumerate(base.tolist()):
        k[b, :, start + width:] = value
        v[b, :, start + width:] = value


def oracle(q, k, v, base, local, scale):
    """The dense reference in float64 on the live slots only (dead slots are NaN-poisoned)."""
    width = q.shape[2] if local is None else local.shape[-1]
    end = int(base.max()) + width
    return tree_attention_reference(q.double(), k[:, :, :end].double(), v[:, :, :end].double(), base, local, scale)


CASES = {  # name -> (batch, Hq, Hkv, T, S, hd, bases, tree?)
    "tree, ragged rows, GQA": (2, 4, 2, 5, 37, 24, [20, 9], True),
    "causal block, same base": (2, 4, 2, 6, 40, 16, [12, 12], False),
    "causal block at slot 0 (first prefill chunk)": (1, 3, 1, 7, 20, 16, [0], False),
    "one-token step, ragged rows": (3, 6, 2, 1, 50, 16, [33, 0, 17], False),
    "tree, one row at base 0": (2, 2, 2, 4, 30, 16, [0, 11], True),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("impl", ["cpu", "triton-interpreter"])
def test_matches_dense_oracle_and_reads_only_live_slots(name, impl):
    batch, hq, hkv, t, s, hd, bases, tree = CASES[name]
    if impl == "triton-interpreter":
        pytest.importorskip("triton")
    q, k, v = inputs(batch, hq, hkv, t, s, hd, torch.float32)
    base = torch.tensor(bases)
    local = random_tree(batch, t) if tree else None
    expected = oracle(q, k, v, base, local, 1 / math.sqrt(hd))
    # the Triton kernel never loads a row's dead slots; the CPU path never loads slots past the longest row's
    # block end, but in a ragged batch it reads (masked) the dead slots of shorter rows below that
    ragged = len(set(bases)) > 1
    poison_dead_slots(k, v, base, t, value=1e30 if impl == "cpu" and ragged else float("nan"))
    if impl == "cpu":
        out = tree_attention_cpu(q, k, v, base, local, 1 / math.sqrt(hd))
    else:
        out = tree_attention_triton(q, k, v, base, local, 1 / math.sqrt(hd), out=poisoned(q.shape, q.dtype),
                                    block_n=16)
    assert_close(out.float(), expected.float(), torch.float32)


def test_dead_slot_poison_is_a_working_negative_control():
    # reading the whole cache (what SDPA over the dense mask does) sees the NaN-poisoned dead slots
    q, k, v = inputs(1, 2, 1, 3, 30, 16, torch.float32)
    base = torch.tensor([10])
    poison_dead_slots(k, v, base, 3)
    assert tree_attention_reference(q, k, v, base, None, 0.25).isnan().any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_low_precision(dtype):
    # bf16: the interpreter's bf16 tl.dot multiplies bit patterns (COMPILE_FACTS.md §5); the kernel upcasts there
    pytest.importorskip("triton")
    q, k, v = inputs(2, 4, 2, 5, 37, 24, dtype)
    base, local = torch.tensor([20, 9]), random_tree(2, 5)
    out = tree_attention_triton(q, k, v, base, local, 0.2, out=poisoned(q.shape, dtype), block_n=16)
    assert_close(out.float(), oracle(q, k, v, base, local, 0.2).float(), dtype)


@pytest.mark.parametrize("head_dim", [16, 64, 96, 128])
def test_head_dims_of_supported_models(head_dim):
    pytest.importorskip("triton")
    q, k, v = inputs(1, 3, 1, 3, 21, head_dim, torch.float32)
    base, local = torch.tensor([15]), random_tree(1, 3)
    out = tree_attention_triton(q, k, v, base, local, 0.125, out=poisoned(q.shape, q.dtype), block_n=16)
    assert_close(out, oracle(q, k, v, base, local, 0.125).float(), torch.float32)


def test_packed_rows_span_several_programs_and_default_tiles():
    # G*T = 4*9 = 36 packed rows over 16-row programs: three programs, the last one partly masked
    pytest.importorskip("triton")
    q, k, v = inputs(1, 8, 2, 9, 30, 16, torch.float32, seed=2)
    base, local = torch.tensor([20]), random_tree(1, 9, seed=2)
    out = tree_attention_triton(q, k, v, base, local, 0.25, out=poisoned(q.shape, q.dtype), block_m=16,
                                block_n=16)
    assert_close(out, oracle(q, k, v, base, local, 0.25).float(), torch.float32)
    out = tree_attention_triton(q, k, v, base, None, 0.25)
    assert_close(out, oracle(q, k, v, base, None, 0.25).float(), torch.float32)


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 5, 4, 16, generator=g).transpose(1, 2)  # [1, 4, 5, 16] view
    k, v = (torch.randn(1, 30, 2, 16, generator=g).transpose(1, 2) for _ in range(2))
    base, local = torch.tensor([20]), random_tree(1, 5, seed=3)
    expected = oracle(q, k, v, base, local, 0.25).float()
    assert_close(tree_attention_cpu(q, k, v, base, local, 0.25), expected, torch.float32)
    pytest.importorskip("triton")
    out = tree_attention_triton(q, k, v, base, local, 0.25, out=poisoned(q.shape, torch.float32))
    assert_close(out, expected, torch.float32)


def test_visibility_and_dense_mask_follow_the_definition():
    base = torch.tensor([2, 0])
    local = torch.tensor([[[True, False], [True, True]], [[True, False], [False, True]]])
    vis = visible_slots(base, local, 2, 6)
    assert vis[0].tolist() == [[True, True, True, False, False, False], [True, True, True, True, False, False]]
    assert vis[1].tolist() == [[True, False, False, False, False, False], [False, True, False, False, False, False]]
    causal = visible_slots(torch.tensor([3]), None, 2, 6)
    assert causal[0].tolist() == [[True] * 4 + [False] * 2, [True] * 5 + [False]]
    dense = slot_mask(base, local, 2, 6, torch.float32)
    assert dense.shape == (2, 1, 2, 6) and torch.equal(dense[:, 0] == 0, vis)
    assert torch.isneginf(dense[:, 0][~vis]).all()


def test_a_query_that_sees_nothing_gives_zero():
    q, k, v = inputs(1, 2, 1, 2, 8, 8, torch.float32)
    local = torch.tensor([[[True, False], [False, False]]])
    for out in (tree_attention_cpu(q, k, v, torch.tensor([0]), local, 0.5),
                tree_attention_reference(q, k, v, torch.tensor([0]), local, 0.5)):
        assert (out[0, :, 1] == 0).all() and not out.isnan().any()


def test_bad_inputs_are_refused():
    q = torch.randn(1, 3, 2, 16)
    k = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        tree_attention_cpu(q, k, k, torch.tensor([0]), None, 1.0)
    with pytest.raises(ValueError, match="base must be"):
        tree_attention_cpu(q[:, :2], k, k, torch.tensor([0], dtype=torch.int32), None, 1.0)
    with pytest.raises(ValueError, match="local must be"):
        tree_attention_cpu(q[:, :2], k, k, torch.tensor([0]), torch.ones(1, 2, 2), 1.0)
    with pytest.raises(ValueError, match="head_dim 288"):
        tree_attention_triton(torch.randn(1, 1, 1, 288), torch.randn(1, 1, 4, 288), torch.randn(1, 1, 4, 288),
                              torch.tensor([0]), None, 1.0)
