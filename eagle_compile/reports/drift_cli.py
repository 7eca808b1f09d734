"""``eagle31 drift``: tau and the drift monitors of one or more heads against context length and prompt format.

    eagle31 drift                                  # the shipped head, 0.5K..8K contexts, 3 documents, 64 tokens
    eagle31 drift --draft runs/eagle3/head --draft runs/eagle31/head --out drift_twins
    eagle31 drift --lengths 512,2048 --documents 1 --sections context --new-tokens 32    # a quick look

Writes OUT/records.jsonl (one line per head and case, as soon as it is measured: run the same command again to
resume), OUT/drift.json (the summary), OUT/drift.md (tables) and OUT/*.png (tau against context length, RMS and
sink mass against draft depth; the plots need matplotlib, the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eagle_compile.errors import OptionsError

SECTIONS = ("context", "prompt")


def add_drift_parser(sub) -> None:
    p = sub.add_parser("drift", help="tau and attention drift of draft heads against context length and prompt "
                       "format (a report: JSON, markdown, PNG)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", action="append", default=None, metavar="FOLDER",
                   help="a draft head folder; repeat to compare heads (default: the shipped SmolLM2 head)")
    p.add_argument("--target", default=None, help="HF model folder (default: the embedded SmolLM2 target)")
    p.add_argument("--tree", default=None, help='the fixed tree every head runs, as JSON, e.g. \'{"depth": 3, '
                   '"top_k": 3, "total_tokens": 8}\' (default: the tree.json beside the first head)')
    p.add_argument("--lengths", default="512,1024,2048,4096,8192",
                   help="comma-separated context lengths in tokens (cut to the target's window minus the new "
                   "tokens); default %(default)s")
    p.add_argument("--documents", type=int, default=3, help="long documents per length (default %(default)s)")
    p.add_argument("--chat-prompts", type=int, default=2,
                   help="questions per EAGLE eval set (alpaca, gsm8k, humaneval) for the prompt-format cases "
                   "(default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per case (default %(default)s)")
    p.add_argument("--sections", default="context,prompt", help="which cases: context, prompt or both")
    p.add_argument("--data", default=None, help="the data folder (default: $EAGLE_COMPILE_DATA or ../shared/data)")
    p.add_argument("--out", default="drift_out", help="output folder (default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--fresh", action="store_true", help="discard the records in --out and start over")


@torch.no_grad()                 # not a global switch: in-process callers (tests) keep their grad mode
def run_drift(args) -> int:
    from eagle_compile.reports import drift, drift_cases, drift_render
    from eagle_compile.targets import load_target

    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    if not sections or set(sections) - set(SECTIONS):
        raise OptionsError(f"--sections takes {', '.join(SECTIONS)}; got {args.sections!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.target, getattr(torch, args.dtype))
    heads = _heads(args, model)
    tree = _tree(args, next(iter(heads.values()))[2], model)
    data = Path(args.data) if args.data else drift_cases.default_data_dir()
    cases = []
    if "context" in sections:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        window = int(getattr(model.config, "max_position_embeddings", max(lengths) + args.new_tokens))
        cases += drift_cases.context_cases(tokenizer, data, lengths, args.documents, window, args.new_tokens)
    if "prompt" in sections:
        cases += drift_cases.prompt_cases(tokenizer, data, args.chat_prompts)
    out = Path(args.out)
    print(f"drift report: {len(heads)} head(s) x {len(cases)} cases, tree {json.dumps(tree)}, {args.new_tokens} new "
          f"tokens, {torch.get_num_threads()} threads -> {out}")
    records = drift.run(out, {k: (v[0], v[1]) for k, v in heads.items()}, model, cases, tree, args.new_tokens,
                        fresh=args.fresh)
    settings = json.loads((out / drift.RUN_FILE).read_text())
    for path in drift_render.write(out, drift.summarize(records), settings):
        print(f"wrote {path}")
    return 0


def _heads(args, model) -> dict[str, tuple[torch.nn.Module, str, Path]]:
    """{label: (head, description, folder)}; labels are the folders' names (with their parent's on a clash)."""
    from eagle_compile.draft.checkpoint import load_draft
    from eagle_compile.heads import shipped_head

    folders = [Path(f) for f in args.draft] if args.draft else [shipped_head()]
    if folders[0] is None:
        raise OptionsError("no draft head: this checkout ships none; pass --draft FOLDER")
    names = [f.resolve().name for f in folders]
    heads = {}
    for folder, name in zip(folders, names, strict=True):
        label = name if names.count(name) == 1 else f"{folder.resolve().parent.name}/{name}"
        head = load_draft(folder, target=model, dtype=model.dtype)
        heads[label] = (head, f"head {folder.resolve()}", folder)
    return heads


def _tree(args, folder: Path, model) -> dict:
    from eagle_compile.draft.tree_file import head_tree

    if args.tree:
        tree = json.loads(args.tree)
        if not isinstance(tree, dict):
            raise OptionsError(f"--tree takes a JSON object of tree options, got {args.tree!r}")
        return tree
    param = next(model.parameters())
    tree, why = head_tree(folder, param.device, param.dtype)
    if tree is None:
        raise OptionsError(f"no tree for the drift report: {why}; pass --tree, e.g. "
                           '\'{"depth": 3, "top_k": 3, "total_tokens": 8}\'')
    return tree
