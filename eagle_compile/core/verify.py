"""Verification: which draft tokens the target accepts, and the bonus token (EAGLE31_SPEC.md §5).

Vocabulary (docs/INTERNALS.md): the *root* is node 0 of the draft tree (the last emitted token); *accepted
tokens* are draft tokens the target agrees with; the *bonus token* is what the target emits after the last
accepted token (the correction at the first mismatch, or a fresh token when a whole path was accepted).
`Acceptance` carries the result in the layout fixed by INTERNALS.md.

The tree arrives as anything with the attributes of `DraftTreeLike` (the lead's `DraftTree` satisfies it):
`tokens`, `parents`, `depth`, `valid` (all `[B, M]`) and the Python int `max_depth` (D).

Both verifiers are written for capture into a CUDA graph and lowering by inductor: static shapes, no host
synchronisation (no `.item()`, `nonzero`, boolean-mask indexing, or branches on tensor values); the only loops
run over the static tree depth D.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class DraftTreeLike(Protocol):
    """The draft tree as verification reads it (layout: docs/INTERNALS.md, "Draft tree")."""

    tokens: torch.Tensor  # [B, M] int64, target-vocabulary ids; node 0 is the root
    parents: torch.Tensor  # [B, M] int64, parents[:, 0] = -1, parents[b, i] < i
    depth: torch.Tensor  # [B, M] int64, root 0
    valid: torch.Tensor  # [B, M] bool, False for padding nodes
    max_depth: int  # D


@dataclass(frozen=True)
class Acceptance:
    """Result of one verification, per batch row (layout: docs/INTERNALS.md, "Verification").

    `accept_len [B]`: accepted draft tokens `a` in `[0, D]`; tokens emitted this cycle = `a + 1`.
    `path [B, D + 1]`: node indices root, accepted nodes...; entries after index `a` repeat `path[:, a]`.
    `tokens [B, D + 1]`: accepted draft tokens at `0..a-1`, the bonus token at `a`, `-1` after `a`.
    """

    accept_len: torch.Tensor  # [B] int64
    path: torch.Tensor  # [B, D + 1] int64
    tokens: torch.Tensor  # [B, D + 1] int64


def verify_greedy(tree: DraftTreeLike, target_logits: torch.Tensor) -> Acceptance:
    """Greedy verification (§5.1): accept the deepest root path whose every token is the target's argmax.

    Node `i` is correct iff it is valid and `tokens[i] == argmax(target_logits[parents[i]])`; it is on an
    all-correct path iff it and all its ancestors are correct. The deepest such node wins (the lowest node
    index among equally deep ones); the bonus token is the target argmax at that node, so with nothing
    accepted it is the argmax at the root.

    Args:
        tree: `DraftTreeLike` with `[B, M]` tensors and `max_depth` D.
        target_logits: `[B, M, V]` target logits at every tree node (any float dtype).

    Worked example (one row, D = 3; asserted in tests/runtime/test_verify.py)::

        node           0  1  2  3  4  5  6
        parents       -1  0  0  1  1  2  3
        depth          0  1  1  2  2  2  3
        tokens         5  7  3  9  2  4  1
        target argmax  3  9  4  1  0  8  6

        correct: node 2 (3 == argmax@0), 3 (9 == argmax@1), 5 (4 == argmax@2), 6 (1 == argmax@3);
        node 1 (7 != 3) is wrong, so 3 and 6 are not on an all-correct path. Deepest on-path node: 5.
        accept_len = 2, path = [0, 2, 5, 5], tokens = [3, 4, 8, -1]   (8 = bonus, argmax at node 5)
    """
    size = tree.tokens.shape[1]
    parents = tree.parents.clamp(min=0)
    argmax = target_logits.argmax(dim=-1)  # [B, M]
    node_index = torch.arange(size, device=tree.tokens.device)
    correct = (tree.valid & (tree.tokens == argmax.gather(1, parents))) | (node_index == 0)
    on_path = correct
    for _ in range(tree.max_depth):  # one level of ancestry per step; topological order is not needed
        on_path = correct & on_path.gather(1, parents)
    # deepest first, then lowest index: a unique key so argmax has no ties to resolve
    key = torch.where(on_path, tree.depth * size + (size - 1 - node_index), -1)
    best = key.argmax(dim=1)  # [B]
    bonus = argmax.gather(1, best[:, None]).squeeze(1)
    return _acceptance(tree, best, bonus)


def verify_sample(tree: DraftTreeLike, probs: torch.Tensor, uniforms: torch.Tensor,
                  final_uniform: torch.Tensor) -> Acceptance:
    """Lossless sampling for deterministic tree drafts (§5.2): every emitted token follows `probs` exactly.

    The draft distribution is a point mass, so from the current node (root first) its children are tried in
    node order (draft-score order, best first): child `x` is accepted iff `u < p[x]`, `p` being the current
    distribution; on rejection `p[x] = 0`, `p` is renormalised and the next sibling is tried. An accepted
    child becomes the current node with `p = probs[child]`. When no child is accepted (or the node has none)
    the bonus token is drawn from the current `p` by inverse CDF with `final_uniform`: the residual if the
    last level had rejections, otherwise the fresh target distribution at the last accepted node.

    `u < p` with `u` in `[0, 1)` (the spec writes `<=`; the two differ on a null set) makes zero-probability
    drafts impossible to accept and makes a token that holds all remaining mass certain to be accepted. So the
    residual can never become all-zero: when the siblings cover all of `p`, the last one with mass is accepted
    with probability 1 (its renormalised mass is exactly 1). Rows whose `probs` have no mass at all (garbage
    padding rows) still emit a valid token id.

    Chain rejection sampling (§5.3, vLLM's `RejectionSampler` with `draft_probs=None`) is this function on a
    chain tree (`parents = [-1, 0, 1, ..., D-1]`, K = 1): accept with probability `p(x)`, recovered token from
    `p` with `x` zeroed, bonus token from the target at the last position.

    Args:
        tree: `DraftTreeLike` with `[B, M]` tensors and `max_depth` D.
        probs: `[B, M, V]` target distribution at every node (`sampling.target_probs`).
        uniforms: `[B, D, K]` in `[0, 1)`; `uniforms[:, d, k]` decides the k-th child tried at depth `d + 1`.
            K (static) is the most children tried per node; children of rank >= K are never tried, which
            keeps the result exact (it only lowers acceptance).
        final_uniform: `[B]` in `[0, 1)`, draws the bonus token.
    """
    batch = tree.tokens.shape[0]
    vocab = probs.shape[-1]
    top_k = uniforms.shape[-1]
    tokens = tree.tokens.clamp(0, vocab - 1)  # padding ids may be anything; such nodes are never valid
    children, child_ok = _children(tree.parents, tree.valid, top_k)  # [B, M, K] each
    rows = torch.arange(batch, device=probs.device)
    node = torch.zeros(batch, dtype=torch.long, device=probs.device)
    active = torch.ones(batch, dtype=torch.bool, device=probs.device)
    rank = torch.arange(top_k, device=probs.device)
    for level in range(tree.max_depth):
        kids = children[rows, node]  # [B, K]
        tried = child_ok[rows, node] & active[:, None]  # [B, K]
        accept = _accept_children(probs[rows, node], tokens.gather(1, kids), tried, uniforms[:, level])
        active = accept.any(dim=1)
        first = torch.where(accept, top_k - rank, 0).argmax(dim=1, keepdim=True)  # first accepted sibling
        node = torch.where(active, kids.gather(1, first).squeeze(1), node)
    # Rows still active sit at depth D (no children tried); the others rejected every child of `node`.
    rejected = child_ok[rows, node] & ~active[:, None]
    residual = _remove_tokens(probs[rows, node], tokens.gather(1, children[rows, node]), rejected)
    bonus = inverse_cdf(residual, final_uniform)
    return _acceptance(tree, node, bonus)


def draw_uniforms(batch: int, depth: int, top_k: int, *, generator: torch.Generator | None = None,
                  device: torch.device | str | None = None,
                  dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The random inputs of `verify_sample`: `uniforms [batch, depth, top_k]` and `final_uniform [batch]`.

    One `torch.rand` call (one kernel), values in `[0, 1)`. float64 by default so that acceptance tests are
    exact to 2**-53 rather than float32's 2**-24.
    """
    draws = torch.rand(batch, depth * top_k + 1, generator=generator, device=device, dtype=dtype)
    return draws[:, :-1].reshape(batch, depth, top_k), draws[:, -1]


def _children(parents: torch.Tensor, valid: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Child table: `children[b, i, r]` = the r-th valid child of node i in node order, for r < top_k.

    Returns `children [B, M, K]` (0 where there is no child) and `child_ok [B, M, K]` bool.
    """
    batch, size = parents.shape
    node_index = torch.arange(size, device=parents.device)
    family = torch.where(valid, parents, -2)  # padding matches no real node's parent
    earlier = node_index[None, :] < node_index[:, None]  # [i, j]: j precedes i
    rank = ((family[:, :, None] == family[:, None, :]) & earlier).sum(dim=2, dtype=torch.int32)  # [B, M]
    is_child = valid & (node_index > 0) & (rank < top_k)
    dump = size * top_k  # one extra slot that collects every non-child and is dropped
    slot = torch.where(is_child, parents.clamp(min=0) * top_k + rank, dump)
    children = torch.zeros(batch, dump + 1, dtype=torch.long, device=parents.device)
    children = children.scatter(1, slot, node_index.expand(batch, size))
    child_ok = torch.zeros(batch, dump + 1, dtype=torch.bool, device=parents.device)
    child_ok = child_ok.scatter(1, slot, is_child)
    return children[:, :dump].view(batch, size, top_k), child_ok[:, :dump].view(batch, size, top_k)


def _remove_tokens(p: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`p [B, V]` with `tokens [B, K]` zeroed where `mask [B, K]`; duplicate tokens are fine."""
    hits = torch.zeros_like(p).scatter_add(1, tokens, mask.to(p.dtype))
    return p.masked_fill(hits > 0, 0.0)


def _accept_children(p: torch.Tensor, kid_tokens: torch.Tensor, tried: torch.Tensor,
                     uniforms: torch.Tensor) -> torch.Tensor:
    """Which of the K children would be accepted if tried; the first True is the one accepted.

    Sequentially, child k is tried after siblings 0..k-1 were rejected and removed, so it is accepted with
    probability `p[x_k] / (mass left)`, mass left = mass on non-children + mass of children k..K-1. The u's
    are independent, so deciding all K at once and taking the first acceptance is the same draw. Summing what
    is left (instead of subtracting what was removed) keeps the ratio exactly 1 for a child that holds all
    remaining mass.

    Args:
        p: `[B, V]` target distribution at the current node. kid_tokens, tried, uniforms: `[B, K]`.
    """
    top_k = kid_tokens.shape[1]
    rank = torch.arange(top_k, device=p.device)
    repeated = ((kid_tokens[:, :, None] == kid_tokens[:, None, :]) & tried[:, None, :]
                & (rank[None, :] < rank[:, None])).any(dim=2)  # a repeated token was already removed
    mass = torch.where(tried & ~repeated, p.gather(1, kid_tokens).double(), 0.0)  # [B, K]
    others = _remove_tokens(p, kid_tokens, tried).sum(dim=1, dtype=torch.float64)  # [B]
    left = others[:, None] + mass.flip(1).cumsum(1).flip(1)
    ratio = torch.where(left > 0, mass / left, 0.0)
    return uniforms.double() < ratio


def inverse_cdf(p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Token `i` with probability `p[i] / sum(p)` (`p [B, V]` unnormalised, `uniform [B]` in `[0, 1)`)."""
    cdf = p.double().cumsum(dim=1)
    threshold = uniform.double() * cdf[:, -1]
    index = (cdf <= threshold[:, None]).sum(dim=1)  # first i with cdf[i] > threshold: always p[i] > 0
    # rounding can push the threshold onto the total: fall back to the last token with mass (0 if none)
    vocab_index = torch.arange(p.shape[1], device=p.device)
    last = torch.where(p > 0, vocab_index, 0).amax(dim=1)
    return torch.minimum(index, last)


def _acceptance(tree: DraftTreeLike, node: torch.Tensor, bonus: torch.Tensor) -> Acceptance:
    """The `Acceptance` of accepting the root path down to `node [B]`, then emitting `bonus [B]`."""
    depth = tree.max_depth
    parents = tree.parents.clamp(min=0)
    accept_len = tree.depth.gather(1, node[:, None]).squeeze(1)  # [B]
    ancestors = [node]  # ancestors[t] = t-th ancestor of node (the root is its own parent here)
    for _ in range(depth):
        ancestors.append(parents.gather(1, ancestors[-1][:, None]).squeeze(1))
    ancestors = torch.stack(ancestors, dim=1)  # [B, D + 1]
    slot = torch.arange(depth + 1, device=node.device)
    path = ancestors.gather(1, (accept_len[:, None] - slot).clamp(min=0))  # slots after a repeat node
    drafted = torch.cat([tree.tokens.gather(1, path)[:, 1:], bonus[:, None]], dim=1)  # token of path[s + 1]
    tokens = torch.where(slot < accept_len[:, None], drafted,
                         torch.where(slot == accept_len[:, None], bonus[:, None], -1))
    return Acceptance(accept_len=accept_len, path=path, tokens=tokens)
