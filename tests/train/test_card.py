"""The model card is read from the runs' files: each stage's numbers and command, the head's facts from the last."""

from __future__ import annotations

import json

import pytest

from eagle_compile.train.card import Stage, stage_section, write_model_card


def _run(path, *, accuracies, tokens, init_head=None, responses=None):
    path.mkdir()
    config = {"data_files": ["instruct_mix.jsonl"], "sources": None, "responses": responses, "init_head": init_head,
              "seed": 0, "batch_size": 8, "grad_accum": 1, "max_len": 384, "lr": 1e-3, "ttt_steps": 4,
              "step_decay": 0.8}
    summary = {"steps": len(tokens), "flags": {"fc_norm": True, "norm_output": True}, "capture_indices": [2, 15, 27],
               "draft_vocab_size": 8192, "vocab_coverage": 0.97, "train_samples": 100,
               "eval": {"accuracies": accuracies, "accept_estimate": 1.0 + sum(accuracies)}}
    (path / "train_config.json").write_text(json.dumps(config))
    (path / "summary.json").write_text(json.dumps(summary))
    lines = [{"split": "train", "step": i + 1, "tokens": t, "step_time_s": 30.0} for i, t in enumerate(tokens)]
    lines.append({"split": "eval", "step": len(tokens)})
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_card_lists_every_stage_and_takes_the_head_facts_from_the_last(tmp_path):
    base = _run(tmp_path / "base", accuracies=[0.38, 0.35], tokens=[700, 800])
    tuned = _run(tmp_path / "tuned", accuracies=[0.61, 0.55], tokens=[900, 1000, 1100], init_head="base/head",
                 responses="runs/sd/responses.jsonl")
    head = tmp_path / "head"
    head.mkdir()
    (head / "model.safetensors").write_bytes(b"x" * 2**20)
    card = write_model_card(head, [Stage(base, "eagle31 train --max-steps 2", "base"),
                                   Stage(tuned, "eagle31 train --init-head base/head", "self-distilled")],
                            title="T", limitations="Trained on a CPU.").read_text()
    assert "| held-out per-step accuracy (depth 1..) | 0.610, 0.550 |" in card
    assert "| total training wall time | 2.5 min" in card                           # 5 steps of 30 s
    assert "| conversations / tokens seen / steps | 100 / 1500 / 2 |" in card
    assert "| conversations / tokens seen / steps | 100 / 3000 / 3 |" in card
    assert card.index("## Stage 1: base") < card.index("## Stage 2: self-distilled")
    assert "eagle31 train --max-steps 2" in card and "eagle31 train --init-head base/head" in card
    assert "| starting point | `base/head` |" in card and "responses.jsonl" in card
    assert "| files | 1.0 MiB |" in card and card.rstrip().endswith("Trained on a CPU.")
    with pytest.raises(ValueError, match="at least one"):
        write_model_card(head, [], title="T", limitations="")


def test_one_stage_is_the_section_the_card_has_and_a_budget_stop_says_so(tmp_path):
    """stage_section (a stage to append to a shipped card, e.g. from benchmarks/gpu_train.py) is the card's own
    section; a run the time budget ended says how many steps were planned."""
    run = _run(tmp_path / "gpu", accuracies=[0.5], tokens=[100, 200])
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "planned_steps": 9, "stopped_by_budget": True}))
    stage = Stage(run, "python benchmarks/gpu_train.py pack", "GPU")
    section = stage_section(stage, 5)
    assert section.startswith("## Stage 5: GPU\n")
    assert "| conversations / tokens seen / steps | 100 / 300 / 2 (of 9 planned: the time budget ended the run) |" \
        in section
    head = tmp_path / "head"
    head.mkdir()
    (head / "model.safetensors").write_bytes(b"x")
    card = write_model_card(head, [stage], title="T", limitations="L").read_text()
    assert section.replace("## Stage 5", "## Stage 1") in card
