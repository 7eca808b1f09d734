"""verify_greedy / verify_sample on hand-built trees: worked index examples, ties, padding, chains, batch."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from eagle_compile.core.verify import Acceptance, draw_uniforms, verify_greedy, verify_sample
from eagle_compile.runtime.sampling import SamplingParams, target_probs

ALMOST_ONE = 1.0 - 2.0**-53  # the largest float64 below 1: the least favourable u for acceptance


@dataclass
class Tree:
    """The `DraftTreeLike` attributes (docs/INTERNALS.md); stands in for `draft.tree.DraftTree`."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    valid: torch.Tensor
    max_depth: int


def make_tree(parents: list[int], tokens: list[int], valid: list[bool] | None = None) -> Tree:
    """One-row tree; depth is computed from the parents."""
    depth = [0] * len(parents)
    for i, parent in enumerate(parents[1:], start=1):
        depth[i] = depth[parent] + 1
    valid = [True] * len(parents) if valid is None else valid
    max_depth = max(d for d, ok in zip(depth, valid, strict=True) if ok)
    return Tree(torch.tensor([tokens]), torch.tensor([parents]), torch.tensor([depth]), torch.tensor([valid]),
                max_depth)


FIELDS = ("tokens", "parents", "depth", "valid")


def stack_trees(trees: list[Tree]) -> Tree:
    stacked = (torch.cat([getattr(t, name) for t in trees]) for name in FIELDS)
    return Tree(*stacked, max(t.max_depth for t in trees))


def tree_row(tree: Tree, b: int) -> Tree:
    return Tree(*(getattr(tree, name)[b : b + 1] for name in FIELDS), tree.max_depth)


def same(x: Acceptance, y: Acceptance) -> bool:
    return all(torch.equal(getattr(x, n), getattr(y, n)) for n in ("accept_len", "path", "tokens"))


def logits_with_argmax(argmax: list[int], vocab: int) -> torch.Tensor:
    """`[1, M, V]` float64 logits whose argmax at node i is argmax[i] (and no ties)."""
    noise = torch.rand(1, len(argmax), vocab, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return noise + 2.0 * F.one_hot(torch.tensor([argmax]), vocab).double()


def assert_layout(acc: Acceptance, tree: Tree) -> None:
    """The INTERNALS.md layout, row by row."""
    depth = tree.max_depth
    assert acc.accept_len.dtype == acc.path.dtype == acc.tokens.dtype == torch.long
    assert acc.path.shape == acc.tokens.shape == (tree.tokens.shape[0], depth + 1)
    for b in range(tree.tokens.shape[0]):
        a = int(acc.accept_len[b])
        path, tokens = acc.path[b].tolist(), acc.tokens[b].tolist()
        assert 0 <= a <= depth and path[0] == 0
        for s in range(1, a + 1):
            assert bool(tree.valid[b, path[s]]) and int(tree.parents[b, path[s]]) == path[s - 1]
            assert int(tree.depth[b, path[s]]) == s and tokens[s - 1] == int(tree.tokens[b, path[s]])
        assert path[a + 1:] == [path[a]] * (depth - a)
        assert tokens[a] >= 0 and tokens[a + 1:] == [-1] * (depth - a)


# --- greedy -------------------------------------------------------------------------------------------------

def test_greedy_docstring_example():
    tree = make_tree(parents=[-1, 0, 0, 1, 1, 2, 3], tokens=[5, 7, 3, 9, 2, 4, 1])
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2, 2, 3]] and tree.max_depth == 3
    acc = verify_greedy(tree, logits_with_argmax([3, 9, 4, 1, 0, 8, 6], vocab=10))
    assert acc.accept_len.tolist() == [2]
    assert acc.path.tolist() == [[0, 2, 5, 5]]
    assert acc.tokens.tolist() == [[3, 4, 8, -1]]
    assert_layout(acc, tree)


def test_greedy_prefers_the_deepest_correct_node_over_a_lower_index():
    # duplicate sibling tokens: nodes 1 and 2 are both correct, but only 2 -> 4 -> 5 stays correct to depth 3
    tree = make_tree(parents=[-1, 0, 0, 1, 2, 4], tokens=[0, 6, 6, 1, 7, 8])
    acc = verify_greedy(tree, logits_with_argmax([6, 2, 7, 0, 8, 9], vocab=10))
    assert acc.accept_len.tolist() == [3]
    assert acc.path.tolist() == [[0, 2, 4, 5]]
    assert acc.tokens.tolist() == [[6, 7, 8, 9]]


def test_greedy_first_index_on_equal_depth():
    # duplicate sibling tokens: nodes 1 and 2 both correct, each with a correct child (3 under 2, 4 under 1);
    # the deepest correct nodes are 3 and 4, the lowest index (3) wins
    tree = make_tree(parents=[-1, 0, 0, 2, 1], tokens=[0, 5, 5, 6, 6])
    acc = verify_greedy(tree, logits_with_argmax([5, 6, 6, 1, 2], vocab=8))
    assert acc.path.tolist() == [[0, 2, 3]]
    assert acc.tokens.tolist() == [[5, 6, 1]]


def test_greedy_nothing_accepted_emits_the_root_argmax():
    tree = make_tree(parents=[-1, 0, 0, 1], tokens=[3, 1, 2, 4])
    acc = verify_greedy(tree, logits_with_argmax([7, 4, 0, 0], vocab=8))
    assert acc.accept_len.tolist() == [0]
    assert acc.path.tolist() == [[0, 0, 0]]  # never -1
    assert acc.tokens.tolist() == [[7, -1, -1]]


def test_greedy_never_accepts_padding():
    # nodes 3 and 4 are padding: node 3 carries the right token and node 4 an out-of-range one
    valid = [True, True, True, False, False]
    tree = make_tree(parents=[-1, 0, 1, 2, 0], tokens=[0, 3, 4, 5, -1], valid=valid)
    acc = verify_greedy(tree, logits_with_argmax([3, 4, 5, 6, 0], vocab=8))
    assert acc.accept_len.tolist() == [2]
    assert acc.path.tolist() == [[0, 1, 2]]
    assert acc.tokens.tolist() == [[3, 4, 5]]


@pytest.mark.parametrize("matches, expected_len", [(0, 0), (1, 1), (2, 2), (3, 3)])
def test_greedy_chain(matches, expected_len):
    draft = [4, 5, 6]
    target = [4, 5, 6, 7]  # argmax at nodes 0..3
    target[matches] = 1  # the first mismatch (or the bonus position when all match)
    tree = make_tree(parents=[-1, 0, 1, 2], tokens=[9] + draft)
    acc = verify_greedy(tree, logits_with_argmax(target, vocab=10))
    assert acc.accept_len.tolist() == [expected_len]
    assert acc.tokens[0, : expected_len + 1].tolist() == target[: expected_len] + [target[expected_len]]
    assert_layout(acc, tree)


def random_tree_batch(batch: int, size: int, vocab: int, seed: int) -> tuple[Tree, torch.Tensor]:
    """Random trees (distinct sibling tokens, trailing padding) and float64 logits; the first child of a node
    usually carries the parent's argmax, so deep acceptances are common."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, size, vocab, generator=gen, dtype=torch.float64)
    argmax = logits.argmax(-1)
    trees = []
    for b in range(batch):
        real = int(torch.randint(1, size + 1, (1,), generator=gen))
        parents, tokens, used = [-1], [int(torch.randint(vocab, (1,), generator=gen))], {}
        for i in range(1, size):
            parent = int(torch.randint(max(i - 3, 0), i, (1,), generator=gen)) if i < real else 0
            offsets = used.setdefault(parent, [])
            candidates = [o for o in range(vocab) if o not in offsets]
            if not offsets and float(torch.rand(1, generator=gen)) < 0.7:
                offset = 0  # the first child usually agrees with the target
            else:
                offset = candidates[int(torch.randint(len(candidates), (1,), generator=gen))]
            if i < real:
                offsets.append(offset)
            parents.append(parent)
            tokens.append(int((argmax[b, parent] + offset) % vocab) if i < real else -1)
        trees.append(make_tree(parents, tokens, [i < real for i in range(size)]))
    return stack_trees(trees), logits


def test_random_trees_layout_and_rows_independent():
    tree, logits = random_tree_batch(batch=24, size=9, vocab=6, seed=1)
    acc = verify_greedy(tree, logits)
    assert_layout(acc, tree)
    assert acc.accept_len.max() >= 2 and acc.accept_len.min() == 0  # the stress happened
    for b in range(24):
        single = verify_greedy(tree_row(tree, b), logits[b : b + 1])
        assert same(single, Acceptance(acc.accept_len[b : b + 1], acc.path[b : b + 1], acc.tokens[b : b + 1]))


# --- sampling: deterministic cases --------------------------------------------------------------------------

def test_sample_worked_example():
    # root p = [.1, .2, .3, .4]; children: node 1 = token 3 (tried first), node 2 = token 2.
    # u = .5 rejects token 3 (p = .4): p -> [.1, .2, .3, 0] / .6, so token 2 has .5
    tree = make_tree(parents=[-1, 0, 0], tokens=[0, 3, 2])
    probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.25] * 4, [0.0, 0.0, 0.0, 1.0]]], dtype=torch.float64)
    # u = .4 < .5 accepts token 2; node 2's target is a point mass on 3: bonus 3
    acc = verify_sample(tree, probs, torch.tensor([[[0.5, 0.4]]]), torch.tensor([0.9]))
    assert same(acc, Acceptance(torch.tensor([1]), torch.tensor([[0, 2]]), torch.tensor([[2, 3]])))
    # u = .6 rejects token 2 too: residual [.1, .2, 0, 0] / .3; the final u = .5 lands on token 1
    acc = verify_sample(tree, probs, torch.tensor([[[0.5, 0.6]]]), torch.tensor([0.5]))
    assert same(acc, Acceptance(torch.tensor([0]), torch.tensor([[0, 0]]), torch.tensor([[1, -1]])))
    # the final u = .3 is below 1/3: token 0
    acc = verify_sample(tree, probs, torch.tensor([[[0.5, 0.6]]]), torch.tensor([0.3]))
    assert acc.tokens.tolist() == [[0, -1]]


@pytest.mark.parametrize("dtype, almost_one", [(torch.float64, ALMOST_ONE), (torch.float32, 1.0 - 2.0**-24)])
def test_sample_siblings_covering_all_mass_never_leave_an_empty_residual(dtype, almost_one):
    # root mass only on tokens 0 and 1, both drafted: with the least favourable u, token 0 is rejected and
    # token 1 (then holding all the mass) must be accepted, not rejected into an all-zero residual
    tree = make_tree(parents=[-1, 0, 0], tokens=[3, 0, 1])
    probs = torch.tensor([[[0.3, 0.7, 0.0, 0.0], [0.25] * 4, [0.0, 0.0, 1.0, 0.0]]], dtype=dtype)
    uniforms = torch.full((1, 1, 2), almost_one, dtype=dtype)
    acc = verify_sample(tree, probs, uniforms, torch.tensor([almost_one], dtype=dtype))
    assert acc.path.tolist() == [[0, 2]] and acc.tokens.tolist() == [[1, 2]]


def test_sample_inverse_cdf_skips_zero_mass_tokens():
    tree = make_tree(parents=[-1], tokens=[0])
    probs = torch.tensor([[[0.0, 0.5, 0.5, 0.0]]], dtype=torch.float64).expand(3, 1, 4)
    tree = stack_trees([tree] * 3)
    acc = verify_sample(tree, probs, torch.zeros(3, 0, 1), torch.tensor([0.0, 0.5, ALMOST_ONE]))
    assert acc.tokens.tolist() == [[1], [2], [2]]


def test_sample_rows_without_mass_still_emit_a_valid_token():
    tree = stack_trees([make_tree(parents=[-1, 0], tokens=[0, 1])] * 2)
    probs = torch.zeros(2, 2, 5)
    acc = verify_sample(tree, probs, torch.full((2, 1, 1), 0.5), torch.tensor([0.0, 0.7]))
    assert acc.accept_len.tolist() == [0, 0]
    assert ((acc.tokens[:, 0] >= 0) & (acc.tokens[:, 0] < 5)).all()


def test_sample_never_accepts_padding_or_zero_probability_drafts():
    # node 1 is padding with a certain token, node 2 has zero probability
    tree = make_tree(parents=[-1, 0, 0, 0], tokens=[0, 2, 3, 1], valid=[True, False, True, True])
    probs = torch.tensor([[[0.0, 0.0, 1.0, 0.0]] * 4], dtype=torch.float64)
    uniforms, final = draw_uniforms(1, 1, 3, generator=torch.Generator().manual_seed(0))
    for u in (torch.zeros_like(uniforms), uniforms):
        acc = verify_sample(tree, probs, u, final)
        assert acc.accept_len.tolist() == [0] and acc.tokens.tolist() == [[2, -1]]


def test_sample_children_beyond_top_k_are_never_tried():
    # K = 1: only node 1 is tried; node 2 holds all the mass but is not a candidate, so its token comes out
    # as the bonus token (the residual keeps it) and node 2 is not on the path
    tree = make_tree(parents=[-1, 0, 0], tokens=[0, 1, 2])
    probs = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]], dtype=torch.float64)
    acc = verify_sample(tree, probs, torch.zeros(1, 1, 1), torch.tensor([0.5]))
    assert same(acc, Acceptance(torch.tensor([0]), torch.tensor([[0, 0]]), torch.tensor([[2, -1]])))


def test_sample_with_greedy_params_equals_verify_greedy():
    tree, logits = random_tree_batch(batch=32, size=10, vocab=5, seed=2)
    probs = target_probs(logits, SamplingParams(do_sample=False))
    uniforms, final = draw_uniforms(32, tree.max_depth, 4, generator=torch.Generator().manual_seed(3))
    sampled, greedy = verify_sample(tree, probs, uniforms, final), verify_greedy(tree, logits)
    assert greedy.accept_len.max() >= 3 and (greedy.accept_len > 0).sum() >= 12  # deep paths exist
    assert same(sampled, greedy)
    assert_layout(sampled, tree)


def test_sample_rows_independent():
    tree, logits = random_tree_batch(batch=16, size=8, vocab=5, seed=4)
    probs = target_probs(logits, SamplingParams(do_sample=True, temperature=0.8))
    uniforms, final = draw_uniforms(16, tree.max_depth, 3, generator=torch.Generator().manual_seed(5))
    acc = verify_sample(tree, probs, uniforms, final)
    assert_layout(acc, tree)
    assert acc.accept_len.max() >= 1
    for b in range(16):
        single = verify_sample(tree_row(tree, b), probs[b : b + 1], uniforms[b : b + 1], final[b : b + 1])
        assert same(single, Acceptance(acc.accept_len[b : b + 1], acc.path[b : b + 1], acc.tokens[b : b + 1]))


def test_draw_uniforms_shapes_and_range():
    uniforms, final = draw_uniforms(4, 3, 2, generator=torch.Generator().manual_seed(0))
    assert uniforms.shape == (4, 3, 2) and final.shape == (4,) and uniforms.dtype == torch.float64
    assert 0 <= uniforms.min() and uniforms.max() < 1 and 0 <= final.min() and final.max() < 1
    again, _ = draw_uniforms(4, 3, 2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(uniforms, again)
    assert draw_uniforms(2, 1, 1, dtype=torch.float32)[0].dtype == torch.float32


def test_verifiers_compile_without_graph_breaks():
    # fullgraph=True fails on any host synchronisation (.item(), nonzero, boolean-mask indexing) or branch on
    # tensor values, which CUDA-graph capture could not take either
    tree, logits = random_tree_batch(batch=4, size=7, vocab=6, seed=6)
    params = SamplingParams(do_sample=True, temperature=0.7, top_k=4, top_p=0.9)
    probs = target_probs(logits, params)
    uniforms, final = draw_uniforms(4, tree.max_depth, 3, generator=torch.Generator().manual_seed(7))
    compile_ = dict(backend="eager", fullgraph=True, dynamic=False)
    greedy = torch.compile(verify_greedy, **compile_)(tree, logits)
    sampled = torch.compile(verify_sample, **compile_)(tree, probs, uniforms, final)
    assert torch.equal(torch.compile(target_probs, **compile_)(logits, params), probs)
    assert torch.equal(greedy.tokens, verify_greedy(tree, logits).tokens)
    assert torch.equal(sampled.tokens, verify_sample(tree, probs, uniforms, final).tokens)


# --- paths that need no KV compaction ---------------------------------------------------------------------------

@pytest.mark.parametrize("do_sample", [False, True])
def test_a_chain_accepts_its_nodes_in_place_so_the_step_skips_compaction(do_sample):
    from eagle_compile.core.tree import TreeShape
    from eagle_compile.runtime.step import in_place_paths

    gen = torch.Generator().manual_seed(3)
    depth, vocab, rows = 4, 6, 64
    shape = TreeShape.chain(depth)
    assert in_place_paths(shape) and in_place_paths(TreeShape(0, 0, 1, copy=5))
    assert not in_place_paths(TreeShape(3, 2, 6)) and not in_place_paths(TreeShape(2, 1, 3, copy=2))
    chain = stack_trees([make_tree(parents=[-1, 0, 1, 2, 3], tokens=torch.randint(vocab, (5,), generator=gen).tolist())
                         for _ in range(rows)])
    logits = torch.randn(rows, depth + 1, vocab, generator=gen, dtype=torch.float64) * 3
    if do_sample:
        probs = target_probs(logits, SamplingParams(do_sample=True, temperature=1.0))
        uniforms, final = draw_uniforms(rows, depth, 1, generator=gen)
        acc = verify_sample(chain, probs, uniforms, final)
    else:
        acc = verify_greedy(chain, logits)
    lengths = acc.accept_len.tolist()
    assert max(lengths) >= 1                                    # the check saw accepted nodes
    for b, a in enumerate(lengths):
        assert acc.path[b, :a + 1].tolist() == list(range(a + 1))
    # negative control: a branching tree's accepted path moves (the docstring example accepts nodes 2 and 5)
    tree = make_tree(parents=[-1, 0, 0, 1, 1, 2, 3], tokens=[5, 7, 3, 9, 2, 4, 1])
    moved = verify_greedy(tree, logits_with_argmax([3, 9, 4, 1, 0, 8, 6], vocab=10)).path[0, :3].tolist()
    assert moved != [0, 1, 2]
