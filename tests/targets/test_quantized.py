"""torchao weight-only quantised targets (int8 `Int8WeightOnlyConfig`, int4 on CPU `PrototypeInt4WeightOnlyConfig`,
the `quant` extra) through the eagle31 backend: greedy output equals the quantised model's own HF greedy, token for
token, with an oracle drafter whose drafts are accepted; plain mode too; numerics falls back to eager with the
reason recorded, and an explicit batch-invariant promise is refused (targets/quantized.py). bitsandbytes 8-bit and
nf4 targets too, where bitsandbytes is installed (the `bnb` extra)."""

from __future__ import annotations

import pytest
import torch

torchao = pytest.importorskip("torchao", reason="torchao is not installed: pip install 'eagle_compile[quant]'")

from tiny import ScriptedDrafter, continuations, greedy_reference, ragged, tiny_target  # noqa: E402

import eagle_compile  # noqa: E402
from eagle_compile.errors import OptionsError  # noqa: E402
from eagle_compile.passes import PassContext, batch_invariant  # noqa: E402
from eagle_compile.passes.batch_invariant import NotBatchInvariant  # noqa: E402
from eagle_compile.targets.quantized import find_quantized, quantize_weight_only  # noqa: E402

LINEARS = 8 * 7 + 1          # tiny_target: q, k, v, o, gate, up, down per layer, and the lm_head
KINDS = {"int8": "torchao Int8Tensor", "int4": "torchao Int4OpaqueTensor"}


def _quantized(kind: str, seed: int = 0):
    model = tiny_target("llama", seed=seed, dtype=torch.float32)
    return quantize_weight_only(model, kind, group_size=32)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_quantisation_happened_and_changes_the_greedy_text(kind):
    """The negative control: the unquantised model's greedy output differs, so equality below is not vacuous."""
    model = _quantized(kind)
    found = find_quantized(model)
    assert found.types == {KINDS[kind]: LINEARS}, found
    assert found.names[0] == "model.layers.0.self_attn.q_proj.weight"
    assert not find_quantized(tiny_target("llama", seed=0, dtype=torch.float32))
    ids, mask = ragged([7], seed=3)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=16)
    plain = greedy_reference(tiny_target("llama", seed=0, dtype=torch.float32), ids, attention_mask=mask,
                             max_new_tokens=16)
    assert not torch.equal(ref, plain), "quantisation did not change the greedy text: the tests would not tell"


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("lengths", [[7], [3, 12]])
def test_eagle31_equals_the_quantised_models_own_greedy(kind, lengths):
    model = _quantized(kind)
    ids, mask = ragged(lengths, seed=3)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=16)
    drafter = ScriptedDrafter(continuations(ids, mask, ref), 96, "oracle")
    compiled = torch.compile(model, backend="eagle31", options={"draft": drafter, "calibrate": "off"})
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=16, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert max(out.stats.acceptance_lengths) > 1, "no draft token was accepted"
    assert f"the target has {LINEARS} quantised weights ({LINEARS} x {KINDS[kind]})" in out.stats.lowering
    report = eagle_compile.explain(compiled, file=open("/dev/null", "w"))
    assert f"quantised target: {LINEARS} quantised weights" in report
    assert "batch_invariant 0" in report               # the pass rewrote nothing: numerics resolved to eager


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_plain_mode_equals_the_quantised_models_own_greedy(kind):
    model = _quantized(kind, seed=5)
    ids, mask = ragged([3, 12], seed=8)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=12)
    compiled = torch.compile(model, backend="eagle31", options={"speculate": False})
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=12, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert set(out.stats.acceptance_lengths) == {1}
    assert torch.equal(compiled(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)


def test_batch_invariant_numerics_are_refused_for_a_quantised_target():
    model = _quantized("int8")
    ids, _ = ragged([7], seed=3)
    with pytest.raises(OptionsError, match=r"numerics='batch_invariant' needs plain float32 weights.*Int8Tensor"):
        eagle_compile.generate(model, ids, max_new_tokens=4, options={"speculate": False,
                                                                      "numerics": "batch_invariant"})


def test_the_batch_invariant_pass_refuses_a_quantised_linear():
    """The backstop: a graph with quantised linears handed to the pass under batch_invariant raises, naming it."""
    model = _quantized("int4")
    graphs = []

    def spy(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids, _ = ragged([5], seed=1)
    torch.compile(lambda x: model(x).logits, backend=spy, fullgraph=True)(ids)
    with pytest.raises(NotBatchInvariant, match="quantised weight \\(torchao Int4OpaqueTensor\\)"):
        batch_invariant(graphs[0], PassContext(numerics="batch_invariant"))


@pytest.mark.slow
def test_real_target_int8_equals_its_own_greedy():
    from eagle_compile.heads import shipped_head

    torch.set_num_threads(2)
    model, tokenizer = eagle_compile.load_default_target(torch.float32)
    quantize_weight_only(model, "int8")
    found = find_quantized(model)
    assert found.types == {"torchao Int8Tensor": 30 * 7 + 1}, found      # 30 layers; the tied lm_head once
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    draft = eagle_compile.load_draft(shipped_head(), target=model, dtype=torch.float32)
    # the head's fixed tree (calibrate off): whether the adaptive layer speculates in 32 tokens depends on the
    # costs it measures (it ran all 31 cycles plain once, on a loaded machine), so the acceptance check would
    # test the machine; the call also took 80 s measured that way, 22 s fixed
    out = eagle_compile.generate(model, ids, draft=draft, max_new_tokens=32, options={"calibrate": "off"},
                                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert max(out.stats.acceptance_lengths) > 1, "the shipped head had nothing accepted"


@pytest.mark.parametrize("bits", [8, 4])
def test_bitsandbytes_targets_equal_their_own_greedy(bits):
    """bitsandbytes' CPU backend (its Linear8bitLt / Linear4bit nf4 modules) through the same programs."""
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install 'eagle_compile[bnb]'")
    model = tiny_target("llama", seed=0, dtype=torch.float32)
    _swap_bnb_linears(model, bnb, bits)
    found = find_quantized(model)
    assert found.types == {f"bitsandbytes {'Int8Params' if bits == 8 else 'Params4bit'}": LINEARS}, found
    ids, mask = ragged([3, 12], seed=3)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=16)
    drafter = ScriptedDrafter(continuations(ids, mask, ref), 96, "oracle")
    out = eagle_compile.generate(model, ids, attention_mask=mask, max_new_tokens=16, draft=drafter,
                                 options={"calibrate": "off"}, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert max(out.stats.acceptance_lengths) > 1, "no draft token was accepted"
    assert "numerics='auto': eager, the target has" in out.stats.lowering


def _swap_bnb_linears(module: torch.nn.Module, bnb, bits: int) -> None:
    for name, child in module.named_children():
        if not isinstance(child, torch.nn.Linear):
            _swap_bnb_linears(child, bnb, bits)
            continue
        if bits == 8:
            quantized = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=False,
                                            has_fp16_weights=False)
        else:
            quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                          compute_dtype=torch.float32, quant_type="nf4")
        quantized.load_state_dict(child.state_dict())
        setattr(module, name, quantized.to("cpu"))     # .to() quantises the weights
