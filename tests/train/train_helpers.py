"""Tiny draft heads and hand-made conversations for the training tests (the tokenizer: tests/tiny.py)."""

from __future__ import annotations

import torch

from eagle_compile.draft import DraftConfig, EagleDraftModel, build_vocab_mapping
from eagle_compile.train.data import Sample

FLAG_SETS = {
    "eagle3": {},
    "eagle31": {"fc_norm": True, "norm_output": True},
    "norm_before_residual": {"norm_before_residual": True, "norm_output": True},
    "norm_before_fc": {"norm_before_fc": True},
}

def tiny_draft(vocab: int = 64, hidden: int = 32, draft_vocab: int = 24, seed: int = 0,
               dtype: torch.dtype = torch.float64, capture_indices=(1, 3, 5), **flags) -> EagleDraftModel:
    """A random head (norm weights around 1, not 1: a misplaced norm must show) with a reduced vocabulary."""
    cfg = DraftConfig(hidden_size=hidden, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=vocab, draft_vocab_size=draft_vocab, capture_indices=capture_indices, **flags)
    model = EagleDraftModel(cfg).to(torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1.0 + 0.3 * noise if p.dim() == 1 else noise / p.shape[1] ** 0.5)
        d2t, t2d = build_vocab_mapping(torch.randint(0, 1000, (vocab,), generator=gen), draft_vocab)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    model.tie_target_embedding(torch.randn(vocab, hidden, generator=gen, dtype=torch.float64))
    return model.to(dtype)


def tiny_features(cfg: DraftConfig, batch: int, tokens: int, seed: int = 1) -> torch.Tensor:
    """``[B, T, A*Ht]`` with very different scales per feature (low < mid < high), as real targets have."""
    gen = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(batch, tokens, cfg.target_hidden_size, generator=gen, dtype=torch.float64) * s
                      for s in (0.5, 4.0, 30.0)[: cfg.num_features]], dim=-1)


def hand_samples(n: int = 6, vocab: int = 96, seed: int = 0, min_len: int = 12, max_len: int = 24) -> list[Sample]:
    """Random conversations: a prompt of a few tokens, then a reply (loss mask) ending in token 2."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        prompt = int(torch.randint(3, 7, (1,), generator=gen))
        ids = torch.randint(3, vocab, (length,), generator=gen)
        ids[-1] = 2
        mask = torch.arange(length) >= prompt
        out.append(Sample(f"s{i}", ids, mask))
    return out
