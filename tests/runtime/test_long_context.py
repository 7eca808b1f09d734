"""Long context (issue 13 item 2): what a call does past each window (runtime/context_window.py), memory that
grows linearly with the prompt, and a 32K-token prompt decoded exactly on the CPU.

Past the target's window HF's own generate keeps going (RoPE extrapolation) and so do we, token for token;
past the draft head's window the head keeps drafting and the output stays exact; what cannot be exact (RoPE
recomputed per forward, a sliding window) is refused before any work with the lengths. Each refusal is paired
with the proof that it is needed: the model's tokens really depend on what we would get wrong.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch
from tiny import greedy_reference, ragged, random_head, tiny_target
from transformers import DynamicCache

import eagle_compile
from eagle_compile.core.tree import TreeShape
from eagle_compile.errors import OptionsError, UnsupportedGenerationError, UnsupportedModelError
from eagle_compile.runtime.decoder import cache_slots_needed, positions_reached

TREE = {"depth": 3, "top_k": 2, "total_tokens": 6, "prefill_chunk": 16}
MODES = {"tree": TREE, "plain": {"speculate": False, "prefill_chunk": 16}}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

_spec = importlib.util.spec_from_file_location(
    "gpu_memory", Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "memory.py")
gpu_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_memory)


def prompt(length: int, seed: int = 1, vocab: int = 96) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def generate(target, ids, options, max_new, head=None, **kwargs):
    head = head if head is not None else random_head(target, flags=True, seed=3, reduced=False)
    return eagle_compile.generate(target, ids, draft=head, options=options, max_new_tokens=max_new,
                                  return_dict_in_generate=True, **kwargs)


def notes_about(out, what: str) -> list[str]:
    return [n for n in out.stats.notes if what in n]


# -- the target's window -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def window64():
    """A target with a 64-token window and a random head (its window copied from the target's: 64 too)."""
    target = tiny_target("llama", seed=11, max_position_embeddings=64)
    return target, random_head(target, flags=True, seed=3, reduced=False)


@pytest.mark.parametrize("case", ["default rope, tree", "llama3 rope, plain"])
def test_past_the_target_window_equals_generate_and_says_so(case, window64):
    """A 64-token window, 50 prompt tokens + 30 new: HF runs past the window (its output is 80 long) and we give
    its tokens, with a note and one warning; a call inside the window gets no note. The plain mode runs no head,
    so it notes nothing about the head's window."""
    if case == "default rope, tree":
        (target, head), options = window64, TREE
    else:
        target = tiny_target("llama", seed=11, max_position_embeddings=64, rope_parameters=LLAMA3)
        options = MODES["plain"]
        head = random_head(target, flags=True, seed=3, reduced=False)
    ids = prompt(50)
    ref = greedy_reference(target, ids, max_new_tokens=30)
    assert ref.shape[1] == 80 > target.config.max_position_embeddings
    with pytest.warns(UserWarning, match=r"past the target's max_position_embeddings \(64\)"):
        out = generate(target, ids, options, 30, head=head)
    assert torch.equal(out.sequences, ref)
    assert len(notes_about(out, "past the target's max_position_embeddings (64)")) == 1
    assert "reached 80 tokens" in notes_about(out, "target's")[0]
    assert len(notes_about(out, "draft head's max_position_embeddings (64)")) == (options is TREE)
    inside = generate(target, ids[:, :20], options, 10, head=head)
    assert torch.equal(inside.sequences, greedy_reference(target, ids[:, :20], max_new_tokens=10))
    assert not notes_about(inside, "max_position_embeddings")


def test_default_length_is_hfs_capped_at_the_window(window64):
    """Without max_new_tokens HF generates 20 new tokens, the total capped at max_position_embeddings, and
    refuses a prompt that fills the window; so do we (this used to raise a TypeError on None)."""
    target, head = window64
    for length, new in ((10, 20), (50, 14)):
        ids = prompt(length)
        with torch.no_grad():
            ref = target.generate(ids, do_sample=False)
        out = eagle_compile.generate(target, ids, draft=head, options=TREE)
        assert ref.shape[1] - length == new and torch.equal(out, ref)
    with pytest.raises(ValueError), torch.no_grad():
        target.generate(prompt(64), do_sample=False)
    with pytest.raises(ValueError, match=r"input_ids has 64 tokens but max_length \(HF's default.*\) is 64"):
        eagle_compile.generate(target, prompt(64), draft=head, options=TREE)


# -- RoPE recomputed per forward ---------------------------------------------------------------------------------
def test_dynamic_rope_target_is_refused_before_any_work():
    """'dynamic' RoPE decides inside the forward with a data-dependent branch (dynamo failed deep inside with
    "Data-dependent branching"); now a clear error at the first call. HF itself decodes the model."""
    target = tiny_target("llama", seed=11, max_position_embeddings=64,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert greedy_reference(target, prompt(20), max_new_tokens=4).shape == (1, 24)
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic'.*model.generate"):
        generate(target, prompt(20), MODES["plain"], 4)


def test_longrope_is_exact_below_its_original_window_and_refused_past_it():
    """longrope switches every position of a forward to its long factors once the forward passes
    original_max_position_embeddings (64): HF's logits then depend on how the sequence is cut into forwards, so
    a call that may pass it is refused; one that stays below is exact."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [16.0] * 4,
            "original_max_position_embeddings": 64}
    target = tiny_target("llama", seed=11, max_position_embeddings=256, rope_parameters=rope)
    long_ids = prompt(80)
    with torch.no_grad():                               # the proof: one forward vs the same tokens in two
        whole = target(long_ids).logits
        split = DynamicCache(config=target.config)
        parts = torch.cat([target(long_ids[:, :32], cache=split).logits,
                           target(long_ids[:, 32:], cache=split).logits], 1)
    assert (whole - parts).abs().max() > 1e-3
    ids = prompt(20)
    out = generate(target, ids, TREE, 10)
    assert torch.equal(out.sequences, greedy_reference(target, ids, max_new_tokens=10))
    with pytest.raises(UnsupportedGenerationError, match=r"longrope.*original_max_position_embeddings 64.*"
                                                         r"longest prompt 80 \+ max_new_tokens 10"):
        generate(target, long_ids, TREE, 10)


# -- a sliding window --------------------------------------------------------------------------------------------
def test_sliding_window_is_exact_inside_and_refused_past_it():
    """Mistral with sliding_window 24: up to 24 tokens in all the window changes nothing and we are exact; at
    52 HF's tokens differ from those of the same weights with full attention (the proof), so the call is refused
    with the lengths."""
    target = tiny_target("mistral", seed=11, sliding_window=24)
    ids = prompt(12)
    out = generate(target, ids, TREE, 12)
    assert torch.equal(out.sequences, greedy_reference(target, ids, max_new_tokens=12))
    long_ids = prompt(40)
    full_attention = tiny_target("mistral", seed=11, sliding_window=None)
    assert not torch.equal(greedy_reference(target, long_ids, max_new_tokens=12),
                           greedy_reference(full_attention, long_ids, max_new_tokens=12))
    with pytest.raises(UnsupportedGenerationError, match=r"\(40 tokens\) \+ max_new_tokens \(12\) = 52.*"
                                                         r"sliding window \(24\)"):
        generate(target, long_ids, TREE, 12)


# -- the draft head's window -------------------------------------------------------------------------------------
def test_past_the_draft_window_keeps_drafting_exactly():
    """A head with a 32-token window under a 512-token target: 40 prompt tokens + 16 new are past the head's
    window the whole time; it keeps drafting (draft work happened every cycle), the output equals HF's and a
    note says so, once."""
    target = tiny_target("llama", seed=11)
    head = random_head(target, flags=True, seed=3, reduced=False, max_position_embeddings=32)
    ids = prompt(40)
    ref = greedy_reference(target, ids, max_new_tokens=16)
    with pytest.warns(UserWarning, match=r"past the draft head's max_position_embeddings \(32\)"):
        out = generate(target, ids, TREE, 16, head=head)
    assert torch.equal(out.sequences, ref)
    assert out.stats.cycles > 0 and out.stats.draft_time > 0
    assert len(notes_about(out, "draft head's max_position_embeddings (32)")) == 1
    assert not notes_about(out, "target's max_position_embeddings")


def test_draft_head_with_dynamic_rope():
    """The host-loop step runs a 'dynamic' RoPE head eagerly (exact); a captured step program cannot hold its
    data-dependent branch (it failed deep inside dynamo) and is refused with the fix."""
    target = tiny_target("llama", seed=11)
    head = random_head(target, flags=True, seed=3, reduced=False, max_position_embeddings=32,
                       rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    ids = prompt(40)
    out = generate(target, ids, TREE, 12, head=head)
    assert torch.equal(out.sequences, greedy_reference(target, ids, max_new_tokens=12))
    with pytest.raises(OptionsError, match="rope_type 'dynamic'.*step_program=False"):
        generate(target, ids, {**TREE, "step_program": True}, 12, head=head)


# -- memory ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [None, TreeShape(7, 10, 60), TreeShape(4, 1, 5)], ids=["plain", "eagle", "chain"])
@pytest.mark.parametrize("chunk", [4096, 64])
def test_cache_slots_are_the_prompt_plus_a_constant(shape, chunk):
    """Slots = prompt + max_new + a constant of the options (prefill padding, a cycle's reach), for prompts of 1
    to 70K tokens: what is over the committed tokens never grows with the prompt."""
    over = [cache_slots_needed(n, 64, chunk, shape) - n - 64 for n in range(1, 70_000, 331)]
    assert all(0 < x <= max(chunk // 16, 2 * 16) + positions_reached(0, 0, shape) + 2 for x in over), max(over)
    assert max(over[len(over) // 2:]) <= max(over[:len(over) // 2])


def _peak_per_slot(run, length: int) -> float:
    _, peak = gpu_memory.peak_bytes(lambda: run(length))
    return peak / length


def test_peak_memory_grows_linearly_with_the_prompt():
    """Peak bytes allocated by a call (the profiler's timeline: every tensor, transient ones included), per
    prompt token, at 256 and 1024 tokens: it does not grow (the KV caches and per-chunk activations; no [T, S] or
    [S, S] tensor). The same measure on HF's eager-attention forward, which builds [L, L] attention weights,
    grows about 4x: the measure sees quadratic memory when there is some."""
    target = tiny_target("llama", seed=11, layers=2, dtype=torch.float32, max_position_embeddings=4096)
    head = random_head(target, flags=True, seed=3, reduced=False, capture_indices=(1,)).float()
    options = {**TREE, "prefill_chunk": 128, "cache_len_multiple": 16, "numerics": "eager"}

    def ours(length):
        return generate(target, prompt(length), options, 8, head=head)

    for length in (256, 1024):
        ours(length)                                             # capture the programs outside the measure
    small, large = (_peak_per_slot(ours, n) for n in (256, 1024))
    assert large <= 1.1 * small, (small, large)
    target.config._attn_implementation = "eager"

    def hf(length):
        with torch.no_grad():
            return target(prompt(length), logits_to_keep=1)

    small_hf, large_hf = (_peak_per_slot(hf, n) for n in (256, 1024))
    assert large_hf > 3 * small_hf, (small_hf, large_hf)


# -- long prompts ------------------------------------------------------------------------------------------------
def test_ragged_batch_over_many_prefill_chunks():
    """Three rows of 1000, 450 and 700 tokens in 64-token prefill chunks (16 chunks, rows ending in different
    chunks) with a tree and a random head (reduced vocabulary), a 512-token head window: HF's tokens."""
    target = tiny_target("llama", seed=11, max_position_embeddings=2048)
    head = random_head(target, flags=True, seed=3, reduced=True, max_position_embeddings=512)
    ids, mask = ragged([1000, 450, 700], seed=4)
    ref = greedy_reference(target, ids, attention_mask=mask, max_new_tokens=12)
    out = generate(target, ids, {"depth": 4, "top_k": 3, "total_tokens": 10, "prefill_chunk": 64}, 12,
                   head=head, attention_mask=mask)
    assert torch.equal(out.sequences, ref)
    assert out.stats.cycles > 0 and notes_about(out, "draft head's max_position_embeddings (512)")


def test_32k_prompt_decodes_exactly_on_cpu():
    """A 2-layer float32 target with a 32K window decodes a 32,760-token prompt (8 prefill chunks of 4096) with a
    tree and a random head whose window is 4096, token for token as HF greedy. numerics='eager': the
    batch-invariant attention kernel takes ~5x longer over a 32K prefill on one thread (measured: 8K tokens, 4
    layers, 12.5 s against 2.2 s), which would not fit in CI time; the default numerics are covered at short
    context by every other test."""
    torch.manual_seed(0)
    target = tiny_target("llama", seed=11, layers=2, dtype=torch.float32, max_position_embeddings=32768)
    head = random_head(target, flags=True, seed=3, reduced=False, capture_indices=(1,),
                       max_position_embeddings=4096).float()
    ids = prompt(32768 - 8)
    t = time.perf_counter()
    ref = greedy_reference(target, ids, max_new_tokens=8)
    hf_s = time.perf_counter() - t
    out = generate(target, ids, {"depth": 3, "top_k": 2, "total_tokens": 6, "numerics": "eager"}, 8, head=head)
    assert torch.equal(out.sequences, ref), f"HF generate took {hf_s:.1f} s"
    assert out.stats.cycles > 0
    assert notes_about(out, "draft head's max_position_embeddings (4096)")
    assert not notes_about(out, "target's max_position_embeddings")
