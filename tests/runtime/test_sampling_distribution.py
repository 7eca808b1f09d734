"""Invariant 2 (TESTING.md), lossless sampling: `verify_sample` emits tokens from exactly the target
distribution, and the target distribution is Hugging Face's (temperature, top-k, top-p).

The statistical check compares, for every tree node n that enough rows reach, the token emitted right
after the path to n (given that the emitted prefix equals that path) with `probs[n]`: chi-square p > 1e-3 and
total variation < C_TV * sqrt(V / rows). A literal, sequential implementation of the spec (`reference_sample`)
is run through the same check with two deliberate bugs, and the check must reject both (negative control).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from distribution import hf_warpers
from scipy.stats import chisquare
from transformers import GenerationConfig

from eagle_compile.core.verify import draw_uniforms, verify_sample
from eagle_compile.errors import UnsupportedGenerationError
from eagle_compile.runtime.logits_processors import ProcessorSettings
from eagle_compile.runtime.sampling import (
    HF_GENERATION_DEFAULTS,
    SamplingParams,
    SamplingValues,
    process_logits,
    target_probs,
)

VOCAB = 12
ROWS = 200_000
P_MIN = 1e-3
C_TV = 1.0
MIN_ROWS = 1_000  # a node's check runs when at least this many rows emit its path

# root with 3 children; child 1 has 2 children; child 2 starts a chain to depth 3
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 6]
CHAIN_PARENTS = [-1, 0, 1, 2]


# --- the statistical check ----------------------------------------------------------------------------------

@dataclass
class Check:
    label: str
    rows: int
    p_value: float
    tv: float

    @property
    def bound(self) -> float:
        return C_TV * math.sqrt(VOCAB / self.rows)

    @property
    def ok(self) -> bool:
        return self.p_value > P_MIN and self.tv < self.bound


def compare(label: str, emitted: torch.Tensor, p: torch.Tensor) -> Check:
    """Chi-square and total variation of the emitted tokens `[n]` against the distribution `p [V]`."""
    rows = emitted.shape[0]
    if int(emitted.min()) < 0:  # the prefix was not an accepted path: the next token is missing
        return Check(label, rows, 0.0, 1.0)
    counts = torch.bincount(emitted, minlength=VOCAB).double()
    p = p.double() / p.double().sum()
    tv = 0.5 * float((counts / rows - p).abs().sum())
    if counts[p == 0].sum() > 0:  # a token the target can never produce
        return Check(label, rows, 0.0, tv)
    expected = p * rows
    small = (expected < 5) & (p > 0)  # pool sparse bins so the chi-square approximation holds
    observed = torch.cat([counts[expected >= 5], counts[small].sum()[None]])
    expected = torch.cat([expected[expected >= 5], expected[small].sum()[None]])
    keep = expected > 0
    if int(keep.sum()) < 2:  # a point mass: nothing to test beyond the zero-probability tokens
        return Check(label, rows, 1.0, tv)
    p_value = float(chisquare(observed[keep].numpy(), expected[keep].numpy()).pvalue)
    return Check(label, rows, p_value, tv)


def node_paths(parents: list[int], tokens: list[int]) -> list[list[int]]:
    """Draft tokens on the root path of each node (root excluded)."""
    paths = [[]]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + [tokens[i]])
    return paths


def distribution_checks(emitted: torch.Tensor, parents: list[int], tokens: list[int],
                        probs: torch.Tensor) -> list[Check]:
    """Given the emitted prefix equals the path to node n, the next emitted token must follow probs[n]."""
    checks = []
    for node, path in enumerate(node_paths(parents, tokens)):
        reached = (emitted[:, : len(path)] == torch.tensor(path, dtype=torch.long)).all(dim=1)
        if int(reached.sum()) >= MIN_ROWS:
            checks.append(compare(f"after node {node} {path}", emitted[reached, len(path)], probs[node]))
    return checks


def tree_rows(parents: list[int], tokens: list[int], rows: int) -> SimpleNamespace:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    one_row = {"tokens": tokens, "parents": parents, "depth": depth}
    fields = {name: torch.tensor([v]).expand(rows, -1) for name, v in one_row.items()}
    valid = torch.ones(rows, len(parents), dtype=torch.bool)
    return SimpleNamespace(**fields, valid=valid, max_depth=max(depth))


def run_sampler(sampler, parents: list[int], tokens: list[int], probs: torch.Tensor, seed: int,
                rows: int = ROWS):
    """`rows` independent verifications of one tree with per-node target `probs [M, V]`."""
    tree = tree_rows(parents, tokens, rows)
    top_k = max(parents[1:].count(p) for p in set(parents[1:]))
    gen = torch.Generator().manual_seed(seed)
    uniforms, final = draw_uniforms(rows, tree.max_depth, top_k, generator=gen)
    return sampler(tree, probs[None].expand(rows, -1, -1), uniforms, final)


def report(checks: list[Check]) -> str:
    return "\n".join(f"{c.label}: rows={c.rows} p={c.p_value:.2e} tv={c.tv:.4f} bound={c.bound:.4f}"
                     for c in checks)


# --- a literal, sequential implementation of the spec (and its broken variants) ----------------------------

def reference_sample(tree, probs, uniforms, final_uniform, *, renormalise: bool = True,
                     residual_bonus: bool = True):
    """EAGLE31_SPEC §5.2 line by line for one tree shared by all rows (python child lists, per-k loops).

    renormalise=False forgets to renormalise after a rejection; residual_bonus=False draws the bonus token
    from the fresh target distribution instead of the residual. Both are bugs the check must catch.
    """
    rows, depth, top_k = uniforms.shape
    parents, tokens = tree.parents[0].tolist(), tree.tokens[0].tolist()
    table = torch.full((len(parents), top_k), -1)
    for node in range(len(parents)):
        kids = [i for i in range(1, len(parents)) if parents[i] == node]
        table[node, : len(kids)] = torch.tensor(kids, dtype=torch.long)
    token_of = torch.tensor(tokens)
    index = torch.arange(rows)
    node = torch.zeros(rows, dtype=torch.long)
    p = probs[:, 0].clone()
    alive = torch.ones(rows, dtype=torch.bool)
    emitted = torch.full((rows, depth + 1), -1)
    accept_len = torch.zeros(rows, dtype=torch.long)
    for level in range(depth):
        accepted = torch.zeros(rows, dtype=torch.bool)
        next_node = node.clone()
        for k in range(top_k):
            child = table[node, k]
            trying = alive & ~accepted & (child >= 0)
            x = token_of[child.clamp(min=0)]
            take = trying & (uniforms[:, level, k] < p[index, x])
            drop = (trying & ~take)[:, None]
            p = torch.where(drop, p.scatter(1, x[:, None], 0.0), p)  # p[x] = 0
            if renormalise:
                p = torch.where(drop, p / p.sum(dim=1, keepdim=True), p)
            next_node = torch.where(take, child, next_node)
            accepted |= take
        emitted[:, level] = torch.where(accepted, token_of[next_node], -1)
        accept_len += accepted
        p = torch.where(accepted[:, None], probs[index, next_node], p)
        node, alive = next_node, accepted
    bonus_from = p if residual_bonus else probs[index, node]
    cdf = (bonus_from / bonus_from.sum(dim=1, keepdim=True)).cumsum(dim=1)
    bonus = (cdf <= final_uniform[:, None]).sum(dim=1).clamp(max=probs.shape[-1] - 1)
    emitted[index, accept_len] = bonus
    return SimpleNamespace(accept_len=accept_len, tokens=emitted)


# --- scenarios ----------------------------------------------------------------------------------------------

def draft_tokens(parents: list[int], probs: torch.Tensor, mode: str, gen: torch.Generator) -> list[int]:
    """Draft tokens of each node's children (distinct siblings), chosen from the parent's target `probs`.

    argmax: the draft agrees with the target (best child = target argmax, then the next most likely);
    shuffled: the parent's most likely tokens in a random order; outside: tokens the target gives zero
    probability; mixed: the first child one of the two most likely tokens, the last one with zero
    probability, any others random.
    """
    tokens = [0] * len(parents)
    for parent in sorted(set(parents[1:])):
        kids = [i for i in range(1, len(parents)) if parents[i] == parent]
        ranked = torch.argsort(probs[parent], descending=True, stable=True)
        if mode == "argmax":
            chosen = ranked[: len(kids)]
        elif mode == "shuffled":
            chosen = ranked[: len(kids) + 1][torch.randperm(len(kids) + 1, generator=gen)][: len(kids)]
        elif mode == "mixed":
            first = ranked[int(torch.randint(2, (1,), generator=gen))]
            zero = ranked[-1]  # least likely: zero mass once top-k / top-p cut anything
            rest = [t for t in torch.randperm(VOCAB, generator=gen).tolist() if t not in (first, zero)]
            chosen = torch.tensor([first, *rest[: len(kids) - 2], zero][: len(kids)])
        else:
            zero = torch.nonzero(probs[parent] == 0).flatten()
            chosen = zero[torch.randperm(len(zero), generator=gen)][: len(kids)]
        for kid, token in zip(kids, chosen.tolist(), strict=True):
            tokens[kid] = token
    return tokens


SCENARIOS = {
    # name: (parents, sampling params, draft mode, logit scale, fewest node checks that must run)
    "plain": (TREE_PARENTS, SamplingParams(do_sample=True), "shuffled", 1.5, 8),
    "temperature_top_k_top_p": (
        TREE_PARENTS, SamplingParams(do_sample=True, temperature=0.7, top_k=7, top_p=0.9), "mixed", 1.0, 5),
    "draft_is_target_argmax": (
        TREE_PARENTS, SamplingParams(do_sample=True, temperature=1.3, top_p=0.95), "argmax", 1.5, 8),
    "zero_probability_drafts": (TREE_PARENTS, SamplingParams(do_sample=True, top_k=4), "outside", 1.5, 1),
    "chain": (CHAIN_PARENTS, SamplingParams(do_sample=True, temperature=0.8), "shuffled", 2.0, 4),
}


def scenario(name: str, seed: int = 0) -> tuple[list[int], list[int], torch.Tensor]:
    parents, params, mode, scale, _ = SCENARIOS[name]
    gen = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(len(parents), VOCAB, generator=gen, dtype=torch.float64)
    if name == "draft_is_target_argmax":  # the float32 path that generate takes
        logits = logits.float()
    probs = target_probs(logits, params)
    return parents, draft_tokens(parents, probs, mode, gen), probs


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_emitted_tokens_follow_the_target(name):
    parents, tokens, probs = scenario(name)
    acc = run_sampler(verify_sample, parents, tokens, probs, seed=1)
    checks = distribution_checks(acc.tokens, parents, tokens, probs)
    assert len(checks) >= SCENARIOS[name][-1], report(checks)  # the deep nodes were really exercised
    assert all(c.ok for c in checks), report(checks)
    draft_mass = [float(probs[parents[i], tokens[i]]) for i in range(1, len(parents))]
    assert probs.dtype == (torch.float32 if name == "draft_is_target_argmax" else torch.float64)
    if name == "temperature_top_k_top_p":
        assert min(draft_mass) == 0.0 and max(draft_mass) > 0.0  # some drafts were impossible, some not
    if name == "zero_probability_drafts":
        assert max(draft_mass) == 0.0 and int(acc.accept_len.max()) == 0


def test_siblings_covering_all_mass():
    # the root's target lives on exactly its three drafted children: a bonus token at the root is impossible
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(len(TREE_PARENTS), VOCAB, generator=gen, dtype=torch.float64)
    tokens = draft_tokens(TREE_PARENTS, target_probs(logits, SamplingParams(do_sample=True)), "shuffled", gen)
    logits[0] = -math.inf
    logits[0, tokens[1:4]] = torch.tensor([0.0, 0.5, -0.5], dtype=torch.float64)
    probs = target_probs(logits, SamplingParams(do_sample=True))
    acc = run_sampler(verify_sample, TREE_PARENTS, tokens, probs, seed=3)
    assert int(acc.accept_len.min()) == 1
    checks = distribution_checks(acc.tokens, TREE_PARENTS, tokens, probs)
    assert len(checks) >= 4 and all(c.ok for c in checks), report(checks)


@pytest.mark.parametrize("parents", [TREE_PARENTS, CHAIN_PARENTS], ids=["tree", "chain"])
def test_point_mass_target_equal_to_the_draft_accepts_everything(parents):
    # top_k=1 makes every node's target a point mass; the deepest branch carries exactly those tokens
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(len(parents), VOCAB, generator=gen, dtype=torch.float64)
    probs = target_probs(logits, SamplingParams(do_sample=True, top_k=1))
    deepest = [0, 2, 6, 7] if parents == TREE_PARENTS else [0, 1, 2, 3]
    tokens = draft_tokens(parents, probs, "mixed", gen)
    for parent, child in zip(deepest, deepest[1:], strict=False):
        tokens[child] = int(probs[parent].argmax())
    for i in range(1, len(parents)):  # siblings of the deepest branch must differ from it
        if i not in deepest and parents[i] in deepest[:-1]:
            on_branch = deepest[deepest.index(parents[i]) + 1]
            tokens[i] = tokens[i] if tokens[i] != tokens[on_branch] else (tokens[i] + 1) % VOCAB
    acc = run_sampler(verify_sample, parents, tokens, probs, seed=5, rows=10_000)
    expected = [tokens[i] for i in deepest[1:]] + [int(probs[deepest[-1]].argmax())]
    assert (acc.accept_len == 3).all()
    assert (acc.tokens == torch.tensor(expected)).all()


# --- the reference implementation and the negative control -------------------------------------------------

@pytest.mark.parametrize("name", ["plain", "temperature_top_k_top_p", "chain"])
def test_verify_sample_equals_the_sequential_reference(name):
    # same uniforms, same decisions: the vectorised acceptance is the literal algorithm, row by row
    parents, tokens, probs = scenario(name)
    fast = run_sampler(verify_sample, parents, tokens, probs, seed=6, rows=50_000)
    slow = run_sampler(reference_sample, parents, tokens, probs, seed=6, rows=50_000)
    assert torch.equal(fast.accept_len, slow.accept_len) and torch.equal(fast.tokens, slow.tokens)
    assert int(fast.accept_len.max()) >= 2


@pytest.mark.parametrize("bug", ["no_renormalisation", "bonus_from_fresh_target"])
def test_the_check_rejects_a_broken_sampler(bug):
    def broken(*args):
        return reference_sample(*args, renormalise=bug != "no_renormalisation",
                                residual_bonus=bug != "bonus_from_fresh_target")

    parents, tokens, probs = scenario("plain")
    checks = distribution_checks(run_sampler(broken, parents, tokens, probs, seed=1).tokens, parents, tokens,
                                 probs)
    assert len(checks) >= 4 and not all(c.ok for c in checks), report(checks)
    assert not checks[0].ok, report(checks)  # even the first emitted token's distribution is visibly wrong


# --- the target distribution is Hugging Face's --------------------------------------------------------------

WARPER_PARAMS = [
    SamplingParams(do_sample=True, temperature=0.7),
    SamplingParams(do_sample=True, top_k=5),
    SamplingParams(do_sample=True, top_k=100),
    SamplingParams(do_sample=True, top_p=0.8),
    SamplingParams(do_sample=True, top_p=0.0),
    SamplingParams(do_sample=True, temperature=0.6, top_k=7, top_p=0.9),
    SamplingParams(do_sample=True, temperature=1.4, top_k=3, top_p=0.5),
]


@pytest.mark.parametrize("as_tensors", [False, True], ids=["python values", "SamplingValues"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("params", WARPER_PARAMS, ids=str)
def test_process_logits_matches_hf_warpers(params, dtype, as_tensors):
    # half-integer logits: many exact ties at the top-k and top-p boundaries
    logits = torch.randint(-6, 6, (3, 4, 50), generator=torch.Generator().manual_seed(0)).to(dtype) / 2
    values = None
    if as_tensors:          # what a program runs: its key's structure, the numbers from tensors
        values = SamplingValues("cpu")
        values.load(params)
    structure = params.structure() if as_tensors else params
    ours = process_logits(logits, structure, values)
    theirs = hf_warpers(params)(None, logits.reshape(12, 50)).reshape(3, 4, 50)
    assert ours.dtype == dtype and torch.equal(ours, theirs)
    probs = target_probs(logits, structure, values)
    hf_probs = hf_warpers(params)(None, logits.reshape(12, 50).to(probs.dtype)).softmax(-1).reshape(3, 4, 50)
    assert probs.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(probs, hf_probs)


def test_program_keys_and_structures():
    """Settings that differ only in numbers share a program; the top-k bucket, top-p and greedy do not."""
    key = SamplingParams(do_sample=True, temperature=0.7, top_k=20, top_p=0.9).program_key
    assert key == (True, 32, True, None)
    assert key == SamplingParams(do_sample=True, temperature=1.3, top_k=17, top_p=0.5).program_key
    assert SamplingParams(do_sample=True, top_k=33, top_p=0.9).program_key == (True, 64, True, None)
    assert SamplingParams(do_sample=True, top_k=0).program_key == (True, 0, False, None)
    assert SamplingParams(temperature=0.5).program_key == SamplingParams().program_key == (False, 0, False, None)
    for params in WARPER_PARAMS:
        assert params.structure().program_key == params.program_key
    # logits processors are code, not run-time numbers: a step built from the structure must keep them
    penalised = SamplingParams(do_sample=True, top_k=20, processors=ProcessorSettings(repetition_penalty=1.3))
    assert penalised.program_key != SamplingParams(do_sample=True, top_k=20).program_key
    assert penalised.structure().processors == penalised.processors
    assert SamplingParams(processors=penalised.processors).structure().processors == penalised.processors


def test_greedy_params():
    logits = torch.randn(2, 5, 9, dtype=torch.bfloat16)
    params = SamplingParams()
    assert process_logits(logits, params) is logits
    probs = target_probs(logits, params)
    assert probs.dtype == torch.float32 and torch.equal(probs.argmax(-1), logits.float().argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(2, 5))
    assert torch.equal(probs.max(-1).values, torch.ones(2, 5))


def test_from_generation_config_reads_hf_settings():
    assert SamplingParams.from_generation_config(GenerationConfig()) == SamplingParams()
    # transformers fills an unset top_k with 50 when sampling
    assert SamplingParams.from_generation_config(GenerationConfig(do_sample=True)) == SamplingParams(
        do_sample=True, temperature=1.0, top_k=50, top_p=1.0)
    config = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=0.9)
    assert SamplingParams.from_generation_config(config) == SamplingParams(True, 0.6, 0, 0.9)
    # greedy: sampling-only settings are ignored by HF too, and temperature=0 is not an error
    greedy = SimpleNamespace(do_sample=False, temperature=0.0, min_p=0.2, typical_p=0.5)
    assert SamplingParams.from_generation_config(greedy) == SamplingParams()


def test_hf_defaults_match_installed_transformers():
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if defaults is None:  # transformers 4.x: the defaults are the constructor's
        defaults = GenerationConfig().to_dict
    installed = defaults()
    for name, value in HF_GENERATION_DEFAULTS.items():
        assert installed[name] == value, name


# (repetition_penalty, no_repeat_ngram_size, bad_words_ids, sequence_bias, min_length, min_new_tokens,
# suppress_tokens and begin_suppress_tokens are applied per tree node: tests/runtime/test_logits_processors.py)
UNSUPPORTED = [
    {"encoder_repetition_penalty": 0.9}, {"num_beams": 4}, {"num_beam_groups": 2},
    {"diversity_penalty": 0.5}, {"penalty_alpha": 0.6}, {"dola_layers": "high"}, {"guidance_scale": 1.5},
    {"forced_bos_token_id": 1}, {"forced_eos_token_id": 2},
    {"remove_invalid_values": True}, {"exponential_decay_length_penalty": (5, 1.1)},
    {"watermarking_config": {"bias": 2.0}}, {"token_healing": True},
    {"min_p": 0.05}, {"typical_p": 0.9}, {"epsilon_cutoff": 3e-4}, {"eta_cutoff": 3e-4}, {"top_h": 0.4},
    {"constraints": ["x"]}, {"force_words_ids": [[1]]}, {"encoder_no_repeat_ngram_size": 2},
]


@pytest.mark.parametrize("setting", UNSUPPORTED, ids=lambda s: next(iter(s)))
def test_settings_that_change_the_distribution_are_refused(setting):
    name, value = next(iter(setting.items()))
    with pytest.raises(UnsupportedGenerationError, match=re.escape(f"{name}={value!r}")):
        SamplingParams.from_generation_config(SimpleNamespace(do_sample=True, **setting))


def test_every_unsupported_setting_is_named_at_once():
    config = GenerationConfig(do_sample=True, encoder_repetition_penalty=1.3, min_p=0.1, top_k=20)
    with pytest.raises(UnsupportedGenerationError) as error:
        SamplingParams.from_generation_config(config)
    assert "encoder_repetition_penalty=1.3" in str(error.value) and "min_p=0.1" in str(error.value)
    assert "top_k" not in str(error.value).split("Supported")[0]


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0}, {"temperature": -1.0}, {"temperature": float("nan")}, {"temperature": "hot"},
    {"top_k": -1}, {"top_k": 2.5}, {"top_k": True}, {"top_p": 1.5}, {"top_p": -0.1}, {"do_sample": 1},
])
def test_sampling_params_validation(kwargs):
    with pytest.raises(UnsupportedGenerationError, match=next(iter(kwargs))):
        SamplingParams(**{"do_sample": True, **kwargs})
