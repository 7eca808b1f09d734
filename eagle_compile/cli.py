"""The `eagle31` command line: `demo`, `generate`, `train`, `export`, `drift`, `bench` and `serve`."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from eagle_compile.errors import EagleError

DEMO_PROMPT = "Explain in three sentences why the sky is blue."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle31", description="EAGLE 3.1 speculative decoding for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("demo", "speculative vs plain decoding on the embedded default target"),
                           ("generate", "generate with the embedded default target (or --target folder)")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--prompt", default=DEMO_PROMPT)
        p.add_argument("--max-new-tokens", type=int, default=96)
        p.add_argument("--draft", default=None, help="draft head folder (default: the shipped SmolLM2 head)")
        p.add_argument("--options", default="{}", help='eagle31 options as JSON, e.g. \'{"chain": 4}\'')
        p.add_argument("--target", default=None, help="HF model folder (default: the embedded SmolLM2 target)")
        p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    _add_train(sub)
    _add_export(sub)
    _add_drift(sub)
    _add_bench(sub)
    _add_serve(sub)
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except EagleError as error:          # bad input: its message names the problem and the fix; no traceback
        print(f"eagle31 {args.command}: {error}", file=sys.stderr)
        return 2


def _dispatch(args) -> int:
    if args.command == "train":
        from eagle_compile.train.cli import run_train

        return run_train(args)
    if args.command == "export":
        from eagle_compile.export.cli import run_export

        return run_export(args)
    if args.command == "drift":
        from eagle_compile.reports.drift_cli import run_drift

        return run_drift(args)
    if args.command == "bench":
        from eagle_compile.bench_cli import run_bench

        return run_bench(args)
    if args.command == "serve":
        from eagle_compile.serve.cli import run_serve

        return run_serve(args)
    return _run_demo(args, compare=args.command == "demo")


def _add_train(sub) -> None:
    from eagle_compile.train.cli import add_train_parser

    add_train_parser(sub)


def _add_export(sub) -> None:
    from eagle_compile.export.cli import add_export_parser

    add_export_parser(sub)


def _add_drift(sub) -> None:
    from eagle_compile.reports.drift_cli import add_drift_parser

    add_drift_parser(sub)


def _add_bench(sub) -> None:
    from eagle_compile.bench_cli import add_bench_parser

    add_bench_parser(sub)


def _add_serve(sub) -> None:
    from eagle_compile.serve.cli import add_serve_parser

    add_serve_parser(sub)


@torch.no_grad()                 # not a global switch: in-process callers (tests) keep their grad mode
def _run_demo(args, *, compare: bool) -> int:
    import eagle_compile
    from eagle_compile.heads import shipped_head

    model, tokenizer = _target(args)
    draft, note = _draft(args, model, shipped_head())
    print(f"target: {type(model).__name__} ({model.config.num_hidden_layers} layers, {args.dtype})")
    print(f"draft:  {note}")
    messages = [{"role": "user", "content": args.prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    options = {**json.loads(args.options), "draft": draft}   # no tree keys: tree.json beside the head decides
    compiled = torch.compile(model, backend="eagle31", options=options)
    compiled.generate(ids, max_new_tokens=4)          # capture the graphs before timing
    t0 = time.perf_counter()
    out = compiled.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
    spec_time = time.perf_counter() - t0
    new = out.sequences[0, ids.shape[1]:]
    print(f"\n{tokenizer.decode(new, skip_special_tokens=True)}\n")
    stats = out.stats
    print(f"speculative: {len(new)} tokens in {spec_time:.2f} s = {len(new) / spec_time:.1f} tok/s, "
          f"tau {stats.tau:.2f} tokens/cycle over {stats.cycles} cycles, histogram {stats.histogram}, "
          f"tree {stats.tree}; {stats.lowering}")
    if stats.calibration is not None:
        policy = stats.calibration["policy"]
        print(f"calibration: cycles per program {policy['chosen']}, plain cycles {policy['plain_cycles']}, "
              f"probes {policy['probes']}; costs {list(stats.calibration['costs'].values())}")
    if compare:
        t0 = time.perf_counter()
        ref = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        plain_time = time.perf_counter() - t0
        same = torch.equal(ref, out.sequences)
        print(f"plain HF generate: {ref.shape[1] - ids.shape[1]} tokens in {plain_time:.2f} s = "
              f"{(ref.shape[1] - ids.shape[1]) / plain_time:.1f} tok/s; speedup {plain_time / spec_time:.2f}x")
        print(f"identical to plain greedy decoding: {'yes' if same else 'NO'}")
        return 0 if same else 1
    _ = eagle_compile
    return 0


def _target(args):
    from eagle_compile.targets import load_target

    return load_target(args.target, getattr(torch, args.dtype))


def _draft(args, model, shipped):
    from eagle_compile.draft.checkpoint import load_draft

    if args.draft is not None:
        return load_draft(args.draft, target=model, dtype=model.dtype), f"{args.draft}"
    if shipped is not None and args.target is None:
        note = f"shipped EAGLE 3.1 head {shipped.name} (see its MODEL_CARD.md)"
        return load_draft(shipped, target=model, dtype=model.dtype), note
    from eagle_compile.draft.model import untrained_head

    return untrained_head(model), ("UNTRAINED random EAGLE 3.1 head (no trained head ships in this checkout): "
                                   "output is still exact, but almost no draft token is accepted, so expect no "
                                   "speedup")


if __name__ == "__main__":
    sys.exit(main())
