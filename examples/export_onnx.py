"""Export a target and its draft head to ONNX, then decode over the ONNX programs with onnxruntime: same tokens.

    python examples/export_onnx.py --out runs/onnx               # embedded SmolLM2 + shipped head (minutes)
    python examples/export_onnx.py --target path/to/hf-model --draft path/to/head --out runs/onnx --tree '{"chain": 3}'

Writes target.onnx (the tree-verify step, also used for the prefill), draft_fuse.onnx and draft.onnx with their KV
caches as explicit inputs and outputs (past_key_values.{i}.key in, present.{i}.key out), d2t.npy and
eagle31_onnx.json (tensor names and shapes, buckets, capture indices, the tree). Needs the `onnx` extra
(`pip install -e ".[onnx]"`; scripts/setup.sh installs it). The same is `eagle31 export --format onnx OUT`.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from compile_and_generate import prompt_ids

from eagle_compile.export.onnx import export_onnx
from eagle_compile.export.onnx_runtime import OnnxEagle
from eagle_compile.heads import shipped_head
from eagle_compile.targets import load_target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="HF model folder (default: the embedded SmolLM2 target)")
    p.add_argument("--draft", default=None, help="draft head folder (default: the shipped head of the default target)")
    p.add_argument("--out", default="runs/onnx", help="folder for the ONNX programs")
    p.add_argument("--tree", default=None, help="eagle31 tree options as JSON (default: the head's tree.json)")
    p.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args(argv)
    draft = args.draft or (shipped_head() if args.target is None else None)
    if draft is None:
        p.error("--draft is needed: no head ships for this target")
    torch.set_grad_enabled(False)
    model, tokenizer = load_target(args.target)

    # 1. Export: the programs have dynamic batch, tokens and cache slots, so one export serves every tree.
    manifest = export_onnx(model, str(draft), args.out, tree=json.loads(args.tree) if args.tree else None)
    print(f"exported to {args.out}: tree {manifest['tree']}")

    # 2. Decode over them with onnxruntime (greedy; the tree building and acceptance are eagle_compile's).
    ids = prompt_ids(tokenizer, args.prompt)
    new = OnnxEagle(args.out).generate([ids[0].tolist()], max_new_tokens=args.max_new_tokens)[0]
    print(tokenizer.decode(new, skip_special_tokens=True))

    # 3. Lossless: the tokens model.generate gives.
    ref = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
    same = new == ref
    print(f"identical to model.generate: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
