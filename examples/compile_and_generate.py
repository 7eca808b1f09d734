"""Compile a Hugging Face model with the eagle31 backend and generate: speculative, and lossless.

    python examples/compile_and_generate.py                       # embedded SmolLM2-135M-Instruct + shipped head
    python examples/compile_and_generate.py --stream              # print text as each cycle emits it
    python examples/compile_and_generate.py --target path/to/hf-model --draft path/to/eagle3-head

The draft is an EAGLE-3 / EAGLE 3.1 head folder (official or speculators layout). With no tree keys in the
options, the calibration layer picks each cycle's tree from measured costs and acceptance (or decodes plainly
when no tree pays), so the first call spends a few seconds measuring; the costs are cached on disk.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from transformers import TextStreamer

import eagle_compile
from eagle_compile.heads import shipped_head
from eagle_compile.targets import load_target


def prompt_ids(tokenizer, text: str) -> torch.Tensor:
    """[1, L] ids: the chat template when the tokenizer has one, else the plain text."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(text, return_tensors="pt")["input_ids"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="HF model folder (default: the embedded SmolLM2 target)")
    p.add_argument("--draft", default=None, help="draft head folder (default: the shipped head of the default target)")
    p.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    p.add_argument("--options", default="{}", help='more eagle31 options as JSON, e.g. \'{"chain": 3}\' for a '
                   'fixed chain of 3 instead of the calibrated trees')
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--stream", action="store_true", help="stream the reply (TextStreamer)")
    args = p.parse_args(argv)

    draft = args.draft or (shipped_head() if args.target is None else None)
    if draft is None:
        p.error("--draft is needed: no head ships for this target (train one with examples/train_head.py)")
    torch.set_grad_enabled(False)
    model, tokenizer = load_target(args.target)
    ids = prompt_ids(tokenizer, args.prompt)

    # 1. The compiler entry: nothing else changes in the user's code.
    compiled = torch.compile(model, backend="eagle31", options={**json.loads(args.options), "draft": str(draft)})
    streamer = TextStreamer(tokenizer, skip_prompt=True) if args.stream else None
    out = compiled.generate(ids, max_new_tokens=args.max_new_tokens, return_dict_in_generate=True, streamer=streamer)
    new = out.sequences[0, ids.shape[1]:]
    if not args.stream:
        print(tokenizer.decode(new, skip_special_tokens=True))

    # 2. What speculation did: tokens per cycle (tau) and the programs the calibration layer chose.
    stats = out.stats
    print(f"\n{len(new)} tokens in {stats.cycles} cycles: tau {stats.tau:.2f}, histogram {stats.histogram}")
    if stats.calibration is not None:
        print(f"programs chosen per cycle: {stats.calibration['policy']['chosen']}")

    # 3. Lossless: the same tokens as plain greedy decoding.
    reference = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    same = torch.equal(reference, out.sequences)
    print(f"identical to model.generate: {'yes' if same else 'NO'}")
    _ = eagle_compile       # importing the package is not needed for torch.compile; shown for the reader
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
