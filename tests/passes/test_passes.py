"""locate_layers, tap_features and tree_attention on real dynamo graphs of tiny Llama, Qwen2, Qwen3 and Mistral
targets."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, tiny_target

from eagle_compile.capture_indices import default_capture_indices
from eagle_compile.core.masks import SlotMask
from eagle_compile.errors import UnsupportedModelError
from eagle_compile.passes import PASSES, PassContext, locate_layers, run_passes
from eagle_compile.runtime.kv_cache import SlotKVCache
from eagle_compile.runtime.target_program import TargetProgram


def causal(batch: int, start: int = 0, slots: int = 32) -> SlotMask:
    return SlotMask.causal(torch.full((batch,), start), slots)


def _run_program(model, indices, tokens):
    batch, t = tokens.shape
    cache = SlotKVCache(model.config, batch, 32, dtype=torch.float64, device="cpu")
    pos = torch.arange(t).expand(batch, t)
    program = TargetProgram(model, indices)
    logits, feats = program(tokens, pos, causal(batch), pos, cache)
    return program, logits, feats


@pytest.mark.parametrize("arch", ARCHS)
def test_taps_equal_output_hidden_states_at_capture_indices(arch):
    model = tiny_target(arch)
    tokens = torch.randint(3, 96, (2, 7))
    program, logits, feats = _run_program(model, None, tokens)
    ref = model(tokens, output_hidden_states=True)
    indices = default_capture_indices(8)
    assert program.capture_indices == indices == (2, 4, 5)
    expected = torch.cat([ref.hidden_states[k] for k in indices], -1)
    assert torch.allclose(feats, expected, atol=1e-12, rtol=0)
    assert torch.allclose(logits, ref.logits, atol=1e-12, rtol=0)     # original output untouched
    ctx = program.contexts[0]
    assert ctx.counts == {"locate_layers": 8, "tap_features": 3, "tree_attention": 8, "batch_invariant": 0,
                          "fuse_elementwise": 0}
    assert ctx.architecture == type(model).__name__


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_computes_logits_at_those_positions_only(arch):
    """Prefill asks for the logits of one position a row (`keep`): they equal the full forward's there, the
    features and the cache writes are the full forward's, and the call is its own graph."""
    model = tiny_target(arch)
    tokens = torch.randint(3, 96, (2, 7))
    program, logits, feats = _run_program(model, None, tokens)
    pos = torch.arange(7).expand(2, 7)
    cache = SlotKVCache(model.config, 2, 32, dtype=torch.float64, device="cpu")
    keep = torch.tensor([[6], [3]])                 # per row: row 0 at position 6, row 1 at position 3
    kept, kept_feats = program(tokens, pos, causal(2), pos, cache, keep)
    assert kept.shape == (2, 1, logits.shape[-1])
    torch.testing.assert_close(kept[:, 0], logits[torch.arange(2), keep[:, 0]], rtol=0, atol=1e-12)
    torch.testing.assert_close(kept_feats, feats, rtol=0, atol=1e-12)
    full_cache = SlotKVCache(model.config, 2, 32, dtype=torch.float64, device="cpu")
    program(tokens, pos, causal(2), pos, full_cache)
    for a, b in zip(cache.layers, full_cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert program.graphs_captured == 2


def test_custom_capture_indices_including_embeddings_and_last_layer():
    model = tiny_target("llama")
    tokens = torch.randint(3, 96, (1, 5))
    program, _, feats = _run_program(model, (0, 3, 8), tokens)
    ref = model(tokens, output_hidden_states=True)
    # capture index N is the last layer's pre-norm output; HF's hidden_states[N] is post-norm, so rebuild it.
    pre_norm_last = _last_layer_output(model, tokens)
    expected = torch.cat([ref.hidden_states[0], ref.hidden_states[3], pre_norm_last], -1)
    assert torch.allclose(feats, expected, atol=1e-12, rtol=0)
    assert program.contexts[0].counts["tap_features"] == 3


def _last_layer_output(model, tokens):
    seen = {}
    handle = model.model.layers[-1].register_forward_hook(lambda m, i, o: seen.setdefault("out", o))
    model(tokens)
    handle.remove()
    out = seen["out"]
    return out[0] if isinstance(out, tuple) else out


def test_pass_order_is_one_list():
    assert [p.__name__ for p in PASSES] == ["locate_layers", "tap_features", "tree_attention", "batch_invariant",
                                            "fuse_elementwise"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_attention_removes_the_dense_mask_and_every_sdpa(arch):
    """The pass swaps each layer's SDPA over the dense slot mask (and HF's repeat_kv) for the live-slot op: the
    rewritten graph has no SDPA, no slot_mask and no K/V expansion left, and computes the same logits and
    features as the graph as traced (the pass switched off: `kernels="off"`)."""
    model = tiny_target(arch)
    tokens = torch.randint(3, 96, (2, 6))
    graphs = {}

    def spy(use):
        def backend(gm, example_inputs):
            ctx = PassContext(kernels="auto" if use else "off")
            gm = run_passes(gm, ctx)
            graphs[use] = (gm, ctx)
            return gm.forward
        return backend

    results = {}
    for use in (True, False):
        program = TargetProgram(model, None)
        cache = SlotKVCache(model.config, 2, 32, dtype=torch.float64, device="cpu")
        cache.layers[0].keys.normal_(generator=torch.Generator().manual_seed(0))     # a non-trivial prefix
        pos = torch.arange(6).expand(2, 6) + 4
        compiled = torch.compile(program._forward, backend=spy(use), fullgraph=True, dynamic=False)
        logits = compiled(tokens, pos, torch.full((2,), 4), None, 32, pos, cache)
        results[use] = logits
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=1e-12)
    rewritten, ctx = graphs[True]
    traced, _ = graphs[False]
    targets = [n.target for n in rewritten.graph.nodes if n.op in ("call_function", "call_method")]
    assert ctx.counts["tree_attention"] == 8
    assert targets.count(torch.ops.eagle31.tree_attention.default) == 8
    assert torch.ops.eagle31.slot_mask.default not in targets
    assert not any("scaled_dot_product" in str(t) for t in targets)
    assert "expand" not in targets and "repeat_kv" not in str(targets)
    traced_targets = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert sum("scaled_dot_product" in t for t in traced_targets) == 8     # negative control: as traced


def test_graph_without_decoder_layers_names_the_architecture():
    class ResidualBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)

    class TinyMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([ResidualBlock() for _ in range(2)])

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return x

    captured = {}

    def spy(gm, example_inputs):
        captured["gm"] = gm
        return gm.forward

    torch.compile(TinyMLP(), backend=spy, fullgraph=True)(torch.randn(2, 4))
    with pytest.raises(UnsupportedModelError, match="ResidualBlock") as err:
        run_passes(captured["gm"], PassContext())
    assert "Llama, Qwen2, Qwen3, Mistral" in str(err.value)


def test_gpt2_is_refused_by_the_backend_with_its_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2)).eval()
    compiled = torch.compile(model, backend="eagle31", options={"chain": 2})
    with pytest.raises(Exception, match="GPT2Model"):
        compiled(torch.tensor([[1, 2, 3]]))


def test_locate_layers_rewrites_nothing():
    model = tiny_target("qwen3")
    captured = {}

    def spy(gm, example_inputs):
        captured["code"] = gm.code
        ctx = PassContext()
        locate_layers(gm, ctx)
        captured["after"] = gm.code
        captured["ctx"] = ctx
        return gm.forward

    torch.compile(model, backend=spy, fullgraph=True)(torch.randint(3, 96, (1, 4)))
    assert captured["code"] == captured["after"]
    assert captured["ctx"].counts == {"locate_layers": 8}
