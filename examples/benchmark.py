"""How much faster? eagle31 against plain `model.generate` on your prompts, side by side in one process.

    python examples/benchmark.py                                     # embedded SmolLM2 + shipped head, 4 prompts
    python examples/benchmark.py --target path/to/hf-model --draft path/to/head --prompts prompts.txt --rounds 3

Each method is warmed up once (graph capture and the calibration layer's cost measurement happen there), then
the methods run in turns for --rounds rounds so that a noisy machine slows both alike; the table gives median
seconds per prompt and the ratio. eagle31's output is checked against plain greedy decoding on every prompt.
The full benchmarks (Spec-Bench per category, batches, long contexts, HF's own prompt lookup and static cache)
are in benchmarks/ (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from compile_and_generate import prompt_ids

from eagle_compile.heads import shipped_head
from eagle_compile.targets import load_target

PROMPTS = ("Explain in three sentences why the sky is blue.", "Write a haiku about compilers.",
           "List three uses of a hash map, with one line each.", "What is 17 times 23? Show your steps.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="HF model folder (default: the embedded SmolLM2 target)")
    p.add_argument("--draft", default=None, help="draft head folder (default: the shipped head of the default target)")
    p.add_argument("--prompts", default=None, help="a text file, one prompt per line (default: four built-in ones)")
    p.add_argument("--options", default="{}", help='more eagle31 options as JSON, e.g. \'{"chain": 3}\' for a '
                   'fixed chain of 3 instead of the calibrated trees')
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    draft = args.draft or (shipped_head() if args.target is None else None)
    if draft is None:
        p.error("--draft is needed: no head ships for this target")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model, tokenizer = load_target(args.target)
    texts = Path(args.prompts).read_text().splitlines() if args.prompts else list(PROMPTS)
    prompts = [prompt_ids(tokenizer, t) for t in texts if t.strip()]
    compiled = torch.compile(model, backend="eagle31", options={**json.loads(args.options), "draft": str(draft)})
    methods = {
        "model.generate": lambda ids: model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False),
        "eagle31": lambda ids: compiled.generate(ids, max_new_tokens=args.max_new_tokens),
    }
    times = {name: [] for name in methods}
    exact = 0
    for ids in prompts:
        outputs = {name: fn(ids) for name, fn in methods.items()}           # warm-up, untimed
        exact += bool(torch.equal(outputs["eagle31"], outputs["model.generate"]))
        per_round = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, fn in methods.items():                                  # interleaved
                start = time.perf_counter()
                fn(ids)
                per_round[name].append(time.perf_counter() - start)
        for name in methods:
            times[name].append(statistics.median(per_round[name]))
    base = sum(times["model.generate"])
    print(f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds")
    print(f"{'method':16s} {'s per prompt':>12s} {'speedup':>8s}")
    for name, t in times.items():
        print(f"{name:16s} {sum(t) / len(t):12.3f} {base / sum(t):7.2f}x")
    print(f"eagle31 output identical to model.generate on {exact} of {len(prompts)} prompts")
    return 0 if exact == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
