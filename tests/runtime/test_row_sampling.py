"""One sampling setting per row (`BatchSampling`, runtime/sampling.py): each row of a mixed batch is warped exactly
as Hugging Face's warpers warp it alone, greedy rows take the point mass on their argmax, and end to end a batch
whose rows sample with two different settings beside greedy rows emits, per row group, that group's own target
distribution (TESTING.md invariant 2) while the greedy rows equal plain greedy decoding token for token."""

from __future__ import annotations

import pytest
import torch
from distribution import hf_warpers, pair_counts, pair_p_value
from tiny import greedy_reference, tiny_target

from eagle_compile.draft.config import DraftConfig
from eagle_compile.draft.model import EagleDraftModel
from eagle_compile.errors import UnsupportedGenerationError
from eagle_compile.options import parse_options
from eagle_compile.runtime.generate import decoder_for
from eagle_compile.runtime.logits_processors import ProcessorSettings
from eagle_compile.runtime.sampling import (
    BatchSampling,
    RowSamplingValues,
    SamplingParams,
    process_logits,
    target_probs,
)
from eagle_compile.runtime.stopping import StopChecker

GREEDY = SamplingParams()
ROW_PARAMS = [
    SamplingParams(do_sample=True, temperature=0.7),
    GREEDY,
    SamplingParams(do_sample=True, top_k=5),
    SamplingParams(do_sample=True, top_k=100, top_p=0.8),
    SamplingParams(do_sample=True, top_p=0.0),
    SamplingParams(do_sample=True, temperature=1.4, top_k=3, top_p=0.5),
    None,                                                      # a free row: decoded as greedy, never read
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_row_is_warped_as_hf_warps_it_alone(dtype):
    # half-integer logits: many exact ties at the top-k and top-p boundaries
    logits = torch.randint(-6, 6, (len(ROW_PARAMS), 4, 50), generator=torch.Generator().manual_seed(0)).to(dtype) / 2
    batch = BatchSampling.of(ROW_PARAMS)
    values = batch.new_values("cpu")
    values.load(batch)
    structure = batch.structure()
    ours = process_logits(logits, structure, values)
    probs = target_probs(logits, structure, values)
    for b, params in enumerate(ROW_PARAMS):
        if params is None or not params.do_sample:
            assert torch.equal(probs[b], target_probs(logits[b], GREEDY)), b     # the point mass on its argmax
            continue
        assert torch.equal(ours[b], hf_warpers(params)(None, logits[b])), b
        assert torch.equal(probs[b], hf_warpers(params)(None, logits[b]).softmax(-1)), b
    # the plain step's [B, V] logits broadcast the same way
    flat = target_probs(logits[:, 0], structure, values)
    for b, params in enumerate(ROW_PARAMS):
        alone = GREEDY if params is None else params
        assert torch.equal(flat[b], target_probs(logits[b, 0], alone)), b


def test_values_keep_one_set_of_tensors_per_batch_size():
    """A captured program (or CUDA graph) of a bucket reads the same memory every call."""
    a = BatchSampling.of([ROW_PARAMS[0], GREEDY])
    b = BatchSampling.of([GREEDY, ROW_PARAMS[2]])
    values = a.new_values("cpu")
    values.load(a)
    first = values.temperature
    values.load(b)
    assert values.temperature is first and values.sample.tolist() == [False, True]
    values.load(BatchSampling.of(ROW_PARAMS))
    assert values.temperature is not first and values.temperature.shape == (len(ROW_PARAMS),)


def test_rows_that_agree_are_one_setting_and_mixed_rows_have_their_own_programs():
    hot = SamplingParams(do_sample=True, temperature=0.7, top_k=20)
    assert BatchSampling.of([hot, None, hot]) is hot
    assert BatchSampling.of([None, None]) == GREEDY
    mixed = BatchSampling.of([hot, GREEDY, SamplingParams(do_sample=True, top_k=40, top_p=0.9)])
    assert isinstance(mixed, BatchSampling) and mixed.do_sample
    assert mixed.structure() == SamplingParams(do_sample=True, top_k=64, top_p=0.5)   # the widest structure
    assert mixed.program_key == ("rows", True, 64, True, None) != mixed.structure().program_key
    # numbers alone do not change the program
    other = BatchSampling.of([SamplingParams(do_sample=True, temperature=1.2, top_k=50, top_p=0.3), GREEDY, GREEDY])
    assert other.program_key == mixed.program_key


def test_rows_with_different_logits_processors_are_refused():
    penalised = SamplingParams(processors=ProcessorSettings(repetition_penalty=1.3))
    with pytest.raises(UnsupportedGenerationError, match="different logits processors"):
        BatchSampling.of([GREEDY, penalised])


def test_a_row_setting_per_prompt_must_match_the_prompts():
    target = tiny_target("llama", vocab=16)
    decoder = decoder_for(target, None, parse_options({"speculate": False}))
    prompts = [torch.tensor([5, 9, 3]), torch.tensor([4, 2])]
    with pytest.raises(ValueError, match="a sequence of 2"):
        decoder.generate(prompts, StopChecker(prompts, max_new_tokens=2, eos_token_ids=()), [GREEDY])


# --- end to end: a mixed batch --------------------------------------------------------------------------------

V, ROWS = 16, 3000
HOT = SamplingParams(do_sample=True, temperature=1.3, top_k=10, top_p=0.95)
COOL = SamplingParams(do_sample=True, temperature=0.4)                      # no top-k, no top-p: other programs
GREEDY_ROWS = 12


@pytest.fixture(scope="module")
def mixed():
    return _decode_mixed()


def _decode_mixed():
    target = tiny_target("llama", seed=4, vocab=V, dtype=torch.float64)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)        # a spread-out distribution: many tokens with real mass
    torch.manual_seed(0)
    head = EagleDraftModel(DraftConfig.for_target(target.config, None, fc_norm=True, norm_output=True))
    head = head.to(torch.float64).eval()
    head.tie_target_embedding(target)
    prompt = torch.tensor([5, 9, 3, 12, 7])
    settings = [HOT, COOL] * (ROWS // 2) + [GREEDY] * GREEDY_ROWS
    prompts = [prompt] * len(settings)
    options = parse_options({"depth": 3, "top_k": 2, "total_tokens": 6, "prefill_chunk": 8,
                             "batch_buckets": (len(settings),)})
    decoder = decoder_for(target, head, options)
    stopper = StopChecker(prompts, max_new_tokens=2, eos_token_ids=())
    torch.manual_seed(1234)
    stats = decoder.generate(prompts, stopper, settings, torch.Generator().manual_seed(1234))
    out = torch.stack([torch.cat([prompt, torch.tensor(g)]) for g in stopper.generated])
    per_row = [key for key in decoder._steps if key[0][0] == "rows"]
    assert per_row, "the mixed batch never ran a per-row program"
    return target, prompt, settings, out, stats


def _analytic(target, prompt, params):
    """P(x1, x2) with HF's processing for `params`."""
    with torch.no_grad():
        p1 = target_probs(target(prompt[None]).logits[0, -1].float(), params).double()
        seqs = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
        p2 = target_probs(target(seqs).logits[:, -1].float(), params).double()
    return p1[:, None] * p2


def test_each_row_group_follows_its_own_setting(mixed):
    target, prompt, settings, out, stats = mixed
    assert stats.cycles >= 1 and len(stats.acceptance_lengths) > 0       # the second token came from a cycle
    for params in (HOT, COOL):
        rows = [b for b, p in enumerate(settings) if p is params]
        counts = pair_counts(out[rows], V)
        assert pair_p_value(counts, _analytic(target, prompt, params)) > 1e-3, params


def test_negative_control_a_group_checked_against_the_other_setting_fails(mixed):
    """The check tells the two settings apart."""
    target, prompt, settings, out, _ = mixed
    for params, other in ((HOT, COOL), (COOL, HOT)):
        rows = [b for b, p in enumerate(settings) if p is params]
        assert pair_p_value(pair_counts(out[rows], V), _analytic(target, prompt, other)) < 1e-6


def test_negative_control_one_setting_for_every_row_is_detected(monkeypatch):
    """A batch whose programs read the first row's numbers for every row (what a batch-wide setting does)."""
    load = RowSamplingValues.load
    monkeypatch.setattr(RowSamplingValues, "load",
                        lambda self, params: load(self, BatchSampling((params.rows[0],) * len(params.rows))))
    target, prompt, settings, out, _ = _decode_mixed()
    rows = [b for b, p in enumerate(settings) if p is COOL]
    assert pair_p_value(pair_counts(out[rows], V), _analytic(target, prompt, COOL)) < 1e-6


def test_greedy_rows_beside_sampled_rows_equal_plain_greedy(mixed):
    target, prompt, settings, out, _ = mixed
    want = greedy_reference(target, prompt[None], max_new_tokens=2)[0]
    greedy = [b for b, p in enumerate(settings) if p is GREEDY]
    assert len(greedy) == GREEDY_ROWS
    assert all(torch.equal(out[b], want) for b in greedy)
