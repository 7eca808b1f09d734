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

import torch

from eagle_compile.core.masks import SlotMask
from eagle_compile.core.tree import DraftTree, TreeShape, ancestor_matrix
from eagle_compile.draft.drafter import Drafter
from eagle_compile.draft.drift import DriftProbe, rms


def build_tree(drafter: Drafter, state, seed_feedback: torch.Tensor, seed_head: torch.Tensor, root: torch.Tensor,
               seq_len: torch.Tensor, shape: TreeShape, draft_slots: int,
               active: torch.Tensor | None = None, probe: DriftProbe | None = None) -> DraftTree:
    """Grow one draft tree per row.

    Args:
        seed_feedback: [B, H] catch-up feedback at the root's draft position (n-2).
        seed_head: [B, H] catch-up head input at that position.
        root: [B] last emitted token. seq_len: [B] committed sequence length n (root included).
        draft_slots: S of the draft cache.
        active: [B] bool; inactive (frozen or padding) rows write only the sentinel slot S-1.
        probe: collects the drift monitors (`draft/drift.py`) when given.
    """
    K, D = shape.top_k, shape.depth
    B = root.shape[0]
    device = root.device
    score, tokens = drafter.top_k(seed_head, K)                              # [B, K]
    if probe is not None:
        probe.top1.append(score[:, 0].exp())
        reference = rms(seed_feedback).clamp(min=1e-30)
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
        if probe is not None:
            probe.rms.append(rms(f_hidden).mean(1) / reference)
            if hasattr(state, "probe"):                                      # a drafter with draft KV
                state.probe = probe
        feedback, head = drafter.forward(state, f_hidden, f_tok, positions, slots, mask, fuse=False)
        child_score, child_tok = drafter.top_k(head, K)                      # [B, K, K]
        if probe is not None:
            if hasattr(state, "probe"):
                state.probe = None
            probe.top1.append(child_score[:, 0, 0].exp())                    # the best node's best child
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
    node_scores = torch.cat([torch.zeros(B, 1, dtype=scores.dtype, device=device), scores.gather(1, chosen)], 1)
    return DraftTree(tokens=tokens, parents=parents, depth=depth,
                     valid=torch.ones(B, M, dtype=torch.bool, device=device),
                     ancestors=ancestor_matrix(parents, D), max_depth=D, scores=node_scores)


def _stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
