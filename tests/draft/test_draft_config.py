"""DraftConfig: validation, both config.json layouts, capture-index semantics, derivation from a target."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from eagle_compile.draft import DraftConfig
from eagle_compile.errors import CheckpointError

# An official EAGLE-3 config.json as the trainer writes it (EAGLE31_SPEC §3.1): no flags, no rope_theta,
# no capture ids.
OFFICIAL = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "vocab_size": 128,
    "draft_vocab_size": 32,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float16",
}

# A speculators config.json: transformer_layer_config written with to_diff_dict (LlamaConfig defaults
# such as rms_norm_eps=1e-6 and rope_theta=10000 are absent), no norm_before_residual key.
SPECULATORS = {
    "architectures": ["Eagle3Speculator"],
    "speculators_model_type": "eagle3",
    "speculators_version": "0.3.0",
    "draft_vocab_size": 32,
    "norm_before_fc": False,
    "target_hidden_size": None,
    "eagle_aux_hidden_state_layer_ids": [2, 16, 29],
    "transformer_layer_config": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 128,
    },
    "speculators_config": {
        "algorithm": "eagle3",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
        "default_proposal_method": "greedy",
        "verifier": {
            "name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
            "architectures": ["LlamaForCausalLM"],
        },
    },
}


def test_official_config_defaults():
    cfg = DraftConfig.from_hf_dict(OFFICIAL)
    assert not (cfg.fc_norm or cfg.norm_output or cfg.norm_before_fc or cfg.norm_before_residual)
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None  # §1.5: absent -> base 10000
    assert cfg.capture_indices is None  # the target's default, resolved later
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads) == (64, 16, 2)
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.target_hidden_size) == (128, 32, 64)
    assert cfg.rms_norm_eps == 1e-05 and cfg.use_aux_hidden_state
    resolved = DraftConfig.from_hf_dict(OFFICIAL, num_target_layers=32)
    assert resolved.capture_indices == (2, 16, 29)


def test_missing_draft_vocab_size_means_full_vocabulary():
    d = {k: v for k, v in OFFICIAL.items() if k != "draft_vocab_size"}
    assert DraftConfig.from_hf_dict(d).draft_vocab_size == 128
    assert DraftConfig.from_hf_dict({**OFFICIAL, "draft_vocab_size": None}).draft_vocab_size == 128


def test_capture_ids_are_capture_indices_top_level_then_nested():
    top = DraftConfig.from_hf_dict({**OFFICIAL, "eagle_aux_hidden_state_layer_ids": [1, 5, 9]}, 12)
    assert top.capture_indices == (1, 5, 9)  # used as given: no +1 (SGLang-style) shift
    nested = DraftConfig.from_hf_dict(
        {**OFFICIAL, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [24, 30, 36]}}, 36
    )
    assert nested.capture_indices == (24, 30, 36)  # 36 = the last layer's pre-norm output
    both = {
        **OFFICIAL,
        "eagle_aux_hidden_state_layer_ids": [3],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [4]},
    }
    assert DraftConfig.from_hf_dict(both, 8).capture_indices == (3,)
    assert DraftConfig.from_hf_dict(both).capture_indices == (3,)  # without the layer count too
    assert DraftConfig.from_speculators_dict(SPECULATORS, 32).capture_indices == (2, 16, 29)
    with pytest.raises(CheckpointError, match=r"outside \[0, 8\]"):
        DraftConfig.from_hf_dict({**OFFICIAL, "eagle_aux_hidden_state_layer_ids": [2, 4, 9]}, 8)


def test_nested_flags_are_read_and_conflicts_refused():
    cfg = DraftConfig.from_hf_dict({**OFFICIAL, "eagle_config": {"norm_before_fc": True}})
    assert cfg.norm_before_fc
    with pytest.raises(
        CheckpointError, match="norm_before_fc=True at the top level but norm_before_fc=False"
    ):
        DraftConfig.from_hf_dict(
            {**OFFICIAL, "norm_before_fc": True, "eagle_config": {"norm_before_fc": False}}
        )


def test_speculators_defaults_norm_before_residual_true_and_llama_defaults():
    cfg = DraftConfig.from_speculators_dict(SPECULATORS)
    assert cfg.norm_before_residual  # §2.4: absent in a speculators config -> True
    assert not (cfg.fc_norm or cfg.norm_output or cfg.norm_before_fc)
    assert cfg.rms_norm_eps == 1e-6 and cfg.rope_theta == 10000.0 and cfg.max_position_embeddings == 2048
    off = DraftConfig.from_speculators_dict({**SPECULATORS, "norm_before_residual": False})
    assert not off.norm_before_residual
    assert DraftConfig.from_hf_dict(OFFICIAL).norm_before_residual is False  # HF style: absent -> False


def test_speculators_refuses_other_layer_types_and_algorithms():
    qwen = {
        **SPECULATORS,
        "transformer_layer_config": {**SPECULATORS["transformer_layer_config"], "model_type": "qwen3"},
    }
    with pytest.raises(CheckpointError, match="qwen3"):
        DraftConfig.from_speculators_dict(qwen)
    with pytest.raises(CheckpointError, match="'eagle'"):
        DraftConfig.from_speculators_dict({**SPECULATORS, "speculators_model_type": "eagle"})


def test_rope_settings_are_read_in_every_spelling():
    legacy = DraftConfig.from_hf_dict(
        {**OFFICIAL, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert legacy.rope_theta == 500000.0 and legacy.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    v5 = DraftConfig.from_hf_dict(
        {**OFFICIAL, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}}
    )
    assert v5 == legacy
    assert DraftConfig.from_hf_dict({**OFFICIAL, "rope_theta": None}).rope_theta == 10000.0


FLAG_NAMES = ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")


@pytest.mark.parametrize(
    "bits", [b for b in itertools.product([False, True], repeat=4) if not (b[0] and b[2])]
)
def test_both_layouts_round_trip_every_flag(bits):
    flags = dict(zip(FLAG_NAMES, bits, strict=True))
    cfg = DraftConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        draft_vocab_size=32,
        target_hidden_size=48,
        capture_indices=(2, 5, 7),
        rope_theta=123456.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        **flags,
    )
    official = cfg.to_hf_dict()
    for name, value in flags.items():
        assert official[name] is value  # written explicitly, never left to a default
    assert DraftConfig.from_hf_dict(official) == cfg
    assert DraftConfig.from_hf_dict(official, 8) == cfg
    spec = cfg.to_speculators_dict()
    for name, value in flags.items():
        assert spec[name] is value
    assert DraftConfig.from_speculators_dict(spec) == cfg


def test_official_dict_layout():
    cfg = DraftConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        vocab_size=128,
        draft_vocab_size=32,
        capture_indices=(2, 16, 29),
        fc_norm=True,
        norm_output=True,
    )
    d = cfg.to_hf_dict(torch_dtype="bfloat16")
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["model_type"] == "llama"
    assert d["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    assert "eagle_config" not in d  # ids never nested: SGLang would add +1 to them (§9.1)
    assert "target_hidden_size" not in d  # official EAGLE reads its presence as "own embedding"
    assert d["rope_theta"] == 10000.0 and d["num_hidden_layers"] == 1 and d["torch_dtype"] == "bfloat16"
    assert (d["draft_vocab_size"], d["vocab_size"], d["head_dim"]) == (32, 128, 16)
    single = DraftConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        vocab_size=128,
        use_aux_hidden_state=False,
    ).to_hf_dict()
    assert single["eagle_config"] == {"use_aux_hidden_state": False}
    assert DraftConfig.from_hf_dict(single, 10).capture_indices == (10,)


def test_speculators_dict_layout():
    cfg = DraftConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        vocab_size=128,
        draft_vocab_size=32,
        capture_indices=(2, 16, 29),
    )
    d = cfg.to_speculators_dict(speculative_tokens=5, verifier_name_or_path="org/target")
    assert d["speculators_model_type"] == "eagle3" and d["architectures"] == ["Eagle3Speculator"]
    assert d["transformer_layer_config"]["model_type"] == "llama"
    assert d["transformer_layer_config"]["vocab_size"] == 128
    assert d["target_hidden_size"] is None and d["eagle_aux_hidden_state_layer_ids"] == [2, 16, 29]
    sc = d["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 5
    assert sc["verifier"]["name_or_path"] == "org/target"


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(fc_norm=True, norm_before_fc=True), ["mutually exclusive", "§9.3"]),
        (dict(hidden_act="gelu"), ["'gelu'", "silu"]),
        (dict(num_hidden_layers=2), ["num_hidden_layers=2", "single-layer"]),
        (dict(num_key_value_heads=3), ["not a multiple"]),
        (dict(draft_vocab_size=200), ["200", "subset"]),
        (dict(capture_indices=(2, 2, 5)), ["distinct"]),
        (dict(use_aux_hidden_state=False, fc_norm=True), ["no fc"]),
        (dict(use_aux_hidden_state=False, target_hidden_size=32), ["must be equal"]),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ["rope_scaling", "low_freq_factor"]),
    ],
)
def test_invalid_configs_are_refused(overrides, words):
    base = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=128)
    with pytest.raises(ValueError) as info:
        DraftConfig(**{**base, **overrides})
    for word in words:
        assert word in str(info.value)


def test_unsupported_official_configs_raise_checkpoint_errors():
    with pytest.raises(CheckpointError, match="mutually exclusive"):
        DraftConfig.from_hf_dict({**OFFICIAL, "fc_norm": True, "norm_before_fc": True})
    with pytest.raises(CheckpointError, match="model_type 'qwen3'"):
        DraftConfig.from_hf_dict({**OFFICIAL, "model_type": "qwen3"})
    with pytest.raises(CheckpointError, match="bias"):
        DraftConfig.from_hf_dict({**OFFICIAL, "bias": True})


def test_config_is_frozen_and_hashable():
    cfg = DraftConfig.from_hf_dict({**OFFICIAL, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.fc_norm = True
    assert hash(cfg) == hash(
        DraftConfig.from_hf_dict({**OFFICIAL, "rope_scaling": {"type": "linear", "factor": 2.0}})
    )


@pytest.mark.parametrize("cls", [LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig])
def test_for_target_copies_the_target_shapes_and_rope(cls):
    target = cls(
        vocab_size=100,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=10,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    cfg = DraftConfig.for_target(target, 40, fc_norm=True, norm_output=True)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads) == (48, 80, 6)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.target_hidden_size) == (2, 8, 48)
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.num_hidden_layers) == (100, 40, 1)
    assert cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 4096
    assert cfg.capture_indices == (2, 5, 7) and cfg.fc_norm and cfg.norm_output
    assert DraftConfig.for_target(target, None, capture_indices=(1, 2)).capture_indices == (1, 2)
    with pytest.raises(ValueError, match="unknown DraftConfig fields"):
        DraftConfig.for_target(target, 40, fc_nrom=True)
