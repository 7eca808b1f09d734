"""Verify cost c(N)/c(1) of the captured target program, draft step cost, measured acceptance -> the tree shape.

Quick run (512-token prefix, float32, 3 repeats, acceptance from 2 training prompts x 24 tokens; a few minutes on
a 2-core CPU):

    python benchmarks/verify_cost.py --threads 1 --repeats 3 --calib-prompts 2 --calib-tokens 24

Full run (both prefixes, float32 and bfloat16, acceptance from 8 prompts x 128 tokens):

    python benchmarks/verify_cost.py --prefixes 512,2048 --dtypes float32,bfloat16 --repeats 7 \\
        --calib-prompts 8 --calib-tokens 128 --tree-out <head folder>/tree.json

What it measures, in order:

1. c(N): the wall time of one call of the target's captured verify program (`TargetProgram` on a `SlotKVCache`,
   called as `SpeculativeDecoder` calls it: a chain of N tree tokens with a tree `SlotMask` after a prefix that a
   chunked prefill wrote) for N in {1,2,4,6,8,12,16,24,32,48,64}, median of --repeats after a warm-up, per dtype
   and prefix; the N are timed round-robin, so a change of load hits all of them. The cache has the slots a
   generate call of 256 new tokens would use (prefix + 256 + 64, rounded up to 256). Printed and saved as
   c(N)/c(1). For reference, c(1) of HF's own forward on a DynamicCache of the same
   prefix is timed too (what plain `model.generate` pays per token).
2. The draft head's cost, relative to c(1) (in --choose-dtype, default float32, the first prefix): the catch-up
   forward (target features fused, 4 tokens), one draft forward over w frontier nodes, and the draft top-k (lm
   head, log-softmax, top-k) of w nodes, w in 1..4. A draft step = forward + top-k; a chain of D costs
   catch-up + top-k(1) + (D-1) steps of width 1, a tree of depth D and top_k K costs catch-up + top-k(1) +
   (D-1) steps of width K.
3. Per-depth acceptance: eagle31 with a chain of 8 on --calib-prompts prompts from the training data
   (train/instruct_mix.jsonl, round-robin over its sources; none is an eval prompt). From the acceptance-length
   histogram, alpha_i = P(depth i accepted | depths < i accepted) = #(tau >= i+1) / #(tau >= i). A recording
   drafter also keeps the draft's top-16 tokens at every depth, which gives the top-k coverage
   q_i(k) = P(the target's token is among the draft's top k at depth i | depths < i accepted); q_i(1) = alpha_i.
4. `choose_tree_shape`: expected tokens per unit time = E[tokens per cycle] / (c(M) + draft cost), in units of
   c(1) (plain decoding earns 1 token per c(1), so this is the predicted speedup over our own plain step), with
   c(M) interpolated linearly between measured N and made non-decreasing (a dip in the measured curve is noise).
   Chains k = 1..8: E = 1 + sum_j prod_{i<=j} alpha_i. Trees (depth D, top_k K, M nodes): the top-k coverage
   ("fan") model: the accepted path is credited with all K children at its first f depths and the best child
   below, where f = min(D, (M-1-D) // (K-1)) is how many depths the node budget can widen beyond a D-node spine,
   so E = 1 + sum_j prod_{i<=j} q_i(w_i), w_i = K for i <= f else 1. It assumes that the dynamic tree spends its
   budget on the accepted path's siblings first (optimistic when the draft is confident on wrong tokens) and
   that coverage below a non-top-1 child equals coverage below the top-1 child. When no recorded coverage is
   available, q_i(k) = 1 - (1 - alpha_i) * decay^(k-1) (--miss-decay). Per-cycle costs outside target and
   draft forwards (tree building, verification, KV compaction, host reads) are left out. The cost curve is
   --choose-dtype's (`--dtypes float32,bfloat16 --choose-dtype bfloat16` chooses for a bfloat16 target, where
   verifying many tokens is relatively cheaper); acceptance is always calibrated in float32.

Outputs in --out (default bench_out/): verify_cost.json (everything, with machine load before/after, versions,
commit, command), verify_cost.md (tables, paste verbatim), verify_cost.png (c(N)/c(1) curves; predicted speedup
of the best shapes), and the chosen shape as eagle31 options in --tree-out (default <out>/tree.json; put it beside
the head, where eagle31 picks it up as the default tree for CPU targets of --choose-dtype: the file says so in
its `chosen_for` record, eagle_compile/draft/tree_file.py). The head used is stated everywhere; with the
untrained fallback head nothing is accepted and the choice is the cheapest chain, which the outputs say.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    begin,
    chat_ids,
    environment,
    interleaved_times,
    load_head,
    markdown_table,
    median_time,
    print_load,
    timed,
    write_json,
)

from eagle_compile.calibrate.costs import expected_tokens, interpolate, monotone, verify_call

TOKENS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
CALIB_DEPTH = 8
TOP = 16
COVERAGE_KS = (1, 2, 3, 4, 8)
DRAFT_WIDTHS = (1, 2, 3, 4)
CATCH_UP_TOKENS = 4
TREE_DEPTHS, TREE_TOP_KS, TREE_SIZES = (2, 3, 4, 5, 6), (2, 3, 4), (8, 12, 16, 24, 32)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefixes", default="512", help="comma list of prefix lengths (e.g. 512,2048)")
    p.add_argument("--dtypes", default="float32", help="comma list out of float32,bfloat16")
    p.add_argument("--choose-dtype", default="float32",
                   help="dtype whose cost curve and draft cost choose the shape (one of --dtypes)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma list of N (new tokens verified)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--draft", default=None, help="draft head folder (default: shipped head, else untrained)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--calib-prompts", type=int, default=4, help="training prompts for the acceptance rates")
    p.add_argument("--calib-tokens", type=int, default=64, help="new tokens per calibration prompt")
    p.add_argument("--miss-decay", type=float, default=0.6, help="coverage model fallback (see the docstring)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--tree-out", type=Path, default=None, help="where to write tree.json (default: <out>/tree.json)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 on a busy machine)")
    args = p.parse_args(argv)
    args.prefixes = [int(x) for x in args.prefixes.split(",")]
    args.dtypes = [x.strip() for x in args.dtypes.split(",")]
    args.tokens = sorted({int(x) for x in args.tokens.split(",")} | {1})
    bad = sorted(set(args.dtypes) - {"float32", "bfloat16"})
    if bad or "float32" not in args.dtypes:
        p.error(f"--dtypes {args.dtypes}: give float32 (acceptance is calibrated in it), optionally with bfloat16")
    if args.choose_dtype not in args.dtypes:
        p.error(f"--choose-dtype {args.choose_dtype} is not measured: add it to --dtypes ({args.dtypes})")
    return args


# -- 1. verify cost ----------------------------------------------------------------------------------------------
def cache_slots(prefix: int, largest: int) -> int:
    """Slots of the cache a generate call of 256 new tokens after `prefix` would allocate (multiple of 256)."""
    return math.ceil((prefix + 256 + largest + 2) / 256) * 256


def prefill(program, cache, prefix: int, generator: torch.Generator) -> None:
    """Write `prefix` random tokens into the cache through the program, in chunks as the decoder's prefill does."""
    from eagle_compile.core.masks import SlotMask
    from eagle_compile.options import EagleOptions
    from eagle_compile.runtime.decoder import forward_tokens
    from eagle_compile.runtime.prefill_plan import prefill_plan

    vocab = program.model.config.vocab_size
    options = EagleOptions()
    for start, size in prefill_plan(prefix, options.prefill_chunk,
                                    forward_tokens=forward_tokens(options, program.model.device)):
        pos = torch.arange(start, start + size)[None]
        real = pos < prefix
        ids = torch.randint(0, vocab, (1, size), generator=generator)
        mask = SlotMask.causal(torch.tensor([start]), cache.slots)
        program(ids, torch.where(real, pos, 0), mask, torch.where(real, pos, cache.sentinel), cache)


def cost_curve(model, prefix: int, tokens: list[int], repeats: int, warmup: int, lowering=None) -> dict[int, dict]:
    """{N: median/min/max seconds and capture seconds} of the captured program verifying N tokens; the N are
    timed round-robin (see `interleaved_times`) after each was captured once. `lowering`: the programs'
    `eagle_compile.lowering.Lowering` (default: what the default options, inner_backend and numerics "auto",
    pick for the model)."""
    from eagle_compile.lowering import lowering_for
    from eagle_compile.runtime.kv_cache import SlotKVCache
    from eagle_compile.runtime.target_program import TargetProgram

    gen = torch.Generator().manual_seed(0)
    lowering = lowering or lowering_for("auto", None, model.device, model.dtype, "auto")
    program = TargetProgram(model, None, lowering=lowering, recompile_limit=len(tokens) + 8)
    cache = SlotKVCache(model.config, 1, cache_slots(prefix, max(tokens)), dtype=model.dtype, device="cpu")
    prefill(program, cache, prefix, gen)
    calls = {n: verify_call(program, cache, prefix, n, gen) for n in tokens}
    capture = {n: timed(call)[1] for n, call in calls.items()}
    curve = interleaved_times(calls, repeats=repeats, warmup=warmup)
    for n in tokens:
        curve[n]["capture_s"] = capture[n]
        print(f"  prefix {prefix} {model.dtype}: c({n}) = {curve[n]['median'] * 1e3:.1f} ms "
              f"({curve[n]['median'] / curve[1]['median']:.2f} x c(1))", flush=True)
    return curve


def hf_step(model, prefix: int, repeats: int, warmup: int) -> dict[str, float]:
    """One-token forward of the HF model on a DynamicCache holding `prefix` tokens (plain decoding's step)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(1)
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.randint(0, model.config.vocab_size, (1, prefix), generator=gen), cache=cache, use_cache=True)
    x, pos = torch.randint(0, model.config.vocab_size, (1, 1), generator=gen), torch.tensor([[prefix]])

    def step():
        model(input_ids=x, position_ids=pos, cache=cache, use_cache=True)
        cache.crop(-1)                     # transformers 5.24: a negative count of tokens to drop

    return median_time(step, repeats=repeats, warmup=warmup)


# -- 2. draft cost -----------------------------------------------------------------------------------------------
def draft_costs(head, prefix: int, repeats: int, warmup: int) -> dict[str, Any]:
    """Seconds of the draft's catch-up forward, and of its forward and top-k over w frontier nodes, with the
    numerics the default options give the head (numerics "auto")."""
    from eagle_compile.core.masks import SlotMask
    from eagle_compile.draft.drafter import EagleDrafter
    from eagle_compile.lowering import resolve_numerics

    cfg, dtype = head.config, head.lm_head.weight.dtype
    drafter = EagleDrafter(head, numerics=resolve_numerics("auto", head.lm_head.weight.device, dtype)[0])
    slots = cache_slots(prefix, max(TOKENS))
    state = drafter.new_state(1, slots, dtype=dtype, device=torch.device("cpu"))
    feats = torch.randn(1, CATCH_UP_TOKENS, cfg.num_features * cfg.target_hidden_size, dtype=dtype)
    pos = prefix + torch.arange(CATCH_UP_TOKENS)[None]
    tokens = torch.randint(0, cfg.vocab_size, (1, CATCH_UP_TOKENS))
    mask = SlotMask.causal(torch.tensor([prefix]), slots)
    catch_up = median_time(lambda: drafter.forward(state, feats, tokens, pos, pos, mask, fuse=True),
                           repeats=repeats, warmup=warmup)["median"]
    out = {"catch_up": catch_up, "forward": {}, "top_k": {}}
    for w in DRAFT_WIDTHS:
        fwd, top = _frontier_calls(drafter, state, cfg, prefix + CATCH_UP_TOKENS, w, slots, dtype)
        out["forward"][w] = median_time(fwd, repeats=repeats, warmup=warmup)["median"]
        out["top_k"][w] = median_time(top, repeats=repeats, warmup=warmup)["median"]
    return out


def _frontier_calls(drafter, state, cfg, base: int, width: int, slots: int, dtype):
    """Zero-argument calls of one draft tree level over `width` frontier nodes: the forward, the top-k."""
    from eagle_compile.core.masks import SlotMask

    hidden = torch.randn(1, width, cfg.hidden_size, dtype=dtype)                 # [1, w, H]
    ids = torch.randint(0, cfg.vocab_size, (1, width))
    positions, write = torch.full((1, width), base), base + torch.arange(width)[None]
    mask = SlotMask.tree(torch.eye(width, dtype=torch.bool)[None], torch.tensor([base]), slots)
    return (lambda: drafter.forward(state, hidden, ids, positions, write, mask, fuse=False),
            lambda: drafter.top_k(hidden, width))


def relative_draft_cost(costs: dict[str, Any], c1: float) -> dict[str, Any]:
    return {"catch_up": costs["catch_up"] / c1,
            "forward": {w: s / c1 for w, s in costs["forward"].items()},
            "top_k": {w: s / c1 for w, s in costs["top_k"].items()}}


# -- 3. acceptance -----------------------------------------------------------------------------------------------
class RecordingDrafter:
    """A `Drafter` around an EAGLE head that also keeps, for every draft top-k call, the draft's top-16
    target-vocabulary ids of the first node (in a chain: one call per depth, in depth order). Runs only on the
    host-loop path (`step_program=False`): a captured step program would trace the recording away."""

    def __init__(self, head) -> None:
        from eagle_compile.draft.drafter import EagleDrafter

        self.inner = EagleDrafter(head)
        indices = head.config.capture_indices
        self.capture_indices = tuple(indices) if indices is not None else None
        self.calls: list[list[int]] = []

    @property
    def draft_vocab_size(self) -> int:
        return self.inner.draft_vocab_size

    def new_state(self, batch, slots, *, dtype, device):
        return self.inner.new_state(batch, slots, dtype=dtype, device=device)

    def forward(self, state, hidden, tokens, positions, write_slots, mask, *, fuse):
        return self.inner.forward(state, hidden, tokens, positions, write_slots, mask, fuse=fuse)

    def fill(self, state, hidden, tokens, positions, write_slots):
        return self.inner.fill(state, hidden, tokens, positions, write_slots)

    def top_k(self, head_input: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., H] -> (log-probs [..., k], target ids [..., k]), best first, as the wrapped drafter returns."""
        scores, ids = self.inner.top_k(head_input, max(k, TOP))           # sorted: the first k are the top k
        self.calls.append(ids.reshape(-1, ids.shape[-1])[0].tolist())
        return scores[..., :k], ids[..., :k]


def calibration_prompts(data: Path, count: int) -> list[str]:
    """`count` training prompts, round-robin over the sources of train/instruct_mix.jsonl (none is an eval prompt)."""
    by_source: dict[str, list[str]] = {}
    with (data / "train" / "instruct_mix.jsonl").open() as f:
        for line in f:
            rec = json.loads(line)
            text = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
            by_source.setdefault(rec["source"], []).append(text)
            if sum(map(len, by_source.values())) >= 50 * count:
                break
    pools, chosen = list(by_source.values()), []
    for i in range(max(map(len, pools))):
        chosen += [pool[i] for pool in pools if i < len(pool)]
    return chosen[:count]


def depth_ranks(calls: list[list[int]], lengths: list[int], sequence: list[int], start: int) -> list[tuple[int, int]]:
    """(depth, rank of the target's token among the draft's top-16, TOP if absent) for every depth whose
    prefix was accepted. Cycle c emits lengths[c] tokens from `start`; its depth-i draft saw an accepted
    prefix when i <= lengths[c], and the target's token at depth i is the emitted token i-1."""
    out = []
    for c, length in enumerate(lengths):
        for i in range(1, min(length, CALIB_DEPTH) + 1):
            if start + i - 1 >= len(sequence):
                break
            top, token = calls[c * CALIB_DEPTH + i - 1], sequence[start + i - 1]
            out.append((i, top.index(token) if token in top else TOP))
        start += length
    return out


def measure_acceptance(model, tokenizer, head, data: Path, prompts: int, max_new: int) -> dict[str, Any]:
    """Histogram, alpha_i and top-k coverage q_i(k) of a chain of 8 on calibration prompts."""
    import eagle_compile

    drafter, lengths, ranks, recorded = RecordingDrafter(head), [], [], True
    for n, text in enumerate(calibration_prompts(data, prompts), 1):
        ids = chat_ids(tokenizer, text)
        drafter.calls = []
        out = eagle_compile.generate(model, ids, draft=drafter, options={"chain": CALIB_DEPTH, "step_program": False},
                                     max_new_tokens=max_new, do_sample=False, return_dict_in_generate=True)
        cycle_lengths = list(out.stats.acceptance_lengths)
        lengths += cycle_lengths
        if len(drafter.calls) != CALIB_DEPTH * len(cycle_lengths):
            recorded = False            # the runtime no longer calls top_k once per depth in eager Python
            continue
        ranks += depth_ranks(drafter.calls, cycle_lengths, out.sequences[0].tolist(), ids.shape[1] + 1)
        print(f"  calibration prompt {n}/{prompts}: {len(cycle_lengths)} cycles, tau so far "
              f"{sum(lengths) / len(lengths):.2f}", flush=True)
    return {"prompts": prompts, "max_new_tokens": max_new, "cycles": len(lengths),
            "histogram": {k: lengths.count(k) for k in sorted(set(lengths))},
            "alpha": alphas(lengths), "coverage": coverage(ranks) if recorded and ranks else None,
            "observed_per_depth": [sum(1 for d, _ in ranks if d == i) for i in range(1, CALIB_DEPTH + 1)]}


def alphas(lengths: list[int]) -> list[float]:
    """alpha_i = #(length >= i+1) / #(length >= i), i = 1..8; 0 where no cycle reached depth i."""
    reach = [sum(1 for x in lengths if x >= i) for i in range(1, CALIB_DEPTH + 2)]
    return [reach[i] / reach[i - 1] if reach[i - 1] else 0.0 for i in range(1, CALIB_DEPTH + 1)]


def coverage(ranks: list[tuple[int, int]]) -> dict[int, list[float]]:
    """q_i(k) for k in COVERAGE_KS and depths 1..8; 0 where depth i was never reached."""
    out = {}
    for k in COVERAGE_KS:
        row = []
        for i in range(1, CALIB_DEPTH + 1):
            at = [r for d, r in ranks if d == i]
            row.append(sum(1 for r in at if r < k) / len(at) if at else 0.0)
        out[k] = row
    return out


# -- 4. shape choice ---------------------------------------------------------------------------------------------
def _coverage_at(acceptance: dict, k: int, depth: int, miss_decay: float) -> float:
    alpha = acceptance["alpha"][depth - 1]
    measured = acceptance.get("coverage")
    if k == 1:
        return alpha
    if measured and k in measured:
        return measured[k][depth - 1]
    return 1.0 - (1.0 - alpha) * miss_decay ** (k - 1)


def _draft_cost(draft: dict, depth: int, width: int) -> float:
    steps = (depth - 1) * (draft["forward"][width] + draft["top_k"][width])
    return draft["catch_up"] + draft["top_k"][1] + steps


def candidate_shapes(max_tokens: int) -> list[tuple[dict, int, int, int]]:
    """(options, depth, top_k, M) for chains 1..8 and small trees within the measured N range."""
    shapes = [({"chain": k}, k, 1, k + 1) for k in range(1, CALIB_DEPTH + 1) if k + 1 <= max_tokens]
    for d in TREE_DEPTHS:
        for k in TREE_TOP_KS:
            for m in TREE_SIZES:
                if d < m - 1 <= k + (d - 1) * k * k and m <= max_tokens and k in DRAFT_WIDTHS:
                    shapes.append(({"depth": d, "top_k": k, "total_tokens": m}, d, k, m))
    return shapes


def choose_tree_shape(cost_curve: dict[int, float], draft_cost: dict[str, Any], per_depth_acceptance: dict,
                      *, miss_decay: float = 0.6) -> dict[str, Any]:
    """Rank candidate shapes by expected tokens per unit time and return the best (see the module docstring).

    Args:
        cost_curve: {N: c(N)/c(1)} of the target's verify program (made non-decreasing, see `monotone`).
        draft_cost: {"catch_up": x, "forward": {w: x}, "top_k": {w: x}}, each relative to c(1).
        per_depth_acceptance: {"alpha": [alpha_1..alpha_8], "coverage": {k: [q_1(k)..q_8(k)]} or None}.
    """
    ranking, cost_curve = [], monotone(cost_curve)
    for options, depth, top_k, m in candidate_shapes(max(cost_curve)):
        widened = depth if top_k == 1 else min(depth, (m - 1 - depth) // (top_k - 1))
        q = [_coverage_at(per_depth_acceptance, top_k if i <= widened else 1, i, miss_decay)
             for i in range(1, depth + 1)]
        e = expected_tokens(q)
        cost = interpolate(cost_curve, m) + _draft_cost(draft_cost, depth, top_k)
        ranking.append({"options": options, "tree_tokens": m, "expected_tokens": e, "cycle_cost": cost,
                        "speedup": e / cost})
    ranking.sort(key=lambda r: (-r["speedup"], r["tree_tokens"]))
    return {"best": ranking[0], "ranking": ranking}


# -- outputs -----------------------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    meta, head = result["meta"], result["meta"]["head"]
    ref_dtype = meta["reference_curve"][0]
    lines = ["# Verify cost and tree shape (SmolLM2-135M-Instruct target)", ""]
    lines += [f"**{head['note']}.**" if not head["trained"] else f"Draft head: {head['note']}.", ""]
    lines += [f"- machine: {meta['load_before']['nproc']} cores, torch threads {meta['load_before']['torch_threads']}; "
              f"load average (1 min) {meta['load_before']['loadavg_1m']} before, {meta['load_after']['loadavg_1m']} "
              "after", f"- torch {meta['environment']['torch']}, transformers {meta['environment']['transformers']}, "
              f"commit {meta['environment']['git']['commit']}", f"- command: `{meta['environment']['command']}`", "",
              "c(N)/c(1): one call of the captured verify program over N tokens after the prefix (median of "
              f"{meta['repeats']}); c(1) in ms; HF c(1) = plain decoding's step on a DynamicCache:", "",
              _cost_table(result), "", f"Draft head cost relative to c(1) ({ref_dtype}, the first prefix):",
              "", _draft_table(result), "", _acceptance_text(result["acceptance"]), "",
              f"Best shapes for {ref_dtype} (predicted speedup over the plain step = E[tokens per cycle] / (c(M) + "
              "draft cost)):", "",
              _ranking_table(result["choice"]["ranking"][:10]), "",
              f"**Chosen: `{json.dumps(result['choice']['best']['options'])}`** (written to {result['tree_out']})", ""]
    if result["choice"]["best"]["speedup"] < 1.0:
        lines += ["No shape is predicted to beat plain decoding with this head: the choice is the shape that loses "
                  "least (the highest predicted ratio).", ""]
    return "\n".join(lines)


def _cost_table(result: dict) -> str:
    tokens = sorted({n for c in result["cost_curves"] for n in c["ratios"]})
    rows = [[c["dtype"], c["prefix"], f"{c['c1_s'] * 1e3:.1f}", f"{c['hf_c1_s'] * 1e3:.1f}"]
            + [f"{c['ratios'][n]:.2f}" for n in tokens] for c in result["cost_curves"]]
    return markdown_table(["dtype", "prefix", "c(1) ms", "HF c(1) ms"] + [f"N={n}" for n in tokens], rows)


def _draft_table(result: dict) -> str:
    d = result["draft_cost_relative"]
    rows = [["catch-up (4 tokens, fused features)", f"{d['catch_up']:.3f}"]]
    rows += [[f"step of width {w} (forward + top-k)", f"{d['forward'][w] + d['top_k'][w]:.3f}"]
             for w in d["forward"]]
    return markdown_table(["draft work", "x c(1)"], rows)


def _acceptance_text(acc: dict) -> str:
    rows = [["alpha (from the histogram)"] + [f"{a:.2f}" for a in acc["alpha"]]]
    if acc["coverage"]:
        rows += [[f"top-{k} coverage"] + [f"{x:.2f}" for x in row] for k, row in acc["coverage"].items()]
    rows += [["observed prefixes"] + [str(x) for x in acc["observed_per_depth"]]]
    table = markdown_table(["depth"] + [str(i) for i in range(1, CALIB_DEPTH + 1)], rows)
    return (f"Acceptance of a chain of {CALIB_DEPTH} on {acc['prompts']} training prompts x {acc['max_new_tokens']} "
            f"tokens ({acc['cycles']} cycles; histogram {acc['histogram']}):\n\n{table}")


def _ranking_table(ranking: list[dict]) -> str:
    rows = [[f"`{json.dumps(r['options'])}`", r["tree_tokens"], f"{r['expected_tokens']:.2f}", f"{r['cycle_cost']:.2f}",
             f"{r['speedup']:.2f}"] for r in ranking]
    return markdown_table(["shape", "M", "E[tokens/cycle]", "cycle cost (x c(1))", "predicted speedup"], rows)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for c in result["cost_curves"]:
        ns = sorted(c["ratios"])
        ax1.plot(ns, [c["ratios"][n] for n in ns], marker="o", label=f"{c['dtype']}, prefix {c['prefix']}")
    ax1.set_xlabel("N tokens verified")
    ax1.set_ylabel("c(N) / c(1)")
    ax1.legend()
    top = result["choice"]["ranking"][:10]
    ax2.barh([json.dumps(r["options"]) for r in top][::-1], [r["speedup"] for r in top][::-1])
    ax2.set_xlabel("predicted speedup over the plain step")
    untrained = "" if result["meta"]["head"]["trained"] else " [UNTRAINED head]"
    fig.suptitle(f"verify cost and tree shape{untrained}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------------------------------
def measure_costs(args) -> tuple[list[dict], dict[str, Any], Any, dict]:
    """Cost curves for every dtype and prefix; returns them, the model of each dtype, the tokenizer and the curve
    that chooses the shape (--choose-dtype at the first prefix)."""
    from eagle_compile.targets import load_default_target

    curves, models = [], {}
    for name in args.dtypes:
        model, tokenizer = load_default_target(getattr(torch, name))
        for prefix in args.prefixes:
            curve = cost_curve(model, prefix, args.tokens, args.repeats, args.warmup)
            c1 = curve[1]["median"]
            curves.append({"dtype": name, "prefix": prefix, "seconds": curve, "c1_s": c1,
                           "hf_c1_s": hf_step(model, prefix, args.repeats, args.warmup)["median"],
                           "ratios": {n: v["median"] / c1 for n, v in curve.items()}})
        models[name] = model
    ref = next(c for c in curves if c["dtype"] == args.choose_dtype)    # the first prefix
    return curves, models, tokenizer, ref


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = begin(args.threads)
    curves, models, tokenizer, ref = measure_costs(args)
    head, head_info = load_head(models["float32"], args.draft)
    print(f"draft: {head_info['note']}", flush=True)
    costed = head if args.choose_dtype == "float32" else load_head(models[args.choose_dtype], args.draft)[0]
    draft = draft_costs(costed, ref["prefix"], args.repeats, args.warmup)
    draft_rel = relative_draft_cost(draft, ref["c1_s"])
    # acceptance in float32: the head's acceptance does not depend on the dtype the cost is paid in
    acceptance = measure_acceptance(models["float32"], tokenizer, head, args.data, args.calib_prompts,
                                    args.calib_tokens)
    choice = choose_tree_shape(ref["ratios"], draft_rel, acceptance, miss_decay=args.miss_decay)
    tree_out = args.tree_out or args.out / "tree.json"
    meta = {"head": head_info, "repeats": args.repeats, "warmup": args.warmup, "environment": environment(),
            "load_before": load_before, "load_after": print_load("after"), "reference_curve": [ref["dtype"],
                                                                                             ref["prefix"]]}
    result = {"meta": meta, "cost_curves": curves, "draft_cost_s": draft, "draft_cost_relative": draft_rel,
              "acceptance": acceptance, "choice": choice, "tree_out": str(tree_out)}
    write_outputs(args.out, tree_out, result, getattr(torch, args.choose_dtype))
    return 0


def write_outputs(out: Path, tree_out: Path, result: dict, dtype: torch.dtype) -> None:
    from eagle_compile.draft.tree_file import write_tree_file

    write_json(out / "verify_cost.json", result)
    md = markdown(result)
    (out / "verify_cost.md").write_text(md)
    plot(result, out / "verify_cost.png")
    env = result["meta"]["environment"]
    write_tree_file(tree_out, result["choice"]["best"]["options"], device="cpu", dtype=dtype,
                    by=f"benchmarks/verify_cost.py (commit {env['git']['commit']}, {env['processor']})",
                    command=env["command"])
    print("\n" + md, flush=True)
    print(f"tree.json: {json.dumps(result['choice']['best']['options'])} -> {tree_out}", flush=True)
    print(f"wrote {out / 'verify_cost.json'}, {out / 'verify_cost.md'}, {out / 'verify_cost.png'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
