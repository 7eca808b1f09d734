"""The draft tree as data: its static shape (`TreeShape`), one cycle's tree (`DraftTree`), ancestor matrices.

Shared by the tree builder (`draft/tree.py`), verification (`core/verify.py`), the passes and the runtime;
EAGLE31_SPEC.md §4.3 defines the tree, docs/INTERNALS.md its tensor layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_compile.errors import OptionsError


@dataclass(frozen=True)
class TreeShape:
    """The static shape of one cycle's tree: the draft's part (depth D, top_k K, M nodes with the root) and a
    copy branch of `copy` = L nodes (prompt lookup, `draft/lookup.py`): a chain hanging off the root after the
    draft's M nodes. `depth=0` (then top_k 0, M 1) is a copy branch alone, with no draft levels."""

    depth: int          # D: draft levels (max draft tokens on a path)
    top_k: int          # K
    total_tokens: int   # M: draft nodes including the root
    copy: int = 0       # L: copy-branch nodes (0: none)

    def __post_init__(self) -> None:
        if self.copy < 0:
            raise OptionsError(f"copy={self.copy}: the copy branch has 0 or more nodes")
        if self.depth == 0:
            if self.copy < 1 or self.top_k != 0 or self.total_tokens != 1:
                raise OptionsError("a tree with no draft levels (depth=0) is a copy branch alone: top_k=0, "
                                   f"total_tokens=1 and copy >= 1 (got top_k={self.top_k}, "
                                   f"total_tokens={self.total_tokens}, copy={self.copy})")
            return
        if self.total_tokens - 1 > self.pool_size:
            raise OptionsError(
                f"total_tokens={self.total_tokens} exceeds the largest tree depth={self.depth}, top_k={self.top_k} "
                f"can build (1 + K + (D-1)*K^2 = {self.pool_size + 1}); lower total_tokens or raise depth/top_k"
            )

    @property
    def pool_size(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    @property
    def tree_slots(self) -> int:
        """Draft-cache slots the expanded levels occupy beyond the committed prefix."""
        return max(self.depth - 1, 0) * self.top_k

    @property
    def nodes(self) -> int:
        """Nodes the target verifies per row: the draft's M and the copy branch's L."""
        return self.total_tokens + self.copy

    @property
    def span(self) -> int:
        """The most tokens one cycle can accept (the deepest path: draft depth or copy length)."""
        return max(self.depth, self.copy)

    @property
    def width(self) -> int:
        """The most children of one node (the root's: K draft children and the copy branch's first node)."""
        return self.top_k + (1 if self.copy else 0)

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        return cls(depth=k, top_k=1, total_tokens=k + 1)


@dataclass
class DraftTree:
    """Layout: docs/INTERNALS.md. `ancestors[b, i, j]` is True when node j is node i or one of its ancestors."""

    tokens: torch.Tensor      # [B, M] target-vocabulary ids, node 0 = root
    parents: torch.Tensor     # [B, M] parent node index, -1 for the root
    depth: torch.Tensor       # [B, M]
    valid: torch.Tensor       # [B, M] bool
    ancestors: torch.Tensor   # [B, M, M] bool
    max_depth: int
    scores: torch.Tensor | None = None   # [B, M] cumulative draft log-probability, root 0 (None: not a draft's)


def with_copy_branch(tree: DraftTree, copy_tokens: torch.Tensor) -> DraftTree:
    """`tree` with a copy branch appended: nodes M..M+L-1 form a chain from the root carrying `copy_tokens`
    [B, L] (target-vocabulary ids; -1 = no proposal: that node and every later one are not valid). Copy nodes
    score 0 (log 1): the confidence floor never masks them, only a row's `drafting` flag does."""
    B, M = tree.tokens.shape
    L = copy_tokens.shape[1]
    device = tree.tokens.device
    index = torch.arange(L, device=device)
    parents = torch.where(index == 0, 0, M + index - 1).expand(B, L)
    valid = (copy_tokens >= 0).long().cumprod(1).bool()
    parents = torch.cat([tree.parents, parents], 1)
    depth = torch.cat([tree.depth, (index + 1).expand(B, L)], 1)
    max_depth = max(tree.max_depth, L)
    scores = None if tree.scores is None else torch.cat([tree.scores, tree.scores.new_zeros(B, L)], 1)
    return DraftTree(tokens=torch.cat([tree.tokens, copy_tokens.clamp(min=0)], 1), parents=parents, depth=depth,
                     valid=torch.cat([tree.valid, valid], 1), ancestors=ancestor_matrix(parents, max_depth),
                     max_depth=max_depth, scores=scores)


def root_tree(root: torch.Tensor) -> DraftTree:
    """The tree of the root alone (a copy branch with no draft levels starts from it)."""
    B, device = root.shape[0], root.device
    zeros = torch.zeros(B, 1, dtype=torch.long, device=device)
    return DraftTree(tokens=root[:, None], parents=zeros - 1, depth=zeros,
                     valid=torch.ones(B, 1, dtype=torch.bool, device=device),
                     ancestors=torch.ones(B, 1, 1, dtype=torch.bool, device=device), max_depth=0,
                     scores=torch.zeros(B, 1, device=device))


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, M] parents -> [B, M, M] bool: node j is i or an ancestor of i."""
    B, M = parents.shape
    eye = torch.eye(M, dtype=torch.bool, device=parents.device).expand(B, M, M)
    anc = eye.clone()
    cur = torch.arange(M, device=parents.device).expand(B, M)
    for _ in range(max_depth):
        cur = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), cur)
        anc |= (cur[:, :, None] == torch.arange(M, device=parents.device)) & (cur[:, :, None] >= 0)
    return anc
