"""The copy branch (prompt lookup merged into the tree, option `copy`) against the tree without it and against
HF's prompt lookup, on the tasks that copy: Spec-Bench summarization and rag, and long-document summaries.

    python benchmarks/copy_branch.py --threads 2
    python benchmarks/copy_branch.py --per-category 2 --long-lengths 1024,4096 --copy 8 --out bench_out/copy

Methods (float32, greedy, batch 1, shipped head; side by side in one process, each warmed up once untimed,
then --rounds interleaved timed rounds, as benchmarks/calibration.py does):

* `plain`: eagle31's plain mode (`speculate=False`), the comparator;
* `tree`: the head's tree.json, fixed (`calibrate="off"`); `tree+copy`: the same with a copy branch of --copy nodes;
* `adaptive`: the default calibration layer; `adaptive+copy`: with the copy-only program in its menu;
* `hf lookup`: HF `generate(prompt_lookup_num_tokens=--copy)` (greedy; its own exactness is reported vs plain);
* `hf`: HF `generate`, greedy.

Cases: the first --per-category Spec-Bench prompts of summarization and rag (first turn, chat template), and
"summarize this report" over one LEval government report cut to each of --long-lengths tokens.
Outputs in --out: copy_branch.records.jsonl (resumable), copy_branch.json, copy_branch.md, copy_branch.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from calibration import Runner, markdown, plot, spec_prompts, summarize
from common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    append_jsonl,
    chat_ids,
    environment,
    load_head,
    markdown_table,
    print_load,
    read_jsonl,
    resumable_log,
    set_threads,
    write_json,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--long-lengths", default="1024,4096")
    p.add_argument("--long-new-tokens", type=int, default=64)
    p.add_argument("--copy", type=int, default=8, help="copy-branch nodes (and HF's prompt_lookup_num_tokens)")
    p.add_argument("--methods", default="plain,tree,tree+copy,adaptive,adaptive+copy,hf lookup,hf")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--fresh", action="store_true", help="discard the records of an earlier run")
    return p.parse_args(argv)


def methods(head, copy: int, chosen: list[str]) -> dict[str, dict | None]:
    every = {"plain": {"speculate": False},
             "tree": {"draft": head, "calibrate": "off"},
             "tree+copy": {"draft": head, "calibrate": "off", "copy": copy},
             "adaptive": {"draft": head, "copy": 0},
             "adaptive+copy": {"draft": head, "copy": copy},
             "hf lookup": {"hf": {"prompt_lookup_num_tokens": copy}},
             "hf": None}
    unknown = set(chosen) - set(every)
    if unknown or "plain" not in chosen:
        raise SystemExit(f"--methods: unknown {sorted(unknown)} (valid: {list(every)}); 'plain' is required")
    return {name: every[name] for name in chosen}


def long_summary(tokenizer, data: Path, length: int) -> torch.Tensor:
    """A request to summarise one LEval government report, the report cut to `length` tokens."""
    with (data / "long_context" / "leval" / "gov_report_summ.jsonl").open() as f:
        for line in f:
            ids = tokenizer(json.loads(line)["input"])["input_ids"]
            if len(ids) >= length:
                text = tokenizer.decode(ids[:length])
                return chat_ids(tokenizer, f"Summarize the following report.\n\n{text}")
    raise SystemExit(f"no government report has {length} tokens")


def cases(args, tokenizer) -> list[tuple[str, str, torch.Tensor, int]]:
    out = [("spec", cid, ids, args.new_tokens) for cid, ids in spec_prompts(tokenizer, args.data, args.per_category)
           if cid.split("/")[0] in ("summarization", "rag")]
    for n in (int(x) for x in args.long_lengths.split(",") if x):
        out.append(("long", f"report {n} tokens", long_summary(tokenizer, args.data, n), args.long_new_tokens))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    import eagle_compile

    log, done = resumable_log(args.out, "copy_branch.records.jsonl", args.fresh)
    model, tokenizer = eagle_compile.load_default_target()
    head, info = load_head(model, None)
    chosen = methods(head, args.copy, [m for m in args.methods.split(",") if m])
    runner = Runner(model, args.out / "cost_cache")
    load_before = print_load("before")
    for section, cid, ids, new in cases(args, tokenizer):
        if (section, cid) in done:
            continue
        with torch.no_grad():
            rec = runner.case(chosen, ids, torch.ones_like(ids), new, args.rounds)
        rec.update(section=section, case=cid)
        append_jsonl(log, rec)
        line = ", ".join(f"{n} {rec['plain']['s'] / rec[n]['s']:.2f}x" for n in chosen if n != "plain")
        print(f"[{section}] {cid} ({rec['prompt_tokens']} tokens): {line} (plain {rec['plain']['s']:.1f} s)",
              flush=True)
    records = read_jsonl(log)
    summary = summarize(records)
    for section in summary.values():          # the copied tokens per group, beside tau
        for group, per_method in section.items():
            recs = [r for r in records if r["case"] == group or r["case"].split("/")[0] == group or
                    (group == "overall" and r["section"] == "spec")]
            for name, s in per_method.items():
                s["copied"] = sum(r[name].get("copied", 0) for r in recs)
    meta = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "environment": environment(),
            "head": info["note"], "copy": args.copy, "load_before": load_before, "load_after": print_load("after")}
    write_json(args.out / "copy_branch.json", {"meta": meta, "summary": summary, "records": records})
    text = markdown(summary, meta) + "\n" + copied_table(summary)
    (args.out / "copy_branch.md").write_text(text)
    plot(summary, args.out / "copy_branch.png")
    print(text)
    # eagle31's methods must equal the plain mode; HF's prompt lookup is reported, not required
    mismatch = [(r["case"], n) for r in records for n, v in r.items()
                if isinstance(v, dict) and not n.startswith("hf") and not v.get("exact_vs_plain", True)]
    return 1 if mismatch else 0


def copied_table(summary: dict) -> str:
    lines = []
    for section, groups in summary.items():
        names = [n for n in next(iter(groups.values())) if "copy" in n]
        if not names:
            continue
        rows = [[g] + [str(s[n]["copied"]) for n in names] for g, s in groups.items()]
        lines += [f"**{section}**: tokens accepted from the copy branch", markdown_table(["case", *names], rows), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
