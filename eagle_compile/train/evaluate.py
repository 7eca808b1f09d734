"""Held-out evaluation of a head under the TTT unroll: loss and accuracy per depth, acceptance estimate."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

from eagle_compile.draft.model import EagleDraftModel
from eagle_compile.train.features import FeatureBatch, TeacherHead
from eagle_compile.train.loss import acceptance_estimate, batch_loss


@dataclass
class EvalResult:
    loss: float  # Σ_i w_i loss_i, position-weighted over the batches
    losses: list[float]  # per depth (TTT step i = chain depth i+1)
    accuracies: list[float]  # per depth: draft argmax == target argmax
    accept_estimate: float  # 1 + mean leading correct depths (greedy chain, teacher forcing)
    positions: int  # trained positions at depth 1
    samples: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def evaluate(model: EagleDraftModel, teacher: TeacherHead, batches: Iterable[FeatureBatch], steps: int,
             weights: Sequence[float], autocast: Callable[[], contextlib.AbstractContextManager] | None = None
             ) -> EvalResult:
    """Held-out metrics; ``autocast`` wraps the head's forward only (the target's features come as they are)."""
    was_training = model.training
    model.eval()
    loss_sums, counts, correct = [0.0] * steps, [0] * steps, [0] * steps
    accept_sum, starts, samples = 0.0, 0, 0
    for fb in batches:
        with (autocast or contextlib.nullcontext)():
            result, targets = batch_loss(model, teacher, fb, steps, weights)
        for i in range(steps):
            loss_sums[i] += float(result.losses[i]) * result.counts[i]
            counts[i] += result.counts[i]
            correct[i] += result.correct[i]
        tau, n = acceptance_estimate(result, targets)
        accept_sum += tau * n
        starts += n
        samples += fb.tokens.input_ids.shape[0]
    model.train(was_training)
    losses = [s / n if n else 0.0 for s, n in zip(loss_sums, counts, strict=True)]
    return EvalResult(
        loss=sum(w * x for w, x in zip(weights, losses, strict=True)),
        losses=losses,
        accuracies=[c / n if n else 0.0 for c, n in zip(correct, counts, strict=True)],
        accept_estimate=accept_sum / starts if starts else 0.0,
        positions=counts[0],
        samples=samples,
    )
