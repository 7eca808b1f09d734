"""Tiny random draft heads for the draft tests (float64: module and literal reference agree to ~1e-15).

Every weight is random, norm weights included (a norm weight of 1 would hide a norm applied twice or to
the wrong tensor), and the vocabulary mapping is a real reduced one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle_compile.draft import DraftConfig, EagleDraftModel, build_vocab_mapping

SMALL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    draft_vocab_size=24,
    capture_indices=(1, 3, 5),
)


def make_config(**overrides) -> DraftConfig:
    return DraftConfig(**{**SMALL, **overrides})


def randomize(model: EagleDraftModel, seed: int) -> EagleDraftModel:
    """Random weights everywhere (norm weights around 1), a random reduced vocabulary, a random embedding."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * noise)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)
        counts = torch.randint(0, 1000, (cfg.vocab_size,), generator=gen)
        d2t, t2d = build_vocab_mapping(counts, cfg.draft_vocab_size)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    table = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, dtype=torch.float64)
    model.tie_target_embedding(table)
    return model


def make_model(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> EagleDraftModel:
    model = EagleDraftModel(make_config(**overrides)).to(torch.float64)
    return randomize(model, seed).to(dtype).eval()


def features(cfg: DraftConfig, batch: int, tokens: int, seed: int = 1) -> torch.Tensor:
    """Target features ``[B, T, A*Ht]`` whose chunks have very different scales (low < mid < high)."""
    gen = torch.Generator().manual_seed(seed)
    chunks = [
        torch.randn(batch, tokens, cfg.target_hidden_size, generator=gen, dtype=torch.float64) * scale
        for scale in (0.5, 4.0, 30.0)[: cfg.num_features]
    ]
    return torch.cat(chunks, dim=-1)


def slot_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """bool ``[B, T, S]`` -> additive ``[B, 1, T, S]`` (0 attend, -inf blocked)."""
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))
    return mask[:, None]


def causal_slot_mask(positions: torch.Tensor, slots: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Each query at position p sees slots 0..p (slot = position)."""
    allowed = torch.arange(slots)[None, None, :] <= positions[..., None]
    return slot_mask(allowed, dtype)


def tiny_target(layers: int = 8, vocab: int = 64, hidden: int = 32, seed: int = 0) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


@pytest.fixture
def tiny():
    return SimpleNamespace(
        config=make_config,
        model=make_model,
        randomize=randomize,
        features=features,
        slot_mask=slot_mask,
        causal_slot_mask=causal_slot_mask,
        target=tiny_target,
    )
