"""Per-step soft cross-entropy: alignment of teacher and masks (worked example and brute force), the 0.8^i
weighting, accuracy and the acceptance estimate."""

from __future__ import annotations

import torch
from train_helpers import FLAG_SETS, tiny_draft, tiny_features

from eagle_compile.train.loss import acceptance_estimate, step_position_mask, teacher_targets, ttt_loss
from eagle_compile.train.ttt import ttt_forward

STEPS = 3


def _teacher(model, seed=5):
    """A random teacher head over the draft vocabulary and its full-vocabulary counterpart."""
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(model.config.vocab_size, model.config.hidden_size, generator=gen, dtype=torch.float64)
    rows = full[model.t2d]
    return (lambda h: h @ rows.T), (lambda h: h @ full.T)


def test_position_masks_worked_example():
    """valid[j] = loss_mask[j+1] and argmax in t2d; step i at t uses valid[t+1+i]."""
    t2d = torch.tensor([True, False, True, True])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0]], dtype=torch.bool)  # reply = x_2..x_5
    argmax = torch.tensor([[0, 2, 1, 3, 0, 2, 0]])                      # target argmax at j=2 not in draft vocab
    targets = teacher_targets(lambda h: h[..., :2], torch.zeros(1, 7, 3), argmax, loss_mask, t2d)
    assert targets.valid.int().tolist() == [[0, 1, 0, 1, 1, 0, 0]]
    assert targets.column.tolist() == [1, 3, 4]
    # step 0 at t predicts x_{t+2} from target logits at t+1
    assert step_position_mask(targets, 0).int().tolist() == [[1, 0, 1, 1, 0, 0, 0]]
    assert step_position_mask(targets, 1).int().tolist() == [[0, 1, 1, 0, 0, 0, 0]]
    assert step_position_mask(targets, 2).int().tolist() == [[1, 1, 0, 0, 0, 0, 0]]


def test_loss_equals_brute_force_and_weights_are_0_8_pow_i():
    model = tiny_draft(**FLAG_SETS["eagle31"])
    b, t = 2, 10
    features = tiny_features(model.config, b, t)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 64, (b, t), generator=gen)
    attention = torch.arange(t)[None] < torch.tensor([[t], [7]])
    loss_mask = attention & (torch.arange(t)[None] >= 3)
    last_hidden = torch.randn(b, t, model.config.hidden_size, generator=gen, dtype=torch.float64)
    teacher, teacher_full = _teacher(model)
    argmax = teacher_full(last_hidden).argmax(-1)
    targets = teacher_targets(teacher, last_hidden, argmax, loss_mask, model.t2d)
    steps = ttt_forward(model, features, ids, attention, STEPS)
    weights = [0.8**i for i in range(STEPS)]
    result = ttt_loss(model, steps, targets, weights)

    for i in range(STEPS):
        terms, hits = [], 0
        for r in range(b):
            for pos in range(t):
                j = pos + 1 + i  # teacher position; predicted token x_{j+1}
                if j + 1 >= t or not (loss_mask[r, j + 1] and model.t2d[argmax[r, j]]):
                    continue
                p = torch.softmax(teacher(last_hidden[r, j]), -1)
                logits = model.logits(steps[i].normed[r, pos])
                terms.append(-(p * torch.log_softmax(logits, -1)).sum())
                hits += int(logits.argmax() == p.argmax())
        assert result.counts[i] == len(terms) > 0
        torch.testing.assert_close(result.losses[i], torch.stack(terms).mean(), rtol=0, atol=1e-12)
        assert result.correct[i] == hits
    expected_total = sum(0.8**i * result.losses[i] for i in range(STEPS))
    torch.testing.assert_close(result.total, expected_total, rtol=0, atol=1e-12)
    assert result.accuracies == [c / n for c, n in zip(result.correct, result.counts, strict=True)]


def test_empty_step_gives_zero_loss_with_a_gradient_path():
    model = tiny_draft()
    features = tiny_features(model.config, 1, 4)
    steps = ttt_forward(model, features, torch.randint(3, 64, (1, 4)), torch.ones(1, 4, dtype=torch.bool), 2)
    targets = teacher_targets(lambda h: h[..., :24], torch.zeros(1, 4, 32, dtype=torch.float64),
                              torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.bool), model.t2d)
    result = ttt_loss(model, steps, targets, [1.0, 0.8])
    assert result.counts == [0, 0] and result.total.item() == 0.0
    result.total.backward()  # must not raise


def test_acceptance_estimate_counts_leading_correct_steps():
    valid = torch.tensor([[False, True, True, True, True, False]])
    targets = type("T", (), {"valid": valid})()
    hit = [torch.tensor([[True, True, False, False, False, False]]),   # step 0 correct at t=0,1
           torch.tensor([[True, False, False, False, False, False]]),  # step 1 correct at t=0
           torch.tensor([[False, False, False, False, False, False]])]
    result = type("R", (), {"correct_masks": hit})()
    tau, n = acceptance_estimate(result, targets)
    # step-0 positions t = 0..3; leading correct steps: t0 -> 2, t1 -> 1, t2 -> 0, t3 -> 0
    assert n == 4
    assert tau == 1 + (2 + 1 + 0 + 0) / 4

