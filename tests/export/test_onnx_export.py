"""ONNX export (eagle_compile/export/onnx*.py) on a tiny float32 target, exported once for the module: the programs
equal their PyTorch counterparts, and the onnxruntime decode loop gives exactly the PyTorch greedy tokens (HF's and
eagle_compile.generate's with the same tree) for several trees, batch 1 and a ragged batch of 2, with the exported
draft (nothing accepted: a random head) and with an oracle drafter (every draft token accepted), and stops at EOS."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from tiny import ScriptedDrafter, greedy_reference, tiny_target

import eagle_compile
from eagle_compile.core.masks import SlotMask
from eagle_compile.core.tree import TreeShape, ancestor_matrix
from eagle_compile.draft.config import DraftConfig
from eagle_compile.draft.model import EagleDraftModel
from eagle_compile.draft.vocab import build_vocab_mapping
from eagle_compile.errors import OptionsError
from eagle_compile.export.onnx import MANIFEST, export_onnx
from eagle_compile.export.onnx_runtime import OnnxEagle, mask_feeds

LAYERS = 3
CAPTURE = (0, 2, 3)               # the embeddings, a middle layer, N: the last layer's output before the final norm
TREES = (TreeShape.chain(3), TreeShape(depth=3, top_k=3, total_tokens=8), TreeShape(depth=4, top_k=2, total_tokens=7))
NEW = 16


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = tiny_target(dtype=torch.float32, layers=LAYERS)
    cfg = DraftConfig.for_target(model.config, 48, fc_norm=True, norm_output=True, capture_indices=CAPTURE)
    torch.manual_seed(1)
    head = EagleDraftModel(cfg).float().eval()
    d2t, t2d = build_vocab_mapping(torch.randint(0, 1000, (model.config.vocab_size,)), 48)
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
    head.tie_target_embedding(model)
    out = tmp_path_factory.mktemp("onnx")
    manifest = export_onnx(model, head, out, tree={"chain": 3}, buckets=(1, 2, 4))
    return model, head, out, manifest, OnnxEagle(out, threads=1)


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def test_manifest_names_the_programs_and_their_tensors(exported):
    model, head, out, manifest, _ = exported
    assert json.loads((out / MANIFEST).read_text()) == manifest
    target = manifest["target"]
    assert list(target["inputs"])[:5] == ["input_ids", "position_ids", "mask_base", "mask_local", "write_slots"]
    assert list(target["inputs"])[5:7] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert list(target["outputs"])[:4] == ["logits", "features", "present.0.key", "present.0.value"]
    assert len(target["outputs"]) == 2 + 2 * LAYERS
    session = ort.InferenceSession(str(out / target["file"]), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(target["inputs"])
    assert [o.name for o in session.get_outputs()] == list(target["outputs"])
    assert manifest["capture_indices"] == list(CAPTURE) and manifest["feature_width"] == 3 * 32
    assert manifest["tree"]["depth"] == 3 and manifest["tree"]["top_k"] == 1
    assert manifest["buckets"]["batch"] == [1, 2, 4]
    assert manifest["opset"] == 18 and manifest["draft"]["draft_vocab_size"] == 48
    assert np.array_equal(np.load(out / manifest["d2t"]), head.d2t.numpy())


def test_target_program_equals_hf_forward_and_hidden_states(exported):
    """A prefill from an empty cache: ORT logits == HF logits, features == the capture-index residual streams."""
    model, _, out, manifest, runtime = exported
    ids = torch.tensor(_prompts([9]))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
        pre_norm = {}
        hook = model.model.layers[-1].register_forward_hook(
            lambda m, a, o: pre_norm.setdefault("x", o if isinstance(o, torch.Tensor) else o[0]))
        model(ids)
        hook.remove()
    from eagle_compile.export.onnx_runtime import OnnxKVCache

    cache = OnnxKVCache(LAYERS, 1, 2, 16, 8, torch.float32)
    pos = torch.arange(9)[None]
    logits, feats = runtime.target(ids, pos, SlotMask.causal(torch.zeros(1, dtype=torch.long), 16), pos, cache)
    streams = [ref.hidden_states[0], ref.hidden_states[2], pre_norm["x"]]
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(feats, torch.cat(streams, -1), atol=1e-5, rtol=1e-5)
    assert cache.tensors[0][:, :, 9:].abs().max() == 0 and cache.tensors[0][:, :, :9].abs().max() > 0


def test_draft_programs_equal_the_head(exported):
    """draft_fuse == head.fuse; draft step == EagleDraftModel.forward (in-place KV) on a tree mask with a prefix:
    logits, feedback and the updated cache."""
    _, head, _, _, runtime = exported
    g = torch.Generator().manual_seed(5)
    B, T, S = 2, 4, 20
    features = torch.randn(B, T, 3 * 32, generator=g)
    (hidden,) = runtime.drafter.fuse_session.run(None, {"features": features.numpy()})
    torch.testing.assert_close(torch.from_numpy(hidden), head.fuse(features).detach(), atol=1e-5, rtol=1e-5)
    hidden = torch.randn(B, T, 32, generator=g)
    tokens = torch.randint(0, 96, (B, T), generator=g)
    base = torch.tensor([3, 9])
    local = ancestor_matrix(torch.tensor([[-1, 0, 0, 1]] * B), 3)
    kv = head.new_kv(B, S)
    kv.keys.normal_(generator=g)
    kv.values.normal_(generator=g)
    state = runtime.drafter.new_state(B, S, dtype=torch.float32)
    state.tensors = [kv.keys.clone(), kv.values.clone()]
    write = base[:, None] + torch.arange(T)
    mask = SlotMask.tree(local, base, S)
    feedback, logits = runtime.drafter.forward(state, hidden, tokens, write, write, mask, fuse=False)
    with torch.no_grad():
        ref = head(tokens, hidden, write, kv, write, mask)
        ref_logits = head.lm_head(ref.normed)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(feedback, ref.feedback, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.tensors[0], kv.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.tensors[1], kv.values, atol=1e-5, rtol=1e-5)


def test_causal_blocks_are_fed_as_their_lower_triangle():
    feeds = mask_feeds(SlotMask.causal(torch.tensor([0, 5]), 32), 3)
    assert feeds["mask_local"].shape == (2, 3, 3)
    assert (feeds["mask_local"][1] == np.tril(np.ones((3, 3), dtype=bool))).all()


@pytest.mark.parametrize("lengths", [[7], [5, 11]], ids=["batch1", "ragged2"])
def test_onnx_decode_equals_hf_greedy(exported, lengths):
    model, _, _, _, runtime = exported
    prompts = _prompts(lengths)
    refs = [greedy_reference(model, torch.tensor([p]), max_new_tokens=NEW)[0, len(p):].tolist() for p in prompts]
    for tree in TREES:
        assert runtime.generate(prompts, NEW, tree=tree) == refs, tree
        assert len(runtime.acceptance_lengths) >= len(prompts) * NEW // (tree.depth + 1)


def test_onnx_decode_equals_eagle_compile_generate(exported):
    """The same ragged batch through eagle_compile.generate (left-padded) and OnnxEagle, on the tree of a trained
    head's tree.json (HF greedy, the ground truth, is compared for every tree above)."""
    model, head, _, _, runtime = exported
    prompts = _prompts([5, 11])
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, 11 - len(p):], mask[b, 11 - len(p):] = torch.tensor(p), 1
    for tree in TREES[1:2]:
        options = {"depth": tree.depth, "top_k": tree.top_k, "total_tokens": tree.total_tokens,
                   "calibrate": "off", "numerics": "eager"}
        spec = eagle_compile.generate(model, ids, attention_mask=mask, draft=head, options=options,
                                      max_new_tokens=NEW)
        assert runtime.generate(prompts, NEW, tree=tree) == spec[:, 11:].tolist(), tree


def test_oracle_drafts_are_all_accepted_and_exact(exported):
    """The ONNX target with a drafter that proposes its own greedy continuation: every cycle accepts the whole
    path (compaction of accepted tree KV in the functional cache), the tokens are still exactly greedy."""
    model, _, out, _, _ = exported
    runtime = OnnxEagle(out, threads=1)
    prompts = _prompts([5, 11], seed=4)
    refs = [greedy_reference(model, torch.tensor([p]), max_new_tokens=NEW)[0, len(p):].tolist() for p in prompts]
    runtime.drafter = ScriptedDrafter([p + r for p, r in zip(prompts, refs, strict=True)], 96, mode="oracle")
    tree = TreeShape(depth=3, top_k=2, total_tokens=6)
    assert runtime.generate(prompts, NEW, tree=tree) == refs
    # 15 tokens after the prefill's: 4 + 4 + 4 cycles, then the proposals run past the known continuation
    assert runtime.acceptance_lengths.count(tree.depth + 1) >= 2 * 3, runtime.acceptance_lengths


def test_eos_ends_a_row_where_hf_ends_it(exported):
    model, _, _, _, runtime = exported
    prompts = _prompts([5, 11])
    free = greedy_reference(model, torch.tensor([prompts[1]]), max_new_tokens=NEW)[0, 11:].tolist()
    eos = free[5]
    got = runtime.generate(prompts, NEW, eos_token_id=eos, tree=TREES[1])
    for p, row in zip(prompts, got, strict=True):
        ref = greedy_reference(model, torch.tensor([p]), max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
        assert row == ref[0, len(p):].tolist()
    assert got[1][-1] == eos and len(got[1]) <= 6


def test_refusals_name_the_value_and_the_range(exported, tmp_path):
    model, head, _, _, runtime = exported
    with pytest.raises(OptionsError, match="opset=17"):
        export_onnx(model, head, tmp_path, opset=17)
    with pytest.raises(OptionsError, match="copy=2"):
        runtime.generate(_prompts([5]), 4, tree=TreeShape(depth=2, top_k=1, total_tokens=3, copy=2))
    with pytest.raises(ValueError, match="largest exported batch bucket 4"):
        runtime.generate(_prompts([3] * 5), 4)
    with pytest.raises(FileNotFoundError, match=MANIFEST):
        OnnxEagle(tmp_path)
