"""Lowering on CPU: is the lowered speculative step (inductor for the non-custom parts) no slower than the unlowered
one? Side by side on the embedded SmolLM2-135M-Instruct target, with plain HF greedy decoding as the baseline.

    python benchmarks/lowering_cpu.py                      # default: 3 prompts x 48 new tokens, 3 rounds, ~10 min

Other options: `--prompts N`, `--max-new-tokens N`, `--rounds N` (timed rounds), `--modes plain,unlowered,...`,
`--draft HEAD_FOLDER` (default: the shipped head, else an untrained random EAGLE 3.1 head, which every output
says), `--options '{"chain": 4}'` (default: chain 4, or tree.json beside the head), `--data DIR` (default
../shared/data), `--out DIR` (default bench_out/), `--threads N` (torch threads, default 1: the machine is shared,
see benchmarks/common.py `set_threads`).

Modes (all greedy, float32, batch 1, on the same prompts):

* `plain`: `model.generate(do_sample=False)`, the baseline;
* `unlowered`: `eagle_compile.generate(options={"step_program": False})`: the cycle is a host loop around the
  captured target program (FX graph run as is);
* `lowered_eager`: `step_program=True, inner_backend="eager"`: the whole cycle captured as one graph, rewritten
  by the step passes (eagle31 ops: on CPU their torch references), run as the FX graph;
* `lowered_inductor`: `step_program=True, inner_backend="inductor"`: the same graph compiled by inductor around
  the eagle31 custom ops (and the prefill's target program too).

Protocol. Prompts are the first `--prompts` records of the training mix `train/instruct_mix.jsonl` (not an eval
set) whose chat-templated length is 16..150 tokens (so every call has the same static shapes: one capture per
mode), with the target's chat template and assistant prefix. Warm-up: each mode runs every prompt once first;
that wall time minus the mode's steady time is reported as `compile` (dynamo capture, passes and, for inductor,
its C++ compilation; inductor's FX-graph cache in $TORCHINDUCTOR_CACHE_DIR, else /tmp/torchinductor_$USER, makes
a second run faster, and the JSON says which run this was not: compare `compile_s` between runs). Timed: `--rounds`
rounds, each running every mode over all prompts, the mode order rotating from round to round so a change of
the machine's load hits every mode alike; per mode the median round time gives tokens/s. Every mode must emit
exactly the plain greedy tokens (float32; a mismatch is printed loudly and the exit status is 1). Machine load is
printed and recorded before and after: this machine is shared, compare ratios from one run only.

Outputs in --out: `lowering_cpu.json` (everything, with versions, commit, command line, `eagle_compile.explain`),
`lowering_cpu.md` (the table), `lowering_cpu.png` (tokens/s per mode, compile time per mode).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    chat_ids,
    environment,
    load_head,
    markdown_table,
    print_load,
    read_options,
    set_threads,
    timed,
    write_json,
)

MODES = ("plain", "unlowered", "lowered_eager", "lowered_inductor")
STEP_OPTIONS = {
    "unlowered": {"step_program": False},
    "lowered_eager": {"step_program": True, "inner_backend": "eager"},
    "lowered_inductor": {"step_program": True, "inner_backend": "inductor"},
}
DEFAULT_TREE = {"chain": 4}
PROMPT_TOKENS = (16, 150)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="shared data folder (train/ inside)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (each runs every mode over all prompts)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list out of {','.join(MODES)}")
    p.add_argument("--draft", default=None, help="draft head folder (default: shipped head, else untrained)")
    p.add_argument("--options", default=None, help="eagle31 tree options: JSON string or a JSON file")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    if args.rounds < 1 or args.prompts < 1 or args.max_new_tokens < 1:
        p.error("--rounds, --prompts and --max-new-tokens must be >= 1")
    return args


def load_prompts(data: Path, tokenizer, count: int) -> list[dict]:
    """The first `count` training-mix records whose templated prompt is PROMPT_TOKENS long, one per source."""
    path = data / "train" / "instruct_mix.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"training prompts not found at {path}; pass --data (the shared data folder)")
    prompts, sources = [], set()
    with path.open() as f:
        for line in f:
            rec = json.loads(line)
            text = rec["instruction"] + (f"\n\n{rec['input']}" if rec.get("input") else "")
            ids = chat_ids(tokenizer, text)
            if rec.get("source") in sources or not PROMPT_TOKENS[0] <= ids.shape[1] <= PROMPT_TOKENS[1]:
                continue
            sources.add(rec.get("source"))
            prompts.append({"id": rec["id"], "source": rec.get("source"), "tokens": ids.shape[1], "ids": ids})
            if len(prompts) == count:
                return prompts
    raise ValueError(f"{path} has only {len(prompts)} records of distinct sources with {PROMPT_TOKENS} tokens")


class Modes:
    """One callable per mode: runs every prompt, returns (new tokens, outputs, tau) of the pass."""

    def __init__(self, model, head, tree: dict, max_new: int) -> None:
        self.model, self.head, self.tree, self.max_new = model, head, tree, max_new

    def run(self, mode: str, prompts: list[dict]) -> dict[str, Any]:
        outputs, new, taus, cycles, step_s = [], 0, [], 0, 0.0
        for p in prompts:
            seq, stats = self._one(mode, p["ids"])
            outputs.append(seq[0, p["ids"].shape[1]:].tolist())
            new += seq.shape[1] - p["ids"].shape[1]
            if stats is not None:
                taus += stats.acceptance_lengths
                cycles += stats.cycles
                step_s += stats.step_time
        return {"outputs": outputs, "new_tokens": new, "tau": sum(taus) / len(taus) if taus else None,
                "cycles": cycles, "step_s": step_s}

    @torch.no_grad()
    def _one(self, mode: str, ids: torch.Tensor):
        if mode == "plain":
            return self.model.generate(ids, max_new_tokens=self.max_new, do_sample=False), None
        import eagle_compile

        out = eagle_compile.generate(self.model, ids, draft=self.head, options={**self.tree, **STEP_OPTIONS[mode]},
                                     max_new_tokens=self.max_new, return_dict_in_generate=True)
        return out.sequences, out.stats


def warm_up(modes: Modes, names: list[str], prompts: list[dict]) -> dict[str, float]:
    """First pass of each mode (captures and compiles happen here): wall seconds."""
    first = {}
    for name in names:
        print(f"warm-up {name} (captures/compiles now) ...", flush=True)
        _, first[name] = timed(lambda n=name: modes.run(n, prompts))
        print(f"warm-up {name}: {first[name]:.1f} s", flush=True)
    return first


def timed_rounds(modes: Modes, names: list[str], prompts: list[dict], rounds: int) -> dict[str, list[dict]]:
    """`rounds` rounds of every mode over all prompts; the order rotates each round."""
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            result, seconds = timed(lambda n=name: modes.run(n, prompts))
            result["seconds"] = seconds
            results[name].append(result)
            print(f"round {r + 1}/{rounds} {name:16s} {seconds:7.2f} s  {result['new_tokens'] / seconds:6.2f} tok/s",
                  flush=True)
    return results


def summarize(names: list[str], first: dict[str, float], results: dict[str, list[dict]]) -> dict[str, dict]:
    reference = results["plain"][0]["outputs"] if "plain" in results else None
    summary = {}
    for name in names:
        runs = results[name]
        seconds = [r["seconds"] for r in runs]
        median = statistics.median(seconds)
        outputs = [r["outputs"] for r in runs]
        summary[name] = {
            "median_s": median, "min_s": min(seconds), "max_s": max(seconds), "rounds": len(runs),
            "new_tokens": runs[0]["new_tokens"], "tokens_per_s": runs[0]["new_tokens"] / median,
            "first_call_s": first[name], "compile_s": max(0.0, first[name] - median),
            "tau": runs[0]["tau"], "cycles": runs[0]["cycles"],
            "ms_per_cycle": (statistics.median(1e3 * r["step_s"] / r["cycles"] for r in runs)
                             if runs[0]["cycles"] else None),
            "stable_outputs": all(o == outputs[0] for o in outputs),
            "equals_plain": None if reference is None else all(o == reference for o in outputs),
        }
    return summary


def markdown(summary: dict, meta: dict) -> str:
    base = summary.get("unlowered")
    rows = []
    for name, s in summary.items():
        rows.append([name, f"{s['tokens_per_s']:.2f}", f"{s['median_s']:.2f} ({s['min_s']:.2f}..{s['max_s']:.2f})",
                     f"{base['median_s'] / s['median_s']:.2f}" if base else "",
                     "" if s["ms_per_cycle"] is None else f"{s['ms_per_cycle']:.1f}",
                     f"{s['compile_s']:.0f}", "" if s["tau"] is None else f"{s['tau']:.2f}",
                     {None: "(reference)", True: "yes", False: "**NO**"}[s["equals_plain"]]])
    lines = [
        "# Lowering on CPU: unlowered vs lowered (eager, inductor) speculative steps", "",
        f"Target: SmolLM2-135M-Instruct float32, batch 1, greedy; {meta['prompts']} training-mix prompts "
        f"({meta['prompt_tokens']} tokens) x {meta['max_new_tokens']} new tokens; tree {json.dumps(meta['tree'])}; "
        f"{meta['rounds']} interleaved rounds; torch threads {meta['threads']}.",
        f"Head: {meta['head']['note']}.", "",
        markdown_table(["mode", "tok/s", "round s: median (min..max)", "speed vs unlowered", "ms per cycle",
                        "compile s", "tau", "== plain greedy"], rows), "",
        "tok/s and round s: whole generate calls (prefill included). speed vs unlowered: unlowered median / mode "
        "median (> 1 is faster). ms per cycle: speculative cycles only (draft, verify, accept, commit and the "
        "host read; no prefill), median over rounds. compile s: first pass minus the steady median (dynamo "
        "capture, passes; inductor: its C++ compilation, faster on a warm FX-graph cache).",
        f"Machine load (1/5/15 min) before {meta['load_before']['loadavg_1m']}/{meta['load_before']['loadavg_5m']}/"
        f"{meta['load_before']['loadavg_15m']}, after {meta['load_after']['loadavg_1m']}/"
        f"{meta['load_after']['loadavg_5m']}/{meta['load_after']['loadavg_15m']} on {meta['load_before']['nproc']} "
        "cores: the machine is shared; compare ratios from this run only.",
    ]
    return "\n".join(lines) + "\n"


def plot(summary: dict, meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    tps = [summary[n]["tokens_per_s"] for n in names]
    low = [summary[n]["new_tokens"] / summary[n]["max_s"] for n in names]
    high = [summary[n]["new_tokens"] / summary[n]["min_s"] for n in names]
    ax1.bar(names, tps, yerr=[[t - lo for t, lo in zip(tps, low, strict=True)],
                              [hi - t for t, hi in zip(tps, high, strict=True)]], capsize=4, color="tab:blue")
    ax1.set_ylabel("tokens/s (median round; bars: min..max)")
    ax1.set_title("steady-state speed")
    ax2.bar(names, [summary[n]["compile_s"] for n in names], color="tab:orange")
    ax2.set_ylabel("seconds")
    ax2.set_title("compile / capture (first pass minus steady)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=20)
    untrained = "" if meta["head"]["trained"] else " (UNTRAINED random head)"
    fig.suptitle(f"SmolLM2-135M float32 on CPU, {meta['threads']} thread(s){untrained}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    import eagle_compile

    load_before = print_load("start")
    model, tokenizer = eagle_compile.load_default_target()
    head, head_info = load_head(model, args.draft)
    print(head_info["note"], flush=True)
    tree, tree_source = read_options(args.options, head_info, DEFAULT_TREE)
    prompts = load_prompts(args.data, tokenizer, args.prompts)
    print(f"{len(prompts)} prompts of {[p['tokens'] for p in prompts]} tokens; tree {tree} ({tree_source})",
          flush=True)
    modes = Modes(model, head, tree, args.max_new_tokens)
    first = warm_up(modes, args.modes, prompts)
    results = timed_rounds(modes, args.modes, prompts, args.rounds)
    load_after = print_load("end")
    summary = summarize(args.modes, first, results)
    report = io.StringIO()
    eagle_compile.explain(model, file=report)
    meta = {"prompts": len(prompts), "prompt_tokens": [p["tokens"] for p in prompts],
            "prompt_ids": [p["id"] for p in prompts], "max_new_tokens": args.max_new_tokens, "tree": tree,
            "tree_source": tree_source, "rounds": args.rounds, "threads": torch.get_num_threads(), "head": head_info,
            "load_before": load_before, "load_after": load_after, "environment": environment()}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "lowering_cpu.json", {"summary": summary, "meta": meta, "explain": report.getvalue(),
                                                 "outputs": {n: results[n][0]["outputs"] for n in args.modes}})
    text = markdown(summary, meta)
    (args.out / "lowering_cpu.md").write_text(text)
    plot(summary, meta, args.out / "lowering_cpu.png")
    print("\n" + text, flush=True)
    print(f"wrote {args.out / 'lowering_cpu.json'}, .md and .png", flush=True)
    wrong = [n for n, s in summary.items() if s["equals_plain"] is False or not s["stable_outputs"]]
    if wrong:
        print(f"MISMATCH: {wrong} did not emit exactly the plain greedy tokens (or changed between rounds)",
              flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
