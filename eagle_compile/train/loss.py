"""Per-step soft cross-entropy of the TTT steps to the target's distribution (EAGLE31_SPEC.md §6.2-§6.3).

Step i at index t predicts ``x_{t+2+i}``. Its teacher is the target's own distribution of that token, the
target logits at index ``j = t+1+i`` restricted to the draft vocabulary and renormalised:
``p = softmax(target_logits_j[t2d])``. The step is trained at t when

    valid[j] = loss_mask[j+1]  and  t2d[argmax target_logits_j]

i.e. the predicted token is an assistant token and the target's own choice there can be proposed by the
draft at all (spec: "position mask = loss_mask ∧ t2d[argmax]"). We index ``loss_mask`` by the predicted token
``x_{j+1}``; the official trainer uses ``loss_mask[t+i]``, two positions earlier, which never trains the
first two reply tokens' predictions (the first draft token of every reply at inference) and trains two
positions past the reply's end. So the step-i position mask is ``valid`` shifted left by ``1+i``.

Loss: ``loss_i = mean over trained positions of -Σ_v p(v) log q(v)`` (q = draft softmax over the draft
vocabulary), total ``Σ_i w_i loss_i`` with ``w_i = 0.8**i``. The official code divides each step's sum by
batch×sequence instead, which scales the gradient by the (varying) fraction of trained positions in the
batch; the masked mean makes losses comparable between batches and the weights relative between steps.
Accuracy of step i: draft argmax == teacher argmax at the trained positions.

Logits are only computed where a step is trained (the lm_head is most of a head's FLOPs: prompt and
padding positions are skipped exactly).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle_compile.draft.model import EagleDraftModel
from eagle_compile.train.ttt import TTTStep, shift_left, ttt_forward


@dataclass
class TTTTargets:
    """The teacher of one batch, shared by all steps."""

    valid: torch.Tensor  # [B, T] bool: teacher position j is trained (loss_mask[j+1] and argmax in t2d)
    probs: torch.Tensor  # [n, Vd] teacher distribution at the valid positions, row-major order
    column: torch.Tensor  # [n] int64: j of each valid position


@dataclass
class TTTLoss:
    total: torch.Tensor  # scalar, Σ w_i loss_i (differentiable)
    losses: list[torch.Tensor]  # per step, scalar (differentiable)
    correct: list[int]  # per step: trained positions where draft argmax == teacher argmax
    counts: list[int]  # per step: trained positions
    correct_masks: list[torch.Tensor]  # per step [B, T] bool, at the step's index t

    @property
    def accuracies(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.correct, self.counts, strict=True)]


def teacher_targets(
    teacher_logits_fn,  # [n, Ht] -> [n, Vd]: target norm + lm_head rows of the draft vocabulary
    last_hidden: torch.Tensor,  # [B, T, Ht] target's last-layer pre-norm output (capture index N)
    target_argmax: torch.Tensor,  # [B, T] int64 target-vocabulary argmax of the target logits
    loss_mask: torch.Tensor,  # [B, T] bool, True on assistant tokens
    t2d: torch.Tensor,  # [V] bool
) -> TTTTargets:
    valid = shift_left(loss_mask, 1) & t2d[target_argmax]
    with torch.no_grad():
        logits = teacher_logits_fn(last_hidden[valid])
        probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    column = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)[valid]
    return TTTTargets(valid=valid, probs=probs, column=column)


def step_position_mask(targets: TTTTargets, step: int) -> torch.Tensor:
    """``[B, T]``: step ``step`` is trained at index t (``valid[t+1+step]``)."""
    return shift_left(targets.valid, 1 + step)


def ttt_loss(model: EagleDraftModel, steps: Sequence[TTTStep], targets: TTTTargets,
             weights: Sequence[float]) -> TTTLoss:
    """Weighted per-step soft cross-entropy and per-step accuracy (module docstring)."""
    if len(weights) != len(steps):
        raise ValueError(f"{len(weights)} step weights for {len(steps)} TTT steps")
    losses, correct, counts, masks = [], [], [], []
    total = None
    for i, (step, w) in enumerate(zip(steps, weights, strict=True)):
        mask = step_position_mask(targets, i)
        # rows of `probs` whose column j >= 1+i are exactly the positions of `mask`, in the same order
        p = targets.probs[targets.column >= 1 + i]
        logits = model.logits(step.normed[mask])  # [n_i, Vd]
        if logits.shape[0]:
            logq = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
            loss = -(p * logq).sum(-1).mean()
            hit = logits.argmax(-1) == p.argmax(-1)
        else:
            loss = logits.sum() * 0.0
            hit = torch.zeros(0, dtype=torch.bool, device=logits.device)
        hit_mask = torch.zeros_like(mask)
        hit_mask[mask] = hit
        losses.append(loss)
        correct.append(int(hit.sum()))
        counts.append(int(mask.sum()))
        masks.append(hit_mask)
        total = w * loss if total is None else total + w * loss
    return TTTLoss(total=total, losses=losses, correct=correct, counts=counts, correct_masks=masks)


def acceptance_estimate(result: TTTLoss, targets: TTTTargets) -> tuple[float, int]:
    """(mean accepted length, positions): 1 + leading correct steps per index where step 0 is trained.

    Under teacher forcing: the tokens fed to steps >= 1 are the data's, which equal the drafted ones only
    while the draft is right, so this estimates chain acceptance (tau) for greedy decoding of
    self-distilled data.
    """
    start = step_position_mask(targets, 0)
    run = start.clone()
    accepted = torch.zeros(start.shape, dtype=torch.int64, device=start.device)
    for i, hit in enumerate(result.correct_masks):
        run = run & hit & step_position_mask(targets, i)
        accepted += run
    n = int(start.sum())
    return (1.0 + float(accepted[start].sum()) / n if n else 0.0), n


def batch_loss(model: EagleDraftModel, teacher, batch, steps: int,
               weights: Sequence[float]) -> tuple[TTTLoss, TTTTargets]:
    """TTT forward and loss of one `FeatureBatch` (``teacher``: `TeacherHead` over the draft vocabulary)."""
    tokens = batch.tokens
    targets = teacher_targets(teacher, batch.last_hidden, batch.target_argmax, tokens.loss_mask, model.t2d)
    out = ttt_forward(model, batch.features, tokens.input_ids, tokens.attention_mask, steps)
    return ttt_loss(model, out, targets, weights), targets
