"""`eagle31 serve`: the embedded target with the shipped head by default, `--target` / `--draft` to change them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from eagle_compile.errors import EagleError


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)")
    p.add_argument("--target", default=None, help="HF model folder (default: the embedded SmolLM2 target)")
    p.add_argument("--draft", default=None, help="draft head folder (default: the shipped SmolLM2 head)")
    p.add_argument("--options", default="{}", help='eagle31 options as JSON (calibrate defaults to "on")')
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the target's name)")
    p.add_argument("--max-rows", type=int, default=None, help="most requests per batch (default: largest bucket)")
    p.add_argument("--join-tokens", type=int, default=1024,
                   help="cache room per row for requests that join a running batch: prompt + max_tokens up to this "
                        "joins; a longer request waits for the next batch (default 1024)")


def run_serve(args) -> int:
    missing = [m for m in ("starlette", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise EagleError(f"eagle31 serve needs {missing}: pip install -e '.[serve]' (scripts/setup.sh installs it)")
    from eagle_compile.cli import _draft, _target
    from eagle_compile.heads import shipped_head
    from eagle_compile.serve.engine import Engine
    from eagle_compile.serve.server import serve

    try:
        options = json.loads(args.options)
    except json.JSONDecodeError as error:
        raise EagleError(f"--options is not valid JSON ({error}): {args.options!r}") from None
    model, tokenizer = _target(args)
    draft = None
    if options.get("speculate", True):
        draft, note = _draft(args, model, shipped_head())
        print(f"draft: {note}")
    name = args.model_name or (Path(args.target).name if args.target else "SmolLM2-135M-Instruct")
    with torch.no_grad():
        engine = Engine(model, tokenizer, draft, options, model_name=name, max_rows=args.max_rows,
                        join_tokens=args.join_tokens)
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 ({engine.describe()['batching']})")
    serve(engine, args.host, args.port)
    return 0
