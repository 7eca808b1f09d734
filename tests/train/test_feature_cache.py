"""Offline features: fp16 round trip equals the online features, gives the same loss within fp16 tolerance,
an interrupted build resumes with the missing shards only, and a cache of other data is refused."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_target
from train_helpers import FLAG_SETS, hand_samples

from eagle_compile.errors import OptionsError
from eagle_compile.train import feature_cache as fc
from eagle_compile.train.data import collate
from eagle_compile.train.draft_vocab import select_draft_vocab
from eagle_compile.train.features import FeatureExtractor, TeacherHead
from eagle_compile.train.head import build_head
from eagle_compile.train.loss import batch_loss


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama")
    extractor = FeatureExtractor(target, None, rows=3)
    return target, extractor, hand_samples(7, vocab=96)


def _build(path, extractor, samples, **kw):
    return fc.build_feature_cache(path, lambda: extractor, samples, capture_indices=extractor.capture_indices,
                                  hidden_size=32, target_name="tiny", batch_size=3, shard_samples=3,
                                  pad_multiple=32, progress=False, **kw)


def test_round_trip_and_loss_match_online(setup, tmp_path):
    target, extractor, samples = setup
    cache = _build(tmp_path / "c", extractor, samples)
    assert len(cache) == 7 and [s["file"] for s in cache.shards] == [f"shard_0000{k}.safetensors" for k in range(3)]
    assert cache.lengths == [len(s) for s in samples] and cache.shard_of == [0, 0, 0, 1, 1, 1, 2]

    positions = [4, 5, 3]
    offline = cache.batch(positions)
    online = extractor(collate([samples[i] for i in positions], pad_multiple=32))
    assert offline.features.dtype == torch.float16
    n = offline.tokens.input_ids.shape[1]
    assert torch.equal(offline.tokens.input_ids, online.tokens.input_ids[:, :n])
    assert torch.equal(offline.tokens.loss_mask, online.tokens.loss_mask[:, :n])
    real = offline.tokens.attention_mask
    assert torch.equal(offline.target_argmax[real], online.target_argmax[:, :n][real])  # stored as computed
    torch.testing.assert_close(offline.features[real], online.features[:, :n][real].half(), rtol=0, atol=0)
    torch.testing.assert_close(offline.last_hidden[real], online.last_hidden[:, :n][real].half(), rtol=0, atol=0)
    assert not offline.features[~real].any()

    d2t, t2d, _ = select_draft_vocab(samples, 96, 48)
    head = build_head(target, d2t=d2t, t2d=t2d, flags=FLAG_SETS["eagle31"], capture_indices=None,
                      lm_head_init="target", freeze_lm_head=False, dtype=torch.float64, seed=0)
    teacher = TeacherHead(target, head.t2d)
    weights = [0.8**i for i in range(4)]
    with torch.no_grad():
        loss_off, _ = batch_loss(head, teacher, offline, 4, weights)
        loss_on, _ = batch_loss(head, teacher, online, 4, weights)
    assert loss_off.counts == loss_on.counts and loss_on.counts[0] > 0
    torch.testing.assert_close(loss_off.total, loss_on.total, rtol=2e-3, atol=0)   # fp16 storage only
    assert loss_off.total != loss_on.total                                            # (it did go through fp16)


def test_interrupted_build_resumes_missing_shards_only(setup, tmp_path, monkeypatch):
    _, extractor, samples = setup
    calls = []
    real = fc._extract_shard

    def flaky(extractor, members, *args):
        calls.append([m.id for m in members])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(extractor, members, *args)

    monkeypatch.setattr(fc, "_extract_shard", flaky)
    with pytest.raises(KeyboardInterrupt):
        _build(tmp_path / "c", extractor, samples)
    assert sorted(p.name for p in (tmp_path / "c").glob("shard_*")) == ["shard_00000.safetensors"]
    with pytest.raises(OptionsError, match="incomplete"):
        fc.FeatureCache(tmp_path / "c")
    cache = _build(tmp_path / "c", extractor, samples)
    assert calls == [["s0", "s1", "s2"], ["s3", "s4", "s5"], ["s3", "s4", "s5"], ["s6"]]
    assert len(cache) == 7

    with pytest.raises(OptionsError, match="other data"):
        _build(tmp_path / "c", extractor, hand_samples(7, vocab=96, seed=4))


def test_fp16_overflow_is_refused(setup, tmp_path, monkeypatch):
    _, extractor, samples = setup

    class Loud:
        capture_indices, hidden_size = extractor.capture_indices, 32

        def __call__(self, batch):
            fb = extractor(batch)
            fb.features = fb.features * 1e6
            return fb

    with pytest.raises(OverflowError, match="bfloat16"):
        fc.build_feature_cache(tmp_path / "c", Loud, samples[:2], capture_indices=extractor.capture_indices,
                               hidden_size=32, target_name="tiny", batch_size=3, shard_samples=3,
                               pad_multiple=32, progress=False)
