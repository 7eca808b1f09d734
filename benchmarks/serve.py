"""`eagle31 serve` under load: throughput and latency at 1, 4 and 16 concurrent clients, speculation on and off.

    python benchmarks/serve.py --threads 2
    python benchmarks/serve.py --clients 1,4 --requests 2 --max-tokens 16 --target runs/tiny --draft runs/tiny-head

One process, one server at a time on 127.0.0.1 (uvicorn in a thread, the real `openai` client): first with the
shipped head and the calibration layer on (the server's default), then the same target with `speculate=False`
(plain decoding through the same programs and batching). Each client sends `--requests` streamed chat requests
one after another (MT-bench first turns, greedy, `--max-tokens` each). Before anything is timed, every batch
bucket up to the largest client count is warmed up (captures and the calibration's cost measurements) with a
batch of that many rows through the server's own decoder.

Reported per mode and client count: output tokens/s over the wall time, requests/s, time to first token (TTFT:
request sent to first streamed text) and time per output token after it (TPOT) at p50/p90/p99, the mean tau the
server reported in `usage`, the batch sizes its requests saw, how many requests joined a running batch, and the
share of cycles each program ran (what the calibration layer chose for that load). Outputs in --out: serve.json,
serve.md, serve.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    begin,
    environment,
    load_head,
    markdown_table,
    print_load,
    write_json,
)

PERCENTILES = ("p50", "p90", "p99")
FALLBACK_PROMPTS = ["Why is the sky blue?", "Write a haiku about the sea.", "What is 17 * 23?",
                    "Name three prime numbers.", "Explain recursion to a child.", "Give me a recipe for tea."]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--target", default=None, help="HF folder (default: the embedded SmolLM2 target)")
    p.add_argument("--draft", default=None, help="head folder (default: the shipped head)")
    p.add_argument("--modes", default="speculative,plain")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "serve")
    args = p.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",")]
    args.modes = args.modes.split(",")
    return args


def prompts(data: Path, count: int) -> tuple[list[str], str]:
    """MT-bench first turns (Spec-Bench's questions 81-160, the data folder's), else a few built-in questions."""
    path = data / "spec_bench" / "question.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        turns = [r["turns"][0] for r in rows if 81 <= r["question_id"] <= 160]
        return (turns * count)[:count], "MT-bench first turns"
    return (FALLBACK_PROMPTS * count)[:count], "built-in prompts (no data folder)"


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0]}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": statistics.median(values), "p90": q[89], "p99": q[98]}


def one_request(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """A streamed chat request: TTFT, TPOT and the server's usage."""
    t0 = time.perf_counter()
    first = None
    usage = None
    for part in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True}):
        if part.choices and part.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if part.usage is not None:
            usage = part.usage
    end = time.perf_counter()
    tokens = usage.completion_tokens
    first = first or end
    return {"ttft": first - t0, "tpot": (end - first) / (tokens - 1) if tokens > 1 else None, "latency": end - t0,
            "tokens": tokens, "tau": usage.model_extra.get("tau"), "batch_rows": usage.model_extra["batch_rows"]}


def run_level(client, model: str, texts: list[str], clients: int, requests: int, max_tokens: int) -> dict:
    def worker(c: int) -> list[dict]:
        return [one_request(client, model, [{"role": "user", "content": texts[(c * requests + r) % len(texts)]}],
                            max_tokens) for r in range(requests)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [x for batch in pool.map(worker, range(clients)) for x in batch]
    wall = time.perf_counter() - t0
    taus = [r["tau"] for r in results if r["tau"] is not None]
    return {"clients": clients, "requests": len(results), "wall_s": wall,
            "tokens": sum(r["tokens"] for r in results), "tok_s": sum(r["tokens"] for r in results) / wall,
            "req_s": len(results) / wall, "ttft": percentiles(sorted(r["ttft"] for r in results)),
            "tpot": percentiles(sorted(r["tpot"] for r in results if r["tpot"] is not None)),
            "tau": statistics.mean(taus) if taus else None,
            "batch_rows": sorted({r["batch_rows"] for r in results})}


def warm_up(engine, texts: list[str], largest: int, max_tokens: int) -> list[int]:
    """Per bucket up to `largest` rows, two batches through the server's decoder, of the shortest and of the longest
    prompts: the programs' captures (prefill chunk sizes) and the calibration's cost measurements (per batch and
    context bucket) happen here, not in a timed request."""
    from eagle_compile.runtime.sampling import SamplingParams
    from eagle_compile.runtime.stopping import StopChecker

    buckets = sorted({next(b for b in engine.options.batch_buckets if b >= n) for n in range(1, largest + 1)})
    ids = sorted((engine.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"]
                  for t in set(texts)), key=len)
    for b in buckets:
        for rows in (ids[:b], ids[-b:]):
            prompts = [torch.tensor(rows[i % len(rows)], dtype=torch.long) for i in range(b)]
            stops = StopChecker(prompts, max_new_tokens=max_tokens, eos_token_ids=engine.eos)
            session = engine.decoder.session(prompts, stops, SamplingParams(do_sample=False),
                                             min_slots=engine.cache_room(b))     # the server's cache size
            while session.running:
                session.cycle()
            session.finish()
    return buckets


def measure_mode(mode: str, model, tokenizer, head, texts: list[str], args) -> dict:
    import openai

    from eagle_compile.serve.engine import Engine
    from eagle_compile.serve.server import BackgroundServer

    options = {} if mode == "speculative" else {"speculate": False}
    engine = Engine(model, tokenizer, head if mode == "speculative" else None, options, model_name="bench")
    buckets = warm_up(engine, texts, max(args.clients), args.max_tokens)
    levels = []
    with BackgroundServer(engine) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=3600)
        for clients in args.clients:
            before, joins = program_cycles(engine), engine.joins
            level = run_level(client, "bench", texts, clients, args.requests, args.max_tokens)
            after = program_cycles(engine)
            level["programs"] = {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)}
            level["joins"] = engine.joins - joins
            levels.append({"mode": mode, **level})
            print(f"  {mode:11s} {clients:3d} clients: {level['tok_s']:.1f} tok/s, TTFT p50 "
                  f"{level['ttft']['p50']:.3f} s, TPOT p50 {_fmt(level['tpot']['p50'])} s, tau {_fmt(level['tau'])}, "
                  f"batches of {level['batch_rows']}", flush=True)
    return {"mode": mode, "warmed_buckets": buckets, "levels": levels, "engine": engine.describe()}


def program_cycles(engine) -> dict[str, float]:
    """Cycles per program the calibration layer chose so far (the server's eagle31_cycles_by_program)."""
    family = [m for m in engine.metrics.registry.collect() if m.name == "eagle31_cycles_by_program"]
    return {x.labels["program"]: x.value for m in family for x in m.samples if x.name.endswith("_total")}


def _programs(level: dict) -> str:
    total = sum(level["programs"].values()) or 1
    return ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(level["programs"].items(), key=lambda kv: -kv[1]))


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def plot(modes: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for m in modes:
        xs = [lv["clients"] for lv in m["levels"]]
        a.plot(xs, [lv["tok_s"] for lv in m["levels"]], "o-", label=m["mode"])
        b.plot(xs, [lv["ttft"]["p50"] for lv in m["levels"]], "o-", label=f"{m['mode']} TTFT p50")
        b.plot(xs, [lv["tpot"]["p50"] or 0 for lv in m["levels"]], "s--", label=f"{m['mode']} TPOT p50")
    for ax, label in ((a, "output tokens / s"), (b, "seconds")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("eagle31 serve: speculation (calibrated) vs plain")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = begin(args.threads)
    from eagle_compile.targets import load_target

    model, tokenizer = load_target(args.target, torch.float32)
    head, head_info = load_head(model, args.draft)
    print(f"draft: {head_info['note']}", flush=True)
    texts, source = prompts(args.data, max(args.clients) * args.requests)
    modes = [measure_mode(mode, model, tokenizer, head, texts, args) for mode in args.modes]
    result = {"environment": environment(), "load_before": load_before, "load_after": print_load("after"),
              "threads": torch.get_num_threads(), "prompts": source, "head": head_info, "modes": modes,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "serve.json", result)
    plot(modes, args.out / "serve.png")
    env = result["environment"]
    rows = [[lv["mode"], lv["clients"], lv["requests"], f"{lv['tok_s']:.1f}", f"{lv['req_s']:.2f}",
             *(_fmt(lv["ttft"][p]) for p in PERCENTILES), *(_fmt(lv["tpot"][p]) for p in PERCENTILES),
             _fmt(lv["tau"]), lv["batch_rows"], lv["joins"], _programs(lv)] for m in modes for lv in m["levels"]]
    text = "\n".join([
        f"eagle31 serve, {args.max_tokens} max tokens, {args.requests} requests per client ({source}): torch "
        f"{env['torch']}, {result['threads']} threads, load {load_before['loadavg_1m']} / "
        f"{result['load_after']['loadavg_1m']}; `{env['command']}`", "",
        markdown_table(["mode", "clients", "requests", "tok/s", "req/s", "TTFT p50 s", "TTFT p90 s", "TTFT p99 s",
                        "TPOT p50 s", "TPOT p90 s", "TPOT p99 s", "tau", "batch rows", "joins",
                        "cycles by program"], rows)])
    (args.out / "serve.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
