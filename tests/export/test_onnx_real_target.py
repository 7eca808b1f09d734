"""ONNX export of the embedded default target (SmolLM2-135M-Instruct, float32) with the shipped EAGLE 3.1 head:
onnxruntime decoding of 3 Spec-Bench prompts x 64 tokens, as one ragged batch, equals HF greedy row by row, and the
exported head is accepted about as often as in PyTorch."""

from __future__ import annotations

import pytest
import torch
from test_real_target import TAU_FLOORS, _prompts

import eagle_compile
from eagle_compile.export.onnx import export_onnx
from eagle_compile.export.onnx_runtime import OnnxEagle
from eagle_compile.heads import shipped_head

pytestmark = pytest.mark.slow
NEW = 64


def test_onnx_decode_of_the_default_target_equals_hf_greedy(tmp_path):
    torch.set_num_threads(2)
    model, tokenizer = eagle_compile.load_default_target(torch.float32)
    draft = eagle_compile.load_draft(shipped_head(), target=model, dtype=torch.float32)
    manifest = export_onnx(model, draft, tmp_path, buckets=(1, 2, 4))
    assert manifest["tree"]["source"].startswith(str(shipped_head() / "tree.json")), manifest["tree"]
    prompts = _prompts(tokenizer)
    with torch.no_grad():
        refs = [model.generate(ids, max_new_tokens=NEW, do_sample=False)[0, ids.shape[1]:].tolist()
                for ids in prompts]
    runtime = OnnxEagle(tmp_path, threads=2)
    assert runtime.generate([ids[0].tolist() for ids in prompts], NEW) == refs
    tau = sum(runtime.acceptance_lengths) / len(runtime.acceptance_lengths)
    assert tau >= TAU_FLOORS["tree.json"], f"mean acceptance length {tau:.2f} of the exported head"
