"""Heads refused with errors that name the file, the mismatch and the fix: NaN/inf weights, weights that overflow
the dtype asked for, truncated or corrupt weight files, missing folders and shards, heads made for another
target; and an official config without num_hidden_layers, which is the one-layer head the official loader
builds (SafeAILab EAGLE's EAGLE-3 `Model` has one `midlayer` whatever the key says)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_draft_checkpoint import OFFICIAL_CONFIG, V, official_tensors, run_head, write
from transformers import LlamaConfig

import eagle_compile
from eagle_compile.draft import load_draft, save_draft
from eagle_compile.errors import CheckpointError

CONFIG = {**OFFICIAL_CONFIG, "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}


def _refused(path, *words, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        load_draft(path, **kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    return message


# -- weights that are not numbers -------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_weights_are_refused_naming_the_tensor(tmp_path, value):
    raw = official_tensors()
    raw["midlayer.mlp.up_proj.weight"][3, :5] = value
    raw["norm.weight"][0] = value
    write(tmp_path, CONFIG, raw)
    # load_state_dict takes NaN like any other value: without the check the head loads, runs, and every
    # proposal is garbage (verification keeps the output exact, so acceptance would just silently collapse).
    assert not torch.isfinite(load_file(str(tmp_path / "model.safetensors"))["norm.weight"]).all()
    _refused(tmp_path, str(tmp_path / "model.safetensors"), "'midlayer.mlp.up_proj.weight'", "5 NaN/inf values",
             "also NaN/inf: ['norm.weight']", "another checkpoint")


def test_weights_that_overflow_the_requested_dtype_are_refused_with_the_dtype_to_use(tmp_path):
    raw = official_tensors(dtype=torch.float32)
    raw["fc.weight"][0, 0] = 1e6                      # finite in float32, inf in float16
    write(tmp_path, CONFIG, raw)
    _refused(tmp_path, "['fc.weight']", "finite in the file (torch.float32)", "overflow torch.float16", "1e+06",
             "dtype=torch.float32 or torch.bfloat16", dtype=torch.float16)
    # negative control: the same file in float32 (the check sees exactly what the head would hold)
    assert load_draft(tmp_path, dtype=torch.float32).fc.weight[0, 0] == 1e6


def test_an_owned_embedding_with_nan_is_refused(tiny, tmp_path):
    model = tiny.model(seed=5)
    table = torch.randn(V, 32, dtype=torch.float64)
    table[7, 1] = float("nan")
    model.tie_target_embedding(table, owned=True)
    save_draft(model, tmp_path, "speculators")
    _refused(tmp_path, "'embed_tokens.weight'", "1 NaN/inf values")


# -- files that cannot be read ----------------------------------------------------------------------------------
def _cut(file, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_truncated_weight_files_are_refused_naming_the_file(tmp_path, fmt):
    write(tmp_path, CONFIG, official_tensors(), fmt)
    file = tmp_path / ("model.safetensors" if fmt == "safetensors" else "pytorch_model.bin")
    _cut(file)
    # negative control: the loaders' own errors do not say which file (safetensors: "incomplete metadata, file
    # not fully covered"; torch.load of a cut zip: "[Errno 22] Invalid argument")
    with pytest.raises(Exception) as bare:
        load_file(str(file)) if fmt == "safetensors" else torch.load(file, weights_only=True)
    assert str(file) not in str(bare.value) and not isinstance(bare.value, CheckpointError)
    _refused(tmp_path, str(file), "truncated or corrupt", "download or save it again", type(bare.value).__name__)


def test_a_file_that_is_not_safetensors_is_refused(tmp_path):
    write(tmp_path, CONFIG, official_tensors())
    (tmp_path / "model.safetensors").write_bytes(b"<html>404 Not Found</html>")     # a failed download
    _refused(tmp_path, str(tmp_path / "model.safetensors"), "26 bytes", "truncated or corrupt")


def test_shards_missing_or_a_broken_index_are_refused(tmp_path):
    write(tmp_path, CONFIG, official_tensors())
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00002.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    weight_map = {"fc.weight": "model-00001-of-00002.safetensors", "norm.weight": "model-00002-of-00002.safetensors"}
    index.write_text(json.dumps({"weight_map": weight_map}))
    _refused(tmp_path, str(index), "model-00002-of-00002.safetensors", "download every shard")
    index.write_text('{"weight_map": {"fc.weight": ')            # cut short
    _refused(tmp_path, str(index), "not a safetensors index")


def test_missing_folder_or_a_file_given_as_the_folder_are_refused(tmp_path):
    _refused(tmp_path / "nowhere", "does not exist")
    write(tmp_path, CONFIG, official_tensors())
    _refused(tmp_path / "model.safetensors", "is a file", "pass the folder")
    (tmp_path / "config.json").unlink()
    _refused(tmp_path, "no config.json")


# -- heads made for another target -------------------------------------------------------------------------------
def test_a_head_for_another_target_is_refused_naming_its_config(tiny, tmp_path):
    write(tmp_path, OFFICIAL_CONFIG, official_tensors())
    _refused(tmp_path, str(tmp_path / "config.json"), "vocab_size 80", "use the head made for this target",
             target=tiny.target(vocab=80))
    _refused(tmp_path, str(tmp_path / "config.json"), "hidden_size 48", target=tiny.target(hidden=48))


def test_a_head_object_for_another_target_is_refused_by_generate(tiny):
    """An `EagleDraftModel` handed to generate is checked against the target as a folder is, before any program
    is captured."""
    head = tiny.model(seed=1, vocab_size=96, capture_indices=(2, 4, 5))      # made for a 96-token target
    target = tiny.target(vocab=V)
    # without the check its proposals reach the target's embedding: an IndexError deep inside the first verify
    # forward on CPU, a device-side assert on a GPU
    proposable = int((head.d2t + torch.arange(len(head.d2t))).max())
    assert proposable >= V
    with pytest.raises(IndexError):
        target.model.embed_tokens(torch.tensor([proposable]))
    with pytest.raises(CheckpointError, match=r"the EagleDraftModel given as draft=: .*vocabulary of 96 ids"):
        eagle_compile.generate(target, torch.tensor([[5, 6, 7]]), draft=head, max_new_tokens=2)
    # the hidden size too (the head's fc would refuse 48-wide features only once the programs were captured)
    with pytest.raises(CheckpointError, match=r"expects target features of width 32 .*hidden_size 48"):
        eagle_compile.generate(tiny.target(vocab=96, hidden=48), torch.tensor([[5, 6, 7]]), draft=head,
                               max_new_tokens=2)


# -- the layer count of an official config -----------------------------------------------------------------------
def test_an_official_config_without_num_hidden_layers_is_the_one_layer_head(tiny, tmp_path):
    raw = official_tensors(dtype=torch.float64)
    stated = {k: v for k, v in CONFIG.items() if k != "num_hidden_layers"}
    write(tmp_path / "omitted", stated, raw)
    write(tmp_path / "stated", CONFIG, raw)
    # an absent key used to mean transformers' default, 32 layers: refused (see the test below)
    assert LlamaConfig().num_hidden_layers == 32
    omitted, one = load_draft(tmp_path / "omitted"), load_draft(tmp_path / "stated")
    assert omitted.config.num_hidden_layers == 1 and omitted.config == one.config
    table = torch.randn(V, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for head in (omitted, one):
        head.tie_target_embedding(table)
    feats = tiny.features(one.config, 1, 5)
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(1))
    for a, b in zip(run_head(omitted, feats, ids), run_head(one, feats, ids), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layers", [2, 32, 0])
def test_an_official_config_stating_more_layers_is_refused_with_the_fix(tmp_path, layers):
    write(tmp_path, {**CONFIG, "num_hidden_layers": layers}, official_tensors())
    _refused(tmp_path, str(tmp_path), f"num_hidden_layers: {layers}", "exactly one decoder layer",
             "set num_hidden_layers to 1", "multi-layer drafts")
