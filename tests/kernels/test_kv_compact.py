"""kv_compact: the Triton kernel (interpreter on CPU) against gather-then-scatter in torch, in place."""

from __future__ import annotations

import pytest
import torch

from eagle_compile.kernels.kv_compact import kv_compact_reference, kv_compact_triton

pytest.importorskip("triton")

# one path per row, all non-decreasing with path[j] >= j: accept everything, skip nodes, nothing accepted
# (repeats of the root), and an accepted node followed by repeats of it (accept_len 2 of D = 4)
PATHS = [[0, 1, 2, 3, 4], [0, 2, 5, 6, 9], [0, 0, 0, 0, 0], [0, 3, 7, 7, 7]]
BASES = [0, 4, 11, 6]


def caches(dtype, slots=24, head_dim=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(len(PATHS), 3, slots, head_dim, generator=g).to(dtype)
    values = torch.randn(len(PATHS), 3, slots, head_dim, generator=g).to(dtype)
    return keys, values


def expected_by_hand(keys, base, path):
    """Slot base+j takes the old content of slot base+path[j]; every other slot keeps its content."""
    out = keys.clone()
    for b in range(keys.shape[0]):
        for j, p in enumerate(path[b].tolist()):
            out[b, :, base[b] + j] = keys[b, :, base[b] + p]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_matches_reference_and_hand_computation(dtype):
    keys, values = caches(dtype)
    base, path = torch.tensor(BASES), torch.tensor(PATHS)
    want_k, want_v = expected_by_hand(keys, base, path), expected_by_hand(values, base, path)
    ref_k, ref_v = keys.clone(), values.clone()
    kv_compact_reference(ref_k, ref_v, base, path)
    assert torch.equal(ref_k, want_k) and torch.equal(ref_v, want_v)
    # block_d = 16 against head_dim 20: two programs per (row, head), the second partly masked
    kv_compact_triton(keys, values, base, path, block_d=16)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)


def test_every_slot_outside_the_path_is_untouched_and_moves_happened():
    keys, values = caches(torch.float32, slots=30, head_dim=8, seed=1)
    before = keys.clone()
    base, path = torch.tensor(BASES), torch.tensor(PATHS)
    kv_compact_triton(keys, values, base, path)
    changed = (keys != before).any(dim=(1, 3))  # [B, S]
    for b, (offset, row) in enumerate(zip(BASES, PATHS, strict=True)):
        moved = {offset + j for j, p in enumerate(row) if p != j}
        assert set(torch.nonzero(changed[b]).flatten().tolist()) == moved
    assert changed.any(), "the test moved something"


def test_overlapping_chain_needs_read_before_write():
    # path [0, 2, 3]: slot 1 <- 2 and slot 2 <- 3; writing slot 2 before reading it would copy slot 3 twice
    keys = torch.arange(8.0).view(1, 1, 8, 1).repeat(1, 1, 1, 4)
    values = keys.clone()
    kv_compact_triton(keys, values, torch.tensor([0]), torch.tensor([[0, 2, 3]]))
    assert keys[0, 0, :, 0].tolist() == [0, 2, 3, 3, 4, 5, 6, 7]


def test_non_contiguous_cache_views():
    keys, values = caches(torch.float32, seed=2)
    # same values, memory laid out as [B, S, H, hd]
    k_t, v_t = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (keys, values))
    base, path = torch.tensor(BASES), torch.tensor(PATHS)
    kv_compact_triton(k_t, v_t, base, path)
    kv_compact_reference(keys, values, base, path)
    assert torch.equal(k_t, keys) and torch.equal(v_t, values)


def test_bad_arguments_are_refused():
    keys, values = caches(torch.float32)
    with pytest.raises(ValueError, match="int64"):
        kv_compact_reference(keys, values, torch.tensor(BASES, dtype=torch.int32), torch.tensor(PATHS))
    with pytest.raises(ValueError, match=r"\[B\] and \[B, P\]"):
        kv_compact_reference(keys, values, torch.tensor(BASES[:2]), torch.tensor(PATHS))
