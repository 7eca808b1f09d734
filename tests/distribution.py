"""The end-to-end sampling check shared by the tests: counts of a pair of emitted tokens against an analytic joint
distribution (chi-square, sparse cells pooled)."""

from __future__ import annotations

import torch
from scipy.stats import chisquare


def pair_counts(sequences: torch.Tensor, vocab: int) -> torch.Tensor:
    """[V, V] how often each pair of the last two tokens of `sequences` [N, L] occurs."""
    pairs = sequences[:, -2:]
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    counts.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs), dtype=torch.float64), accumulate=True)
    return counts


def pair_p_value(counts: torch.Tensor, joint: torch.Tensor) -> float:
    """Chi-square p-value of `counts` [V, V] against `joint` [V, V] (cells expecting < 5 pooled into one)."""
    expected = (joint * counts.sum()).flatten()
    observed = counts.flatten()
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    scale = obs[keep].sum().item() / exp[keep].sum().item()
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy() * scale).pvalue)
