"""What a new user sees: eagle31 the README's way against HF `model.generate`, side by side in one process.

    python benchmarks/user_path.py --threads 1
    python benchmarks/user_path.py --threads 2 --sections chat,long,batch

The script uses only the public API (`torch.compile(model, backend="eagle31", options=...)`, `.generate`,
`eagle_compile.load_draft`), so the same file runs against an older checkout for a before/after comparison:
`PYTHONPATH=<old checkout> python benchmarks/user_path.py ...` (it prints which `eagle_compile` it imported).

Sections (float32, greedy, the shipped head; every eagle31 output is compared with HF's, exit 1 on a mismatch):

* `chat`: `--chat-prompts` Spec-Bench MT-bench first turns (evaluation prompts, chat template) x `--new-tokens`,
  batch 1, for each eagle31 configuration in `--configs`: `readme` = `options={"draft": head}` and nothing else
  (whatever tree that gives), `tree.json` = the shape in the tree.json beside the head given explicitly.
* `long`: one LEval government report cut to `--long-lengths` tokens x `--long-new-tokens`, `readme` options.
* `batch`: `--batches` rows of MT-bench first turns, left padded, `readme` options, against HF batched generate.

Each eagle31 configuration warms up once per shape (captures, not timed), then the eagle31 and HF calls of every
prompt run interleaved for `--rounds` rounds; the speedup is total HF time / total eagle31 time. Outputs in --out:
user_path.json and user_path.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    begin,
    compare_with_hf,
    environment,
    left_pad,
    long_report,
    markdown_table,
    mt_bench,
    print_load,
    write_json,
)

SECTIONS = ("chat", "long", "batch")
SHAPE_KEYS = ("depth", "top_k", "total_tokens", "chain")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--configs", default="readme,tree.json")
    p.add_argument("--chat-prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--long-lengths", default="1024,3072,6144")
    p.add_argument("--long-new-tokens", type=int, default=48)
    p.add_argument("--batches", default="4,16")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--label", default="", help="a name for this run in the outputs (e.g. before / after)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    args.sections = args.sections.split(",")
    args.configs = args.configs.split(",")
    args.long_lengths = [int(x) for x in args.long_lengths.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    return args


def config_options(name: str, head, folder: Path) -> dict[str, Any]:
    if name == "readme":
        return {"draft": head}
    if name == "tree.json":
        tree = json.loads((folder / "tree.json").read_text())
        return {"draft": head, **{k: tree[k] for k in SHAPE_KEYS if k in tree}}
    raise SystemExit(f"--configs: unknown {name!r} (readme, tree.json)")


def package_commit(package_dir: Path) -> str | None:
    """The git commit of the checkout `eagle_compile` was imported from (an older worktree for a 'before')."""
    done = subprocess.run(["git", "-C", str(package_dir), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = begin(args.threads)
    import eagle_compile
    from eagle_compile.heads import shipped_head

    print(f"eagle_compile from {Path(eagle_compile.__file__).parent}", flush=True)
    model, tokenizer = eagle_compile.load_default_target(torch.float32)
    folder = shipped_head()
    head = eagle_compile.load_draft(folder, target=model, dtype=torch.float32)
    rows = []

    def run(section: str, config: str, cases, new: int, what: str) -> None:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eagle31", options=config_options(config, head, folder))
        measured = compare_with_hf(model, compiled, cases, new, args.rounds)
        measured.pop("stats"), measured.pop("hf_sequences")
        row = {"section": section, "config": config, "what": what, "new_tokens": new, **measured}
        rows.append(row)
        print(f"  {section} {config} {what}: {row['speedup']:.2f}x HF (HF {row['hf_s']:.1f} s, eagle31 "
              f"{row['eagle31_s']:.1f} s, prefill {row['prefill_s']:.1f} s), tau {row['tau']:.2f}, exact "
              f"{row['exact']}/{row['cases']}, tree {row['tree']}", flush=True)

    if "chat" in args.sections:
        cases = [(ids, None) for ids in mt_bench(tokenizer, args.data, args.chat_prompts)]
        for config in args.configs:
            run("chat", config, cases, args.new_tokens, f"{len(cases)} MT-bench prompts")
    if "long" in args.sections:
        for length in args.long_lengths:
            run("long", "readme", [(long_report(tokenizer, args.data, length), None)], args.long_new_tokens,
                f"{length}-token report")
    if "batch" in args.sections:
        for batch in args.batches:
            ids, mask = left_pad(mt_bench(tokenizer, args.data, batch), tokenizer.pad_token_id or 0)
            run("batch", "readme", [(ids, mask)], args.new_tokens, f"batch {batch}")
    result = {"label": args.label, "environment": environment(), "load_before": load_before,
              "load_after": print_load("after"), "rows": rows,
              "eagle_compile": str(Path(eagle_compile.__file__).parent),
              "eagle_compile_commit": package_commit(Path(eagle_compile.__file__).parent),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "user_path" + (f".{args.label}" if args.label else "")
    write_json(args.out / f"{stem}.json", result)
    env = result["environment"]
    text = "\n".join([
        f"user path{f' ({args.label})' if args.label else ''}: eagle_compile from `{result['eagle_compile']}` "
        f"(commit {(result['eagle_compile_commit'] or '?')[:7]}), "
        f"torch {env['torch']}, {torch.get_num_threads()} threads, load {load_before['loadavg_1m']} / "
        f"{result['load_after']['loadavg_1m']}; `{env['command']}`", "",
        markdown_table(["section", "eagle31 options", "prompts", "new tokens", "HF s", "eagle31 s", "speedup",
                        "eagle31 prefill s", "tau", "exact", "tree"],
                       [[r["section"], r["config"], r["what"], r["new_tokens"], f"{r['hf_s']:.1f}",
                         f"{r['eagle31_s']:.1f}", f"{r['speedup']:.2f}x", f"{r['prefill_s']:.1f}", f"{r['tau']:.2f}",
                         f"{r['exact']}/{r['cases']}", json.dumps(r["tree"])] for r in rows])])
    (args.out / f"{stem}.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return 0 if all(r["exact"] == r["cases"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
