"""accept_greedy / accept_sample: the Triton kernel (Triton interpreter on CPU) against core/verify.py."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import POISON_INT, poisoned

from eagle_compile.kernels.accept import (
    accept_greedy_reference,
    accept_greedy_triton,
    accept_sample_reference,
    accept_sample_triton,
)

pytest.importorskip("triton")


def random_trees(batch, size, vocab, seed, *, valid_p=0.85):
    """Random topological trees (parents[i] < i) with padding nodes; tokens from a tiny vocabulary, so sibling
    tokens repeat and target argmaxes often match (deep acceptances, ties between equally deep paths)."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, size), -1, dtype=torch.long)
    depth = torch.zeros(batch, size, dtype=torch.long)
    for i in range(1, size):
        parents[:, i] = (torch.rand(batch, generator=g) * i).long()
        depth[:, i] = depth.gather(1, parents[:, i : i + 1]).squeeze(1) + 1
    valid = torch.rand(batch, size, generator=g) < valid_p
    valid[:, 0] = True
    tokens = torch.randint(0, vocab, (batch, size), generator=g)
    return tokens, parents, depth, valid, int(depth[valid].max()), g


def poisoned_outputs(batch, max_depth):
    return (poisoned((batch,), torch.int64), poisoned((batch, max_depth + 1), torch.int64),
            poisoned((batch, max_depth + 1), torch.int64))


def assert_same(got, expected):
    assert all((t != POISON_INT).all() for t in got), "unwritten (poisoned) output elements"
    for name, a, b in zip(("accept_len", "path", "tokens"), got, expected, strict=True):
        assert torch.equal(a, b), f"{name}: kernel {a.tolist()} != reference {b.tolist()}"


def test_greedy_worked_example_of_verify():
    # the docstring example of verify_greedy: accept_len 2, path [0, 2, 5, 5], tokens [3, 4, 8, -1]
    tokens = torch.tensor([[5, 7, 3, 9, 2, 4, 1]])
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]])
    depth = torch.tensor([[0, 1, 1, 2, 2, 2, 3]])
    valid = torch.ones(1, 7, dtype=torch.bool)
    logits = torch.nn.functional.one_hot(torch.tensor([[3, 9, 4, 1, 0, 8, 6]]), 10).float()
    got = accept_greedy_triton(tokens, parents, depth, valid, logits, 3, out=poisoned_outputs(1, 3))
    assert_same(got, (torch.tensor([2]), torch.tensor([[0, 2, 5, 5]]), torch.tensor([[3, 4, 8, -1]])))


@pytest.mark.parametrize("seed", range(3))
def test_greedy_random_trees(seed):
    # M = 13 (tile 16), 8 rows per launch, vocab 3: many matches, duplicate siblings, padding nodes
    tokens, parents, depth, valid, max_depth, g = random_trees(8, 13, 3, seed)
    logits = torch.randn(8, 13, 3, generator=g)
    got = accept_greedy_triton(tokens, parents, depth, valid, logits, max_depth,
                               out=poisoned_outputs(8, max_depth))
    expected = accept_greedy_reference(tokens, parents, depth, valid, logits, max_depth)
    assert_same(got, expected)
    assert expected[0].max() >= 2, "some row accepted a deep path"


def test_greedy_chain_oracle_and_adversary():
    # chain of 4 drafts; row 0's target agrees with every draft (accept 4, bonus 9), row 1 with none
    tokens = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    parents = torch.tensor([[-1, 0, 1, 2, 3]] * 2)
    depth = torch.arange(5).expand(2, 5).contiguous()
    valid = torch.ones(2, 5, dtype=torch.bool)
    logits = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3, 4, 9], [5, 5, 5, 5, 5]]), 10).float()
    got = accept_greedy_triton(tokens, parents, depth, valid, logits, 4, out=poisoned_outputs(2, 4))
    assert_same(got, (torch.tensor([4, 0]), torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]),
                      torch.tensor([[1, 2, 3, 4, 9], [5, -1, -1, -1, -1]])))


@pytest.mark.parametrize("seed", range(3))
def test_sample_random_trees(seed):
    # V = 7 over 4-wide tiles, K = 3 children tried per node (the tree has more: rank >= K never tried)
    tokens, parents, depth, valid, max_depth, g = random_trees(8, 12, 7, seed + 10)
    probs = torch.softmax(2.0 * torch.randn(8, 12, 7, generator=g), dim=-1)
    uniforms = torch.rand(8, max_depth, 3, generator=g, dtype=torch.float64)
    final = torch.rand(8, generator=g, dtype=torch.float64)
    got = accept_sample_triton(tokens, parents, depth, valid, probs, uniforms, final, max_depth,
                               out=poisoned_outputs(8, max_depth), block_v=4)
    expected = accept_sample_reference(tokens, parents, depth, valid, probs, uniforms, final, max_depth)
    assert_same(got, expected)
    assert expected[0].max() >= 1 and expected[0].min() == 0, "both acceptances and rejections happened"


def test_sample_mass_on_children_and_empty_rows():
    # row 0: the root's distribution lives on its two children: the second one must be accepted with
    # probability 1 after the first is rejected (u = 0.999..), and the bonus comes from its fresh
    # distribution; row 1: an all-zero distribution (garbage padding row) still emits token 0; row 2: node 1
    # holds all the mass (accepted), its child none (rejected): the bonus comes from the residual
    tokens = torch.tensor([[0, 3, 5, 1], [0, 3, 5, 1], [0, 2, 4, 1]])
    parents = torch.tensor([[-1, 0, 0, 1]] * 3)
    depth = torch.tensor([[0, 1, 1, 2]] * 3)
    valid = torch.ones(3, 4, dtype=torch.bool)
    probs = torch.zeros(3, 4, 6)
    probs[0, 0, 3], probs[0, 0, 5] = 0.25, 0.75
    probs[0, 2, 1] = 1.0
    probs[2, :, 2] = 1.0
    uniforms = torch.full((3, 2, 2), 1.0 - 2.0**-53, dtype=torch.float64)
    final = torch.tensor([0.5, 0.5, 0.999], dtype=torch.float64)
    got = accept_sample_triton(tokens, parents, depth, valid, probs, uniforms, final, 2,
                               out=poisoned_outputs(3, 2))
    expected = accept_sample_reference(tokens, parents, depth, valid, probs, uniforms, final, 2)
    assert_same(got, expected)
    assert got[1][0].tolist() == [0, 2, 2] and got[2][0].tolist() == [5, 1, -1]
    assert got[2][1].tolist() == [0, -1, -1]
    assert got[1][2].tolist() == [0, 1, 1] and got[2][2].tolist() == [2, 2, -1]


def test_sample_wide_vocabulary_default_tile():
    tokens, parents, depth, valid, max_depth, g = random_trees(4, 9, 1500, 20)
    probs = torch.softmax(torch.randn(4, 9, 1500, generator=g) * 4, dim=-1)
    probs.scatter_add_(2, tokens[:, None, :].expand(4, 9, 9), torch.full((4, 9, 9), 0.2))  # drafts likely
    probs /= probs.sum(-1, keepdim=True)
    uniforms = torch.rand(4, max_depth, 4, generator=g, dtype=torch.float64)
    final = torch.rand(4, generator=g, dtype=torch.float64)
    got = accept_sample_triton(tokens, parents, depth, valid, probs, uniforms, final, max_depth,
                               out=poisoned_outputs(4, max_depth))
    expected = accept_sample_reference(tokens, parents, depth, valid, probs, uniforms, final, max_depth)
    assert_same(got, expected)


def test_bad_arguments_are_refused():
    tokens, parents, depth, valid, max_depth, _ = random_trees(2, 5, 4, 0)
    with pytest.raises(ValueError, match="int64 and valid bool"):
        accept_greedy_reference(tokens.int(), parents, depth, valid, torch.zeros(2, 5, 4), max_depth)
    with pytest.raises(ValueError, match="uniforms"):
        accept_sample_reference(tokens, parents, depth, valid, torch.zeros(2, 5, 4),
                                torch.zeros(2, max_depth - 1, 2), torch.zeros(2), max_depth)
