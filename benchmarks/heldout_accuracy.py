"""Heads on one training run's held-out conversations: per-depth accuracy and the acceptance estimate.

    python benchmarks/heldout_accuracy.py --run runs/sd/ft5 \\
        --heads runs/old_head,eagle_compile/heads/smollm2-135m-instruct-eagle31

A run's own evaluation (its summary.json) uses that run's held-out set, which changes with its data
(`split_eval`: the smallest sha1(id)), and its own feature dtype; two stages' numbers are then not one
yardstick. This script rebuilds the held-out set of `--run` from its train_config.json (the same data files,
sources and max length) and scores every head on it with the training code's `evaluate`, the target in float32
(as inference feeds the head). It prints one JSON line per head.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from eagle_compile.draft.checkpoint import load_draft
from eagle_compile.targets import load_default_target
from eagle_compile.train.config import TrainConfig
from eagle_compile.train.data import collate, split_eval
from eagle_compile.train.evaluate import evaluate
from eagle_compile.train.features import FeatureExtractor, TeacherHead
from eagle_compile.train.trainer import load_samples


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a training run's output folder (train_config.json)")
    p.add_argument("--heads", required=True, help="comma-separated head folders")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def score(head_dir: str, model, samples, held: list[int], config: TrainConfig) -> dict:
    draft = load_draft(head_dir, target=model, dtype=torch.float32, device=torch.device("cpu"))
    indices = draft.config.resolved_capture_indices(int(model.config.num_hidden_layers))
    teacher, extractor = TeacherHead(model, draft.t2d), FeatureExtractor(model, indices)
    order = sorted(held, key=lambda i: len(samples[i]))
    bs = config.batch_size
    batches = (extractor(collate([samples[j] for j in order[i:i + bs]])) for i in range(0, len(order), bs))
    with torch.no_grad():
        res = evaluate(draft, teacher, batches, config.ttt_steps, config.step_weights)
    return {"head": head_dir, "accuracies": [round(a, 4) for a in res.accuracies],
            "accept_estimate": round(res.accept_estimate, 4), "positions": res.positions, "samples": res.samples}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config_file = args.run / "train_config.json"
    if not config_file.is_file():
        raise SystemExit(f"{config_file} does not exist: --run takes a training run's output folder")
    config = TrainConfig.from_dict(json.loads(config_file.read_text()))
    model, tokenizer = load_default_target(torch.float32)
    samples, _ = load_samples(config, tokenizer)
    _, held = split_eval(samples, config.eval_samples)
    print(f"{len(held)} held-out conversations of {len(samples)} ({args.run})", file=sys.stderr)
    for head in args.heads.split(","):
        print(json.dumps(score(head, model, samples, held, config)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
