"""Soak: hundreds of `generate` calls of mixed batch sizes, prompt lengths, lengths and sampling settings, and
whether anything a compiled model holds grows (issue 13.6).

    python benchmarks/soak.py --threads 1                      # tiny random Llama, 300 calls
    python benchmarks/soak.py --target default --calls 100     # SmolLM2-135M with the shipped head

A warm-up phase first runs every batch bucket the soak uses with its shortest and longest prompt and greedy and
sampled decoding (the captures happen there); then `eagle_compile.footprint` is taken, the soak's calls run
(rows 1..--max-rows, prompt lengths and max_new_tokens drawn from their ranges, greedy or sampled with a fresh
temperature / top_k / top_p nearly every call), RSS is recorded after every call and live tensor bytes every
--every calls, and a second footprint is taken. `eagle_compile.growth` lists what grew: captured graphs, dynamo
cache entries, the decoders' books and held tensor bytes, live tensor bytes must not grow at all, RSS not past
its slack. Verdict "no growth" or the list. Outputs in --out: soak.json, soak.md, soak.png (when matplotlib is
there). Nothing here asserts a time; tests/runtime/test_soak.py asserts the figures over a shorter soak.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from common import DEFAULT_OUT_DIR, begin, environment, markdown_table, print_load, write_json

MIB = 2 ** 20
#: the tiny target's options: a fixed tree, buckets 1/2/4, prefill chunks 64 and 16
TINY_OPTIONS = {"depth": 3, "top_k": 2, "total_tokens": 6, "prefill_chunk": 64, "batch_buckets": (1, 2, 4)}
#: the soak's sampled calls draw top_k and top_p from these (and a temperature in [0.5, 1.5])
TOP_KS = (0, 20, 50)
TOP_PS = (1.0, 0.95, 0.8)


@dataclass(frozen=True)
class Call:
    """One generate call of the soak: a row per prompt length, its new-token budget and sampling kwargs."""

    lengths: tuple[int, ...]
    max_new_tokens: int
    sampling: dict
    seed: int

    def kind(self) -> str:
        return "sample" if self.sampling.get("do_sample") else "greedy"


def soak_calls(count: int, seed: int, *, max_rows: int, prompts: tuple[int, int], new: tuple[int, int]
               ) -> list[Call]:
    """`count` calls: rows 1..max_rows, prompt lengths in `prompts` (inclusive, per row), max_new_tokens in `new`;
    a third greedy, the rest sampled with a temperature in [0.5, 1.5] (two decimals: a new value nearly every
    call), top_k in `TOP_KS` and top_p in `TOP_PS`."""
    rng = random.Random(seed)
    calls = []
    for i in range(count):
        rows = rng.randint(1, max_rows)
        lengths = tuple(rng.randint(*prompts) for _ in range(rows))
        if rng.random() < 1 / 3:
            sampling = {"do_sample": False}
        else:
            sampling = {"do_sample": True, "temperature": round(rng.uniform(0.5, 1.5), 2),
                        "top_k": rng.choice(TOP_KS), "top_p": rng.choice(TOP_PS)}
        calls.append(Call(lengths, rng.randint(*new), sampling, seed * 100_003 + i))
    return calls


def warmup_calls(buckets: tuple[int, ...], *, max_rows: int, prompts: tuple[int, int], new: tuple[int, int]
                 ) -> list[Call]:
    """Every bucket the soak reaches, full: greedy with its shortest and longest prompts (every prefill chunk
    size and cache size), then each sampling program key the soak can draw (`SamplingParams.program_key`: the
    top-k bucket, top-p on or off) with the shortest. Each program the soak can run is captured here; the
    numbers within a key (temperature, top_k, top_p) never capture anything."""
    used = sorted({next(b for b in buckets if b >= rows) for rows in range(1, max_rows + 1)})
    kinds = [{"do_sample": True, "temperature": 0.9, "top_k": k, "top_p": p} for k in TOP_KS for p in TOP_PS[:2]]
    calls = []
    for bucket in used:
        rows = min(bucket, max_rows)
        for length in prompts:
            calls.append(Call((length,) * rows, new[1], {"do_sample": False}, len(calls)))
        for sampling in kinds:
            calls.append(Call((prompts[0],) * rows, new[1], sampling, len(calls)))
    return calls


def prompt_ids(call: Call, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random ids (>= 3: clear of the usual special ids) of the call's lengths, and the mask."""
    g = torch.Generator().manual_seed(call.seed)
    width = max(call.lengths)
    ids = torch.zeros(len(call.lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(call.lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def run_call(compiled, call: Call, vocab: int):
    """One generate call through `compiled.generate` (the eagle31 backend); returns its statistics."""
    ids, mask = prompt_ids(call, vocab)
    out = compiled.generate(ids, attention_mask=mask, max_new_tokens=call.max_new_tokens, return_dict_in_generate=True,
                            generator=torch.Generator().manual_seed(call.seed), **call.sampling)
    return out.stats


def run_soak(compiled, calls: list[Call], warmup: list[Call], vocab: int, *, every: int = 10,
             progress=None) -> dict:
    """Warm up, take a footprint, run `calls`, take another; the figures, the growth list and what the soak
    did (so that a soak that did nothing cannot pass as one that grew nothing)."""
    import eagle_compile
    from eagle_compile.runtime.footprint import live_tensor_storages, rss_bytes

    for call in warmup:
        run_call(compiled, call, vocab)
    before = eagle_compile.footprint(compiled)
    samples, cycles, tokens, t0 = [], 0, 0, time.perf_counter()
    for i, call in enumerate(calls, 1):
        stats = run_call(compiled, call, vocab)
        cycles += stats.cycles
        tokens += stats.new_tokens
        sample = {"call": i, "rss_bytes": rss_bytes(),
                  "fx_graphs": stats.graphs_captured}
        if i % every == 0 or i == len(calls):
            sample["live_tensor_bytes"] = live_tensor_storages()[1]
        samples.append(sample)
        if progress is not None:
            progress(i, call, stats, sample)
    after = eagle_compile.footprint(compiled)
    settings = {json.dumps(c.sampling, sort_keys=True) for c in calls}
    return {"before": before.as_dict(), "after": after.as_dict(), "growth": eagle_compile.growth(before, after),
            "samples": samples, "seconds": time.perf_counter() - t0,
            "did": {"calls": len(calls), "warmup_calls": len(warmup), "cycles": cycles, "new_tokens": tokens,
                    "sampling_settings": len(settings), "greedy_calls": sum(c.kind() == "greedy" for c in calls),
                    "rows": sorted({len(c.lengths) for c in calls}),
                    "prompt_lengths": [min(min(c.lengths) for c in calls), max(max(c.lengths) for c in calls)],
                    "max_new_tokens": sorted({c.max_new_tokens for c in calls})}}


# -- targets -------------------------------------------------------------------------------------------------------
def tiny_target(vocab: int = 96):
    """An 8-layer random Llama (hidden 32, GQA 4/2, vocab 96), float32, and an untrained EAGLE 3.1 head for it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle_compile.draft.model import untrained_head

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, untrained_head(model), dict(TINY_OPTIONS)


def default_target():
    """SmolLM2-135M float32 with the shipped head, its tree (tree.json) or the calibration's menu."""
    from common import load_head

    import eagle_compile

    model, _ = eagle_compile.load_default_target(torch.float32)
    head, _ = load_head(model, None)
    return model, head, {"batch_buckets": (1, 2, 4)}


# -- report --------------------------------------------------------------------------------------------------------
def report(result: dict) -> str:
    before, after = result["before"], result["after"]
    rows = []
    for name in ("fx_graphs", "cuda_graphs", "dynamo_backends", "decoders", "held_bytes", "live_tensors",
                 "live_tensor_bytes", "rss_bytes"):
        rows.append([name, before[name], after[name], after[name] - before[name]])
    for group in ("cache_entries", "books", "bounded"):
        for key in after[group]:
            rows.append([f"{group}.{key}", before[group].get(key, 0), after[group][key],
                         after[group][key] - before[group].get(key, 0)])
    did = result["did"]
    verdict = "NO GROWTH" if not result["growth"] else "GROWTH: " + "; ".join(result["growth"])
    return "\n".join([
        f"soak of {did['calls']} generate calls after {did['warmup_calls']} warm-up calls: rows {did['rows']}, "
        f"prompt lengths {did['prompt_lengths'][0]}-{did['prompt_lengths'][1]}, max_new_tokens "
        f"{did['max_new_tokens'][0]}-{did['max_new_tokens'][-1]}, {did['greedy_calls']} greedy, "
        f"{did['sampling_settings']} distinct sampling settings, {did['cycles']} cycles, "
        f"{did['new_tokens']} new tokens",
        "", markdown_table(["figure", "after warm-up", "after soak", "change"], rows), "", f"verdict: {verdict}"])


def plot(samples: list[dict], path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s["call"] for s in samples], [s["rss_bytes"] / MIB for s in samples], label="RSS (MiB)")
    live = [s for s in samples if "live_tensor_bytes" in s]
    ax.plot([s["call"] for s in live], [s["live_tensor_bytes"] / MIB for s in live], "o-",
            label="live tensor bytes (MiB)")
    ax.set_xlabel("generate call (after warm-up)")
    ax.set_ylabel("MiB")
    ax.set_title("eagle31 soak")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=("tiny", "default"), default="tiny")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--max-rows", type=int, default=4)
    p.add_argument("--prompts", default="3,60", help="shortest,longest prompt (tokens)")
    p.add_argument("--new", default="1,24", help="smallest,largest max_new_tokens")
    p.add_argument("--options", default=None, help="eagle31 options as JSON (replace the target's defaults)")
    p.add_argument("--every", type=int, default=10, help="count live tensor bytes every N calls (a gc scan)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "soak")
    args = p.parse_args(argv)
    args.prompts = tuple(int(x) for x in args.prompts.split(","))
    args.new = tuple(int(x) for x in args.new.split(","))
    return args


def main(argv: list[str] | None = None) -> int:
    from eagle_compile.options import parse_options

    args = parse_args(argv)
    load_before = begin(args.threads)
    model, head, options = tiny_target() if args.target == "tiny" else default_target()
    if args.options:
        options = json.loads(args.options)
    options = {**options, "draft": head}
    compiled = torch.compile(model, backend="eagle31", options=options)
    buckets = parse_options(options).batch_buckets
    ranges = {"max_rows": args.max_rows, "prompts": args.prompts, "new": args.new}
    calls = soak_calls(args.calls, args.seed, **ranges)
    warmup = warmup_calls(buckets, **ranges)
    vocab = model.get_input_embeddings().num_embeddings

    def progress(i, call, stats, sample):
        if i % max(1, args.calls // 10) == 0:
            print(f"  call {i}/{args.calls}: rows {len(call.lengths)}, {call.kind()}, RSS "
                  f"{sample['rss_bytes'] / MIB:.1f} MiB, graphs {sample['fx_graphs']}", flush=True)

    print(f"warm-up: {len(warmup)} calls; soak: {len(calls)} calls", flush=True)
    result = run_soak(compiled, calls, warmup, vocab, every=args.every, progress=progress)
    result.update(environment=environment(), load_before=load_before, load_after=print_load("after"),
                  threads=torch.get_num_threads(), target=args.target, calls=[asdict(c) for c in calls],
                  options={k: v for k, v in options.items() if k != "draft"},
                  args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "soak.json", result)
    text = report(result)
    (args.out / "soak.md").write_text(text + "\n")
    drew = plot(result["samples"], args.out / "soak.png")
    print("\n" + text + ("" if drew else "\n(no matplotlib: no soak.png)"), flush=True)
    return 0 if not result["growth"] else 1


if __name__ == "__main__":
    sys.exit(main())
