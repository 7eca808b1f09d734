"""AdamW with linear warmup then cosine decay (EAGLE31_SPEC.md §6.4)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class WarmupCosine:
    """Learning-rate multiplier before optimizer step ``s`` (0-based).

    ``(s + 1) / warmup`` for the first ``warmup`` steps (the first step already moves the weights), then a
    cosine from 1 down to ``min_ratio`` at step ``total``.
    """

    warmup: int
    total: int
    min_ratio: float = 0.0

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / self.warmup
        progress = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, lr: float, betas: tuple[float, float],
                    weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (the frozen target embedding is a buffer, never among them)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int,
                    min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(warmup, total, min_ratio))
