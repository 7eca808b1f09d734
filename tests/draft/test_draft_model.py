"""EagleDraftModel against the literal EAGLE31_SPEC §2.5 computation, flag by flag, via a slot KV cache."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from eagle_compile.draft import DraftConfig, EagleDraftModel
from eagle_compile.draft.model import draft_step_reference, reference_fuse

EXACT = dict(rtol=0.0, atol=1e-11)  # float64: module and reference differ only by summation order
POISON = 1.0e30  # finite, so a masked poisoned slot contributes exactly 0 (a NaN would poison 0 * NaN)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


FLAG_COMBOS = [
    dict(zip(("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"), bits, strict=True))
    for bits in itertools.product([False, True], repeat=4)
    if not (bits[0] and bits[2])  # fc_norm and norm_before_fc are mutually exclusive
]


def _ids(combo):
    return "-".join(k for k, v in combo.items() if v) or "eagle3"


def test_defaults_are_eagle3(tiny):
    cfg = DraftConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, vocab_size=64)
    assert not (cfg.fc_norm or cfg.norm_output or cfg.norm_before_fc or cfg.norm_before_residual)
    assert cfg.use_aux_hidden_state and cfg.rope_theta == 10000.0
    resolved = (cfg.head_dim, cfg.num_key_value_heads, cfg.draft_vocab_size, cfg.target_hidden_size)
    assert resolved == (8, 4, 64, 32)


def test_state_dict_keys_are_the_official_layout(tiny):
    model = tiny.model(fc_norm=True)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {
        "fc.weight": [32, 96],
        "fc_norm.0.weight": [32],
        "fc_norm.1.weight": [32],
        "fc_norm.2.weight": [32],
        "midlayer.input_layernorm.weight": [32],
        "midlayer.hidden_norm.weight": [32],
        "midlayer.self_attn.q_proj.weight": [32, 64],
        "midlayer.self_attn.k_proj.weight": [16, 64],
        "midlayer.self_attn.v_proj.weight": [16, 64],
        "midlayer.self_attn.o_proj.weight": [32, 32],
        "midlayer.post_attention_layernorm.weight": [32],
        "midlayer.mlp.gate_proj.weight": [48, 32],
        "midlayer.mlp.up_proj.weight": [48, 32],
        "midlayer.mlp.down_proj.weight": [32, 48],
        "norm.weight": [32],
        "lm_head.weight": [24, 32],
        "d2t": [24],
        "t2d": [64],
    }
    assert model.state_dict()["d2t"].dtype == torch.int64 and model.state_dict()["t2d"].dtype == torch.bool
    assert "input_norm.weight" in tiny.model(norm_before_fc=True).state_dict()
    assert "fc.weight" not in tiny.model(use_aux_hidden_state=False, capture_indices=(8,)).state_dict()


def test_all_flags_off_matches_literal_reference(tiny):
    model = tiny.model()
    cfg = model.config
    batch, t, slots = 2, 6, 10
    feats = tiny.features(cfg, batch, t)
    ids = torch.randint(0, cfg.vocab_size, (batch, t), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(t).expand(batch, t)
    kv = model.new_kv(batch, slots)
    out = model(ids, model.fuse(feats), pos, kv, pos.clone(), tiny.causal_slot_mask(pos, slots))
    logits, g_next, (k, v) = draft_step_reference(model, ids, feats, pos, is_first=True)
    assert_close(model.logits(out.normed), logits, **EXACT)
    assert_close(out.feedback, g_next, **EXACT)
    assert_close(kv.keys[:, :, :t], k, **EXACT)
    assert_close(kv.values[:, :, :t], v, **EXACT)
    assert torch.equal(kv.keys[:, :, t:], torch.zeros_like(kv.keys[:, :, t:]))
    assert logits.shape == (batch, t, cfg.draft_vocab_size)


@pytest.mark.parametrize("flags", FLAG_COMBOS, ids=_ids)
def test_three_step_chain_matches_recomputation_from_scratch(tiny, flags):
    """Ragged batch (row lengths 5 and 3; padding writes the sentinel slot), catch-up + 2 chain steps.

    Each step's rows must equal the literal reference recomputed from scratch over the row's whole
    history (no cache), so KV reuse, the growing mask, the feedback and RoPE positions are all checked.
    """
    model = tiny.model(seed=2, **flags)
    cfg = model.config
    lengths, t0, slots = [5, 3], 5, 12
    sentinel = slots - 1
    gen = torch.Generator().manual_seed(9)
    feats = tiny.features(cfg, 2, t0)
    ids0 = torch.randint(0, cfg.vocab_size, (2, t0), generator=gen)
    pos0 = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]])
    slots0 = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, sentinel, sentinel]])
    allowed = torch.arange(slots)[None, None, :] <= pos0[..., None]
    allowed[1, 3:] = False
    allowed[1, 3:, sentinel] = True  # padded queries see only the sentinel
    kv = model.new_kv(2, slots)
    out = model(ids0, model.fuse(feats), pos0, kv, slots0, tiny.slot_mask(allowed))

    last = torch.tensor(lengths) - 1
    hidden = out.feedback[torch.arange(2), last][:, None]  # [2, 1, H]
    got = [[out.feedback[b, : lengths[b]] for b in range(2)]]
    got_logits = [[model.logits(out.normed)[b, : lengths[b]] for b in range(2)]]
    chain_ids = []
    for step in (1, 2):
        tok = torch.randint(0, cfg.vocab_size, (2, 1), generator=gen)
        chain_ids.append(tok)
        pos = (last + step)[:, None]
        out = model(tok, hidden, pos, kv, pos.clone(), tiny.causal_slot_mask(pos, slots))
        hidden = out.feedback
        got.append([out.feedback[b] for b in range(2)])
        got_logits.append([model.logits(out.normed)[b] for b in range(2)])

    for b, n in enumerate(lengths):
        hist_g = reference_fuse(model, feats[b : b + 1, :n])
        hist_ids = ids0[b : b + 1, :n]
        for step in range(3):
            if step:
                hist_ids = torch.cat([hist_ids, chain_ids[step - 1][b : b + 1]], dim=1)
            pos = torch.arange(hist_ids.shape[1])[None]
            logits, g_next, _ = draft_step_reference(model, hist_ids, hist_g, pos, is_first=False)
            rows = slice(0, n) if step == 0 else slice(-1, None)
            assert_close(got[step][b], g_next[0, rows], **EXACT)
            assert_close(got_logits[step][b], logits[0, rows], **EXACT)
            hist_g = torch.cat([hist_g, g_next[:, -1:]], dim=1)  # what is fed back to the next step


def test_writes_land_only_at_write_slots(tiny):
    model = tiny.model(seed=4)
    cfg = model.config
    slots, t = 11, 4
    write = torch.tensor([[7, 2, 9, 4], [0, 5, 1, 8]])
    pos = torch.arange(t).expand(2, t)
    allowed = torch.zeros(2, t, slots, dtype=torch.bool)
    for b in range(2):
        for q in range(t):
            allowed[b, q, write[b, : q + 1]] = True  # token q sees tokens 0..q wherever they were written
    kv = model.new_kv(2, slots)
    kv.keys.fill_(POISON)
    kv.values.fill_(-POISON)
    feats = tiny.features(cfg, 2, t)
    ids = torch.randint(0, cfg.vocab_size, (2, t), generator=torch.Generator().manual_seed(1))
    out = model(ids, model.fuse(feats), pos, kv, write, tiny.slot_mask(allowed))

    logits, g_next, (k, v) = draft_step_reference(model, ids, feats, pos, is_first=True)
    assert_close(out.feedback, g_next, **EXACT)
    assert_close(model.logits(out.normed), logits, **EXACT)
    for b in range(2):
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[write[b]] = False
        assert torch.all(kv.keys[b][:, untouched] == POISON)
        assert torch.all(kv.values[b][:, untouched] == -POISON)
        assert_close(kv.keys[b][:, write[b]], k[b], **EXACT)
        assert_close(kv.values[b][:, write[b]], v[b], **EXACT)


def test_fc_norm_normalises_each_feature_separately(tiny):
    model = tiny.model(fc_norm=True, rms_norm_eps=1e-12)
    cfg = model.config
    feats = tiny.features(cfg, 2, 3)
    chunks = feats.split(cfg.target_hidden_size, dim=-1)
    by_hand = torch.cat([rms(c, model.fc_norm[i].weight, 1e-12) for i, c in enumerate(chunks)], -1)
    assert_close(model.fuse(feats), by_hand @ model.fc.weight.T, **EXACT)
    # per-feature norms: rescaling each feature separately changes nothing ...
    rescaled = torch.cat([c * s for c, s in zip(chunks, (7.0, 0.01, 300.0), strict=True)], dim=-1)
    assert_close(model.fuse(rescaled), model.fuse(feats), rtol=0, atol=1e-9)
    # ... which a single norm over the concat (norm_before_fc) or no norm does not give
    for other in (tiny.model(norm_before_fc=True, rms_norm_eps=1e-12), tiny.model()):
        assert not torch.allclose(other.fuse(rescaled), other.fuse(feats), atol=1e-3)


def test_norm_before_fc_is_one_norm_over_the_concat(tiny):
    model = tiny.model(norm_before_fc=True, rms_norm_eps=1e-12)
    feats = tiny.features(model.config, 2, 3)
    by_hand = rms(feats, model.input_norm.weight, 1e-12) @ model.fc.weight.T
    assert_close(model.fuse(feats), by_hand, **EXACT)
    assert_close(model.fuse(feats * 25.0), model.fuse(feats), rtol=0, atol=1e-9)
    plain = tiny.model()
    assert not torch.allclose(plain.fuse(feats * 25.0), plain.fuse(feats), atol=1e-3)


def _zero_blocks(model):
    """Attention and MLP outputs exactly 0, so o = residual: isolates what the residual is."""
    with torch.no_grad():
        model.midlayer.self_attn.o_proj.weight.zero_()
        model.midlayer.mlp.down_proj.weight.zero_()
    return model


def test_norm_before_residual_residual_is_the_normed_hidden(tiny):
    off, on = tiny.model(seed=6), tiny.model(seed=6, norm_before_residual=True)
    g = torch.randn(1, 3, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 5
    assert not torch.allclose(on(*_args(on, g)).feedback, off(*_args(off, g)).feedback, atol=1e-3)
    _zero_blocks(off), _zero_blocks(on)
    eps = on.config.rms_norm_eps
    assert_close(off(*_args(off, g)).feedback, g, **EXACT)  # EAGLE-3: residual = g
    assert_close(on(*_args(on, g)).feedback, rms(g, on.midlayer.hidden_norm.weight, eps), **EXACT)


def _args(model, hidden, t=3, slots=8):
    ids = torch.randint(0, model.config.vocab_size, (1, t), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(t)[None]
    allowed = torch.arange(slots)[None, None, :] <= pos[..., None]
    mask = torch.zeros(allowed.shape, dtype=hidden.dtype).masked_fill(~allowed, float("-inf"))[:, None]
    return ids, hidden, pos, model.new_kv(1, slots), pos.clone(), mask


def test_norm_output_feeds_back_norm_o_and_logits_are_normalised_once(tiny):
    off, on = tiny.model(seed=7), tiny.model(seed=7, norm_output=True)
    for (k, a), b in zip(off.state_dict().items(), on.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    g = torch.randn(1, 3, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(8)) * 5
    out_off, out_on = off(*_args(off, g)), on(*_args(on, g))
    eps = on.config.rms_norm_eps
    o = out_off.feedback  # EAGLE-3 feeds back the pre-norm o
    assert_close(out_off.normed, rms(o, off.norm.weight, eps), **EXACT)
    assert_close(out_on.normed, out_off.normed, **EXACT)  # same norm(o), not norm(norm(o))
    assert torch.equal(out_on.feedback, out_on.normed)  # EAGLE 3.1 feeds back norm(o)
    assert not torch.allclose(o, out_off.normed, atol=1e-3)
    logits = on.logits(out_on.normed)
    assert_close(logits, out_on.normed @ on.lm_head.weight.T, **EXACT)
    assert_close(logits, off.logits(out_off.normed), **EXACT)  # logits do not depend on the flag
    twice = rms(out_on.normed, on.norm.weight, eps) @ on.lm_head.weight.T
    assert not torch.allclose(logits, twice, atol=1e-3)
    # the next step of the 3.1 head is the EAGLE-3 step fed with norm(o)
    assert_close(on(*_args(on, out_on.feedback)).feedback, off(*_args(off, out_off.normed)).normed, **EXACT)


def test_rope_comes_from_the_draft_config_and_stays_fp32(tiny):
    model = tiny.model(rope_theta=500000.0)
    hd = model.config.head_dim
    expected = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    assert torch.equal(model.rotary_emb.inv_freq, expected)
    assert not torch.equal(tiny.model().rotary_emb.inv_freq, expected)
    model.to(torch.bfloat16)
    assert model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.rotary_emb.inv_freq, expected)
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_scaled_rope_config_builds_transformers_frequencies(tiny):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    model = tiny.model(rope_scaling=scaling, max_position_embeddings=1024, head_dim=32)
    plain = tiny.model(head_dim=32)
    assert model.rotary_emb.rope_type == "llama3"
    assert not torch.equal(model.rotary_emb.inv_freq, plain.rotary_emb.inv_freq)
    feats = tiny.features(model.config, 1, 4)
    ids = torch.arange(4)[None]
    pos = torch.arange(4)[None]
    out = model(ids, model.fuse(feats), pos, model.new_kv(1, 6), pos.clone(), tiny.causal_slot_mask(pos, 6))
    logits, _, _ = draft_step_reference(model, ids, feats, pos, is_first=True)
    assert_close(model.logits(out.normed), logits, **EXACT)


def test_bfloat16_step_runs_and_tracks_float64(tiny):
    ref = tiny.model(seed=11)
    low = tiny.model(seed=11, dtype=torch.bfloat16)
    feats = tiny.features(ref.config, 1, 4)
    pos = torch.arange(4)[None]
    ids = torch.arange(4)[None]
    outs = []
    for m, dt in ((ref, torch.float64), (low, torch.bfloat16)):
        kv = m.new_kv(1, 6)
        assert kv.keys.dtype == dt
        out = m(ids, m.fuse(feats.to(dt)), pos, kv, pos.clone(), tiny.causal_slot_mask(pos, 6, dt))
        assert out.normed.dtype == dt
        outs.append(m.logits(out.normed).double())
    assert_close(outs[1], outs[0], rtol=0.05, atol=0.1)


def test_draft_to_target_applies_offsets(tiny):
    model = tiny.model()
    used = model.t2d.nonzero().flatten()
    draft_ids = torch.arange(model.config.draft_vocab_size)
    assert torch.equal(model.draft_to_target(draft_ids), used)
    assert torch.equal(model.draft_to_target(draft_ids.view(4, 6)), used.view(4, 6))
    identity = EagleDraftModel(tiny.config(draft_vocab_size=None))
    ids = torch.arange(64)
    assert torch.equal(identity.draft_to_target(ids), ids)


def test_embedding_is_the_targets_shared_frozen_and_never_saved(tiny):
    target = tiny.target()
    model = EagleDraftModel(tiny.config(capture_indices=(2, 4, 5))).to(torch.float64)
    model.tie_target_embedding(target)
    table = target.get_input_embeddings().weight
    assert model.embed_tokens.weight.data_ptr() == table.data_ptr()  # shared, not copied
    assert not model.embed_tokens.weight.requires_grad
    assert all(not k.startswith("embed_tokens") for k in model.state_dict())
    assert all(p is not table for p in model.parameters())
    before = table.detach().clone()
    model.to(torch.float32)
    assert table.dtype == torch.float64 and torch.equal(table, before)  # the target is untouched
    with pytest.raises(ValueError, match=r"\[64, 16\]"):
        EagleDraftModel(tiny.config(hidden_size=16)).tie_target_embedding(target)


def test_forward_refuses_missing_embedding_and_wrong_inputs(tiny):
    model = EagleDraftModel(tiny.config()).to(torch.float64)
    args = list(_args(tiny.model(), torch.zeros(1, 3, 32, dtype=torch.float64)))
    with pytest.raises(RuntimeError, match="tie_target_embedding"):
        model(*args)
    model = tiny.model()
    with pytest.raises(ValueError, match="call fuse"):
        model(args[0], torch.zeros(1, 3, 96, dtype=torch.float64), *args[2:])
    with pytest.raises(TypeError, match="int64"):
        model(*args[:4], args[4].to(torch.int32), args[5])
    with pytest.raises(ValueError, match="3 \\* 32 = 96"):
        model.fuse(torch.zeros(1, 2, 64, dtype=torch.float64))


def test_new_kv_shape_dtype_device(tiny):
    model = tiny.model()
    kv = model.new_kv(3, 9)
    assert kv.keys.shape == kv.values.shape == (3, 2, 9, 8)
    assert kv.keys.dtype == torch.float64 and not kv.keys.any() and not kv.values.any()
    assert model.new_kv(1, 2, dtype=torch.float32).values.dtype == torch.float32


def test_fill_writes_exactly_the_kv_forward_writes(tiny):
    """`fill` (the prompt catch-up's K/V-only path) leaves the cache as `forward` leaves it, bit for bit."""
    model = tiny.model(seed=12, fc_norm=True, norm_output=True)
    ids, feats = torch.randint(0, 64, (2, 5)), tiny.features(model.config, 2, 5)
    pos = torch.arange(5).expand(2, 5) + 1
    full, kv_only = model.new_kv(2, 8), model.new_kv(2, 8)
    model(ids, model.fuse(feats), pos, full, pos.clone(), tiny.causal_slot_mask(pos, 8))
    model.fill(ids, model.fuse(feats), pos, kv_only, pos.clone())
    assert torch.equal(full.keys, kv_only.keys) and torch.equal(full.values, kv_only.values)
    assert kv_only.keys[:, :, 1:6].abs().sum() > 0 and (kv_only.keys[:, :, 6:] == 0).all()
