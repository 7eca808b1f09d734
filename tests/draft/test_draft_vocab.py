"""d2t / t2d: construction from token counts and the refusal of every broken mapping."""

from __future__ import annotations

import pytest
import torch

from eagle_compile.draft import build_vocab_mapping, validate_vocab_mapping
from eagle_compile.draft.vocab import identity_vocab_mapping
from eagle_compile.errors import CheckpointError

V, VD = 12, 5


def good_mapping() -> tuple[torch.Tensor, torch.Tensor]:
    used = torch.tensor([1, 3, 4, 8, 11])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(VD), t2d


def test_build_vocab_mapping_takes_most_frequent_ties_to_lower_id():
    counts = torch.tensor([5, 9, 0, 7, 7, 1, 7, 3, 9, 0, 2, 4])
    d2t, t2d = build_vocab_mapping(counts, 5)
    used = torch.arange(5) + d2t
    # 9s at ids 1 and 8, then 7s at ids 3, 4, 6 (of which the count 5 at id 0 loses), so {1, 3, 4, 6, 8}
    assert used.tolist() == [1, 3, 4, 6, 8]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.nonzero().flatten().tolist() == [1, 3, 4, 6, 8]
    assert bool((d2t[1:] >= d2t[:-1]).all())  # offsets non-decreasing
    validate_vocab_mapping(d2t, t2d, 12, 5)
    # ties among equal counts go to the lower id: only one of the three 7s fits here
    assert (torch.arange(3) + build_vocab_mapping(counts, 3)[0]).tolist() == [1, 3, 8]


def test_build_vocab_mapping_full_vocabulary_is_identity():
    d2t, t2d = build_vocab_mapping(torch.randint(0, 50, (10,)), 10)
    assert not d2t.any() and t2d.all()


def test_good_mapping_passes_unchanged():
    d2t, t2d = good_mapping()
    out_d2t, out_t2d = validate_vocab_mapping(d2t, t2d, V, VD)
    assert torch.equal(out_d2t, d2t) and torch.equal(out_t2d, t2d)


def test_identity_when_full_vocabulary_and_no_mapping():
    d2t, t2d = validate_vocab_mapping(None, None, V, V)
    assert torch.equal(d2t, torch.zeros(V, dtype=torch.int64)) and t2d.all()


def test_missing_t2d_is_derived_from_d2t():
    d2t, t2d = good_mapping()
    assert torch.equal(validate_vocab_mapping(d2t, None, V, VD)[1], t2d)


def _case(name):
    d2t, t2d = good_mapping()
    if name == "missing d2t":
        return None, t2d, VD, ["no d2t", "reduced", f"{VD} < vocab_size {V}"]
    if name == "float d2t":
        return d2t.float(), t2d, VD, ["dtype", "torch.float32", "int64"]
    if name == "int32 d2t":
        return d2t.int(), t2d, VD, ["dtype", "torch.int32", "d2t.long()"]
    if name == "wrong d2t shape":
        return d2t[:4], t2d, VD, ["shape", "[4]", f"[{VD}]"]
    if name == "negative target":
        bad = d2t.clone()
        bad[2] = -5  # 2 + (-5) = -3
        return bad, t2d, VD, ["negative", "[2]", "[-5]", "sign"]
    if name == "out of range target":
        bad = d2t.clone()
        bad[4] = 10  # 4 + 10 = 14 >= 12
        return bad, t2d, VD, ["out of range", ">= vocab_size 12", "[14]"]
    if name == "absolute ids instead of offsets":
        return torch.tensor([1, 3, 4, 8, 11]), t2d, VD, ["out of range", "[15]", "offsets"]
    if name == "duplicate target":
        bad = d2t.clone()
        bad[2] = 1  # 2 + 1 = 3, like draft id 1
        return bad, t2d, VD, ["duplicate", "[3]"]
    if name == "t2d does not match d2t":
        bad = t2d.clone()
        bad[8], bad[9] = False, True
        return d2t, bad, VD, ["does not match", "[8, 9]"]
    if name == "t2d count":
        bad = t2d.clone()
        bad[0] = True
        return d2t, bad, VD, ["count", "marks 6", f"draft_vocab_size is {VD}"]
    if name == "t2d dtype":
        return d2t, t2d.long(), VD, ["t2d", "dtype", "bool"]
    if name == "t2d shape":
        return d2t, t2d[:10], VD, ["t2d", "shape", "[10]", f"[{V}]"]
    if name == "draft vocab larger than target":
        return None, None, V + 1, ["exceeds", "13", "12"]
    if name == "no d2t but partial t2d":
        return None, t2d, V, ["no d2t", "marks only 5"]
    raise AssertionError(name)


CASES = [
    "missing d2t",
    "float d2t",
    "int32 d2t",
    "wrong d2t shape",
    "negative target",
    "out of range target",
    "absolute ids instead of offsets",
    "duplicate target",
    "t2d does not match d2t",
    "t2d count",
    "t2d dtype",
    "t2d shape",
    "draft vocab larger than target",
    "no d2t but partial t2d",
]


@pytest.mark.parametrize("name", CASES)
def test_bad_mapping_is_refused_with_what_and_why(name):
    d2t, t2d, vd, words = _case(name)
    with pytest.raises(CheckpointError) as info:
        validate_vocab_mapping(d2t, t2d, V, vd)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_identity_helper():
    d2t, t2d = identity_vocab_mapping(6, 4)
    assert d2t.tolist() == [0, 0, 0, 0] and t2d.tolist() == [True] * 4 + [False] * 2
    validate_vocab_mapping(d2t, t2d, 6, 4)
