"""Spec-Bench speed benchmark: eagle31 speculative decoding against HF `generate` and HF prompt lookup decoding.

Quick run (2 prompts of each of the 6 categories, 32 new tokens; a few minutes on a 2-core CPU):

    python benchmarks/spec_bench.py --per-category 2 --max-new-tokens 32 --threads 1

Full run (80 prompts of each category, 256 new tokens, as Spec-Bench specifies; many hours on a 2-core CPU,
resumable: rerun the same command after an interruption and finished prompts are skipped):

    python benchmarks/spec_bench.py

Other options: `--categories qa,rag`, `--draft HEAD_FOLDER` (default: the shipped head, else an untrained head,
which every output says), `--options '{"chain": 4}'` or `--options tree.json` (default: `tree.json` beside the
head, written by benchmarks/verify_cost.py, else chain 4), `--data DIR` (default ../shared/data from the repo
root), `--out DIR` (default bench_out/), `--fresh` (discard the records of an earlier run in --out), `--threads N`
(torch threads; on a machine shared with other jobs use 1, see benchmarks/common.py `set_threads`), `--dtype
bfloat16` (all three methods on a bfloat16 target and head; see below).

Protocol. Prompts are Spec-Bench's `question.jsonl`: the first turn of each record, with the target's chat
template and the assistant prefix. Records 81-160 are the MT-bench questions (8 sub-categories) and are reported
as one category `mt_bench`; the others are translation, summarization, qa, math_reasoning and rag. The target is
the embedded SmolLM2-135M-Instruct in float32 unless --dtype says otherwise. For every prompt, in one
process, the three methods run back to back with the same `max_new_tokens`, greedy:

* `plain`: `model.generate(do_sample=False)`;
* `prompt_lookup`: `model.generate(prompt_lookup_num_tokens=10, do_sample=False)`;
* `eagle31`: `eagle_compile.generate(model, ids, draft=head, options=tree)`.

The order of the three rotates from prompt to prompt so that a drift of the machine's load does not always hit
the same method. Untimed warm-ups come first: one short generate per HF method, and one short eagle31 generate
for every new pair (static cache size, number of prefill chunks), the shapes its captured graphs specialise on
(the cache size is fixed per prompt with `max_cache_len`, rounded up to a multiple of 256 slots like the
default). A graph captured inside a timed eagle31 call anyway is counted, printed and flagged in the table. In
float32 eagle31 must produce exactly the plain greedy tokens for every prompt: a mismatch is printed loudly and the
exit status is 1. In bfloat16 a forward over N tokens and N forwards over one token round differently, so a near-tie
between the two best tokens can flip and the texts part from there (plain bfloat16 greedy itself parts from float32
greedy after 16-48 tokens): exactness is proven in float32 (and float64 in the tests); in bfloat16 the tables say how
many outputs equal plain greedy and, for the others, how many leading tokens agree. Whether prompt lookup matched
plain greedy is recorded as well (HF's assisted decoding need not be exact).

Outputs in --out: `spec_bench.records.jsonl` (one record per prompt, appended as it finishes: the resume log),
`spec_bench.json` (records, per-category summary, machine and load, versions, git commit, command line),
`spec_bench.md` (the tables, paste verbatim), `spec_bench.png` (tokens/s per category and method; tau).
Speedups are ratios of total wall times over a category; tau is the mean acceptance length over all cycles.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    append_jsonl,
    begin,
    chat_ids,
    environment,
    load_head,
    markdown_table,
    print_load,
    read_jsonl,
    read_options,
    timed,
    write_json,
)

CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
METHODS = ("plain", "prompt_lookup", "eagle31")
MT_BENCH_IDS = range(81, 161)
DEFAULT_TREE = {"chain": 4}
PROMPT_LOOKUP_TOKENS = 10
DTYPES = ("float32", "bfloat16")
WARMUP_TOKENS = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="shared data folder (spec_bench/ inside)")
    p.add_argument("--categories", default=",".join(CATEGORIES), help=f"comma list out of {','.join(CATEGORIES)}")
    p.add_argument("--per-category", type=int, default=80, help="first N prompts of each category (80 = all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--draft", default=None, help="draft head folder (default: shipped head, else untrained)")
    p.add_argument("--options", default=None, help="eagle31 tree options: JSON string or a JSON file (tree.json)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--fresh", action="store_true", help="discard the records of an earlier run in --out")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 on a busy machine)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype of the target and head for all three methods (exactness is required in float32)")
    args = p.parse_args(argv)
    args.categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    unknown = sorted(set(args.categories) - set(CATEGORIES))
    if unknown:
        p.error(f"unknown categories {unknown}; choose from {list(CATEGORIES)}")
    return args


# -- prompts -----------------------------------------------------------------------------------------------------
def load_questions(data: Path, categories: list[str], per_category: int) -> list[dict]:
    """The first `per_category` records of each category, first turn only, in category order."""
    path = data / "spec_bench" / "question.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"Spec-Bench questions not found at {path}; pass --data (the shared data folder)")
    by_cat: dict[str, list[dict]] = {c: [] for c in categories}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        cat = "mt_bench" if rec["question_id"] in MT_BENCH_IDS else rec["category"]
        if cat in by_cat and len(by_cat[cat]) < per_category:
            by_cat[cat].append({"question_id": rec["question_id"], "category": cat, "text": rec["turns"][0]})
    return [q for c in categories for q in by_cat[c]]


# -- resume log --------------------------------------------------------------------------------------------------
def run_key(args, options: dict, head_info: dict) -> dict[str, Any]:
    """What a record depends on: records are reused on resume only when this matches exactly."""
    return {"max_new_tokens": args.max_new_tokens, "options": options, "dtype": args.dtype,
            "torch_threads": torch.get_num_threads(),
            "head": head_info["folder"] or "untrained (seed 0)",
            "data": str((args.data / "spec_bench" / "question.jsonl").resolve()),
            "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}


def load_done(path: Path, key: dict, fresh: bool) -> dict[int, dict]:
    if fresh and path.is_file():
        path.unlink()
    records = read_jsonl(path)
    foreign = [r["question_id"] for r in records if r["key"] != key]
    if foreign:
        raise SystemExit(f"{path} holds {len(foreign)} records of a different configuration (first: question "
                         f"{foreign[0]}); this run is {json.dumps(key)}. Pass --fresh to discard them, or another "
                         "--out to keep both.")
    return {r["question_id"]: r for r in records}


# -- the three methods -------------------------------------------------------------------------------------------
class Methods:
    """Runs one prompt through each method; warms up what needs warming before anything is timed."""

    def __init__(self, model, head, options: dict, max_new_tokens: int) -> None:
        import eagle_compile
        from eagle_compile.options import parse_options

        self.generate = eagle_compile.generate
        self.model, self.head, self.options, self.max_new = model, head, options, max_new_tokens
        self.parsed = parse_options(options)
        self.warm: set[tuple[int, int]] = set()
        self.graphs: dict[int, int] = {}          # cache slots -> graphs captured so far by that decoder
        self.last_new_graphs = 0

    def warm_hf(self, ids: torch.Tensor) -> None:
        for method in ("plain", "prompt_lookup"):
            self.run(method, ids, WARMUP_TOKENS)

    def cache_slots(self, prompt_len: int) -> int:
        """Static eagle31 cache slots for this prompt (what the decoder allocates), rounded up."""
        from eagle_compile.core.tree import TreeShape
        from eagle_compile.runtime.decoder import cache_slots_needed, forward_tokens

        o = self.parsed
        if o.max_cache_len is not None:
            return o.max_cache_len
        need = cache_slots_needed(prompt_len, self.max_new, o.prefill_chunk,
                                  TreeShape(o.tree_depth, o.tree_top_k, o.tree_tokens),
                                  forward_tokens=forward_tokens(o, self.model.device))
        return math.ceil(need / o.cache_len_multiple) * o.cache_len_multiple

    def shape_key(self, prompt_len: int) -> tuple:
        """What the captured graphs specialise on: the static cache size and the prefill chunk sizes used."""
        from eagle_compile.runtime.decoder import forward_tokens
        from eagle_compile.runtime.prefill_plan import prefill_plan

        sizes = frozenset(size for _, size in prefill_plan(prompt_len, self.parsed.prefill_chunk,
                                                           forward_tokens=forward_tokens(self.parsed,
                                                                                         self.model.device)))
        return self.cache_slots(prompt_len), sizes

    def warm_eagle(self, ids: torch.Tensor) -> float | None:
        """Capture the graphs for this prompt's shapes, untimed; seconds spent, None when already warm."""
        key = self.shape_key(ids.shape[1])
        if key in self.warm:
            return None
        _, seconds = timed(lambda: self.run("eagle31", ids, WARMUP_TOKENS))
        self.warm.add(key)
        return seconds

    def new_graphs(self, ids: torch.Tensor, out) -> int:
        """Graphs captured during the last eagle31 call (0 when the warm-up did its job)."""
        slots = self.cache_slots(ids.shape[1])
        now = out.stats.graphs_captured
        before, self.graphs[slots] = self.graphs.get(slots, now), now
        return now - before

    def run(self, method: str, ids: torch.Tensor, max_new: int | None = None):
        max_new = max_new or self.max_new
        mask = torch.ones_like(ids)
        if method == "plain":
            return self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False)
        if method == "prompt_lookup":
            return self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                       prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
        options = {**self.options, "max_cache_len": self.cache_slots(ids.shape[1])}
        out = self.generate(self.model, ids, attention_mask=mask, draft=self.head, options=options,
                            max_new_tokens=max_new, do_sample=False, return_dict_in_generate=True)
        self.last_new_graphs = self.new_graphs(ids, out)
        return out


def run_prompt(methods: Methods, tokenizer, question: dict, index: int, key: dict) -> dict:
    """One record: each method timed once on this prompt, in an order that rotates with `index`."""
    ids = chat_ids(tokenizer, question["text"])
    warmup_s = methods.warm_eagle(ids)
    order = METHODS[index % 3:] + METHODS[:index % 3]
    outputs, times = {}, {}
    for method in order:
        outputs[method], times[method] = timed(lambda m=method: methods.run(m, ids))
    plain = outputs["plain"]
    eagle = outputs["eagle31"]
    stats = eagle.stats.as_dict()
    return {
        "question_id": question["question_id"], "category": question["category"], "prompt_tokens": ids.shape[1],
        "order": list(order), "key": key, "load": _load_now(), "eagle_warmup_s": warmup_s,
        "eagle_cache_slots": methods.cache_slots(ids.shape[1]),
        "plain": {"time": times["plain"], "new_tokens": plain.shape[1] - ids.shape[1]},
        "prompt_lookup": {"time": times["prompt_lookup"],
                          "new_tokens": outputs["prompt_lookup"].shape[1] - ids.shape[1],
                          "matches_plain": torch.equal(outputs["prompt_lookup"], plain)},
        "eagle31": {"time": times["eagle31"], "new_tokens": eagle.sequences.shape[1] - ids.shape[1],
                    "graphs_captured_while_timed": methods.last_new_graphs,
                    "lossless": torch.equal(eagle.sequences, plain),
                    "agreeing_tokens": agreeing_tokens(eagle.sequences, plain, ids.shape[1]),
                    "histogram": {int(k): v for k, v in stats["histogram"].items()},
                    "cycles": stats["cycles"], "tree": stats["tree"],
                    "times": _time_split(stats)},
    }


def agreeing_tokens(out: torch.Tensor, ref: torch.Tensor, prompt_len: int) -> int:
    """How many leading new tokens of ``out`` equal ``ref``'s (batch 1)."""
    a, b = out[0, prompt_len:], ref[0, prompt_len:]
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if len(differ) else n


def _load_now() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def report_prompt(rec: dict, done: int, total: int) -> None:
    e = rec["eagle31"]
    tau = _tau(Counter({int(k): v for k, v in e["histogram"].items()}))
    rates = ", ".join(f"{m} {rec[m]['new_tokens'] / rec[m]['time']:.1f} tok/s" for m in METHODS)
    flag = "exact" if e["lossless"] else f"MISMATCH WITH PLAIN GREEDY after {e['agreeing_tokens']} tokens"
    if e.get("graphs_captured_while_timed"):
        flag += f" (WARNING: {e['graphs_captured_while_timed']} graph capture(s) inside the timed call)"
    print(f"[{done}/{total}] {rec['category']} q{rec['question_id']} ({rec['prompt_tokens']} prompt tokens): "
          f"{rates}; tau {tau:.2f}; eagle31 {flag}; prompt lookup "
          f"{'exact' if rec['prompt_lookup']['matches_plain'] else 'differs'}; load {rec['load'][0]}", flush=True)


def _time_split(stats: dict) -> dict[str, float]:
    """prefill plus either the step's draft/verify/accept split (eager step) or the whole step (captured)."""
    times = {k: v for k, v in stats.items() if k.endswith("_time") and v is not None}
    if "draft_time" in times:
        times.pop("step_time", None)      # step_time = draft + verify + accept (+ the host read)
    return times


# -- summary -----------------------------------------------------------------------------------------------------
def _tau(hist: Counter) -> float:
    cycles = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / cycles if cycles else float("nan")


def summarize_group(records: list[dict]) -> dict[str, Any]:
    """Totals over a group of records: tokens/s per method, tau and its histogram, speedups, eagle time split."""
    hist: Counter = Counter()
    split: Counter = Counter()
    for r in records:
        hist.update({int(k): v for k, v in r["eagle31"]["histogram"].items()})
        split.update(r["eagle31"]["times"])
    total = {m: sum(r[m]["time"] for r in records) for m in METHODS}
    tokens = {m: sum(r[m]["new_tokens"] for r in records) for m in METHODS}
    return {
        "prompts": len(records), "new_tokens": tokens, "time_s": total,
        "tokens_per_s": {m: tokens[m] / total[m] if total[m] else float("nan") for m in METHODS},
        "tau": _tau(hist), "histogram": dict(sorted(hist.items())),
        "speedup_vs_plain": total["plain"] / total["eagle31"],
        "speedup_vs_prompt_lookup": total["prompt_lookup"] / total["eagle31"],
        "prompt_lookup_vs_plain": total["plain"] / total["prompt_lookup"],
        "eagle31_time_split": {k: v / total["eagle31"] for k, v in sorted(split.items())},
        "eagle31_mismatches": [r["question_id"] for r in records if not r["eagle31"]["lossless"]],
        "eagle31_agreeing_tokens": {r["question_id"]: r["eagle31"]["agreeing_tokens"] for r in records
                                    if not r["eagle31"]["lossless"]},
        "eagle31_captures_while_timed": [r["question_id"] for r in records
                                         if r["eagle31"].get("graphs_captured_while_timed")],
        "prompt_lookup_mismatches": [r["question_id"] for r in records if not r["prompt_lookup"]["matches_plain"]],
    }


def summarize(records: list[dict], categories: list[str]) -> dict[str, dict]:
    groups = {c: [r for r in records if r["category"] == c] for c in categories}
    summary = {c: summarize_group(rs) for c, rs in groups.items() if rs}
    if len(summary) > 1:
        summary["all"] = summarize_group(records)
    return summary


# -- outputs -----------------------------------------------------------------------------------------------------
def markdown(summary: dict, meta: dict) -> str:
    head = meta["head"]
    intro = f"**{head['note']}.**" if not head["trained"] else f"Draft head: {head['note']}."
    return "\n".join([
        f"# Spec-Bench: eagle31 vs HF generate vs HF prompt lookup ({meta['target']})", "", intro, "",
        *_setup_lines(meta), *_warning_lines(summary, meta["dtype"]), "", _main_table(summary), "",
        "Acceptance-length histogram per category (tokens emitted per cycle: count of cycles):", "",
        _hist_table(summary), "",
        "eagle31 wall time split (fraction of its total time, from its statistics):", "", _split_table(summary), "",
    ])


def _warning_lines(summary: dict, dtype: str) -> list[str]:
    lines = []
    captured = sorted({q for s in summary.values() for q in s["eagle31_captures_while_timed"]})
    if captured:
        lines.append(f"- **WARNING: eagle31 captured graphs inside the timed call for questions {captured}; their "
                     "eagle31 times include compilation**")
    mismatched = sorted({q for s in summary.values() for q in s["eagle31_mismatches"]})
    if mismatched and dtype == "float32":
        lines.append(f"- **ERROR: eagle31 output differs from plain greedy decoding for questions {mismatched}**")
    elif mismatched:
        agree = {q: n for s in summary.values() for q, n in s["eagle31_agreeing_tokens"].items()}
        lines.append(f"- {dtype}: eagle31 output parts from plain greedy for questions {mismatched} after "
                     f"{[agree[q] for q in mismatched]} new tokens (rounding near-ties, see the script's docstring; "
                     "exactness is checked in float32)")
    return lines


def _setup_lines(meta: dict) -> list[str]:
    env, before, after = meta["environment"], meta["load_before"], meta["load_after"]
    loads = [r[0] for r in meta["record_loads"]]
    return [
        f"- eagle31 tree: `{json.dumps(meta['options'])}` (from {meta['options_source']})",
        f"- greedy, {meta['dtype']}, max_new_tokens {meta['max_new_tokens']}, first turn with the chat template; "
        f"prompt lookup with prompt_lookup_num_tokens={PROMPT_LOOKUP_TOKENS}; methods interleaved per prompt",
        f"- machine: {before['nproc']} cores, torch threads {before['torch_threads']}; load average (1 min) "
        f"{before['loadavg_1m']} before, {after['loadavg_1m']} after this invocation; over the prompts "
        f"{min(loads):.2f}-{max(loads):.2f}" if loads else "- machine: no prompts",
        f"- torch {env['torch']}, transformers {env['transformers']}, commit {env['git']['commit']}"
        f"{' (dirty tree)' if env['git']['dirty'] else ''}",
        f"- command: `{env['command']}`",
    ]


def _main_table(summary: dict) -> str:
    header = ["category", "prompts", "new tokens", "plain tok/s", "prompt lookup tok/s", "eagle31 tok/s", "tau",
              "eagle31 vs plain", "eagle31 vs prompt lookup", "eagle31 exact", "prompt lookup exact"]
    rows = []
    for cat, s in summary.items():
        tps = s["tokens_per_s"]
        rows.append([cat, s["prompts"], s["new_tokens"]["plain"], f"{tps['plain']:.1f}",
                     f"{tps['prompt_lookup']:.1f}", f"{tps['eagle31']:.1f}", f"{s['tau']:.2f}",
                     f"{s['speedup_vs_plain']:.2f}x", f"{s['speedup_vs_prompt_lookup']:.2f}x",
                     _exact(s["eagle31_mismatches"], s["prompts"]), _exact(s["prompt_lookup_mismatches"],
                                                                           s["prompts"])])
    return markdown_table(header, rows)


def _exact(mismatches: list[int], prompts: int) -> str:
    return f"{prompts - len(mismatches)}/{prompts}" + (f" (differs: {mismatches})" if mismatches else "")


def _hist_table(summary: dict) -> str:
    return markdown_table(["category", "histogram"], [
        [cat, " ".join(f"{k}:{v}" for k, v in s["histogram"].items())] for cat, s in summary.items()])


def _split_table(summary: dict) -> str:
    keys = sorted({k for s in summary.values() for k in s["eagle31_time_split"]})
    rows = []
    for cat, s in summary.items():
        split = s["eagle31_time_split"]
        other = 1.0 - sum(split.values())
        rows.append([cat] + [f"{split.get(k, 0.0):.0%}" for k in keys] + [f"{other:.0%}"])
    return markdown_table(["category"] + [k.removesuffix("_time") for k in keys] + ["other"], rows)


def plot(summary: dict, meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / len(METHODS)
    for i, m in enumerate(METHODS):
        xs = [j + (i - 1) * width for j in range(len(cats))]
        ax1.bar(xs, [summary[c]["tokens_per_s"][m] for c in cats], width, label=m)
    ax1.set_xticks(range(len(cats)), cats, rotation=25, ha="right")
    ax1.set_ylabel("tokens / s")
    ax1.legend()
    ax2.bar(range(len(cats)), [summary[c]["tau"] for c in cats], color="tab:green")
    ax2.set_xticks(range(len(cats)), cats, rotation=25, ha="right")
    ax2.set_ylabel("tau (tokens per cycle)")
    untrained = "" if meta["head"]["trained"] else "  [UNTRAINED draft head: no speedup expected]"
    fig.suptitle(f"Spec-Bench, {meta['target']} {meta['dtype']}, {meta['max_new_tokens']} new tokens, tree "
                 f"{json.dumps(meta['options'])}{untrained}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out: Path, records: list[dict], summary: dict, meta: dict) -> None:
    write_json(out / "spec_bench.json", {"meta": meta, "summary": summary, "records": records})
    md = markdown(summary, meta)
    (out / "spec_bench.md").write_text(md)
    if summary:
        plot(summary, meta, out / "spec_bench.png")
    print("\n" + md, flush=True)
    print(f"wrote {out / 'spec_bench.json'}, {out / 'spec_bench.md'}, {out / 'spec_bench.png'}", flush=True)


# -- main --------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = begin(args.threads)
    from eagle_compile.targets import load_default_target

    model, tokenizer = load_default_target(getattr(torch, args.dtype))
    head, head_info = load_head(model, args.draft)
    options, options_source = read_options(args.options, head_info, DEFAULT_TREE, model.dtype)
    print(f"draft: {head_info['note']}\neagle31 tree: {json.dumps(options)} (from {options_source})", flush=True)
    questions = load_questions(args.data, args.categories, args.per_category)
    key = run_key(args, options, head_info)
    log = args.out / "spec_bench.records.jsonl"
    done = load_done(log, key, args.fresh)
    todo = [q for q in questions if q["question_id"] not in done]
    print(f"{len(questions)} prompts selected, {len(questions) - len(todo)} already in {log}, {len(todo)} to run",
          flush=True)
    methods = Methods(model, head, options, args.max_new_tokens)
    interrupted = _run_all(methods, tokenizer, todo, done, key, log, len(questions))
    records = [done[q["question_id"]] for q in questions if q["question_id"] in done]
    meta = {"target": "SmolLM2-135M-Instruct", "dtype": args.dtype, "head": head_info, "options": options,
            "options_source": options_source, "max_new_tokens": args.max_new_tokens,
            "categories": args.categories, "per_category": args.per_category, "environment": environment(),
            "load_before": load_before, "load_after": print_load("after"),
            "record_loads": [r["load"] for r in records]}
    summary = summarize(records, args.categories)
    write_outputs(args.out, records, summary, meta)
    return _exit_status(summary, interrupted, args.dtype)


def _run_all(methods: Methods, tokenizer, todo: list[dict], done: dict, key: dict, log: Path, total: int) -> bool:
    """Run and log the prompts still to do; True when interrupted (the log keeps every finished prompt)."""
    if not todo:
        return False
    methods.warm_hf(chat_ids(tokenizer, todo[0]["text"]))
    try:
        for i, q in enumerate(todo):
            rec = run_prompt(methods, tokenizer, q, len(done) + i, key)
            append_jsonl(log, rec)
            done[q["question_id"]] = rec
            report_prompt(rec, len(done), total)
    except KeyboardInterrupt:
        print(f"interrupted at {time.strftime('%H:%M:%S')}; rerun the same command to continue", flush=True)
        return True
    return False


def _exit_status(summary: dict, interrupted: bool, dtype: str) -> int:
    bad = sorted({q for s in summary.values() for q in s["eagle31_mismatches"]})
    if bad and dtype == "float32":
        print(f"\n!!! eagle31 output DIFFERS from plain greedy decoding for questions {bad}: speculative decoding "
              "must be lossless; this is a bug !!!", file=sys.stderr, flush=True)
        return 1
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
