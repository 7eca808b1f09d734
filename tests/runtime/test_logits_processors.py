"""HF's history-reading logits processors, losslessly (issue 13 item 5; TESTING.md invariants 1, 2, 7, 9).

Every tree node is processed from its own path (history + the draft tokens leading to it), so speculative greedy
equals `model.generate(do_sample=False, <same settings>)` token for token, and sampling follows the processed
distribution. Each setting is chosen from the plain greedy output so that it changes the output (asserted), the
oracle drafter proposes HF's processed continuation so that processed nodes are accepted (asserted: accepted
draft tokens > 0), and a variant that processes every node from the root's context alone must fail the same
equality (negative control).
"""

from __future__ import annotations

import pytest
import torch
from distribution import pair_counts, pair_p_value
from tiny import ScriptedDrafter, continuations, greedy_reference, ragged, rotate_programs, tiny_target
from transformers import GenerationConfig
from transformers.generation import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import eagle_compile
import eagle_compile.runtime.logits_processors as lp
from eagle_compile.errors import UnsupportedGenerationError

TREE = {"depth": 4, "top_k": 3, "total_tokens": 10, "prefill_chunk": 8}
NEW = 24


@pytest.fixture(scope="module")
def setup():
    model = tiny_target("llama", seed=3)
    ids, mask = ragged([5, 11], seed=2)                      # batch 2, left-padded (ragged)
    plain = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=NEW)
    return model, ids, mask, plain


def settings(name: str, ids: torch.Tensor, plain: torch.Tensor) -> dict:
    """Generation settings that bite on this batch: built from the tokens plain greedy emits."""
    g0, g1 = plain[0, ids.shape[1]:].tolist(), plain[1, ids.shape[1]:].tolist()
    eos = {"eos_token_id": g0[2]}                                  # row 0 would stop at its 3rd new token
    table = {
        "repetition_penalty": {"repetition_penalty": 1.6},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
        "min_new_tokens": {"min_new_tokens": 12, **eos},
        "min_length": {"min_length": ids.shape[1] + 12, **eos},
        "bad_words_ids": {"bad_words_ids": [[g0[0]], [g1[3], g1[4]]]},
        "sequence_bias": {"sequence_bias": [[[g0[1]], -6.0], [[g1[2], g1[3]], -9.0], [[g1[0]], 1.5]]},
        "suppress_tokens": {"suppress_tokens": [g0[1], g1[1]]},
        "begin_suppress_tokens": {"begin_suppress_tokens": [g0[0], g1[0]]},
    }
    if name == "combined":
        return {**table["repetition_penalty"], "repetition_penalty": 1.3, "no_repeat_ngram_size": 3,
                **table["bad_words_ids"], **table["min_new_tokens"], **table["sequence_bias"],
                "suppress_tokens": [g1[1]], **table["begin_suppress_tokens"]}
    return table[name]


def without_processors(kwargs: dict) -> dict:
    return {k: v for k, v in kwargs.items() if k == "eos_token_id"}


def speculative(model, ids, mask, ref, kwargs, *, mode="oracle", options=TREE, new=NEW):
    drafter = ScriptedDrafter(continuations(ids, mask, ref), 96, mode)
    return eagle_compile.generate(model, ids, attention_mask=mask, draft=drafter, options=options,
                                  max_new_tokens=new, return_dict_in_generate=True, **kwargs)


def accepted_draft_tokens(stats) -> int:
    return sum(length - 1 for length in stats.acceptance_lengths)


NAMES = ["repetition_penalty", "no_repeat_ngram_size", "min_new_tokens", "min_length", "bad_words_ids",
         "sequence_bias", "suppress_tokens", "begin_suppress_tokens", "combined"]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_hf_with_each_setting(setup, name):
    model, ids, mask, _ = setup
    kwargs = settings(name, ids, setup[3])
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=NEW, **kwargs)
    baseline = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=NEW, **without_processors(kwargs))
    assert not torch.equal(ref, baseline), "the setting does not change HF's output: the test would prove nothing"
    out = speculative(model, ids, mask, ref, kwargs)
    assert torch.equal(out.sequences, ref)
    assert accepted_draft_tokens(out.stats) > NEW // 2          # processed tree nodes were accepted


@pytest.mark.parametrize("name", ["repetition_penalty", "combined"])
def test_an_adversarial_drafter_stays_exact(setup, name):
    model, ids, mask, plain = setup
    kwargs = settings(name, ids, plain)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=NEW, **kwargs)
    out = speculative(model, ids, mask, ref, kwargs, mode="adversarial")
    assert torch.equal(out.sequences, ref)
    assert accepted_draft_tokens(out.stats) == 0


@pytest.mark.parametrize("name", ["no_repeat_ngram_size", "combined"])
def test_the_calibration_layer_and_the_plain_step_stay_exact(setup, name, monkeypatch):
    """Every menu program in turn, the plain step first (processed from the history alone), then trees."""
    rotate_programs(monkeypatch)
    model, ids, mask, plain = setup
    kwargs = settings(name, ids, plain)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=NEW, **kwargs)
    out = speculative(model, ids, mask, ref, kwargs,
                      options={**TREE, "calibrate": "on", "calibration_cache": "memory"})
    assert torch.equal(out.sequences, ref)
    assert out.stats.calibration["policy"]["chosen"]["plain"] > 0 and accepted_draft_tokens(out.stats) > 0


def test_plain_mode_equals_hf(setup):
    model, ids, mask, plain = setup
    kwargs = settings("combined", ids, plain)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=NEW, **kwargs)
    out = eagle_compile.generate(model, ids, attention_mask=mask, options={"speculate": False, "prefill_chunk": 8},
                                 max_new_tokens=NEW, **kwargs)
    assert torch.equal(out, ref)


def test_the_copy_branch_stays_exact(setup):
    model, ids, mask, plain = setup
    kwargs = settings("repetition_penalty", ids, plain)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=NEW, **kwargs)
    out = speculative(model, ids, mask, ref, kwargs, mode="adversarial", options={**TREE, "copy": 4})
    assert torch.equal(out.sequences, ref)


def test_hf_door_custom_generate(setup):
    """model.generate(custom_generate=...) hands over the processors HF built from the same settings."""
    model, ids, mask, plain = setup
    kwargs = settings("combined", ids, plain)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=NEW, **kwargs)
    drafter = ScriptedDrafter(continuations(ids, mask, ref), 96, "oracle")
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         custom_generate=eagle_compile.generate, draft=drafter, options=TREE, **kwargs)
    assert torch.equal(out, ref)


def root_context_only(history, tree):
    """The deliberately wrong variant: every node processed as if it were the root (no path tokens)."""
    rows, nodes = tree.tokens.shape
    return history.tokens[:, None, :].expand(rows, nodes, -1), history.length[:, None].expand(rows, nodes)


@pytest.mark.parametrize("name", ["repetition_penalty", "no_repeat_ngram_size", "combined"])
def test_negative_control_root_context_breaks_equality(setup, name, monkeypatch):
    model, ids, mask, plain = setup
    kwargs = settings(name, ids, plain)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=NEW, **kwargs)
    monkeypatch.setattr(lp, "node_sequences", root_context_only)
    out = speculative(model, ids, mask, ref, kwargs)
    assert not torch.equal(out.sequences, ref)


# -- the processors themselves against HF's, node by node ------------------------------------------------------
def test_every_node_gets_hfs_scores_for_its_path():
    """process_nodes on a hand-built tree == HF's processors run on each node's sequence one at a time."""
    from types import SimpleNamespace

    from eagle_compile.core.tree import ancestor_matrix
    from eagle_compile.runtime.sampling import SamplingParams

    kwargs = {"repetition_penalty": 1.7, "no_repeat_ngram_size": 2, "bad_words_ids": [[4, 6], [9]],
              "sequence_bias": [[[3], 2.5], [[6, 5], -1.5], [[2, 5], 0.75]], "min_new_tokens": 3,
              "eos_token_id": 7, "suppress_tokens": [8], "begin_suppress_tokens": [5], "min_length": 9}
    gc = GenerationConfig(**kwargs)
    params = SamplingParams.from_generation_config(gc)
    prompt = torch.tensor([[0, 0, 3, 4, 6, 5], [2, 5, 6, 4, 3, 1]])     # row 0 left-padded by 2
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    history = lp.TokenHistory.start(prompt, mask, rows=2, room=8)
    history.append(torch.tensor([[2], [4]]), torch.tensor([1, 1]))      # the root: the first emitted token
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2], [-1, 0, 1, 1, 0, 4]])
    tokens = torch.tensor([[2, 5, 4, 6, 5, 2], [4, 6, 5, 4, 2, 5]])
    depth = torch.zeros_like(parents)
    for i in range(1, 6):
        depth[:, i] = depth.gather(1, parents[:, i:i + 1].clamp(min=0))[:, 0] + 1
    tree = SimpleNamespace(tokens=tokens, parents=parents, depth=depth, max_depth=int(depth.max()),
                           ancestors=ancestor_matrix(parents, int(depth.max())))
    scores = torch.randn(2, 6, 12, generator=torch.Generator().manual_seed(0))
    got = lp.process_nodes(scores, params.processors, history, tree)

    hf_model = tiny_target("llama", vocab=12, layers=1)
    gc._eos_token_tensor = torch.tensor([7])            # what generate's _prepare_special_tokens sets
    for b in range(2):                                  # HF's own processor list, as generate builds it
        procs = hf_model._get_logits_processor(gc, input_ids_seq_length=6,
                                               model_kwargs={"attention_mask": mask[b:b + 1]})
        for i in range(6):
            path = [int(tokens[b, j]) for j in range(1, 6) if tree.ancestors[b, i, j]]
            seq = torch.tensor([prompt[b].tolist() + [int(tokens[b, 0])] + path])
            want = procs(seq, scores[b, i][None].clone())[0]
            assert torch.equal(got[b, i], want), (b, i, seq.tolist())
    assert bool(torch.isinf(got).any()) and not torch.equal(got, scores)   # the processors did something


# -- sampling: the distribution of the 2nd and 3rd tokens with a repetition penalty --------------------------------
# The 3rd token is where a node's own path matters: when the drafted 2nd token is accepted, the 3rd comes from the
# node at depth 1, whose penalty must include that drafted token. A scripted drafter proposes the most likely
# path (often accepted: the target is sharpened), so the root-context variant is caught.
V, ROWS = 16, 6000
CHUNK = 1500          # rows per generate call: 4 calls, ~a quarter of one 6000-row batch's memory
SAMPLING = {"do_sample": True, "temperature": 1.2, "top_k": 12}
PENALTY = 3.0


@pytest.fixture(scope="module")
def sampling_setup():
    target = tiny_target("llama", seed=4, vocab=V)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)
    prompt = torch.tensor([[5, 9, 3, 12, 7]])
    p1 = _hf_probs(target, prompt)[0]                                               # [V]
    two = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], 1)
    p2 = _hf_probs(target, two)                                                     # [V, V]
    three = torch.cat([two.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
    p3 = _hf_probs(target, three).view(V, V, V)
    joint = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)                       # P(x2, x3)
    a = int(p1.argmax())
    b = int(p2[a].argmax())
    path = prompt[0].tolist() + [a, b, int(p3[a, b].argmax())]
    return target, ScriptedDrafter([path] * CHUNK, V, "oracle"), prompt, joint


def _hf_probs(target, seqs):
    """HF's processing of the next token after each of `seqs` [N, L]: float32, penalty, warpers, softmax."""
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(PENALTY), TemperatureLogitsWarper(1.2),
                                 TopKLogitsWarper(12)])
    with torch.no_grad():
        return procs(seqs, target(seqs).logits[:, -1].float()).softmax(-1).double()


def _sample(target, drafter, prompt, **options):
    """ROWS independent rows in batches of CHUNK: their pair counts, and the last call's statistics with every
    call's acceptance lengths."""
    torch.manual_seed(1234)
    counts, lengths = torch.zeros(V, V, dtype=torch.float64), []
    for _ in range(ROWS // CHUNK):
        out = eagle_compile.generate(target, prompt.repeat(CHUNK, 1), draft=drafter, max_new_tokens=3,
                                     options={"depth": 3, "top_k": 2, "total_tokens": 6, "prefill_chunk": 8,
                                              "batch_buckets": (CHUNK,), **options},
                                     return_dict_in_generate=True, repetition_penalty=PENALTY, **SAMPLING)
        counts += pair_counts(out.sequences, V)
        lengths += out.stats.acceptance_lengths
    out.stats.acceptance_lengths = lengths
    return counts, out.stats


def test_sampling_follows_the_processed_distribution(sampling_setup):
    target, drafter, prompt, joint = sampling_setup
    counts, stats = _sample(target, drafter, prompt)
    through_node = sum(n for length, n in stats.histogram.items() if length >= 2)   # the 2nd token was drafted
    assert through_node > 1000, "the depth-1 node rarely decided a token: the test would prove little"
    assert counts[joint == 0].sum() == 0
    assert pair_p_value(counts, joint) > 1e-3
    assert 0.5 * (counts / ROWS - joint).abs().sum() < 2.0 * (V * V / ROWS) ** 0.5


def test_plain_mode_samples_the_processed_distribution(sampling_setup):
    target, drafter, prompt, joint = sampling_setup
    counts, stats = _sample(target, drafter, prompt, speculate=False)
    assert not stats.speculate and stats.cycles == 2
    assert counts[joint == 0].sum() == 0
    assert pair_p_value(counts, joint) > 1e-3
    assert 0.5 * (counts / ROWS - joint).abs().sum() < 2.0 * (V * V / ROWS) ** 0.5


def test_negative_control_sampling_from_the_root_context_is_detected(sampling_setup, monkeypatch):
    target, drafter, prompt, joint = sampling_setup
    monkeypatch.setattr(lp, "node_sequences", root_context_only)
    counts, _ = _sample(target, drafter, prompt)
    assert pair_p_value(counts, joint) < 1e-6


# -- what stays refused -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("option", ["step_program", "cudagraphs"])
def test_programs_without_the_processors_are_refused(setup, option):
    model, ids, mask, plain = setup
    with pytest.raises(UnsupportedGenerationError, match=f"repetition_penalty.*{option}=True.*'{option}': False"):
        speculative(model, ids, mask, plain, {"repetition_penalty": 1.2}, options={**TREE, option: True})


@pytest.mark.parametrize("setting", [{"encoder_repetition_penalty": 1.3}, {"encoder_no_repeat_ngram_size": 2}])
def test_encoder_settings_stay_refused(setup, setting):
    model, ids, mask, plain = setup
    name = next(iter(setting))
    with pytest.raises(UnsupportedGenerationError, match=f"{name}=.*not implemented per tree node; use"):
        speculative(model, ids, mask, plain, setting)


def test_a_processor_the_config_does_not_imply_is_refused(setup):
    model, ids, mask, plain = setup
    with pytest.raises(UnsupportedGenerationError, match="RepetitionPenaltyLogitsProcessor.*set repetition_penalty"):
        eagle_compile.generate(model, ids, attention_mask=mask, draft=ScriptedDrafter([], 96), options=TREE,
                               max_new_tokens=4, logits_processor=[RepetitionPenaltyLogitsProcessor(1.5)])


def test_token_ids_outside_the_vocabulary_are_refused(setup):
    model, ids, mask, plain = setup
    with pytest.raises(UnsupportedGenerationError, match=r"token ids \[500\].*vocabulary \[0, 96\)"):
        speculative(model, ids, mask, plain, {"bad_words_ids": [[500]]})


def test_no_processor_configured_leaves_the_fast_path_untouched(setup, monkeypatch):
    """HF's defaults configure no processor: `SamplingParams.processors` is None and nothing here runs."""
    import eagle_compile.runtime.decoder as decoder_module
    import eagle_compile.runtime.plain_step as plain_module
    import eagle_compile.runtime.step as step_module
    from eagle_compile.runtime.sampling import SamplingParams

    assert SamplingParams.from_generation_config(GenerationConfig(do_sample=True)).processors is None
    assert SamplingParams.from_generation_config(GenerationConfig(repetition_penalty=1.0, bad_words_ids=None,
                                                                  min_new_tokens=0)).processors is None

    def never(*args):
        raise AssertionError("a logits processor ran although none was configured")

    for module, name in ((step_module, "process_nodes"), (plain_module, "process_next"),
                         (decoder_module, "process_next"), (decoder_module.TokenHistory, "start")):
        monkeypatch.setattr(module, name, never)
    model, ids, mask, plain = setup
    rotate_programs(monkeypatch)
    out = speculative(model, ids, mask, plain, {}, options={**TREE, "calibrate": "on", "calibration_cache": "memory"})
    assert torch.equal(out.sequences, plain)
    assert out.stats.calibration["policy"]["chosen"]["plain"] > 0


@pytest.mark.slow
def test_the_real_target_with_the_shipped_head():
    """SmolLM2-135M-Instruct with the shipped head: greedy with a repetition penalty and n-gram blocking equals
    HF's, 32 tokens, with draft tokens accepted."""
    from eagle_compile.heads import shipped_head

    torch.set_num_threads(2)
    model, tokenizer = eagle_compile.load_default_target(torch.float32)
    draft = eagle_compile.load_draft(shipped_head(), target=model, dtype=torch.float32)
    messages = [[{"role": "user", "content": "Write a short poem about the sea and the sea again."}],
                [{"role": "user", "content": "List three colours."}]]
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    kwargs = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 3, "max_new_tokens": 32}
    with torch.no_grad():
        ref = model.generate(**batch, do_sample=False, **kwargs)
        plain = model.generate(**batch, do_sample=False, max_new_tokens=32)
    assert not torch.equal(ref, plain)
    out = eagle_compile.generate(model, batch["input_ids"], attention_mask=batch["attention_mask"], draft=draft,
                                 options={"numerics": "eager", "calibrate": "off"}, return_dict_in_generate=True,
                                 **kwargs)
    assert torch.equal(out.sequences, ref)
    assert accepted_draft_tokens(out.stats) > 0


def test_min_new_tokens_takes_precedence_over_min_length(setup):
    """HF replaces min_length by min_new_tokens + the prompt width when both are given."""
    model, ids, mask, plain = setup
    eos = {"eos_token_id": int(plain[0, ids.shape[1] + 2])}
    kwargs = {"min_new_tokens": 4, "min_length": ids.shape[1] + 20, **eos}
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=NEW, **kwargs)
    long = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=NEW, min_length=kwargs["min_length"], **eos)
    assert not torch.equal(ref, long), "min_length alone gives the same output: the precedence would not show"
    out = speculative(model, ids, mask, ref, kwargs)
    assert torch.equal(out.sequences, ref)


def test_rows_that_advance_at_different_rates_stay_exact(setup):
    """Row 0 drafts HF's processed continuation, row 1 the unprocessed one (right until the processors change
    it): the rows' histories grow at different rates within one batch."""
    model, ids, mask, plain = setup
    kwargs = settings("bad_words_ids", ids, plain)          # row 1's output changes at its 5th new token
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=NEW, **kwargs)
    drafter = ScriptedDrafter([continuations(ids, mask, ref)[0], continuations(ids, mask, plain)[1]], 96)
    out = eagle_compile.generate(model, ids, attention_mask=mask, draft=drafter, options=TREE, max_new_tokens=NEW,
                                 return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, ref)
    rows = out.stats.row_acceptance
    assert sum(rows[0]) / len(rows[0]) > sum(rows[1]) / len(rows[1]) > 1.0     # ragged, and row 1 accepted some


def test_measured_calibration_costs_with_processors(setup):
    """The calibration layer times every program on scratch copies of the row state, history included (many
    cycles past a short call's room): the call stays exact."""
    model, ids, mask, plain = setup
    kwargs = settings("no_repeat_ngram_size", ids, plain)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=4, **kwargs)
    out = speculative(model, ids, mask, ref, kwargs, new=4,
                      options={**TREE, "calibrate": "on", "calibration_cache": "memory"})
    assert torch.equal(out.sequences, ref)
    assert "measured now" in next(iter(out.stats.calibration["costs"].values()))
