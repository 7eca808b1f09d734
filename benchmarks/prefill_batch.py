"""Where a ragged batch's time goes: prefill against decode, eagle31 with and without the grouped prefill, and HF.

    python benchmarks/prefill_batch.py --threads 2 --batch 64 --new-tokens 16

The first `--batch` Spec-Bench MT-bench first turns (chat template), left padded, float32, greedy, the shipped
head with the README's options (`{"draft": head}`). Each method runs `generate` with max_new_tokens 1 (prefill
and the first token) and `--new-tokens`; the difference is the decode. Methods: HF `generate` (one forward over
the padded batch), eagle31 (rows prefilled in groups of neighbouring lengths, `prefill_plan.prefill_groups`) and
eagle31 with grouping patched off (one block over every row up to the longest prompt: what ran before the grouped
prefill). One untimed warm-up call per eagle31 method (captures, cost measurements). Every eagle31 output is
checked against HF's. Writes prefill_batch.json and prefill_batch.md in --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    begin,
    environment,
    left_pad,
    markdown_table,
    mt_bench,
    print_load,
    write_json,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "prefill_batch")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = begin(args.threads)
    import eagle_compile
    import eagle_compile.runtime.decoder as decoder_module
    from eagle_compile.heads import shipped_head

    model, tokenizer = eagle_compile.load_default_target(torch.float32)
    head = eagle_compile.load_draft(shipped_head(), target=model, dtype=torch.float32)
    ids, mask = left_pad(mt_bench(tokenizer, args.data, args.batch), tokenizer.pad_token_id or 0)
    grouped = decoder_module.prefill_groups

    def one_block(lengths, *a, **k):
        return [list(range(len(lengths)))]

    def hf(n):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)

    def eagle(plan):
        def run(n):
            decoder_module.prefill_groups = plan
            try:
                return compiled.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
            finally:
                decoder_module.prefill_groups = grouped
        return run

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eagle31", options={"draft": head})
    methods = {"HF generate": hf, "eagle31 grouped prefill": eagle(grouped), "eagle31 one block": eagle(one_block)}
    rows, reference = [], None
    for name, run in methods.items():
        if name != "HF generate":
            run(args.new_tokens)                                        # warm-up, untimed
        times = {}
        for n in (1, args.new_tokens):
            t0 = time.perf_counter()
            out = run(n)
            times[n] = time.perf_counter() - t0
        reference = out if reference is None else reference
        rows.append({"method": name, "prefill_s": times[1], "total_s": times[args.new_tokens],
                     "decode_s": times[args.new_tokens] - times[1], "exact": bool(torch.equal(out, reference))})
        print(f"  {name}: max_new_tokens 1 {times[1]:.2f} s, {args.new_tokens} {times[args.new_tokens]:.2f} s, "
              f"exact {rows[-1]['exact']}", flush=True)
    result = {"environment": environment(), "load_before": load_before, "load_after": print_load("after"),
              "threads": torch.get_num_threads(), "padded": list(ids.shape), "prompt_tokens": int(mask.sum()),
              "rows": rows, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "prefill_batch.json", result)
    env = result["environment"]
    text = "\n".join([
        f"ragged batch of {args.batch} MT-bench first turns ({result['prompt_tokens']} prompt tokens, padded "
        f"{ids.shape[0]} x {ids.shape[1]}): torch {env['torch']}, {result['threads']} threads, load "
        f"{load_before['loadavg_1m']} / {result['load_after']['loadavg_1m']}; `{env['command']}`", "",
        markdown_table(["method", "max_new_tokens 1 s", f"max_new_tokens {args.new_tokens} s", "decode s",
                        "exact vs HF"],
                       [[r["method"], f"{r['prefill_s']:.2f}", f"{r['total_s']:.2f}", f"{r['decode_s']:.2f}",
                         r["exact"]] for r in rows])])
    (args.out / "prefill_batch.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
