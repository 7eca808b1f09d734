"""``eagle31 export``: the shipped head for the embedded target, a --draft/--target pair, errors, --help."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import random_head, save_random_head, save_tiny_folder, tiny_target, tiny_tokenizer

from eagle_compile.cli import main
from eagle_compile.draft import load_draft, save_draft
from eagle_compile.heads import shipped_head

SHIPPED = shipped_head()


@pytest.mark.skipif(SHIPPED is None, reason="this checkout ships no head")
@pytest.mark.parametrize("engine", ["vllm", "sglang", "speculators"])
def test_shipped_head_for_the_default_target(tmp_path, capsys, engine):
    out = tmp_path / engine
    assert main(["export", "--format", engine, str(out)]) == 0
    printed = capsys.readouterr().out
    assert "capture indices [2, 15, 27] of a 30-layer target" in printed
    assert ("sglang.launch_server" if engine == "sglang" else "vllm serve") in printed
    original = load_draft(SHIPPED, num_target_layers=30)
    exported = load_draft(out, num_target_layers=30)
    assert exported.config == original.config
    for key, value in original.state_dict().items():
        assert torch.equal(exported.state_dict()[key], value), key


def test_draft_and_target_folders(tmp_path, capsys):
    target = tiny_target("llama")
    target.save_pretrained(tmp_path / "target")
    head = random_head(target, flags=True, seed=0, reduced=True)
    save_draft(head, tmp_path / "head")
    out = tmp_path / "out"
    argv = ["export", "--format", "sglang", str(out), "--draft", str(tmp_path / "head"),
            "--target", str(tmp_path / "target"), "--speculative-tokens", "5"]
    assert main(argv) == 0
    assert "--speculative-num-steps 5" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        1, 3, 4]
    assert main(argv) == 2                                  # OUT holds files now
    assert "--overwrite" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 0
    capsys.readouterr()
    wrong = tiny_target("llama", vocab=64)
    wrong.save_pretrained(tmp_path / "wrong")
    assert main(["export", "--format", "vllm", str(tmp_path / "o2"), "--draft", str(tmp_path / "head"),
                 "--target", str(tmp_path / "wrong")]) == 2
    assert "vocab_size 64" in capsys.readouterr().err


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for word in ("--format", "vllm", "sglang", "speculators", "onnx", "tensorrt", "--programs-only", "--draft",
                 "--target", "OUT", "--overwrite"):
        assert word in text


def test_onnx_programs_decode_like_the_target(tmp_path, capsys):
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed (scripts/setup.sh installs it)")
    from eagle_compile.export.onnx_runtime import OnnxEagle

    target = save_tiny_folder(tmp_path / "target", tiny_tokenizer())
    save_random_head(tmp_path / "head", target)
    out = tmp_path / "onnx"
    argv = ["export", "--format", "onnx", str(out), "--target", str(tmp_path / "target"), "--draft",
            str(tmp_path / "head"), "--tree", '{"chain": 2}']
    assert main(argv) == 0
    assert {"target.onnx", "draft.onnx", "draft_fuse.onnx", "eagle31_onnx.json"} <= {p.name for p in out.iterdir()}
    prompt = torch.arange(3, 20)[None]
    with torch.no_grad():
        ref = target.generate(prompt, max_new_tokens=10, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert OnnxEagle(out).generate([prompt[0].tolist()], max_new_tokens=10, eos_token_id=[]) == [ref]
    capsys.readouterr()
    assert main(argv) == 2 and "--overwrite" in capsys.readouterr().err          # OUT holds files now
