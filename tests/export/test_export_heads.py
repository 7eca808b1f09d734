"""export_head: the fields vLLM, SGLang and speculators read, round trips through load_draft, refusals.

Each engine fact asserted below cites the source file it was read from (repository and path). The files
were read as stored in the public code index in 2026; vLLM and SGLang change fast, so a failing engine load
after an upgrade should be checked against the same files first.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tiny import tiny_target

from eagle_compile.draft import DraftConfig, EagleDraftModel, build_vocab_mapping, load_draft
from eagle_compile.errors import ExportError
from eagle_compile.export import ENGINES, export_head

LAYERS = 8  # tiny_target: capture indices (2, 4, 5); hidden 32, vocab 96
FLAG_SETS = {
    "eagle3": {},
    "eagle31": {"fc_norm": True, "norm_output": True},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True},
}


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=LAYERS)


def make_head(target, *, seed: int = 0, draft_vocab: int | None = 48, **fields) -> EagleDraftModel:
    """A random head for ``target``: every weight random (norm weights around 1), a reduced vocabulary."""
    cfg = DraftConfig.for_target(target.config, draft_vocab, **fields)
    head = EagleDraftModel(cfg).to(torch.float64).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 else noise / p.shape[1] ** 0.5)
        if cfg.draft_vocab_size < cfg.vocab_size:
            d2t, t2d = build_vocab_mapping(torch.randint(0, 1000, (cfg.vocab_size,), generator=gen),
                                           cfg.draft_vocab_size)
            head.d2t.copy_(d2t)
            head.t2d.copy_(t2d)
    head.tie_target_embedding(target)
    return head


def read(out):
    config = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return config, tensors


def assert_same_head(loaded: EagleDraftModel, head: EagleDraftModel) -> None:
    assert loaded.config == head.config
    mine, theirs = head.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    for key, value in mine.items():
        assert theirs[key].dtype == value.dtype, key
        assert torch.equal(theirs[key], value), key


# ----------------------------------------------------------------------------------------------------
# SGLang refuses norm_before_residual and norm_before_fc (test_sglang_refuses_flags_it_never_reads)
@pytest.mark.parametrize(("engine", "flags"), [(e, f) for e in ENGINES for f in FLAG_SETS
                                               if e != "sglang" or f in ("eagle3", "eagle31")])
def test_round_trip_through_load_draft(target, tmp_path, engine, flags):
    head = make_head(target, **FLAG_SETS[flags])
    out = export_head(head, tmp_path / engine, engine, num_target_layers=LAYERS)
    assert_same_head(load_draft(out, target=target), head)


def test_vllm_fields(target, tmp_path):
    head = make_head(target, fc_norm=True, norm_output=True)
    config, tensors = read(export_head(head, tmp_path / "h", "vllm", num_target_layers=LAYERS))
    h, vd, v = 32, 48, 96
    # vllm-project/vllm vllm/model_executor/models/registry.py: "LlamaForCausalLMEagle3" -> llama_eagle3.py,
    # Eagle3LlamaForCausalLM; vllm/transformers_utils/configs/eagle.py keeps a name ending in "Eagle3"
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    # vllm-project/vllm vllm/v1/worker/gpu_model_runner.py (_get_eagle3_aux_layers_from_config): the top-level
    # key first, then eagle_config; vllm/model_executor/models/llama.py appends hidden_states + residual
    # before running layer idx, i.e. our capture index (eagle_compile/capture_indices.py), no shift
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert "eagle_config" not in config
    # vllm-project/vllm vllm/model_executor/models/llama_eagle3.py (LlamaModel.__init__): fc width is
    # target_hidden_size * num_aux_hidden_states, the count read from num_aux_hidden_states, else 3
    assert config["num_aux_hidden_states"] == 3
    assert "target_hidden_size" not in config  # llama_eagle3.py: getattr(..., hidden_size) when absent
    # llama_eagle3.py reads each flag with getattr(config, name, False) (norm_before_fc: eagle_config first)
    assert {k: config[k] for k in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")} == {
        "fc_norm": True, "norm_output": True, "norm_before_fc": False, "norm_before_residual": False}
    # llama_eagle3.py (Eagle3LlamaForCausalLM): lm_head and the d2t scatter are sized by draft_vocab_size
    assert config["draft_vocab_size"] == vd and config["vocab_size"] == v
    assert config["tie_word_embeddings"] is False
    # llama_eagle3.py load_weights: midlayer. -> layers.0., d2t -> draft_id_to_target_id (torch.long,
    # offsets: target = arange + d2t), t2d skipped, embed_tokens optional (shared from the target when absent)
    assert all(k.startswith(("fc.", "fc_norm.", "midlayer.", "norm.", "lm_head.", "d2t", "t2d")) for k in tensors)
    assert "embed_tokens.weight" not in tensors
    assert tensors["fc.weight"].shape == (h, 3 * h)
    assert [tuple(tensors[f"fc_norm.{i}.weight"].shape) for i in range(3)] == [(h,)] * 3
    assert tensors["lm_head.weight"].shape == (vd, h)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (vd,)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (v,)
    assert torch.equal(torch.arange(vd) + tensors["d2t"], torch.nonzero(tensors["t2d"]).flatten())


def test_sglang_fields(target, tmp_path):
    head = make_head(target, fc_norm=True, norm_output=True)
    config, tensors = read(export_head(head, tmp_path / "h", "sglang", num_target_layers=LAYERS))
    # sgl-project/sglang python/sglang/srt/models/llama_eagle3.py: EntryClass = [LlamaForCausalLMEagle3]
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    # sgl-project/sglang python/sglang/srt/model_executor/model_runner.py reads
    # eagle_config["eagle_aux_hidden_state_layer_ids"] only; python/sglang/srt/models/llama.py
    # (set_eagle3_layers_to_capture) captures layer id + 1, and its layer loop appends hidden_states + residual
    # before layer i, i.e. capture index id + 1
    assert [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]] == [2, 4, 5]
    assert config["eagle_config"]["use_aux_hidden_state"] is True
    # the top level keeps our convention for load_draft and vLLM (they read it before eagle_config)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    # llama_eagle3.py (LlamaModel.__init__): num_aux_hidden_states, else len(eagle_config ids), else 3;
    # fc_norm and norm_output read with getattr(config, ...); the input layer always takes the un-normalised
    # hidden state as its residual (no norm_before_residual)
    assert config["num_aux_hidden_states"] == 3
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert config["norm_before_residual"] is False and config["norm_before_fc"] is False
    # llama_eagle3.py (LlamaForCausalLMEagle3.__init__): draft_vocab_size null would load the target's
    # lm_head, tie_word_embeddings would reuse embed_tokens as lm_head
    assert config["draft_vocab_size"] == 48 and config["tie_word_embeddings"] is False
    # llama_eagle3.py load_weights: older releases hold a `midlayer` module, newer ones map midlayer ->
    # layers.0; unknown names are skipped silently; d2t becomes hot_token_id = d2t + arange; t2d skipped
    assert any(k.startswith("midlayer.") for k in tensors) and not any(k.startswith("layers.") for k in tensors)
    assert tensors["d2t"].dtype == torch.int64
    assert "embed_tokens.weight" not in tensors   # sglang eagle_worker.py: set_embed(target's embedding)


def test_speculators_fields(target, tmp_path):
    head = make_head(target, fc_norm=True, norm_output=True)
    out = export_head(head, tmp_path / "h", "speculators", num_target_layers=LAYERS,
                      verifier_name_or_path="org/tiny", verifier_architectures=["LlamaForCausalLM"],
                      speculative_tokens=5)
    config, tensors = read(out)
    # vllm-project/speculators src/speculators/models/eagle3/config.py (Eagle3SpeculatorConfig)
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == 48
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    # speculators' config defaults norm_before_residual to False, vLLM's
    # vllm/transformers_utils/configs/speculators/algos.py (update_eagle3) to True: written explicitly
    assert config["norm_before_residual"] is False
    assert config["fc_norm"] is True and config["norm_output"] is True and config["norm_before_fc"] is False
    # vllm-project/vllm vllm/transformers_utils/configs/speculators/base.py builds the draft's config from
    # transformer_layer_config, then update_eagle3 adds the flags it knows (older releases: not fc_norm /
    # norm_output), so the 3.1 flags are repeated there
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 96
    assert layer["fc_norm"] is True and layer["norm_output"] is True and layer["norm_before_fc"] is False
    # base.py (validate_speculators_config): proposal_methods[0].speculative_tokens and verifier.name_or_path
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"] == {"name_or_path": "org/tiny", "architectures": ["LlamaForCausalLM"]}
    # speculators core.py (Eagle3DraftModel): decoder layers in self.layers (layers.0.*), fc of
    # num_aux * hidden_size, fc_norm per feature; model.py (DraftVocabMixin): d2t long [Vd], t2d bool [V]
    assert any(k.startswith("layers.0.") for k in tensors) and not any(k.startswith("midlayer.") for k in tensors)
    assert tensors["fc.weight"].shape == (32, 96)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool


def test_speculators_full_vocabulary_has_no_mapping(target, tmp_path):
    # speculators model.py (DraftVocabMixin._init_vocab) registers d2t/t2d only for a reduced vocabulary
    head = make_head(target, draft_vocab=None)
    out = export_head(head, tmp_path / "h", "speculators", num_target_layers=LAYERS)
    assert not {"d2t", "t2d"} & set(read(out)[1])
    assert_same_head(load_draft(out, target=target), head)


def test_head_with_its_own_embedding(target, tmp_path):
    head = make_head(target)
    head.tie_target_embedding(torch.randn(96, 32, dtype=torch.float64), owned=True)
    for engine in ("vllm", "speculators"):
        # vllm-project/vllm llama_eagle3.py load_weights loads embed_tokens when the checkpoint has it
        out = export_head(head, tmp_path / engine, engine, num_target_layers=LAYERS)
        loaded = load_draft(out, target=target)
        assert loaded.embed_tokens.owned and torch.equal(loaded.embed_tokens.weight, head.embed_tokens.weight)
    # sgl-project/sglang python/sglang/srt/speculative/eagle_worker.py: EAGLE-3 drafts get set_embed(target's)
    with pytest.raises(ExportError, match="SGLang replaces"):
        export_head(head, tmp_path / "sglang", "sglang", num_target_layers=LAYERS)


def test_distinct_target_width(tmp_path):
    cfg = DraftConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=96, draft_vocab_size=48, target_hidden_size=40, capture_indices=(2, 4, 5))
    head = EagleDraftModel(cfg).to(torch.float64)
    with pytest.raises(ExportError, match="carries no embed_tokens"):
        export_head(head, tmp_path / "a", "vllm", num_target_layers=LAYERS)
    head.tie_target_embedding(torch.randn(96, 32, dtype=torch.float64), owned=True)
    out = export_head(head, tmp_path / "b", "vllm", num_target_layers=LAYERS)
    assert read(out)[0]["target_hidden_size"] == 40
    assert load_draft(out, num_target_layers=LAYERS).config == cfg
    # speculators core.py sizes fc (and fc_norm) from the draft's hidden_size, not target_hidden_size
    with pytest.raises(ExportError, match="speculators sizes fc"):
        export_head(head, tmp_path / "c", "speculators", num_target_layers=LAYERS)


# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["norm_before_residual", "norm_before_fc"])
def test_sglang_refuses_flags_it_never_reads(target, tmp_path, flag):
    # sgl-project/sglang python/sglang/srt/models/llama_eagle3.py: no norm_before_residual, no input_norm
    head = make_head(target, **{flag: True})
    with pytest.raises(ExportError, match=rf"{flag}=true cannot be exported for SGLang"):
        export_head(head, tmp_path / "h", "sglang", num_target_layers=LAYERS)
    assert not (tmp_path / "h").exists()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("indices", [(0, 4, 5), (2, 4, LAYERS)])
def test_capture_indices_outside_the_layer_loop_are_refused(target, tmp_path, engine, indices):
    # vllm llama.py and sglang llama.py capture inside `for idx in range(start_layer, end_layer)` with
    # hidden_states + residual (residual is None before layer 0): k = 0 and k = N never arrive
    head = make_head(target, capture_indices=indices)
    with pytest.raises(ExportError, match=r"capture indices \[\d\] .* 1\.\.N-1 = 1\.\.7"):
        export_head(head, tmp_path / "h", engine, num_target_layers=LAYERS)


def test_single_feature_head_is_refused(target, tmp_path):
    head = make_head(target, use_aux_hidden_state=False)
    with pytest.raises(ExportError, match="use_aux_hidden_state=false"):
        export_head(head, tmp_path / "h", "vllm", num_target_layers=LAYERS)


def test_destination_rules(target, tmp_path):
    head = make_head(target)
    out = export_head(head, tmp_path / "h", "vllm", num_target_layers=LAYERS)
    with pytest.raises(ExportError, match="already holds files"):
        export_head(head, out, "sglang", num_target_layers=LAYERS)
    export_head(head, out, "sglang", num_target_layers=LAYERS, overwrite=True)
    assert "eagle_config" in read(out)[0]
    loaded = load_draft(out, target=target)
    with pytest.raises(ExportError, match="folder the head was loaded from"):
        export_head(loaded, out, "vllm", num_target_layers=LAYERS, overwrite=True)
    with pytest.raises(ExportError, match="unknown export format 'onnx'"):
        export_head(head, tmp_path / "x", "onnx", num_target_layers=LAYERS)
