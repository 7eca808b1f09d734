"""``eagle31 train`` (and ``python -m eagle_compile.train``): train an EAGLE 3.1 or EAGLE-3 draft head.

Every option maps to one `TrainConfig` field; an option not given keeps the field's default, so defaults
live in one place. Stages: optional self-distillation (``--regenerate``), optional offline features
(``--features offline``), training, evaluation, the head in the official EAGLE-3 layout under
``<output-dir>/head``. Running the same command again resumes every stage where it stopped.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
from pathlib import Path

from eagle_compile.errors import OptionsError
from eagle_compile.train.config import TrainConfig

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def _default(name: str):
    f = _FIELDS[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _vocab(text: str) -> int | str:
    return "full" if text == "full" else int(text)


# (option, field, type, help); the field's default is appended to the help
_OPTIONS = [
    ("--target", "target", str, "HF model folder of the target (default: the embedded SmolLM2-135M-Instruct)"),
    ("--data-dir", "data_dir", str, "folder of the training jsonl files"),
    ("--data-files", "data_files", _names, "comma-separated jsonl files in --data-dir"),
    ("--sources", "sources", _names, "keep only these comma-separated record sources"),
    ("--responses", "responses", _names, "comma-separated jsonl files of regenerated replies to train on "
     "(see --regenerate)"),
    ("--max-len", "max_len", int, "longest conversation in tokens; longer ones are dropped (see --truncate)"),
    ("--eval-samples", "eval_samples", int, "held-out conversations for evaluation"),
    ("--max-samples", "max_samples", int, "use only the first N conversations"),
    ("--draft-vocab-size", "draft_vocab_size", _vocab, "draft vocabulary size, or 'full'"),
    ("--capture-indices", "capture_indices", _ints, "comma-separated capture indices (default (2, N//2, N-3))"),
    ("--init-head", "init_head", str, "start from this trained head (fine-tune; keeps its draft vocabulary)"),
    ("--lm-head-init", "lm_head_init", str, "'target' (lm_head rows of the target) or 'random'"),
    ("--ttt-steps", "ttt_steps", int, "unrolled training-time-test steps L"),
    ("--step-decay", "step_decay", float, "weight of TTT step i is step_decay**i"),
    ("--epochs", "epochs", int, "passes over the training conversations"),
    ("--max-steps", "max_steps", int, "optimizer steps (overrides --epochs)"),
    ("--batch-size", "batch_size", int, "conversations per batch"),
    ("--grad-accum", "grad_accum", int, "batches per optimizer step"),
    ("--lr", "lr", float, "peak learning rate"),
    ("--min-lr-ratio", "min_lr_ratio", float, "final learning rate as a fraction of --lr"),
    ("--weight-decay", "weight_decay", float, "AdamW weight decay"),
    ("--warmup-ratio", "warmup_ratio", float, "linear warmup as a fraction of the steps"),
    ("--warmup-steps", "warmup_steps", int, "linear warmup steps (overrides --warmup-ratio)"),
    ("--grad-clip", "grad_clip", float, "gradient-norm clipping"),
    ("--seed", "seed", int, "seed of the data order and the head's init"),
    ("--data-start-step", "data_start_step", int, "start at this optimizer step of the seed's data plan: with the "
     "same data, seed and batch size as an earlier run of N steps, N continues its data order (new LR schedule)"),
    ("--amp", "amp", str, "'none' or 'bf16' (autocast of the head's forward; GPUs, CPUs with avx512_bf16)"),
    ("--target-dtype", "target_dtype", str, "dtype the target makes features in: float32, bfloat16 or float16"),
    ("--features", "feature_mode", str, "'online' (run the target every batch) or 'offline' (cache first)"),
    ("--feature-cache", "feature_cache", str, "offline feature cache folder (default <output-dir>/features)"),
    ("--cache-dtype", "cache_dtype", str, "dtype of cached features: float16, bfloat16 or float32"),
    ("--shard-samples", "shard_samples", int, "conversations per feature-cache shard"),
    ("--pad-multiple", "pad_multiple", int, "online batches are padded to a multiple of this length"),
    ("--output-dir", "output_dir", str, "run folder: checkpoints, metrics.jsonl, head/"),
    ("--save-every", "save_every", int, "optimizer steps between checkpoints"),
    ("--keep-checkpoints", "keep_checkpoints", int, "checkpoints kept"),
    ("--eval-every", "eval_every", int, "optimizer steps between held-out evaluations"),
    ("--log-every", "log_every", int, "optimizer steps between metrics.jsonl lines"),
    ("--threads", "num_threads", int, "torch CPU threads"),
    ("--device", "device", str, "'auto', 'cpu' or 'cuda'"),
    ("--save-dtype", "save_dtype", str, "dtype of the saved head"),
    ("--time-budget-s", "time_budget_s", float, "wall-clock seconds for this invocation's training steps; the run "
     "ends (evaluation, head) at the step it reached"),
]


def _add_arguments(p: argparse.ArgumentParser) -> None:
    head = p.add_mutually_exclusive_group()
    head.add_argument("--eagle31", dest="preset", action="store_const", const="eagle31",
                      help="EAGLE 3.1 head: fc_norm + norm_output (default)")
    head.add_argument("--eagle3", dest="preset", action="store_const", const="eagle3",
                      help="EAGLE-3 head: no EAGLE 3.1 flags")
    for option, name, kind, text in _OPTIONS:
        p.add_argument(option, dest=name, type=kind, default=None, help=f"{text} (default: {_default(name)})")
    p.add_argument("--truncate", dest="truncate", action="store_const", const=True,
                   help="truncate conversations longer than --max-len instead of dropping them")
    p.add_argument("--freeze-lm-head", dest="freeze_lm_head", action="store_const", const=True,
                   help="keep the lm_head at its initial value")
    p.add_argument("--no-progress", dest="progress", action="store_const", const=False, help="no progress bars")
    p.add_argument("--no-resume", dest="resume", action="store_const", const=False,
                   help="refuse an --output-dir that already holds checkpoints (default: resume them)")
    regen = p.add_argument_group("self-distillation")
    regen.add_argument("--regenerate", action="store_true",
                       help="first let the target regenerate every reply (to --responses, default "
                            "<output-dir>/responses.jsonl; resumable), then train on those replies")
    regen.add_argument("--regen-batch-size", type=int, default=16, help="prompts per generate call (default 16)")
    regen.add_argument("--regen-max-new-tokens", type=int, default=448, help="longest reply (default 448)")
    regen.add_argument("--regen-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                       help="generate with a copy of the target in this dtype (bfloat16 is ~1.8x faster on CPUs "
                            "with avx512_bf16); features and training keep the target's own dtype "
                            "(default: the target's dtype)")
    regen.add_argument("--regen-temperature", type=float, default=0.0,
                       help="0 = greedy (default); e.g. 0.8 samples")
    p.add_argument("--only", choices=("regenerate", "features"), default=None,
                   help="stop after this stage (features needs --features offline)")


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand to the ``eagle31`` command line."""
    p = subparsers.add_parser("train", help="train an EAGLE 3.1 / EAGLE-3 draft head for a target",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    given = {name: getattr(args, name) for name in _FIELDS if getattr(args, name, None) is not None}
    if given.get("draft_vocab_size") == "full":
        given["draft_vocab_size"] = None
    return TrainConfig(**given)


def run_train(args: argparse.Namespace) -> int:
    from eagle_compile.train.trainer import Trainer, load_target

    config = config_from_args(args)
    if args.only == "features" and config.feature_mode != "offline":
        print("eagle31 train: --only features needs --features offline", file=sys.stderr)
        return 2
    kwargs = {}
    if args.regenerate:
        config, kwargs = _regenerate(config, args, load_target)
        if args.only == "regenerate":
            return 0
    trainer = Trainer(config, **kwargs)
    print(f"{len(trainer.train_idx)} training / {len(trainer.eval_idx)} held-out conversations, draft vocabulary "
          f"{trainer.model.config.draft_vocab_size} ({trainer.vocab_coverage:.2%} of reply tokens), "
          f"{trainer.total_steps} steps, capture indices {list(trainer.capture_indices)}, {config.preset}")
    if args.only == "features":
        trainer.build_features()
        return 0
    result = trainer.train()
    if trainer.step < trainer.total_steps and not trainer.stopped_by_budget:
        print(f"stopped at step {trainer.step} of {trainer.total_steps}; run the same command again to resume")
        return 130
    if trainer.stopped_by_budget:
        print(f"the time budget ended training at step {trainer.step} of {trainer.total_steps}; run the same "
              "command again to train the remaining steps")
    print(f"head written to {trainer.output_dir / 'head'}")
    if result is not None:
        print(json.dumps(result.to_dict(), indent=2))
    return 0


def _regenerate(config: TrainConfig, args, load_target):
    import torch

    from eagle_compile.train.data import read_records
    from eagle_compile.train.regenerate import regenerate_responses
    from eagle_compile.train.trainer import _device

    if config.responses is not None and len(config.responses) > 1:
        raise OptionsError(f"--regenerate writes one file, but --responses names {len(config.responses)}: "
                           "regenerate into one file per run, then train on them with --responses a,b")
    out = Path(config.responses[0]) if config.responses else Path(config.output_dir) / "responses.jsonl"
    target, tokenizer = load_target(config, _device(config.device))
    records = read_records(config.data_paths(), config.sources)[: config.max_samples]
    writer = target
    if args.regen_dtype is not None and getattr(torch, args.regen_dtype) != next(target.parameters()).dtype:
        writer = copy.deepcopy(target).to(getattr(torch, args.regen_dtype))
    stats = regenerate_responses(writer, tokenizer, records, out, batch_size=args.regen_batch_size,
                                 max_new_tokens=args.regen_max_new_tokens, temperature=args.regen_temperature,
                                 seed=config.seed, progress=config.progress)
    print(f"regenerated {stats.written} replies ({stats.skipped} already done, {stats.unfinished} without EOS, "
          f"{stats.new_tokens} tokens in {stats.seconds:.0f} s) -> {out}")
    return dataclasses.replace(config, responses=(str(out),)), {"target": target, "tokenizer": tokenizer}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle_compile.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_train(build_parser().parse_args(argv))
