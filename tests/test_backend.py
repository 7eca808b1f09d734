"""Packaging and the backend contract: entry point, options, compiled forward, compiled.generate wiring."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny import ScriptedDrafter, greedy_reference, tiny_target

from eagle_compile.errors import OptionsError
from eagle_compile.options import VALID_KEYS, EagleOptions, parse_options


def test_entry_point_registers_backend_in_a_fresh_process():
    script = textwrap.dedent("""
        import sys, torch
        from torch._dynamo import list_backends
        assert "eagle31" in list_backends(), list_backends()
        assert not any(m.startswith("eagle_compile") for m in sys.modules), "listing must not need an import"
        f = torch.compile(lambda x: torch.sin(x) * 2, backend="eagle31", options={"chain": 2})
        print("imported-by-torch", "eagle_compile.backend" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "imported-by-torch True" in out.stdout


def test_unknown_option_names_valid_keys():
    with pytest.raises(OptionsError) as err:
        parse_options({"tree_depth": 5})
    for key in VALID_KEYS:
        assert key in str(err.value)


@pytest.mark.parametrize("bad, words", [
    ({"depth": 0}, "depth=0"),
    ({"top_k": "3"}, "top_k='3'"),
    ({"inner_backend": "tvm"}, "['auto', 'eager', 'inductor', 'tensorrt']"),
    ({"inductor_config": "fast"}, "not a preset"),
    ({"inductor_config": {"no_such_setting": 1}}, "not torch._inductor.config settings"),
    ({"batch_buckets": (4, 2)}, "strictly increasing"),
    ({"chain": 3, "depth": 4}, "chain drafting"),
    ({"depth": 2, "top_k": 2, "total_tokens": 40}, None),
])
def test_bad_option_values_are_refused(bad, words):
    if words is None:   # a tree shape that cannot be built is refused when the tree shape is made
        from eagle_compile.core.tree import TreeShape
        opts = parse_options(bad)
        with pytest.raises(OptionsError, match="exceeds the largest tree"):
            TreeShape(opts.tree_depth, opts.tree_top_k, opts.tree_tokens)
        return
    with pytest.raises(OptionsError) as err:
        parse_options(bad)
    assert words in str(err.value)


def test_options_are_frozen_and_chain_derives_the_tree():
    opts = parse_options({"chain": 4})
    assert (opts.tree_depth, opts.tree_top_k, opts.tree_tokens) == (4, 1, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.depth = 3
    assert EagleOptions().as_dict()["total_tokens"] is None and not EagleOptions().tree_given
    assert EagleOptions().tree_tokens == 60 and parse_options({"depth": 3}).tree_given


def test_compiled_forward_returns_target_logits():
    model = tiny_target("qwen2")
    compiled = torch.compile(model, backend="eagle31", options={"chain": 2})
    ids = torch.randint(3, 96, (2, 7))
    assert torch.allclose(compiled(ids).logits, model(ids).logits, atol=1e-12, rtol=0)


def test_bad_options_fail_at_first_use_with_the_message():
    model = tiny_target("llama")
    compiled = torch.compile(model, backend="eagle31", options={"depth": -1})
    with pytest.raises(OptionsError, match="depth=-1"):
        compiled.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    with pytest.raises(Exception, match="depth=-1"):   # dynamo wraps backend errors in BackendCompilerFailed
        compiled(torch.tensor([[5, 6, 7]]))


def test_compiled_generate_is_speculative_and_uses_compile_options():
    model = tiny_target("llama")
    ids = torch.randint(3, 96, (1, 6))
    ref = greedy_reference(model, ids, max_new_tokens=12)
    drafter = ScriptedDrafter([ref[0].tolist()], 96, "oracle")
    compiled = torch.compile(model, backend="eagle31", options={"chain": 3, "draft": drafter})
    out = compiled.generate(ids, max_new_tokens=12, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert {k: v for k, v in out.stats.tree.items() if k != "fixed"} == {"depth": 3, "top_k": 1, "total_tokens": 4,
                                                                          "source": "options"}
    assert "a tree key was given" in out.stats.tree["fixed"]      # a given tree stays fixed (no calibration)
    assert max(out.stats.histogram) == 4          # oracle: depth + 1 tokens per cycle
    other = torch.compile(model, backend="inductor")
    assert other.generate.__func__ is type(model).generate   # other backends keep HF's generate


def test_custom_generate_door():
    import eagle_compile

    model = tiny_target("mistral")
    ids = torch.randint(3, 96, (1, 5))
    ref = greedy_reference(model, ids, max_new_tokens=9)
    drafter = ScriptedDrafter([ref[0].tolist()], 96, "oracle")
    out = model.generate(ids, max_new_tokens=9, custom_generate=eagle_compile.generate, draft=drafter,
                         options={"depth": 2, "top_k": 2, "total_tokens": 4})
    assert torch.equal(out, ref)


def test_no_draft_is_a_clear_error():
    import eagle_compile

    model = tiny_target("llama")
    with pytest.raises(Exception, match="no draft head"):
        eagle_compile.generate(model, torch.tensor([[4, 5]]), max_new_tokens=3)


def test_unsupported_generation_settings_are_refused():
    import eagle_compile

    model = tiny_target("llama")
    drafter = ScriptedDrafter([[0] * 64], 96, "oracle")
    with pytest.raises(Exception, match="encoder_repetition_penalty"):
        eagle_compile.generate(model, torch.tensor([[4, 5]]), draft=drafter, max_new_tokens=3,
                               encoder_repetition_penalty=1.3)
    with pytest.raises(Exception, match="output_scores"):
        eagle_compile.generate(model, torch.tensor([[4, 5]]), draft=drafter, max_new_tokens=3,
                               output_scores=True, return_dict_in_generate=True)
    with pytest.raises(Exception, match="frobnicate"):
        eagle_compile.generate(model, torch.tensor([[4, 5]]), draft=drafter, max_new_tokens=3, frobnicate=1)
