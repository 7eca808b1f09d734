"""Quantised targets: eagle31 against the quantised model's own HF greedy `generate`, per torchao weight-only kind.

    python benchmarks/quantized.py --threads 2
    python benchmarks/quantized.py --kinds int8 --prompts 1 --new-tokens 8      # a smoke run

For each kind ("none" is the float32 target itself, for reference): the embedded target (SmolLM2-135M, float32)
quantised in place with `eagle_compile.targets.quantized.quantize_weight_only` (int8: per-row weights; int4: groups
of `--group-size` input channels, the CPU int4 layout; 576, the hidden size, is not a multiple of torchao's default
128, so 64), the shipped head, `torch.compile(model, backend="eagle31", options={"draft": head})`, the first
`--prompts` Spec-Bench MT-bench first turns at batch 1. One warm-up call each (captures; also the exactness check:
eagle31's tokens equal the quantised model's own greedy tokens), then the two interleaved for `--rounds` rounds
(benchmarks/common.compare_with_hf). Reported: tokens/s of each, the speedup, tau, exactness, the quantised weights
found and the numerics the programs ran with. Outputs in --out: quantized.json, quantized.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    begin,
    compare_with_hf,
    mt_bench,
    write_results,
)

KINDS = ("none", "int8", "int4")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="none,int8,int4", help=f"comma-separated, of {list(KINDS)}")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--group-size", type=int, default=64, help="int4 group size (input channels per scale)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "quantized")
    args = p.parse_args(argv)
    args.kinds = args.kinds.split(",")
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown:
        p.error(f"--kinds {unknown}: not among {list(KINDS)}")
    return args


def measure(kind: str, args) -> dict:
    import eagle_compile
    from eagle_compile.heads import shipped_head
    from eagle_compile.runtime.generate import _decoders
    from eagle_compile.targets.quantized import find_quantized, quantize_weight_only

    model, tokenizer = eagle_compile.load_default_target(torch.float32)
    if kind != "none":
        quantize_weight_only(model, kind, group_size=args.group_size)
    head = eagle_compile.load_draft(shipped_head(), target=model, dtype=torch.float32)
    cases = [(ids, None) for ids in mt_bench(tokenizer, args.data, args.prompts)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eagle31", options={"draft": head})
    row = compare_with_hf(model, compiled, cases, args.new_tokens, args.rounds)
    row.pop("stats")
    tokens = sum(seq.shape[1] - ids.shape[1] for seq, (ids, _) in zip(row.pop("hf_sequences"), cases, strict=True))
    decoder = list(_decoders[model].values())[-1]
    return {"kind": kind, "quantized": find_quantized(model).describe(), "numerics": decoder.lowering.numerics,
            "new_tokens": tokens, **row, "hf_tok_s": tokens / row["hf_s"], "eagle31_tok_s": tokens / row["eagle31_s"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = begin(args.threads)
    rows = []
    for kind in args.kinds:
        row = measure(kind, args)
        rows.append(row)
        print(f"  {kind}: {row['speedup']:.2f}x its own HF generate ({row['eagle31_tok_s']:.1f} vs "
              f"{row['hf_tok_s']:.1f} tok/s), tau {row['tau']:.2f}, exact {row['exact']}/{row['cases']}, "
              f"{row['quantized']}, numerics {row['numerics']}", flush=True)
    write_results(args.out, "quantized", args, rows, load_before,
                  "quantised targets, eagle31 vs the same model's HF generate (batch 1, greedy)",
                  ["kind", "weights", "numerics", "new tokens", "HF tok/s", "eagle31 tok/s", "speedup", "tau", "exact"],
                  [[r["kind"], r["quantized"], r["numerics"], r["new_tokens"], f"{r['hf_tok_s']:.1f}",
                    f"{r['eagle31_tok_s']:.1f}", f"{r['speedup']:.2f}x", f"{r['tau']:.2f}",
                    f"{r['exact']}/{r['cases']}"] for r in rows])
    return 0 if all(r["exact"] == r["cases"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
