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
    depth: int          # D: draft levels (max draft tokens on a path)
    top_k: int          # K
    total_tokens: int   # M: nodes including the root

    def __post_init__(self) -> None:
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
        return (self.depth - 1) * self.top_k

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
