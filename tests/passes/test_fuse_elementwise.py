"""fuse_elementwise: RoPE and the RMSNorm tails become eagle31::rope / eagle31::rms_scale, no-op casts go, and a
program's logits and feature taps keep every bit (four architectures; a deliberately wrong RoPE kernel fails)."""

from __future__ import annotations

import operator

import pytest
import torch
from tiny import tiny_target

import eagle_compile.runtime.target_program as target_program
from eagle_compile.core.masks import SlotMask
from eagle_compile.kernels import batch_invariant
from eagle_compile.lowering import Lowering
from eagle_compile.passes import PASSES, fuse_elementwise, run_passes
from eagle_compile.runtime.kv_cache import SlotKVCache

SLOTS = 48


def _program(model, fused: bool, monkeypatch):
    passes = PASSES if fused else tuple(p for p in PASSES if p is not fuse_elementwise)
    monkeypatch.setattr(target_program, "run_passes", lambda gm, ctx: run_passes(gm, ctx, passes))
    return target_program.TargetProgram(model, None, lowering=Lowering(numerics="batch_invariant"))


def _outputs(model, program):
    """Prefill of 12 tokens in two rows, one-token steps, and a 3-node verify tree: every logit and tap."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(7)
    cache = SlotKVCache(model.config, 2, SLOTS, dtype=torch.float32, device="cpu")
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    base = torch.zeros(2, dtype=torch.long)
    outs = [program(ids, torch.arange(12).expand(2, 12), SlotMask.causal(base, SLOTS),
                    torch.arange(12).expand(2, 12), cache)]
    for t in (12, 13):
        n = torch.full((2,), t, dtype=torch.long)
        outs.append(program(torch.randint(3, vocab, (2, 1), generator=g), n[:, None], SlotMask.causal(n, SLOTS),
                            n[:, None], cache))
    n = torch.full((2,), 14, dtype=torch.long)
    local = torch.tensor([[True, False, False], [True, True, False], [True, False, True]]).expand(2, 3, 3)
    outs.append(program(torch.randint(3, vocab, (2, 3), generator=g), (n[:, None] + torch.tensor([0, 1, 1])),
                        SlotMask(n, local, SLOTS), n[:, None] + torch.arange(3), cache))
    return outs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_programs_keep_every_bit(arch, monkeypatch):
    model = tiny_target(arch, seed=11, dtype=torch.float32)
    fused = _program(model, True, monkeypatch)
    got = _outputs(model, fused)
    counts = fused.contexts[0].counts["fuse_elementwise"]
    layers = model.config.num_hidden_layers
    norms = 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)     # qwen3 also norms q and k per head
    assert counts == norms + 2 * layers                                   # and RoPE of q and of k per layer
    reference = _outputs(model, _program(model, False, monkeypatch))
    for (logits, taps), (ref_logits, ref_taps) in zip(got, reference, strict=True):
        assert torch.equal(logits, ref_logits) and torch.equal(taps, ref_taps)


def test_the_fused_graph_has_no_chain_left(monkeypatch):
    model = tiny_target("llama", seed=2, dtype=torch.float32)
    graphs = []
    monkeypatch.setattr(Lowering, "compile", lambda self, gm, example, kind="step": graphs.append(gm) or gm.forward)
    program = target_program.TargetProgram(model, None, lowering=Lowering(numerics="batch_invariant"))
    _outputs(model, program)
    for gm in graphs:
        targets = [n.target for n in gm.graph.nodes]
        assert torch.ops.eagle31.rope.default in targets and torch.ops.eagle31.rms_scale.default in targets
        left = [n.format_node() for n in gm.graph.nodes if n.target in (torch.rsqrt, operator.neg)]
        assert not left, left
        # every dtype-only cast was float32 -> float32 (RoPE's .to(device=..., dtype=...) stays)
        casts = [n.format_node() for n in gm.graph.nodes if n.target == "to" and "device" not in n.kwargs]
        assert not casts, casts


def test_a_wrong_rope_kernel_is_caught(monkeypatch):
    """Negative control: the comparison above sees a one-ulp change in the fused op."""
    model = tiny_target("llama", seed=11, dtype=torch.float32)
    reference = _outputs(model, _program(model, False, monkeypatch))
    batch_invariant.load()
    rope = torch.ops.eagle31.rope.default
    wrong = {"calls": 0}

    def off_by_an_ulp(q, cos, sin):
        wrong["calls"] += 1
        return torch.nextafter(rope(q, cos, sin), torch.tensor(float("inf")))

    from eagle_compile import kernels

    monkeypatch.setattr(kernels, "eager_calls", lambda real=kernels.eager_calls: {**real(), rope: off_by_an_ulp})
    got = _outputs(model, _program(model, True, monkeypatch))
    assert wrong["calls"] > 0
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(got, reference, strict=True))


def test_other_numerics_leave_the_graph_alone(monkeypatch):
    from eagle_compile.passes.context import PassContext

    model = tiny_target("llama", seed=2, dtype=torch.float32)
    gm = torch.fx.symbolic_trace(lambda x: x.to(torch.float32) * 2)
    ctx = PassContext(capture_indices=None, architecture=type(model).__name__, numerics="eager")
    before = gm.code
    assert fuse_elementwise(gm, ctx).code == before and ctx.counts["fuse_elementwise"] == 0
