"""The calibration layer against the plain mode of the same programs (issue 11), side by side in one process.

    python benchmarks/calibration.py --threads 2                                   # every section, quick sizes
    python benchmarks/calibration.py --sections spec,heads --per-category 2 --new-tokens 64
    python benchmarks/calibration.py --sections fixed --fixed bench_out/verify_cost.json

The comparator is eagle31's plain mode (`options={"speculate": False}`: the same captured programs, kernels and
numerics, one target forward per token): a speedup over it is speculation's alone. HF `model.generate`
(greedy, eager) is timed beside it. Every eagle31 configuration is the README's: `torch.compile(model,
backend="eagle31", options={"draft": head})` with nothing else but the cost cache's folder (--cache), so the
calibration layer is on with its default menu.

Sections (float32, greedy; each case warms every method up once, untimed: captures and the first cost
measurement happen there and are reported as `calibration_s`; then --rounds interleaved timed rounds):

* `spec`: the first --per-category Spec-Bench prompts of each category (first turn, chat template) x
  --new-tokens, batch 1, shipped head: adaptive / plain / hf per category and overall.
* `heads`: the same prompts (the first of each category) with an untrained head (seed 0) and an always-wrong
  drafter (the shipped head's proposals shifted by one token id, so its costs are real and its tokens wrong):
  adaptive / plain; the statistics show the fallback engaging.
* `fixed`: the adaptive default against fixed trees (a tree key in the options keeps the tree fixed), per
  category: --fixed is a verify_cost.json (its ranking's top 5) or a JSON list of option dicts.
* `batch`: --batches rows of MT-bench first turns, left padded: adaptive / plain / hf.
* `long`: one LEval government report cut to --long-lengths tokens x --long-new-tokens: adaptive / plain / hf.
* `monitors`: what the drift monitors (`drift_monitors=True`) cost: the head's tree.json fixed and the adaptive
  default, each with and without the monitors, plain beside them, on the first Spec-Bench prompt of each
  category; the table's `monitor cost` row is time with monitors / time without, minus 1.

Every eagle31 output is compared with the plain mode's (batch-invariant numerics: must be equal, exit 1 if
not) and with HF's (reported). Outputs in --out: calibration.records.jsonl (one record per case, appended: rerun
the same command to resume), calibration.json, calibration.md (the tables, paste verbatim), calibration.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    append_jsonl,
    chat_ids,
    environment,
    interleaved_times,
    left_pad,
    load_head,
    long_report,
    markdown_table,
    print_load,
    read_jsonl,
    read_options,
    resumable_log,
    set_threads,
    write_json,
)

from eagle_compile.draft.drafter import EagleDrafter

SECTIONS = ("spec", "heads", "fixed", "batch", "long", "monitors")
CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="spec,heads,batch,long")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--batch-new-tokens", type=int, default=48)
    p.add_argument("--long-lengths", default="1024,3072,6144")
    p.add_argument("--long-new-tokens", type=int, default=48)
    p.add_argument("--fixed", default=None, help="verify_cost.json (top 5 of its ranking) or a JSON list of options")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--cache", type=Path, default=None, help="cost cache folder (default: <out>/cost_cache)")
    p.add_argument("--fresh", action="store_true", help="discard the records of an earlier run")
    return p.parse_args(argv)


@dataclass
class ShiftedDrafter(EagleDrafter):
    """The always-wrong drafter: a real head's forward (so drafting costs what it costs) proposing its tokens
    shifted by one id, which the target practically never emits."""

    vocab: int = 0
    capture_indices: tuple | None = None

    def top_k(self, head_input, k):
        scores, tokens = super().top_k(head_input, k)
        return scores, (tokens + 1) % self.vocab


# -- inputs -------------------------------------------------------------------------------------------------------
def spec_prompts(tokenizer, data: Path, per_category: int) -> list[tuple[str, torch.Tensor]]:
    by_cat: dict[str, list] = {c: [] for c in CATEGORIES}
    for line in (data / "spec_bench" / "question.jsonl").read_text().splitlines():
        rec = json.loads(line)
        cat = "mt_bench" if 81 <= rec["question_id"] <= 160 else rec["category"]
        if cat in by_cat and len(by_cat[cat]) < per_category:
            by_cat[cat].append((f"{cat}/{rec['question_id']}", chat_ids(tokenizer, rec["turns"][0])))
    return [x for c in CATEGORIES for x in by_cat[c]]


def fixed_trees(spec: str | None) -> list[dict]:
    if spec is None:
        raise SystemExit("--sections fixed needs --fixed (verify_cost.json or a JSON list of option dicts)")
    path = Path(spec)
    if path.is_file():
        record = json.loads(path.read_text())
        return [r["options"] for r in record["choice"]["ranking"][:5]]
    return list(json.loads(spec))


# -- one case ------------------------------------------------------------------------------------------------------
class Runner:
    def __init__(self, model, cache: Path) -> None:
        self.model = model
        self.cache = str(cache)
        self.compiled: dict[str, Any] = {}

    def method(self, name: str, options: dict | None):
        """A callable (ids, mask, new) -> (sequences, stats or None); options None = HF generate, {"hf": kwargs}
        = HF generate with these keyword arguments (e.g. prompt_lookup_num_tokens)."""
        if options is None or "hf" in options:
            extra = {} if options is None else options["hf"]
            return lambda ids, mask, new: (self.model.generate(ids, attention_mask=mask, max_new_tokens=new,
                                                               do_sample=False, **extra), None)
        if name not in self.compiled:
            self.compiled[name] = torch.compile(self.model, backend="eagle31",
                                                options={**options, "calibration_cache": self.cache})
        compiled = self.compiled[name]

        def run(ids, mask, new):
            out = compiled.generate(ids, attention_mask=mask, max_new_tokens=new, return_dict_in_generate=True)
            return out.sequences, out.stats

        return run

    def case(self, methods: dict[str, dict | None], ids, mask, new: int, rounds: int) -> dict[str, Any]:
        fns = {name: self.method(name, opts) for name, opts in methods.items()}
        warm = {name: fn(ids, mask, new) for name, fn in fns.items()}          # captures, first cost measurement
        last: dict[str, Any] = {}

        def timed_call(name):
            def call():
                last[name] = fns[name](ids, mask, new)
            return call

        times = interleaved_times({name: timed_call(name) for name in fns}, repeats=rounds, warmup=0)
        plain = last["plain"][0]
        record: dict[str, Any] = {"rows": int(ids.shape[0]), "prompt_tokens": int(mask.sum(1).max()), "new": new}
        for name in fns:
            seq, stats = last[name]
            entry = {"s": times[name]["median"], "exact_vs_plain": bool(torch.equal(seq, plain))}
            if "hf" in last:
                entry["equal_to_hf"] = bool(torch.equal(seq, last["hf"][0]))
            if stats is not None:
                entry.update(tau=stats.tau, cycles=stats.cycles, prefill_s=stats.prefill_time,
                             copied=stats.copied_tokens, copied_outside_draft_vocab=stats.copied_outside_draft_vocab)
                if stats.calibration is not None:
                    entry["policy"] = stats.calibration["policy"]
                    entry["head_alpha"] = stats.calibration["head_alpha"]
                    entry["costs"] = stats.calibration["costs"]
                    entry["calibration_s"] = warm[name][1].calibration_time
            record[name] = entry
        return record


def methods_for(section: str, head, wrong, random_head, fixed: list[dict], tree: dict) -> dict[str, dict | None]:
    if section == "monitors":
        return {"tree": {"draft": head, **tree}, "tree+monitors": {"draft": head, **tree, "drift_monitors": True},
                "adaptive": {"draft": head}, "adaptive+monitors": {"draft": head, "drift_monitors": True},
                "plain": {"speculate": False}}
    if section in ("spec", "batch", "long"):
        # "head tree": the head's tree.json fixed (calibration off), speculating every cycle: the lossless check
        # of batch-invariant numerics where every cycle verifies a block, and the anchor adaptive must beat
        return {"adaptive": {"draft": head}, "head tree": {"draft": head, **tree}, "plain": {"speculate": False},
                "hf": None}
    if section == "heads":
        return {"random head": {"draft": random_head}, "always wrong": {"draft": wrong},
                "plain": {"speculate": False}}
    out: dict[str, dict | None] = {"adaptive": {"draft": head}, "plain": {"speculate": False}}
    for opts in fixed:
        out["fixed " + ",".join(f"{k}={v}" for k, v in opts.items())] = {"draft": head, **opts}
    return out


def cases(section: str, args, tokenizer) -> list[tuple[str, torch.Tensor, torch.Tensor, int]]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if section in ("spec", "fixed"):
        return [(cid, ids, torch.ones_like(ids), args.new_tokens)
                for cid, ids in spec_prompts(tokenizer, args.data, args.per_category)]
    if section in ("heads", "monitors"):
        return [(cid, ids, torch.ones_like(ids), args.new_tokens)
                for cid, ids in spec_prompts(tokenizer, args.data, 1)]
    if section == "batch":
        rows = [ids for _, ids in spec_prompts(tokenizer, args.data, 80) if _.startswith("mt_bench")]
        out = []
        for b in (int(x) for x in args.batches.split(",")):
            ids, mask = left_pad(rows[:b], pad)
            out.append((f"batch {b}", ids, mask, args.batch_new_tokens))
        return out
    return [(f"{n} tokens", long_report(tokenizer, args.data, n), None, args.long_new_tokens)
            for n in (int(x) for x in args.long_lengths.split(","))]


# -- summary -------------------------------------------------------------------------------------------------------
def summarize(records: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section in SECTIONS:
        recs = [r for r in records if r["section"] == section]
        if not recs:
            continue
        groups: dict[str, list[dict]] = {}
        for r in recs:
            group = r["case"].split("/")[0] if section in ("spec", "fixed", "monitors") else r["case"]
            groups.setdefault(group, []).append(r)
        if section in ("spec", "fixed", "monitors"):
            groups["overall"] = recs
        out[section] = {g: _group(rs) for g, rs in groups.items()}
    return out


def _group(recs: list[dict]) -> dict[str, Any]:
    names = [k for k in recs[0] if isinstance(recs[0][k], dict) and "s" in recs[0][k]]
    total = {n: sum(r[n]["s"] for r in recs) for n in names}
    plain = total["plain"]
    summary = {}
    for n in names:
        taus = [r[n]["tau"] for r in recs if "tau" in r[n]]
        chosen: dict[str, int] = {}
        plain_cycles = probes = 0
        for r in recs:
            pol = r[n].get("policy") or {}
            for k, v in pol.get("chosen", {}).items():
                chosen[k] = chosen.get(k, 0) + v
            plain_cycles += pol.get("plain_cycles", 0)
            probes += pol.get("probes", 0)
        summary[n] = {"s": total[n], "vs_plain": plain / total[n], "exact_vs_plain": sum(r[n]["exact_vs_plain"]
                                                                                        for r in recs),
                      "cases": len(recs), "tau": sum(taus) / len(taus) if taus else None, "chosen": chosen,
                      "plain_cycles": plain_cycles, "probes": probes}
    return summary


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"Command: `{meta['command']}`", f"Machine: {meta['environment']}", ""]
    for section, groups in summary.items():
        lines.append(f"**{section}** (speedup = the plain mode's time / this method's time)")
        names = list(next(iter(groups.values())))
        header = ["case"] + [f"{n} vs plain" for n in names if n != "plain"] + ["plain s"] + \
            [f"{n} tau" for n in names if groups[next(iter(groups))][n]["tau"] is not None] + ["choices (adaptive)"]
        rows = []
        for g, s in groups.items():
            row = [g] + [f"{s[n]['vs_plain']:.3f}x" for n in names if n != "plain"] + [f"{s['plain']['s']:.1f}"]
            row += [f"{s[n]['tau']:.2f}" for n in names if s[n]["tau"] is not None]
            first = next((n for n in names if s[n]["chosen"]), next(n for n in names if n not in ("plain", "hf")))
            row.append(", ".join(f"{k} {v}" for k, v in sorted(s[first]["chosen"].items())) +
                       f"; probes {s[first]['probes']}")
            rows.append(row)
        lines += [markdown_table(header, rows), ""]
        bad = [(g, n) for g, s in groups.items() for n in names if s[n]["exact_vs_plain"] != s[n]["cases"]]
        lines.append("every eagle31 output equals the plain mode's" if not bad else f"MISMATCH vs plain: {bad}")
        lines += _monitor_cost(groups)
        lines.append("")
    return "\n".join(lines)


def _monitor_cost(groups: dict) -> list[str]:
    """For the `monitors` section: the drift monitors' cost per group, (time with) / (time without) - 1."""
    pairs = [(n, f"{n}+monitors") for n in ("tree", "adaptive")]
    first = next(iter(groups.values()))
    if not all(a in first and b in first for a, b in pairs):
        return []
    rows = [[g] + [f"{100 * (s[b]['s'] / s[a]['s'] - 1):+.1f} %" for a, b in pairs] for g, s in groups.items()]
    return ["", "monitor cost (time with the drift monitors / without - 1):",
            markdown_table(["case", *(f"{a}" for a, _ in pairs)], rows)]


def plot(summary: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    panels = list(summary.items())
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (section, groups) in zip(axes[0], panels, strict=True):
        names = [n for n in next(iter(groups.values())) if n != "plain"]
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            ax.bar([j + i * width for j in range(len(groups))], [s[n]["vs_plain"] for s in groups.values()],
                   width, label=n)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], list(groups), rotation=45, ha="right",
                      fontsize=7)
        ax.set_title(section)
        ax.set_ylabel("speedup vs the plain mode")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- main ----------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    import eagle_compile

    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--sections: unknown {sorted(unknown)}; valid: {SECTIONS}")
    log, done = resumable_log(args.out, "calibration.records.jsonl", args.fresh)
    model, tokenizer = eagle_compile.load_default_target()
    head, info = load_head(model, None)
    from eagle_compile.draft.model import untrained_head

    untrained = untrained_head(model)
    wrong = ShiftedDrafter(head, vocab=model.config.vocab_size,
                           capture_indices=tuple(head.config.capture_indices or ()) or None)
    fixed = fixed_trees(args.fixed) if "fixed" in sections else []
    tree, _ = read_options(None, info, {"depth": 3, "top_k": 3, "total_tokens": 8})
    runner = Runner(model, args.cache or args.out / "cost_cache")
    load_before = print_load("before")
    for section in sections:
        methods = methods_for(section, head, wrong, untrained, fixed, tree)
        for cid, ids, mask, new in cases(section, args, tokenizer):
            if (section, cid) in done:
                continue
            mask = torch.ones_like(ids) if mask is None else mask
            with torch.no_grad():
                rec = runner.case(methods, ids, mask, new, args.rounds)
            rec.update(section=section, case=cid)
            append_jsonl(log, rec)
            line = ", ".join(f"{n} {rec['plain']['s'] / rec[n]['s']:.2f}x" for n in methods if n != "plain")
            print(f"[{section}] {cid}: {line} (plain {rec['plain']['s']:.1f} s)", flush=True)
    records = read_jsonl(log)
    summary = summarize(records)
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "environment": environment(),
            "head": info["note"], "load_before": load_before, "load_after": print_load("after")}
    write_json(args.out / "calibration.json", {"meta": meta, "summary": summary, "records": records})
    text = markdown(summary, meta)
    (args.out / "calibration.md").write_text(text)
    plot(summary, args.out / "calibration.png")
    print(text)
    mismatch = [r for r in records for n, v in r.items() if isinstance(v, dict) and not v.get("exact_vs_plain", True)]
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
