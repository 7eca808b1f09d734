"""The end-to-end sampling check shared by the tests: counts of a pair of emitted tokens against an analytic joint
distribution (chi-square, sparse cells pooled), and the warpers Hugging Face builds for a setting."""

from __future__ import annotations

import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from eagle_compile.runtime.sampling import SamplingParams


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


def hf_warpers(params: SamplingParams) -> LogitsProcessorList:
    """The warpers `GenerationMixin._get_logits_processor` builds for these settings, in its order."""
    warpers = LogitsProcessorList()
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return warpers
