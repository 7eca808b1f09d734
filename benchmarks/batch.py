"""Batched decoding: eagle31 against HF batched `generate` for batch buckets 1-64, with the calibration on.

    python benchmarks/batch.py --threads 2
    python benchmarks/batch.py --batches 1,2,4,8,16,32,64 --new-tokens 64 --rounds 2

For each batch size B: the first B Spec-Bench MT-bench first turns (evaluation prompts, chat template), left
padded, float32, greedy, the shipped head, `torch.compile(model, backend="eagle31", options={"draft": head})`
(no tree key: calibrate="auto" is on, so the calibration layer picks per cycle among its menu and falls back to
plain steps when speculation does not pay). One warm-up call per B (captures and cost measurements, not timed;
also the exactness check: every row's tokens equal HF's), then eagle31 and HF interleaved for `--rounds` rounds.

Reported per B: tokens/s of each (the new tokens of every row up to its EOS, the same for both since the outputs
are equal), the speedup, tau, what the calibration chose (cycles per program), and memory: the KV bytes of the
bucket's static caches (target + draft, from the configs) and the growth of the process's resident memory
across the bucket's first call. The bar of issue 13: >= 1.0x at every bucket. Outputs in --out: batch.json,
batch.md, batch.png.
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
    environment,
    left_pad,
    markdown_table,
    mt_bench,
    print_load,
    write_json,
)
from gpu.base import kv_bytes

MIB = 2 ** 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "batch")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    return args


def rss_bytes() -> int:
    """Resident set size of this process (/proc/self/statm: pages)."""
    import os

    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def new_tokens(sequences: torch.Tensor, prompt_len: int, eos: set[int], pad: int) -> int:
    """New tokens of every row up to and including its first EOS (what a user receives)."""
    total = 0
    for row in sequences[:, prompt_len:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        total += cut
    return total


def measure(model, head, tokenizer, args, batch: int) -> dict:
    from eagle_compile.runtime.generate import _decoders

    pad = tokenizer.pad_token_id or 0
    prompts = mt_bench(tokenizer, args.data, batch)
    ids, mask = left_pad(prompts, pad)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eagle31", options={"draft": head})
    before = rss_bytes()
    row = compare_with_hf(model, compiled, [(ids, mask)], args.new_tokens, args.rounds)
    stats = row.pop("stats")[-1]
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    tokens = new_tokens(row.pop("hf_sequences")[-1], ids.shape[1], eos, pad)
    # the decoder's own rules for the bucket and the static cache slots it allocated (every call allocates them)
    decoder = list(_decoders[model].values())[-1]
    bucket, slots = decoder._bucket(batch), decoder._slots([p.reshape(-1) for p in prompts], args.new_tokens)
    kv = kv_bytes(model.config, bucket, slots, 4) + kv_bytes(head.config, bucket, slots, 4)
    policy = (stats.calibration or {}).get("policy", {})
    chosen = policy.get("chosen", {"fixed tree": stats.cycles})
    return {"batch": batch, "bucket": bucket, "prompt_len": ids.shape[1], "new_tokens": tokens, **row,
            "hf_tok_s": tokens / row["hf_s"], "eagle31_tok_s": tokens / row["eagle31_s"],
            "slots": slots, "kv_bytes": kv,
            "rss_growth_bytes": rss_bytes() - before, "programs": {str(k): v for k, v in chosen.items()},
            "plain_cycles": policy.get("plain_cycles")}



def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["batch"] for r in rows]
    ax.plot(xs, [r["hf_tok_s"] for r in rows], "o-", label="HF generate (batched)")
    ax.plot(xs, [r["eagle31_tok_s"] for r in rows], "s-", label="eagle31 (calibrated)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("new tokens / s")
    ax.set_title("SmolLM2-135M float32, MT-bench first turns")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = begin(args.threads)
    import eagle_compile
    from eagle_compile.heads import shipped_head

    model, tokenizer = eagle_compile.load_default_target(torch.float32)
    head = eagle_compile.load_draft(shipped_head(), target=model, dtype=torch.float32)
    rows = []
    for batch in args.batches:
        row = measure(model, head, tokenizer, args, batch)
        rows.append(row)
        print(f"  batch {batch}: {row['speedup']:.2f}x HF ({row['eagle31_tok_s']:.1f} vs {row['hf_tok_s']:.1f} "
              f"tok/s), tau {row['tau']:.2f}, exact {row['exact']}/{row['cases']}, programs {row['programs']}, "
              f"KV {row['kv_bytes'] / MIB:.0f} MiB, RSS +{row['rss_growth_bytes'] / MIB:.0f} MiB", flush=True)
    result = {"environment": environment(), "load_before": load_before, "load_after": print_load("after"),
              "threads": torch.get_num_threads(), "rows": rows,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "batch.json", result)
    plot(rows, args.out / "batch.png")
    env = result["environment"]
    text = "\n".join([
        f"batched decoding, eagle31 calibrated vs HF batched generate: torch {env['torch']}, "
        f"{result['threads']} threads, load {load_before['loadavg_1m']} / {result['load_after']['loadavg_1m']}; "
        f"`{env['command']}`", "",
        markdown_table(["batch", "bucket", "new tokens", "HF tok/s", "eagle31 tok/s", "speedup", "tau", "exact",
                        "programs (cycles)", "KV MiB", "RSS growth MiB"],
                       [[r["batch"], r["bucket"], r["new_tokens"], f"{r['hf_tok_s']:.1f}", f"{r['eagle31_tok_s']:.1f}",
                         f"{r['speedup']:.2f}x", f"{r['tau']:.2f}", f"{r['exact']}/{r['cases']}",
                         ", ".join(f"{k} {v}" for k, v in r["programs"].items()), f"{r['kv_bytes'] / MIB:.0f}",
                         f"{r['rss_growth_bytes'] / MIB:.0f}"] for r in rows])])
    (args.out / "batch.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return 0 if all(r["exact"] == r["cases"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
