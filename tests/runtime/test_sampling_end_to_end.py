"""Lossless sampling end to end (TESTING.md invariant 2): `generate(do_sample=True)` with a real random head,
thousands of independent rows of one prompt, against the analytic distribution of the first two tokens; and a
negative control (a verifier that accepts drafted tokens too eagerly) that the same check must reject."""

from __future__ import annotations

import pytest
import torch
from distribution import pair_counts, pair_p_value
from tiny import force_costs, tiny_target

import eagle_compile
import eagle_compile.runtime.step as step_module
from eagle_compile.core.verify import verify_sample
from eagle_compile.draft.config import DraftConfig
from eagle_compile.draft.model import EagleDraftModel
from eagle_compile.runtime.sampling import SamplingParams, target_probs

V, ROWS = 16, 6000
CHUNK = 1500          # rows per generate call: 4 calls, ~a quarter of one 6000-row batch's memory
SAMPLING = {"do_sample": True, "temperature": 1.3, "top_k": 10, "top_p": 0.95}


@pytest.fixture(scope="module")
def setup():
    return _setup(torch.float64)


@pytest.fixture(scope="module")
def setup32():
    return _setup(torch.float32)


def _setup(dtype):
    target = tiny_target("llama", seed=4, vocab=V, dtype=dtype)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)        # a spread-out distribution: many tokens with real mass
    torch.manual_seed(0)
    head = EagleDraftModel(DraftConfig.for_target(target.config, None, fc_norm=True, norm_output=True))
    head = head.to(dtype).eval()
    head.tie_target_embedding(target)
    prompt = torch.tensor([[5, 9, 3, 12, 7]])
    return target, head, prompt, _analytic(target, prompt)


def _analytic(target, prompt):
    """P(x1, x2) from the target with HF's processing (float32 cast, temperature, top-k, top-p)."""
    params = SamplingParams(do_sample=True, temperature=SAMPLING["temperature"], top_k=SAMPLING["top_k"],
                            top_p=SAMPLING["top_p"])
    with torch.no_grad():
        p1 = target_probs(target(prompt).logits[0, -1].float(), params).double()
        seqs = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
        p2 = target_probs(target(seqs).logits[:, -1].float(), params).double()
    return p1[:, None] * p2                     # [V, V]


def _sample(target, head, prompt, **options):
    """ROWS independent rows in batches of CHUNK: their pair counts, and the last call's statistics with the
    per-row counts (acceptance lengths, copied tokens) of every call."""
    torch.manual_seed(1234)
    counts, lengths, copied = torch.zeros(V, V, dtype=torch.float64), [], 0
    for _ in range(ROWS // CHUNK):
        out = eagle_compile.generate(target, prompt.repeat(CHUNK, 1), draft=head, max_new_tokens=2,
                                     options={"depth": 3, "top_k": 2, "total_tokens": 6, "prefill_chunk": 8,
                                              "batch_buckets": (CHUNK,), **options},
                                     return_dict_in_generate=True, **SAMPLING)
        counts += pair_counts(out.sequences, V)
        lengths += out.stats.acceptance_lengths
        copied += out.stats.copied_tokens
    out.stats.acceptance_lengths, out.stats.copied_tokens = lengths, copied
    return counts, out.stats


def test_first_two_tokens_follow_the_target_distribution(setup):
    target, head, prompt, joint = setup
    counts, stats = _sample(target, head, prompt)
    assert max(stats.histogram) >= 2, "no draft token was ever accepted: the test would not exercise verification"
    assert pair_p_value(counts, joint) > 1e-3
    tv = 0.5 * (counts / ROWS - joint).abs().sum()
    assert tv < 2.0 * (V * V / ROWS) ** 0.5


def test_the_distribution_holds_with_the_batch_invariant_kernels(setup32):
    """float32 on CPU: the default numerics put every linear and attention on the batch-invariant kernels."""
    target, head, prompt, joint = setup32
    counts, stats = _sample(target, head, prompt, numerics="batch_invariant")
    assert "numerics batch_invariant" in stats.lowering
    assert max(stats.histogram) >= 2
    assert pair_p_value(counts, joint) > 1e-3
    assert 0.5 * (counts / ROWS - joint).abs().sum() < 2.0 * (V * V / ROWS) ** 0.5


TREE_ONLY = {"plain": 1.0, "chain1": 9.0, "chain2": 9.0, "chain4": 9.0, "tree3x2x6": 1.0}


def test_the_distribution_holds_with_calibration_and_node_masking(setup, monkeypatch):
    """The calibration layer's tree with low-confidence nodes masked (floor from the confidence map): still
    exactly the target's distribution."""
    force_costs(monkeypatch, TREE_ONLY, min_accept=0.05)
    target, head, prompt, joint = setup
    counts, stats = _sample(target, head, prompt, calibrate="on", calibration_cache="memory")
    assert stats.calibration["policy"]["chosen"] == {"tree3x2x6": 1}
    assert stats.calibration["node_floor"] > -1e9                 # nodes under the floor were masked
    assert max(stats.histogram) >= 2
    assert pair_p_value(counts, joint) > 1e-3
    assert 0.5 * (counts / ROWS - joint).abs().sum() < 2.0 * (V * V / ROWS) ** 0.5


def test_negative_control_with_calibration_is_detected(setup, monkeypatch):
    force_costs(monkeypatch, TREE_ONLY, min_accept=0.05)
    target, head, prompt, joint = setup

    def accept_every_draft_with_mass(tree, probs, uniforms, final_uniform):
        return verify_sample(tree, probs, torch.zeros_like(uniforms), final_uniform)

    monkeypatch.setattr(step_module, "verify_sample", accept_every_draft_with_mass)
    counts, _ = _sample(target, head, prompt, calibrate="on", calibration_cache="memory")
    assert pair_p_value(counts, joint) < 1e-6


def test_negative_control_eager_acceptance_is_detected(setup, monkeypatch):
    target, head, prompt, joint = setup

    def accept_every_draft_with_mass(tree, probs, uniforms, final_uniform):
        return verify_sample(tree, probs, torch.zeros_like(uniforms), final_uniform)

    monkeypatch.setattr(step_module, "verify_sample", accept_every_draft_with_mass)
    counts, _ = _sample(target, head, prompt)
    assert pair_p_value(counts, joint) < 1e-6


def test_plain_mode_samples_the_target_distribution(setup):
    """Speculation off: the second token comes from the plain step's inverse-CDF draw."""
    target, head, prompt, joint = setup
    counts, stats = _sample(target, head, prompt, speculate=False)
    assert not stats.speculate and stats.cycles == 1
    assert counts[joint == 0].sum() == 0, "a token top-k / top-p removed was emitted"
    assert pair_p_value(counts, joint) > 1e-3
    assert 0.5 * (counts / ROWS - joint).abs().sum() < 2.0 * (V * V / ROWS) ** 0.5


def test_negative_control_plain_mode_without_the_warpers_is_detected(setup, monkeypatch):
    import eagle_compile.runtime.plain_step as plain_module

    target, head, prompt, joint = setup
    monkeypatch.setattr(plain_module, "target_probs", lambda logits, params, values=None: torch.softmax(logits, -1))
    counts, _ = _sample(target, head, prompt, speculate=False)
    assert counts[joint == 0].sum() > 100, "the broken step emits tokens top-k / top-p removed"


def test_the_distribution_holds_with_a_copy_branch(setup):
    """The prompt twice: a first token that occurred in it makes the lookup propose what followed it there,
    a copy branch beside the draft's child at the root, tried after it. Still the target's distribution (the
    check's power against a broken verifier: test_negative_control_eager_acceptance_is_detected)."""
    target, head, prompt, _ = setup
    looped = torch.cat([prompt, prompt], 1)
    counts, stats = _sample(target, head, looped, depth=1, top_k=1, total_tokens=2, copy=3)
    assert stats.copied_tokens > 50          # rows whose accepted path went through the copy branch (~2 %)
    joint = _analytic(target, looped)
    assert pair_p_value(counts, joint) > 1e-3
    assert 0.5 * (counts / ROWS - joint).abs().sum() < 2.0 * (V * V / ROWS) ** 0.5

