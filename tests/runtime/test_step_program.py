"""The speculative-step program (issue: lowering): one captured graph per cycle, no host synchronisation, the
step passes rewrite exactly the expected sites, and generation gives exactly the unlowered path's tokens."""

from __future__ import annotations

import pytest
import torch
from tiny import greedy_reference, ragged_batch, random_head, tiny_target

import eagle_compile
import eagle_compile.runtime.step as step_module
from eagle_compile.passes import STEP_PASSES

SHAPE = {"depth": 3, "top_k": 2, "total_tokens": 6, "prefill_chunk": 8, "kernels": "on"}


def _generate(target, head, ids, mask, lowered: bool, **kwargs):
    return eagle_compile.generate(target, ids, attention_mask=mask, draft=head,
                                  options={**SHAPE, "step_program": lowered}, max_new_tokens=12,
                                  return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_lowered_step_gives_the_unlowered_tokens(arch):
    target = tiny_target(arch, seed=21)
    head = random_head(target, flags=True, seed=5, reduced=True)
    ids, mask = ragged_batch(3, seed=9)
    plain = _generate(target, head, ids, mask, lowered=False)
    lowered = _generate(target, head, ids, mask, lowered=True)
    assert torch.equal(lowered.sequences, plain.sequences)
    assert torch.equal(lowered.sequences, greedy_reference(target, ids, attention_mask=mask, max_new_tokens=12))
    assert lowered.stats.cycles > 0


def test_step_passes_rewrite_the_expected_sites():
    target = tiny_target("llama", seed=2)
    head = random_head(target, flags=True, seed=1, reduced=False)
    ids, mask = ragged_batch(1, seed=3)
    decoder_counts = _counts_after_generate(target, head, ids, mask)
    layers, depth = 8, SHAPE["depth"]
    assert [p.__name__ for p in STEP_PASSES] == ["locate_layers", "tap_features", "static_kv", "draft_subgraph",
                                                 "accept_subgraph", "tree_attention", "batch_invariant",
                                                 "fuse_elementwise"]
    assert decoder_counts == {
        "locate_layers": layers,
        "tap_features": 3,                          # three capture-index taps into one marker
        "static_kv": 2 * layers + 2 * depth + 2 * layers,   # target writes, draft writes, compaction
        "draft_subgraph": 1 + depth,                # one fc_norm_fuse, a draft_topk per level
        "accept_subgraph": 1 + layers,              # accept_greedy, a kv_compact per layer
        "tree_attention": layers,                   # target layers (the draft calls the op itself)
        "batch_invariant": 0,                       # float64: numerics "auto" keeps the traced kernels
        "fuse_elementwise": 0,                      # (and the traced elementwise chains)
    }


def test_kernels_auto_on_cpu_keeps_the_traced_code_and_says_why():
    target = tiny_target("llama", seed=2)
    head = random_head(target, flags=True, seed=1, reduced=False)
    ids, mask = ragged_batch(1, seed=3)
    counts = _counts_after_generate(target, head, ids, mask, kernels="auto")
    assert counts["draft_subgraph"] == counts["accept_subgraph"] == 0
    assert counts["tree_attention"] == 8, "live-slot attention is faster on CPU too, so 'auto' keeps it"
    assert counts["static_kv"] > 0 and counts["tap_features"] == 3


def _counts_after_generate(target, head, ids, mask, kernels="on"):
    from eagle_compile.runtime.generate import _decoders

    eagle_compile.generate(target, ids, attention_mask=mask, draft=head, max_new_tokens=4,
                           options={**SHAPE, "step_program": True, "kernels": kernels})
    (decoder,) = [d for d in _decoders[target].values() if d.options.step_program and d.options.kernels == kernels]
    (program,) = decoder._steps.values()
    (ctx,) = program.contexts
    return ctx.counts


def test_sampling_step_is_lowered_to_accept_sample():
    target = tiny_target("mistral", seed=4)
    head = random_head(target, flags=False, seed=2, reduced=True)
    ids, mask = ragged_batch(1, seed=5)
    out = _generate(target, head, ids, mask, lowered=True, do_sample=True, temperature=0.9)
    assert out.sequences.shape[1] == ids.shape[1] + 12


def test_a_host_sync_inside_the_cycle_fails_the_capture(monkeypatch):
    """Negative control: the capture is fullgraph, so a host read inside the step cannot go unnoticed."""
    target = tiny_target("llama", seed=6)
    head = random_head(target, flags=True, seed=3, reduced=False)
    ids, mask = ragged_batch(1, seed=7)
    real = step_module.verify_greedy

    def syncing_verify(tree, logits):
        acc = real(tree, logits)
        if int(acc.accept_len.max().item()) > 100:      # a host read
            raise AssertionError
        return acc

    monkeypatch.setattr(step_module, "verify_greedy", syncing_verify)
    with pytest.raises(Exception, match="item|Unsupported|graph break"):
        _generate(target, head, ids, mask, lowered=True)
