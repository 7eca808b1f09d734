"""Training computes what inference runs: the TTT step-i output at index t equals the draft module's KV-cache
chain (catch-up over 0..t, then i chained steps fed with the feedback and the ground-truth tokens), in float64,
for EAGLE-3 and EAGLE 3.1 flags, with padded rows."""

from __future__ import annotations

import pytest
import torch
from train_helpers import FLAG_SETS, tiny_draft, tiny_features

from eagle_compile.train.ttt import ttt_forward

STEPS = 4


def _slot_mask(positions: torch.Tensor, slots: int) -> torch.Tensor:
    visible = torch.arange(slots)[None, None, :] <= positions[..., None]  # [1, T, S]
    return torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, float("-inf"))[:, None]


def inference_chain(model, features, ids, t: int, steps: int) -> list[torch.Tensor]:
    """norm(o) of chain depth 1..steps after a catch-up over pairs (h_j, x_{j+1}), j = 0..t. Row 0 only."""
    slots = t + steps + 1
    kv = model.new_kv(1, slots)
    pos = torch.arange(t + 1)[None]
    padded = torch.cat([ids, torch.zeros(1, steps + 1, dtype=ids.dtype)], dim=1)  # tokens past the end are 0
    out = model(padded[:, 1 : t + 2], model.fuse(features[:, : t + 1]), pos, kv, pos, _slot_mask(pos, slots))
    normed, feedback = [out.normed[0, -1]], out.feedback[:, -1:]
    for i in range(1, steps):
        p = torch.tensor([[t + i]])
        out = model(padded[:, t + 1 + i : t + 2 + i], feedback, p, kv, p, _slot_mask(p, slots))
        normed.append(out.normed[0, 0])
        feedback = out.feedback
    return normed


@pytest.mark.parametrize("flags", list(FLAG_SETS))
def test_ttt_equals_inference_chain(flags):
    model = tiny_draft(**FLAG_SETS[flags]).eval()
    t_len = 9
    features = tiny_features(model.config, 2, t_len)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (2, t_len), generator=gen)
    lengths = [t_len, 6]
    attention = torch.arange(t_len)[None, :] < torch.tensor(lengths)[:, None]
    ids = ids.masked_fill(~attention, 0)
    with torch.no_grad():
        steps = ttt_forward(model, features, ids, attention, STEPS)
        compared = 0
        for row, length in enumerate(lengths):
            for t in range(length):
                chain = inference_chain(model, features[row : row + 1, :length], ids[row : row + 1, :length], t,
                                        STEPS)
                for i in range(STEPS):
                    torch.testing.assert_close(steps[i].normed[row, t], chain[i], rtol=0, atol=1e-12)
                    compared += 1
    assert compared == STEPS * sum(lengths)


def test_feedback_is_pre_or_post_norm():
    """EAGLE-3 feeds back o; EAGLE 3.1 feeds back norm(o) (the same tensor lm_head reads, never renormalised)."""
    features = None
    for flags, post in (("eagle3", False), ("eagle31", True)):
        model = tiny_draft(**FLAG_SETS[flags])
        features = tiny_features(model.config, 1, 5)
        ids = torch.randint(3, 64, (1, 5))
        with torch.no_grad():
            steps = ttt_forward(model, features, ids, torch.ones(1, 5, dtype=torch.bool), 2)
        same = torch.equal(steps[0].feedback, steps[0].normed)
        assert same is post


def test_gradients_flow_through_feedback():
    """The step-1 loss reaches fc (through step 0's feedback and keys), as in the official TTT."""
    model = tiny_draft(**FLAG_SETS["eagle31"])
    features = tiny_features(model.config, 1, 6)
    steps = ttt_forward(model, features, torch.randint(3, 64, (1, 6)), torch.ones(1, 6, dtype=torch.bool), 2)
    steps[1].normed[0, 0].sum().backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0
