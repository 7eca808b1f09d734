"""load_draft / save_draft: bit-for-bit round trips, hand-written third-party checkpoints, strict refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle_compile.draft import load_draft, save_draft
from eagle_compile.errors import CheckpointError

H, HT, INTER, V, VD = 32, 32, 48, 64, 16
USED = torch.tensor([0, 3, 4, 7, 9, 12, 20, 21, 22, 30, 33, 40, 41, 50, 60, 63])  # the draft vocabulary

# Written by hand like the official trainer's config.json (no flags, no rope_theta, no capture ids).
OFFICIAL_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": H,
    "intermediate_size": INTER,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "vocab_size": V,
    "draft_vocab_size": VD,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float16",
}


def official_tensors(seed: int = 0, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The tensors an external EAGLE-3 trainer writes, under their raw names."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(dtype)

    def n(dim):
        return (1 + 0.2 * torch.randn(dim, generator=gen)).to(dtype)

    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[USED] = True
    return {
        "fc.weight": w(H, 3 * HT),
        "midlayer.input_layernorm.weight": n(H),
        "midlayer.hidden_norm.weight": n(H),
        "midlayer.self_attn.q_proj.weight": w(32, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(16, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(16, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, 32),
        "midlayer.post_attention_layernorm.weight": n(H),
        "midlayer.mlp.gate_proj.weight": w(INTER, H),
        "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "norm.weight": n(H),
        "lm_head.weight": w(VD, H),
        "d2t": USED - torch.arange(VD),
        "t2d": t2d,
    }


def write(path, config: dict, tensors: dict[str, torch.Tensor], fmt: str = "safetensors") -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(tensors, str(path / "model.safetensors"))
    else:
        torch.save(tensors, path / "pytorch_model.bin")


def file_keys(path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def assert_same_head(a, b) -> None:
    assert a.config == b.config
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def run_head(model, feats, ids):
    t = ids.shape[1]
    pos = torch.arange(t)[None].expand(ids.shape[0], t)
    allowed = torch.arange(t + 1)[None, None, :] <= pos[..., None]
    mask = torch.zeros(allowed.shape, dtype=feats.dtype).masked_fill(~allowed, float("-inf"))[:, None]
    out = model(ids, model.fuse(feats), pos, model.new_kv(ids.shape[0], t + 1), pos.clone(), mask)
    return model.logits(out.normed), out.feedback


# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
@pytest.mark.parametrize(
    "flags, dtype",
    [
        ({}, torch.float64),
        ({"fc_norm": True, "norm_output": True}, torch.bfloat16),
        ({"norm_before_fc": True, "norm_before_residual": True}, torch.float32),
        ({"norm_before_residual": False, "target_hidden_size": 24}, torch.float16),
    ],
    ids=["eagle3-f64", "eagle31-bf16", "nbf-nbr-f32", "ht24-f16"],
)
def test_save_load_round_trips_bit_for_bit(tiny, tmp_path, layout, flags, dtype):
    model = tiny.model(seed=3, dtype=dtype, **flags)
    save_draft(model, tmp_path, layout)
    keys = file_keys(tmp_path)
    layer_prefix = "midlayer." if layout == "eagle3" else "layers.0."
    layer_keys = [k for k in keys if "_proj" in k or "layernorm" in k or "hidden_norm" in k]
    assert len(layer_keys) == 10 and all(k.startswith(layer_prefix) for k in layer_keys)
    assert not any(k.startswith("embed_tokens") for k in keys)  # the target's table is never written
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == str(dtype).removeprefix("torch.")
    loaded = load_draft(tmp_path)
    assert_same_head(model, loaded)
    if model.config.target_hidden_size == model.config.hidden_size:
        loaded.tie_target_embedding(model.embed_tokens.weight)
        feats = tiny.features(model.config, 2, 4).to(dtype)
        ids = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(0))
        for a, b in zip(run_head(model, feats, ids), run_head(loaded, feats, ids), strict=True):
            assert torch.equal(a, b)


def test_speculators_round_trip_keeps_an_owned_embedding(tiny, tmp_path):
    model = tiny.model(seed=5)
    table = torch.randn(V, H, dtype=torch.float64)
    model.tie_target_embedding(table, owned=True)
    save_draft(model, tmp_path / "spec", "speculators")
    assert "embed_tokens.weight" in file_keys(tmp_path / "spec")
    loaded = load_draft(tmp_path / "spec")
    assert loaded.embed_tokens.owned and torch.equal(loaded.embed_tokens.weight, table)
    assert_same_head(model, loaded)
    save_draft(model, tmp_path / "official", "eagle3")
    assert "embed_tokens.weight" not in file_keys(tmp_path / "official")  # not a key of the official layout


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_hand_written_official_checkpoint_loads_and_runs(tiny, tmp_path, fmt):
    raw = official_tensors()
    write(tmp_path, OFFICIAL_CONFIG, raw, fmt)
    target = tiny.target(layers=8, vocab=V, hidden=HT)
    model = load_draft(tmp_path, target, dtype=torch.float64)

    cfg = model.config
    assert cfg.capture_indices == (2, 4, 5)  # the EAGLE-3 default (2, N//2, N-3) for the 8-layer target
    assert not (cfg.fc_norm or cfg.norm_output or cfg.norm_before_fc or cfg.norm_before_residual)
    assert cfg.rope_theta == 10000.0 and cfg.rms_norm_eps == 1e-5
    state = model.state_dict()
    assert state.keys() == raw.keys()
    for k, v in raw.items():
        assert torch.equal(state[k], v.to(torch.float64) if v.is_floating_point() else v), k
    assert model.embed_tokens.weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()

    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[k] for k in cfg.capture_indices], dim=-1)  # capture index k < N: hidden_states
        # draft input pairs: (feature at p, token at p + 1)
        logits, feedback = run_head(model, feats[:, :5], ids[:, 1:])
    assert logits.shape == (1, 5, VD) and torch.isfinite(logits).all() and torch.isfinite(feedback).all()
    proposed = model.draft_to_target(logits.argmax(-1))
    assert bool(torch.isin(proposed, USED).all())


def test_hand_written_speculators_checkpoint_loads(tiny, tmp_path):
    raw = {k.replace("midlayer.", "layers.0."): v for k, v in official_tensors(dtype=torch.bfloat16).items()}
    raw["embed_tokens.weight"] = torch.randn(V, H).to(torch.bfloat16)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": VD,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [1, 4, 7],
        "transformer_layer_config": {
            "model_type": "llama",
            "hidden_size": H,
            "intermediate_size": INTER,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 1,
            "vocab_size": V,
        },
        "speculators_config": {"algorithm": "eagle3", "proposal_methods": [], "verifier": {}},
    }
    write(tmp_path, config, raw)
    model = load_draft(tmp_path)
    assert model.config.norm_before_residual  # absent in a speculators config -> True (§2.4)
    assert model.config.capture_indices == (1, 4, 7) and model.lm_head.weight.dtype == torch.bfloat16
    assert model.embed_tokens.owned and torch.equal(model.embed_tokens.weight, raw["embed_tokens.weight"])
    assert torch.equal(model.midlayer.self_attn.q_proj.weight, raw["layers.0.self_attn.q_proj.weight"])


def test_nemo_model_prefix_and_full_vocabulary_without_mapping(tiny, tmp_path):
    raw = official_tensors()
    del raw["d2t"], raw["t2d"]
    gen = torch.Generator().manual_seed(1)
    raw["lm_head.weight"] = torch.randn(V, H, generator=gen).to(torch.float16)
    raw = {("model." + k if k != "lm_head.weight" else k): v for k, v in raw.items()}
    config = {**OFFICIAL_CONFIG, "draft_vocab_size": V, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    write(tmp_path, config, raw)
    model = load_draft(tmp_path)
    assert torch.equal(model.d2t, torch.zeros(V, dtype=torch.int64)) and model.t2d.all()
    assert torch.equal(model.fc.weight, raw["model.fc.weight"])


def test_null_draft_vocab_takes_lm_head_from_the_target(tiny, tmp_path):
    raw = official_tensors()
    for k in ("lm_head.weight", "d2t", "t2d"):
        del raw[k]
    write(tmp_path, {**OFFICIAL_CONFIG, "draft_vocab_size": None}, raw)
    target = tiny.target(layers=8, vocab=V, hidden=HT)
    model = load_draft(tmp_path, target, dtype=torch.float64)
    assert torch.equal(model.lm_head.weight, target.lm_head.weight)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_draft(tmp_path, num_target_layers=8)  # without a target there is nothing to take it from


# ---------------------------------------------------------------------------------------------------------
def _broken(name):
    raw, config = official_tensors(), {**OFFICIAL_CONFIG, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
    if name == "missing key":
        del raw["midlayer.hidden_norm.weight"]
        return raw, config, ["missing keys", "'midlayer.hidden_norm.weight'"]
    if name == "unexpected key":
        raw["midlayer.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        return raw, config, ["unexpected keys", "'midlayer.self_attn.rotary_emb.inv_freq'"]
    if name == "mis-shaped key":
        raw["midlayer.self_attn.q_proj.weight"] = torch.zeros(32, H, dtype=torch.float16)  # H, not 2H, inputs
        return raw, config, ["midlayer.self_attn.q_proj.weight", "shape [32, 32]", "expected [32, 64]"]
    if name == "fc width":
        raw["fc.weight"] = torch.zeros(H, 2 * HT, dtype=torch.float16)
        return raw, config, ["fc.weight", "[32, 64]", "expected [32, 96]", "3 features"]
    if name == "fc_norm weights without the flag":
        for i in range(3):
            raw[f"fc_norm.{i}.weight"] = torch.ones(HT, dtype=torch.float16)
        return raw, config, ["'fc_norm.0.weight'", "fc_norm: true"]
    if name == "input_norm without the flag":
        raw["input_norm.weight"] = torch.ones(3 * HT, dtype=torch.float16)
        return raw, config, ["'input_norm.weight'", "norm_before_fc: true"]
    if name == "flag without its weights":
        return raw, {**config, "fc_norm": True}, ["missing keys", "'fc_norm.0.weight'", "'fc_norm.2.weight'"]
    if name == "extra decoder layer":
        raw["layers.1.mlp.up_proj.weight"] = torch.zeros(INTER, H, dtype=torch.float16)
        return raw, config, ["'layers.1.mlp.up_proj.weight'", "single-layer"]
    if name == "same layer twice":
        raw["layers.0.hidden_norm.weight"] = raw["midlayer.hidden_norm.weight"].clone()
        return raw, config, ["twice", "midlayer.hidden_norm.weight"]
    if name == "negative d2t":
        raw["d2t"] = raw["d2t"].clone()
        raw["d2t"][3] = -10
        return raw, config, ["negative", "sign"]
    if name == "missing d2t":
        del raw["d2t"]
        return raw, config, ["no d2t", "reduced"]
    if name == "t2d count":
        raw["t2d"] = raw["t2d"].clone()
        raw["t2d"][1] = True
        return raw, config, ["t2d", "count"]
    if name == "embed_tokens shape":
        raw["embed_tokens.weight"] = torch.zeros(V, H + 1)
        return raw, config, ["embed_tokens.weight", "[64, 33]", "[64, 32]"]
    if name == "integer weight":
        raw["norm.weight"] = torch.ones(H, dtype=torch.int64)
        return raw, config, ["norm.weight", "not floating-point"]
    if name == "capture ids out of range":
        return raw, {**config, "eagle_aux_hidden_state_layer_ids": [2, 4, 40]}, ["[40]", "outside"]
    raise AssertionError(name)


BROKEN = [
    "missing key",
    "unexpected key",
    "mis-shaped key",
    "fc width",
    "fc_norm weights without the flag",
    "input_norm without the flag",
    "flag without its weights",
    "extra decoder layer",
    "same layer twice",
    "negative d2t",
    "missing d2t",
    "t2d count",
    "embed_tokens shape",
    "integer weight",
    "capture ids out of range",
]


@pytest.mark.parametrize("name", BROKEN)
def test_broken_checkpoints_are_refused_naming_the_problem(tmp_path, name):
    raw, config, words = _broken(name)
    write(tmp_path, config, raw)
    with pytest.raises(CheckpointError) as info:
        load_draft(tmp_path, num_target_layers=8)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_capture_indices_need_a_target_or_the_config(tiny, tmp_path):
    write(tmp_path, OFFICIAL_CONFIG, official_tensors())
    with pytest.raises(CheckpointError, match="num_target_layers"):
        load_draft(tmp_path)
    assert load_draft(tmp_path, num_target_layers=8).config.capture_indices == (2, 4, 5)
    assert load_draft(tmp_path, num_target_layers=32).config.capture_indices == (2, 16, 29)
    with pytest.raises(CheckpointError, match="contradicts"):
        load_draft(tmp_path, tiny.target(layers=8), num_target_layers=9)


def test_target_that_does_not_match_is_refused(tiny, tmp_path):
    write(tmp_path, OFFICIAL_CONFIG, official_tensors())
    with pytest.raises(CheckpointError, match="vocab_size 80"):
        load_draft(tmp_path, tiny.target(vocab=80))
    with pytest.raises(CheckpointError, match="hidden_size 48"):
        load_draft(tmp_path, tiny.target(hidden=48))


def test_missing_files_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_draft(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(OFFICIAL_CONFIG))
    with pytest.raises(CheckpointError, match="no weights"):
        load_draft(tmp_path, num_target_layers=8)


def test_save_refuses_unknown_layout(tiny, tmp_path):
    with pytest.raises(ValueError, match="'vllm'"):
        save_draft(tiny.model(), tmp_path, "vllm")
