"""TensorRT export (eagle_compile/export/tensorrt*.py) checked without TensorRT: the programs export at every
bucket's static shapes, hold only ops torch-tensorrt 2.13 converts, decomposes or removes (the eagle31 custom ops
inlined as their references), and compute what the PyTorch programs compute at the block lengths the runtime
uses; an unconvertible op and a kept custom op are caught (negative controls); engines are refused with the
reason where torch_tensorrt does not import; the op table matches the live registry where it does; and
inner_backend="tensorrt" is refused on CPU naming what it needs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tiny import random_head, save_random_head, save_tiny_folder, tiny_target, tiny_tokenizer

import eagle_compile
from eagle_compile.cli import main
from eagle_compile.errors import ExportError, OptionsError
from eagle_compile.export.programs import DraftStepProgram, TargetVerifyProgram, target_example
from eagle_compile.export.tensorrt import MANIFEST, PROGRAMS, export_program, export_tensorrt
from eagle_compile.export.tensorrt_ops import check_ops, handled, live_converters, op_name

LAYERS = 3
BUCKETS = (1, 2)
SLOTS = 32
TREE = {"depth": 2, "top_k": 2, "total_tokens": 4}


def _head(model):
    layers = model.config.num_hidden_layers
    return random_head(model, flags=True, seed=1, reduced=True, capture_indices=(0, 1, layers))


def _trt_imports() -> bool:
    try:
        import torch_tensorrt  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = tiny_target(dtype=torch.float32, layers=LAYERS)
    head = _head(model)
    head.tie_target_embedding(model)
    out = tmp_path_factory.mktemp("trt")
    manifest = export_tensorrt(model, head, out, tree=TREE, buckets=BUCKETS, max_cache_len=SLOTS, max_tokens=8,
                               programs_only=True)
    return model, head, out, manifest


def test_every_program_and_bucket_exports_whole(exported):
    _, _, out, manifest = exported
    assert json.loads((out / MANIFEST).read_text()) == manifest
    assert manifest["engines"] == "not asked (programs_only)"
    assert manifest["tokens"] == {"min": 1, "opt": 4, "max": 8} and manifest["max_cache_len"] == SLOTS
    assert list(manifest["programs"]) == list(PROGRAMS)
    for name, entry in manifest["programs"].items():
        assert sorted(entry["buckets"]) == [str(b) for b in BUCKETS], name
        for bucket in entry["buckets"].values():
            assert (out / bucket["program"]).is_file() and bucket["engine"] is None
            ops = bucket["ops"]
            assert ops["whole"] and not ops["custom"] and not ops["fallback"], (name, ops)
            assert ops["convert"], name
    target_ops = manifest["programs"]["target"]["buckets"]["1"]["ops"]["convert"]
    assert "aten.mm.default" in target_ops and "aten.scatter.src" in target_ops   # GEMMs; the functional KV write
    assert manifest["programs"]["target"]["inputs"][5:7] == ["past_key_values.0.key", "past_key_values.0.value"]


@pytest.mark.parametrize("tokens", [1, 4, 7])
@pytest.mark.parametrize("bucket", BUCKETS)
def test_saved_target_program_computes_the_pytorch_program(exported, bucket, tokens):
    """The checked program (custom ops replaced by references, decomposed) loaded from disk equals the PyTorch
    program at a plain step, the tree's size and a prefill-like block, at static batch and slots."""
    model, _, out, manifest = exported
    program = torch.export.load(out / manifest["programs"]["target"]["buckets"][str(bucket)]["program"]).module()
    reference = TargetVerifyProgram(model, tuple(manifest["capture_indices"])).eval()
    inputs = target_example(model, torch.float32, bucket, tokens, tokens, SLOTS)
    inputs["mask_local"] = torch.ones(bucket, tokens, tokens, dtype=torch.bool).tril().clone()
    g = torch.Generator().manual_seed(tokens)
    for name in [k for k in inputs if k.startswith("past_key_values")]:
        inputs[name] = torch.randn(inputs[name].shape, generator=g)
    with torch.no_grad():
        got, want = program(*inputs.values()), reference(*inputs.values())
    assert len(got) == len(want) == 2 + 2 * LAYERS
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0].argmax(-1), want[0].argmax(-1))


def test_saved_draft_program_runs_at_one_token(exported):
    _, head, out, manifest = exported
    program = torch.export.load(out / manifest["programs"]["draft"]["buckets"]["2"]["program"]).module()
    from eagle_compile.export.programs import draft_example

    inputs = draft_example(head, torch.float32, 2, 1, 1, SLOTS)
    with torch.no_grad():
        got, want = program(*inputs.values()), DraftStepProgram(head).eval()(*inputs.values())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _Unconvertible(torch.nn.Module):
    """cummax has no torch-tensorrt converter or decomposition: it would run in PyTorch between engines."""

    def forward(self, x):
        return torch.cummax(x, dim=1).values + 1


class _KeptCustomOp(torch.nn.Module):
    def forward(self, base, local):
        return torch.ops.eagle31.slot_mask(base, local, local.shape[1], 16, torch.float32)


def test_negative_controls_an_unconvertible_op_and_a_kept_custom_op_are_reported():
    ep = export_program(_Unconvertible(), {"features": torch.randn(2, 3, 4)}, max_tokens=8)
    report = check_ops(ep.graph)
    assert not report.whole and "aten.cummax.default" in report.fallback
    kept = torch.export.export(_KeptCustomOp(), (torch.tensor([1, 2]), torch.ones(2, 3, 3, dtype=torch.bool)))
    report = check_ops(kept.graph)
    assert not report.whole and report.custom == {"eagle31.slot_mask.default": 1}
    inlined = check_ops(export_program(_KeptCustomOp(), {"mask_base": torch.tensor([1, 2]),
                                                         "mask_local": torch.ones(2, 3, 4, dtype=torch.bool)},
                                       max_tokens=8).graph)
    assert inlined.whole, inlined


def test_export_fails_naming_an_unconvertible_op(monkeypatch, tmp_path):
    import eagle_compile.export.tensorrt as trt

    model = tiny_target(dtype=torch.float32, layers=2)
    head = _head(model)
    without_mm = {**handled(), "convert": handled()["convert"] - {"aten.mm.default"}}
    monkeypatch.setattr(trt, "check_ops", lambda graph: check_ops(graph, without_mm))
    with pytest.raises(ExportError, match=r"target \(batch 1\).*aten\.mm\.default"):
        export_tensorrt(model, head, tmp_path, tree={"chain": 2}, buckets=(1,), max_cache_len=16,
                        programs_only=True)


def test_op_names_and_the_table():
    assert op_name(torch.ops.aten.mm.default) == "aten.mm.default"
    assert op_name(torch.ops.aten.mm) == "aten.mm.*"
    import operator

    assert op_name(operator.getitem) == "operator.getitem"
    table = handled()
    assert len(table["convert"]) > 200 and "aten.batch_norm.*" in table["convert"]
    assert "aten._assert_tensor_metadata.default" in table["remove"]
    assert "aten.full_like.*" in table["decompose"]


def test_table_parser_reads_the_decorators():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import tensorrt_converters as script

    source = ("@dynamo_tensorrt_converter(torch.ops.aten.mm.default, supports_dynamic_shapes=True)\n"
              "@dynamo_tensorrt_converter(torch.ops.aten.batch_norm)\n@dynamo_tensorrt_converter(operator.add)\n"
              "def f(): pass\n@register_torch_trt_decomposition(aten.alias, registry=R)\ndef g(): pass\n")
    assert script._ops_in(source, "dynamo_tensorrt_converter") == {"aten.mm.default", "aten.batch_norm.*",
                                                                    "operator.add"}
    assert script._ops_in(source, "register_torch_trt_decomposition") == {"aten.alias.*"}
    remover = "if node.target == torch.ops.aten._assert_scalar.default:\n    pass\n"
    assert script._ops_in(remover, None) == {"aten._assert_scalar.default"}


@pytest.mark.skipif(_trt_imports(), reason="torch_tensorrt imports here: engines can be built")
def test_engines_are_refused_naming_what_is_missing(tmp_path):
    model = tiny_target(dtype=torch.float32, layers=2)
    head = _head(model)
    with pytest.raises(ExportError, match=r"torch_tensorrt.*eagle_compile\[tensorrt\].*--programs-only"):
        export_tensorrt(model, head, tmp_path, tree={"chain": 2}, buckets=(1,), max_cache_len=16)
    assert not (tmp_path / "programs").exists()        # refused before any work


@pytest.mark.skipif(not _trt_imports(), reason="torch_tensorrt does not import here (TensorRT's libraries "
                                                "cannot be installed on CPU machines, COMPILE_FACTS.md §7)")
def test_table_matches_the_live_registry():
    assert live_converters() == handled()["convert"]


def test_inner_backend_tensorrt_is_refused_on_cpu_naming_the_fix():
    model = tiny_target(dtype=torch.float32, layers=2)
    head = _head(model)
    ids = torch.arange(3, 9)[None]
    with pytest.raises(OptionsError, match=r"inner_backend='tensorrt'.*NVIDIA GPUs.*on cpu"):
        eagle_compile.generate(model, ids, draft=head, max_new_tokens=2, options={"inner_backend": "tensorrt"})
    with pytest.raises(OptionsError, match="inductor_config"):
        eagle_compile.generate(model, ids, draft=head, max_new_tokens=2,
                               options={"inner_backend": "tensorrt", "inductor_config": "freezing"})


def test_cli_writes_programs_only(tmp_path, capsys):
    target = save_tiny_folder(tmp_path / "target", tiny_tokenizer())
    save_random_head(tmp_path / "head", target)
    out = tmp_path / "trt"
    argv = ["export", "--format", "tensorrt", str(out), "--target", str(tmp_path / "target"), "--draft",
            str(tmp_path / "head"), "--tree", '{"chain": 2}', "--buckets", "2", "--max-cache-len", "64",
            "--programs-only"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "engines: not asked (programs_only)" in printed
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["buckets"] == {"batch": [2]} and manifest["max_cache_len"] == 64
    assert sorted(p.name for p in (out / "programs").iterdir()) == ["draft_b2.pt2", "draft_fuse_b2.pt2",
                                                                    "target_b2.pt2"]
    if not _trt_imports():
        assert main([*argv[:-1], "--overwrite"]) == 2
        assert "--programs-only" in capsys.readouterr().err
