"""Side-by-side table of several `spec_bench.py` runs (heads x trees): tau and eagle31-vs-plain per category.

    python benchmarks/spec_bench_compare.py "stage 4, 3x3x8=docs/spec_bench_heads/stage4_tree338" \\
        "stage 5, 3x3x8=docs/spec_bench_heads/stage5_tree338" --out docs/spec_bench_heads/compare.md

Each argument is `LABEL=DIR`, DIR holding a `spec_bench.json` that spec_bench.py wrote. Tau is deterministic for a
given head, tree and prompt set (greedy, float32, exact), so runs made at different times compare directly; the
speed ratios are each run's own interleaved plain / eagle31 times and say as much about that run's machine load.
Every run must cover the same prompts (question ids), or the table would compare different work: that is refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import markdown_table

ORDER = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "all")


def load_run(spec: str) -> tuple[str, dict]:
    label, sep, folder = spec.rpartition("=")
    if not sep or not label:
        raise SystemExit(f"{spec!r}: give LABEL=DIR (DIR holds spec_bench.json)")
    path = Path(folder) / "spec_bench.json"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: run benchmarks/spec_bench.py --out {folder} first")
    return label, json.loads(path.read_text())


def prompt_ids(run: dict) -> list:
    return sorted(r["question_id"] for r in run["records"])


def compare(runs: list[tuple[str, dict]]) -> str:
    first = prompt_ids(runs[0][1])
    for label, run in runs[1:]:
        if prompt_ids(run) != first:
            raise SystemExit(f"{label!r} covers other prompts than {runs[0][0]!r}; compare runs of one prompt set")
    cats = [c for c in ORDER if all(c in run["summary"] for _, run in runs)]
    header = ["category"] + [f"tau: {label}" for label, _ in runs] + [f"vs plain: {label}" for label, _ in runs]
    rows = [[c] + [f"{run['summary'][c]['tau']:.2f}" for _, run in runs]
            + [f"{run['summary'][c]['speedup_vs_plain']:.2f}x" for _, run in runs] for c in cats]
    lines = [markdown_table(header, rows), "", "Runs:", ""]
    for label, run in runs:
        meta, env = run["meta"], run["meta"]["environment"]
        dirty = " (dirty tree)" if env["git"].get("dirty") else ""
        lines.append(f"- {label}: head {meta['head']['folder']}, tree `{json.dumps(meta['options'])}`; "
                     f"`{env['command']}` at commit {env['git']['commit'][:7]}{dirty}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="LABEL=DIR with DIR/spec_bench.json")
    p.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    text = compare([load_run(s) for s in args.runs])
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
