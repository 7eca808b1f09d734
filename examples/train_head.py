"""Train an EAGLE 3.1 draft head for a target, then check it: the head speeds nothing up unless it is accepted.

    python examples/train_head.py --steps 200 --out runs/example-head          # embedded SmolLM2 target
    python examples/train_head.py --target path/to/hf-model --data-dir path/to/jsonl-folder --data-files a.jsonl

Training data: jsonl lines with instruction / input / output (and optionally source), as in
../shared/data/train (the default). The run folder holds checkpoints (rerunning the command resumes), the
metrics and the head in the official EAGLE-3 layout under <out>/head, which `torch.compile(model,
backend="eagle31", options={"draft": "<out>/head"})` loads. This is `eagle31 train` through the Python API;
the command line has every setting (`eagle31 train --help`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import eagle_compile
from eagle_compile.targets import load_target
from eagle_compile.train import TrainConfig, Trainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="HF model folder (default: the embedded SmolLM2 target)")
    p.add_argument("--data-dir", default=None, help="folder of the training jsonl files (default ../shared/data/train)")
    p.add_argument("--data-files", default=None, help="comma-separated jsonl files in --data-dir")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=384, help="longest conversation in tokens")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--eval-samples", type=int, default=64)
    p.add_argument("--out", default="runs/example-head")
    args = p.parse_args(argv)

    # 1. What to train: an EAGLE 3.1 head (fc_norm + norm_output) with the official TTT recipe, 4 unrolled steps.
    settings = dict(target=args.target, preset="eagle31", draft_vocab_size=args.draft_vocab_size, ttt_steps=4,
                    max_len=args.max_len, batch_size=args.batch_size, max_steps=args.steps, lr=1e-3,
                    warmup_ratio=0.03, eval_samples=args.eval_samples, eval_every=max(1, args.steps // 2),
                    save_every=max(1, args.steps // 4), output_dir=args.out, progress=False)
    if args.data_dir:
        settings["data_dir"] = args.data_dir
    if args.data_files:
        settings["data_files"] = tuple(args.data_files.split(","))
    result = Trainer(TrainConfig(**settings)).train()          # resumes from the newest checkpoint in --out
    head = Path(args.out) / "head"
    accuracy = [round(a, 3) for a in result.accuracies] if result is not None else "n/a (no held-out set)"
    print(f"head written to {head}; held-out accuracy per TTT step {accuracy}")

    # 2. Check it where it matters: tokens per cycle in speculative decoding, and the output unchanged.
    torch.set_grad_enabled(False)
    model, tokenizer = load_target(args.target)
    ids = tokenizer("The quick brown fox", return_tensors="pt")["input_ids"]
    out = eagle_compile.generate(model, ids, draft=str(head), options={"chain": 3}, max_new_tokens=32,
                                 return_dict_in_generate=True)
    same = torch.equal(out.sequences, model.generate(ids, max_new_tokens=32, do_sample=False))
    print(f"tau {out.stats.tau:.2f} tokens per cycle with a chain of 3; identical to model.generate: "
          f"{'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
