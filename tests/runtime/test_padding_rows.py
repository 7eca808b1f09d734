"""Batch buckets: padded (and finished) rows write only the sentinel slot and never change real rows."""

from __future__ import annotations

import pytest
import torch
from tiny import random_head, tiny_target

from eagle_compile.core.tree import TreeShape
from eagle_compile.core.verify import draw_uniforms
from eagle_compile.draft.drafter import EagleDrafter
from eagle_compile.runtime.kv_cache import SlotKVCache
from eagle_compile.runtime.sampling import SamplingParams
from eagle_compile.runtime.step import SpeculativeStep, StepState
from eagle_compile.runtime.target_program import TargetProgram

SLOTS = 48


def _setup(active, sampling):
    target = tiny_target("llama", seed=13)
    head = random_head(target, flags=True, seed=2, reduced=True)
    torch.manual_seed(0)
    batch = len(active)
    cache = SlotKVCache(target.config, batch, SLOTS, dtype=torch.float64, device="cpu")
    kv = head.new_kv(batch, SLOTS)
    for buf in [t for layer in cache.layers for t in (layer.keys, layer.values)] + [kv.keys, kv.values]:
        buf.normal_()
    state = StepState(n=torch.tensor([9, 14, 11][:batch]), root=torch.tensor([5, 6, 7][:batch]),
                      seed_feedback=torch.randn(batch, 32, dtype=torch.float64),
                      seed_head=torch.randn(batch, 32, dtype=torch.float64), active=torch.tensor(active))
    step = SpeculativeStep(EagleDrafter(head), TreeShape(3, 2, 6), sampling, TargetProgram(target, None))
    return step, state, cache, kv


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(do_sample=True, temperature=0.7)])
def test_padded_rows_touch_only_the_sentinel_and_never_real_rows(sampling):
    step, state, cache, kv = _setup([True, False, True], sampling)
    # poison the padded row everywhere: NaN cache, NaN seeds
    for buf in [t for layer in cache.layers for t in (layer.keys, layer.values)] + [kv.keys, kv.values]:
        buf[1] = float("nan")
    state.seed_head[1] = float("nan")
    state.seed_feedback[1] = float("nan")
    before = [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)] + [kv.keys.clone(),
                                                                                          kv.values.clone()]
    u, fu = draw_uniforms(3, 3, 2, generator=torch.Generator().manual_seed(1))
    out = step(state, cache, kv, u, fu)

    after = [t for layer in cache.layers for t in (layer.keys, layer.values)] + [kv.keys, kv.values]
    for old, new in zip(before, after, strict=True):
        # the padded row: only the sentinel slot may change
        assert torch.equal(old[1, :, :-1].isnan(), new[1, :, :-1].isnan())
    assert int(state.n[1]) == 14                      # frozen

    # the real rows are exactly what a batch without the padded row computes
    ref_step, ref_state, ref_cache, ref_kv = _setup([True, True], sampling)
    keep = torch.tensor([0, 2])
    for buf, src in zip([t for layer in ref_cache.layers for t in (layer.keys, layer.values)] + [ref_kv.keys,
                                                                                                ref_kv.values],
                        before, strict=True):
        buf.copy_(src[keep])
    fresh = _setup([True, False, True], sampling)[1]
    for name in ("n", "root", "seed_feedback", "seed_head"):
        getattr(ref_state, name).copy_(getattr(fresh, name)[keep])
    ref = ref_step(ref_state, ref_cache, ref_kv, u[keep], fu[keep])
    assert torch.equal(out.tokens[keep], ref.tokens)
    assert torch.equal(out.accept_len[keep], ref.accept_len)
    for layer, ref_layer in zip(cache.layers, ref_cache.layers, strict=True):
        # a batch of 3 vs 2 rows may round differently in the last bit (float64); no NaN may leak in
        assert not layer.keys[keep].isnan().any()
        assert torch.allclose(layer.keys[keep], ref_layer.keys, rtol=0, atol=1e-12)
