"""EAGLE-2 dynamic draft tree with static shapes (EAGLE31_SPEC.md §4.3), and chain drafting as its k=1 case.

One cycle, for every row at once (B rows, committed sequence length n, root = last emitted token at position
n-1, whose draft input pair was already consumed by the catch-up pass):

1. level 1: top-K of the catch-up output's draft log-probs -> K nodes, score = log-prob;
2. levels 2..D: run the draft on the K frontier nodes together (hidden = the parent's feedback, token = the
   node's token, position n-2+depth, each node sees the committed draft prefix plus its own ancestors), take
   top-K of each node's log-probs -> K*K candidates scored parent_score + log-prob; the best K (stable: ties go
   to the earlier candidate) become the next frontier; every candidate enters the pool;
3. rerank: the M-1 best pool entries by score (stable descending), then sorted by pool index. The pool is in
   topological order and scores never increase along a path, so a selected node's ancestors are selected.

Shapes are static: the pool holds K + (D-1)*K*K candidates; draft-cache slots for tree nodes are
n-1 + (level-1)*K + i (discarded after the cycle: the next catch-up overwrites or masks them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_compile.draft.drafter import Drafter
from eagle_compile.errors import OptionsError
from eagle_compile.runtime.masks import SlotMask


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


def build_tree(drafter: Drafter, state, seed_feedback: torch.Tensor, seed_head: torch.Tensor, root: torch.Tensor,
               seq_len: torch.Tensor, shape: TreeShape, draft_slots: int,
               active: torch.Tensor | None = None) -> DraftTree:
    """Grow one draft tree per row.

    Args:
        seed_feedback: [B, H] catch-up feedback at the root's draft position (n-2).
        seed_head: [B, H] catch-up head input at that position.
        root: [B] last emitted token. seq_len: [B] committed sequence length n (root included).
        draft_slots: S of the draft cache.
        active: [B] bool; inactive (frozen or padding) rows write only the sentinel slot S-1.
    """
    K, D = shape.top_k, shape.depth
    B = root.shape[0]
    device = root.device
    score, tokens = drafter.top_k(seed_head, K)                              # [B, K]
    pool_scores, pool_tokens = [score], [tokens]
    pool_parent = [torch.full((B, K), -1, dtype=torch.long, device=device)]
    f_tok, f_score = pool_tokens[0], score
    f_hidden = seed_feedback[:, None, :].expand(B, K, seed_feedback.shape[-1])
    f_pool = torch.arange(K, device=device).expand(B, K)
    f_anc = torch.zeros(B, K, shape.tree_slots, dtype=torch.bool, device=device)
    base = seq_len - 1                                                       # first tree slot of the row
    for level in range(1, D):
        own = torch.zeros_like(f_anc)
        own[:, torch.arange(K), (level - 1) * K + torch.arange(K)] = True
        anc = f_anc | own                                                    # [B, K, tree_slots]
        slots = base[:, None] + (level - 1) * K + torch.arange(K, device=device)
        if active is not None:
            slots = torch.where(active[:, None], slots, draft_slots - 1)
        positions = (seq_len - 2 + level)[:, None].expand(B, K)
        mask = SlotMask.tree(anc, base, draft_slots)
        feedback, head = drafter.forward(state, f_hidden, f_tok, positions, slots, mask, fuse=False)
        child_score, child_tok = drafter.top_k(head, K)                      # [B, K, K]
        cand_score = (f_score[:, :, None] + child_score).reshape(B, K * K)
        cand_tok = child_tok.reshape(B, K * K)
        pool_scores.append(cand_score)
        pool_tokens.append(cand_tok)
        pool_parent.append(f_pool.repeat_interleave(K, dim=1))
        if level < D - 1:
            best = _stable_topk_indices(cand_score, K)                       # [B, K]
            parent_idx = best // K
            f_tok = cand_tok.gather(1, best)
            f_score = cand_score.gather(1, best)
            f_hidden = feedback.gather(1, parent_idx[:, :, None].expand(-1, -1, feedback.shape[-1]))
            f_anc = anc.gather(1, parent_idx[:, :, None].expand(-1, -1, anc.shape[-1]))
            f_pool = K + (level - 1) * K * K + best
    return _select(torch.cat(pool_scores, 1), torch.cat(pool_tokens, 1), torch.cat(pool_parent, 1),
                   root, shape)


def _select(scores, tokens, parents_pool, root, shape: TreeShape) -> DraftTree:
    B, P = scores.shape
    K, D, M = shape.top_k, shape.depth, shape.total_tokens
    device = scores.device
    pool_depth = torch.cat([torch.ones(K, dtype=torch.long, device=device)]
                           + [torch.full((K * K,), lvl + 1, dtype=torch.long, device=device) for lvl in range(1, D)])
    chosen = _stable_topk_indices(scores, M - 1).sort(dim=1).values             # [B, M-1], topological order
    node_of_pool = torch.zeros(B, P, dtype=torch.long, device=device)
    node_of_pool.scatter_(1, chosen, torch.arange(1, M, device=device).expand(B, M - 1))
    parent_pool = parents_pool.gather(1, chosen)
    parent_node = torch.where(parent_pool < 0, 0, node_of_pool.gather(1, parent_pool.clamp(min=0)))
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=device), parent_node], 1)
    depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=device), pool_depth[chosen]], 1)
    tokens = torch.cat([root[:, None], tokens.gather(1, chosen)], 1)
    return DraftTree(tokens=tokens, parents=parents, depth=depth,
                     valid=torch.ones(B, M, dtype=torch.bool, device=device),
                     ancestors=ancestor_matrix(parents, D), max_depth=D)


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


def _stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
