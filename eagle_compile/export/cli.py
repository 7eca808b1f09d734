"""``eagle31 export``: a head folder for vLLM, SGLang or speculators, or the programs as ONNX or TensorRT.

  eagle31 export --format vllm runs/vllm-head                   # the shipped head, for the embedded target
  eagle31 export --format sglang runs/sglang-head --draft runs/my-head/head --target path/to/hf-model
  eagle31 export --format speculators runs/spec-head --speculative-tokens 4

OUT is a new (or empty) folder; it gets config.json and model.safetensors, and the command prints how to
serve it. --format vllm and speculators are both for vLLM (speculators also loads the latter); sglang is for
SGLang. Each format writes the capture indices the way its engine reads them and refuses, with the reason, a
head its engine would run differently from eagle_compile (for example norm_before_residual in SGLang).

  eagle31 export --format onnx runs/onnx                        # the target's verify step and the draft step
  eagle31 export --format onnx runs/onnx --tree '{"chain": 3}' --opset 20

--format onnx writes the programs, not a head folder: target.onnx (the tree-verify step, also the prefill),
draft_fuse.onnx and draft.onnx with their KV caches as inputs and outputs, d2t.npy and eagle31_onnx.json (names,
shapes, buckets, capture indices, tree); eagle_compile.export.onnx_runtime.OnnxEagle decodes over them. It needs
the `onnx` extra and loads the whole target (--target: an HF folder).

  eagle31 export --format tensorrt runs/trt --programs-only     # on CPU: the checked programs, no engines
  eagle31 export --format tensorrt runs/trt --buckets 1,2,4,8 --max-cache-len 4096   # on CUDA with TensorRT

--format tensorrt writes the same programs (functional KV caches) exported per batch bucket at static shapes,
each checked to hold only ops torch-tensorrt converts (programs/*.pt2), and, where torch_tensorrt imports and
CUDA is present, one TensorRT engine per program and bucket (engines/*.ep, torch_tensorrt.save's
ExportedProgram); eagle31_tensorrt.json lists inputs, outputs, shapes and the op report. The engines need the
`tensorrt` extra on a CUDA machine; --programs-only stops before them (what a CPU machine can do).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eagle_compile.export.heads import ENGINE_NOTES, ENGINES

PROGRAM_FORMATS = ("onnx", "tensorrt")
OPSETS = (18, 19, 20)


def add_export_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to the ``eagle31`` command line."""
    p = subparsers.add_parser("export",
                              help="a head for vLLM / SGLang / speculators, or the programs as ONNX / TensorRT",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", required=True, choices=(*ENGINES, *PROGRAM_FORMATS),
                   help="vllm, sglang or speculators (a head folder); onnx or tensorrt (the programs)")
    p.add_argument("out", metavar="OUT", help="folder to write (new or empty; see --overwrite)")
    p.add_argument("--draft", default=None, metavar="HEAD_FOLDER",
                   help="draft head folder, official EAGLE-3 or speculators layout (default: the shipped head)")
    p.add_argument("--target", default=None, metavar="HF_FOLDER",
                   help="HF model folder (or hub id) of the target the head drafts for; only its config.json "
                        "is read (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--speculative-tokens", type=int, default=3, metavar="K",
                   help="draft tokens per step: written into the speculators config (vLLM's default for that "
                        "head) and used in the serve command printed at the end (default 3)")
    p.add_argument("--tree", default=None, metavar="JSON",
                   help="onnx: the tree the ONNX runtime builds by default, as eagle31 tree options (default: the "
                        "head's tree.json when chosen for this device and dtype, else EAGLE's default tree)")
    p.add_argument("--opset", type=int, default=18, choices=OPSETS, help="onnx: the ONNX opset (default 18)")
    p.add_argument("--buckets", default="1,2,4,8", metavar="B,B,..",
                   help="tensorrt: batch buckets, one engine per program and bucket (default 1,2,4,8)")
    p.add_argument("--max-cache-len", type=int, default=2048, metavar="S",
                   help="tensorrt: KV slots of every cache, static in the engines (default 2048)")
    p.add_argument("--programs-only", action="store_true",
                   help="tensorrt: write the checked programs without building engines (no TensorRT needed)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace config.json and model.safetensors in an OUT that already holds files")
    return p


def run_export(args: argparse.Namespace) -> int:
    from eagle_compile.draft.checkpoint import check_target_config, load_draft
    from eagle_compile.errors import CheckpointError, ExportError
    from eagle_compile.export.heads import export_head

    if args.format in PROGRAM_FORMATS:
        return _export_programs(args)
    try:
        target_cfg, target_name = _target_config(args.target)
        draft = _draft_folder(args.draft)
        layers = int(target_cfg.num_hidden_layers)
        head = load_draft(draft, num_target_layers=layers)
        check_target_config(head.config, target_cfg)
        out = export_head(head, args.out, args.format, num_target_layers=layers,
                          verifier_name_or_path=target_name,
                          verifier_architectures=list(getattr(target_cfg, "architectures", None) or []),
                          speculative_tokens=args.speculative_tokens, overwrite=args.overwrite)
    except (CheckpointError, ExportError, OSError) as error:
        print(f"eagle31 export: {error}", file=sys.stderr)
        return 2
    cfg = head.config
    flags = [name for name in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")
             if getattr(cfg, name)]
    print(f"wrote {out} ({args.format} format) from {draft}: capture indices "
          f"{list(cfg.resolved_capture_indices(layers))} of a {layers}-layer target, draft vocabulary "
          f"{cfg.draft_vocab_size}, flags {flags or 'none'}")
    if cfg.fc_norm or cfg.norm_output:
        print(f"note: this EAGLE 3.1 head {ENGINE_NOTES[args.format]}")
    print(f"serve it with:\n  {serve_command(args.format, out, target_name, args.speculative_tokens)}")
    return 0


def _export_programs(args: argparse.Namespace) -> int:
    """The ONNX or TensorRT programs of the target and head (the whole target is loaded: its weights go in)."""
    import json

    import torch

    from eagle_compile.errors import ExportError, OptionsError
    from eagle_compile.targets import load_target

    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        print(f"eagle31 export: {out} already holds files; pass --overwrite to replace them or name a new folder",
              file=sys.stderr)
        return 2
    try:
        tree = json.loads(args.tree) if args.tree else None
    except json.JSONDecodeError as error:
        raise OptionsError(f"--tree is not JSON ({error}); e.g. --tree '{{\"chain\": 3}}'") from error
    model, _ = load_target(args.target)
    draft = str(_draft_folder(args.draft))
    with torch.no_grad():
        if args.format == "onnx":
            from eagle_compile.export.onnx import export_onnx

            manifest = export_onnx(model, draft, out, tree=tree, opset=args.opset)
        else:
            from eagle_compile.export.tensorrt import export_tensorrt

            try:
                manifest = export_tensorrt(model, draft, out, tree=tree, buckets=_buckets(args.buckets),
                                           max_cache_len=args.max_cache_len, programs_only=args.programs_only)
            except ExportError as error:
                print(f"eagle31 export: {error}", file=sys.stderr)
                return 2
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}; tree {manifest.get('tree')}")
    if args.format == "onnx":
        print("decode over it with eagle_compile.export.onnx_runtime.OnnxEagle(OUT).generate([prompt_ids], ...)")
    else:
        print(f"engines: {manifest['engines']}; every program holds only ops torch-tensorrt handles "
              f"({out / 'eagle31_tensorrt.json'} lists them)")
    return 0


def _buckets(text: str) -> tuple[int, ...]:
    from eagle_compile.errors import OptionsError

    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError as error:
        raise OptionsError(f"--buckets {text!r}: give comma-separated batch sizes, e.g. 1,2,4,8") from error


def serve_command(engine: str, out: Path, target: str, tokens: int) -> str:
    """A command line that serves ``target`` with the exported head ``out`` on ``engine``."""
    if engine == "sglang":
        return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {out} --speculative-num-steps {tokens} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {tokens + 1}")
    return (f"vllm serve {target} --speculative-config "
            f"'{{\"method\": \"eagle3\", \"model\": \"{out}\", \"num_speculative_tokens\": {tokens}}}'")


def _target_config(target: str | None):
    """(text config, name) of the target: the given folder or hub id, else the embedded default target."""
    from transformers import AutoConfig

    from eagle_compile.targets import DEFAULT_TARGET_NAME, default_target_folder

    folder, name = (default_target_folder(), DEFAULT_TARGET_NAME) if target is None else (target, target)
    config = AutoConfig.from_pretrained(folder)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "architectures", None):
        text.architectures = getattr(config, "architectures", None)
    return text, name


def _draft_folder(draft: str | None) -> Path:
    from eagle_compile.errors import CheckpointError
    from eagle_compile.heads import shipped_head

    if draft is not None:
        return Path(draft)
    shipped = shipped_head()
    if shipped is None:
        raise CheckpointError("this checkout ships no draft head; pass --draft <head folder>")
    return shipped
