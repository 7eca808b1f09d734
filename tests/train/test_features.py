"""Target features through the captured program: taps == output_hidden_states, the teacher computed from h_N
== the program's logits, padding rows and columns do not change real ones, one graph per batch shape."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_target
from train_helpers import hand_samples

from eagle_compile.train.data import collate
from eagle_compile.train.features import FeatureExtractor, TeacherHead


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def _pre_norm_last(model, ids):
    seen = {}
    handle = model.model.layers[-1].register_forward_hook(lambda m, i, o: seen.setdefault("o", o))
    model(ids)
    handle.remove()
    return seen["o"][0] if isinstance(seen["o"], tuple) else seen["o"]


def test_features_teacher_and_padding(target):
    samples = hand_samples(3, vocab=96, min_len=9, max_len=15)
    extractor = FeatureExtractor(target, None, rows=4)
    assert extractor.capture_indices == (2, 4, 5)
    fb = extractor(collate(samples, pad_multiple=16))
    assert fb.features.shape == (3, 16, 3 * 32) and fb.last_hidden.shape == (3, 16, 32)
    teacher = TeacherHead(target, None)
    for r, s in enumerate(samples):  # each row against an unpadded plain forward of that sample alone
        n, ids = len(s), s.input_ids[None]
        with torch.no_grad():
            ref = target(ids, output_hidden_states=True)
            h_n = _pre_norm_last(target, ids)[0]
        expected = torch.cat([ref.hidden_states[k][0] for k in (2, 4, 5)], -1)
        torch.testing.assert_close(fb.features[r, :n], expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(fb.last_hidden[r, :n], h_n, rtol=0, atol=1e-12)
        # the teacher from h_N is exactly the target's logits
        torch.testing.assert_close(teacher(fb.last_hidden[r, :n]), ref.logits[0], rtol=0, atol=1e-12)
        assert torch.equal(fb.target_argmax[r, :n], ref.logits[0].argmax(-1))
    fb2 = extractor(collate(samples[:2], pad_multiple=16))       # fewer rows: padded to the same shape
    torch.testing.assert_close(fb2.features, fb.features[:2], rtol=0, atol=0)
    assert extractor.graphs_captured == 1


def test_teacher_restricted_to_the_draft_vocabulary(target):
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[torch.tensor([3, 10, 11, 50, 95])] = True
    h = torch.randn(4, 32, dtype=torch.float64)
    full = target.lm_head(target.model.norm(h))
    torch.testing.assert_close(TeacherHead(target, t2d)(h), full[:, t2d], rtol=0, atol=1e-12)


def test_last_layer_among_the_capture_indices(target):
    extractor = FeatureExtractor(target, (1, 8))
    fb = extractor(collate(hand_samples(1, vocab=96), pad_multiple=8))
    assert fb.features.shape[-1] == 2 * 32
    torch.testing.assert_close(fb.last_hidden, fb.features[..., 32:], rtol=0, atol=0)
