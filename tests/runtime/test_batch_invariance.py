"""Batch-invariant programs (numerics="batch_invariant"): a token's logits and feature taps are bit-identical
whether the target program computes it alone (N = 1), in a prefill chunk of N, inside a verify tree of N nodes,
in another batch row or in a larger batch bucket; the draft head's scores likewise across tree-level widths.
Negative control: the same checks catch a deliberately N-dependent linear (TESTING.md: a check that cannot fail
proves nothing). Lossless end to end on the tiny models here, on the real target in tests/test_real_target.py."""

from __future__ import annotations

import pytest
import torch
from invariance import invariance_failures, invariant_program
from tiny import greedy_reference, random_head, tiny_target

import eagle_compile
from eagle_compile.core.masks import SlotMask
from eagle_compile.draft.drafter import EagleDrafter
from eagle_compile.kernels import batch_invariant


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])   # Llama-like, + biases (qwen2) or + q/k norms (qwen3)
def test_logits_and_taps_do_not_depend_on_tokens_per_call_tree_or_batch_row(arch):
    model = tiny_target(arch, seed=5, dtype=torch.float32)
    program = invariant_program(model)
    assert invariance_failures(model, program) == []
    ctx = program.contexts[0]
    assert ctx.counts["batch_invariant"] > 0 and ctx.counts["tree_attention"] > 0   # the swap happened
    assert batch_invariant.PACKED.holds(model.model.layers[0].mlp.up_proj.weight)   # from the packed layout


@pytest.mark.skipif(not batch_invariant.panel_layout(), reason="the wide attention path is built only where AVX-512 is")
def test_prefill_chunks_on_the_wide_attention_path_keep_the_bits_of_one_token_steps():
    """Head dim 16 with 4 query heads per KV head: chunks of 8 and 24 tokens and the trees of 16 run attention's
    wide path (vectors across keys), one-token steps the per-query one; every position's logits and taps agree."""
    model = tiny_target("llama", seed=6, dtype=torch.float32, head_dim=16, num_key_value_heads=1)
    before = batch_invariant.wide_attention_calls()
    assert invariance_failures(model, invariant_program(model)) == []
    assert batch_invariant.wide_attention_calls() > before


def test_the_checks_catch_an_n_dependent_linear(monkeypatch):
    """Negative control: a linear that splits its reduction in two when a call carries several rows."""
    def n_dependent(x, weight, bias=None):
        rows = x.numel() // x.shape[-1]
        if rows == 1:
            return torch.nn.functional.linear(x, weight, bias)
        half = x.shape[-1] // 2
        out = x[..., :half] @ weight[:, :half].T + x[..., half:] @ weight[:, half:].T
        return out if bias is None else out + bias

    def n_dependent_packed(x, packed, bias=None):                     # the same, from the packed layouts
        n4, k8 = packed.shape[:2]
        return n_dependent(x, packed.permute(0, 2, 1, 3).reshape(n4 * 4, k8 * 8), bias)

    def n_dependent_panels(x, panels, bias=None):
        n16, _, k8, _ = panels.shape
        return n_dependent(x, panels.permute(0, 3, 2, 1).reshape(n16 * 16, k8 * 8), bias)

    model = tiny_target("llama", seed=5, dtype=torch.float32)
    lib = torch.library.Library("eagle31", "IMPL")
    lib.impl("bi_linear", n_dependent, "CPU")
    lib.impl("bi_linear_packed", n_dependent_packed, "CPU")
    lib.impl("bi_linear_panels", n_dependent_panels, "CPU")
    try:
        failures = invariance_failures(model, invariant_program(model), chunks=(2,), trees=(4,), batches=())
    finally:
        lib._destroy()
    batch_invariant.load.cache_clear()
    batch_invariant.load()                          # re-register the real kernels
    assert "prefill chunks of 2" in failures and "verify tree of 4" in failures


def test_draft_scores_do_not_depend_on_the_level_width():
    target = tiny_target("llama", seed=3, dtype=torch.float32)
    head = random_head(target, flags=True, seed=2, reduced=True).float()
    drafter = EagleDrafter(head, numerics="batch_invariant")
    rows = torch.randn(1, 16, target.config.hidden_size)
    wide = drafter.top_k(rows, 4)
    for w in (1, 2, 3, 8):
        part = drafter.top_k(rows[:, :w], 4)
        assert torch.equal(part[0], wide[0][:, :w]) and torch.equal(part[1], wide[1][:, :w])


def test_a_float16_head_drafts_from_16_bit_weights_with_the_same_bits():
    """A head shipped in float16 and run in float32 streams its linears' weights in 16 bits (half a draft
    level's memory traffic); its forward and top-k give the bits of the float32 weights."""
    target = tiny_target("llama", seed=3, dtype=torch.float32)
    head = random_head(target, flags=True, seed=2, reduced=True).half().float()
    fast, plain = EagleDrafter(head, numerics="batch_invariant"), EagleDrafter(head, numerics="batch_invariant")
    plain._narrow = lambda weight: weight                                          # the float32 weights
    cfg, slots = head.config, 24
    hidden, tokens = torch.randn(1, 3, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (1, 3))
    positions = torch.arange(3)[None]
    mask = SlotMask.causal(torch.tensor([0]), slots)
    outs = []
    for drafter in (fast, plain):
        state = drafter.new_state(1, slots, dtype=torch.float32, device=torch.device("cpu"))
        feedback, normed = drafter.forward(state, hidden, tokens, positions, positions, mask, fuse=False)
        outs.append((feedback, normed, *drafter.top_k(normed, 4), state.keys))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    used = [name for name, m in head.named_modules() if isinstance(m, torch.nn.Linear) and name != "fc"]
    assert len(used) == 8 and len(fast._narrow) == len(used)          # every linear but fc (no fuse here) in 16 bits


@pytest.mark.parametrize("arch", ["llama"])
def test_speculative_greedy_equals_plain_mode_with_the_invariant_kernels(arch):
    model = tiny_target(arch, seed=7, dtype=torch.float32)
    head = random_head(model, flags=True, seed=4, reduced=False).float()
    ids = torch.randint(3, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    plain = eagle_compile.generate(model, ids, max_new_tokens=40, return_dict_in_generate=True,
                                   options={"speculate": False, "numerics": "batch_invariant"})
    assert "numerics batch_invariant" in plain.stats.lowering
    for options in ({"depth": 4, "top_k": 3, "total_tokens": 10}, {"chain": 3},
                    {"depth": 3, "top_k": 2, "total_tokens": 6, "step_program": True}):
        out = eagle_compile.generate(model, ids, draft=head, max_new_tokens=40, return_dict_in_generate=True,
                                     options={**options, "numerics": "batch_invariant"})
        assert torch.equal(out.sequences, plain.sequences), options
    # and the eager path equals HF eager greedy (the option that keeps HF's rounding)
    eager = eagle_compile.generate(model, ids, draft=head, max_new_tokens=40, options={"chain": 3, "numerics": "eager"})
    assert torch.equal(eager, greedy_reference(model, ids, max_new_tokens=40))
