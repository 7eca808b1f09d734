"""The model card written beside a shipped head: every number in it is read from the training run's files."""

from __future__ import annotations

import json
from pathlib import Path


def write_model_card(run_dir: str | Path, head_dir: str | Path, *, command: str, title: str) -> Path:
    """Write `head_dir/MODEL_CARD.md` from `run_dir`'s train_config.json, summary.json and metrics.jsonl."""
    run_dir, head_dir = Path(run_dir), Path(head_dir)
    config = json.loads((run_dir / "train_config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [m for m in metrics if m.get("split") == "train"]
    seconds = sum(m.get("step_time_s", 0.0) for m in train)
    tokens = sum(m.get("tokens", 0) for m in train)
    ev = summary.get("eval") or {}
    accuracies = ", ".join(f"{a:.3f}" for a in ev.get("accuracies", []))
    size = sum(f.stat().st_size for f in head_dir.iterdir() if f.is_file() and f.name != "MODEL_CARD.md")
    lines = [
        f"# {title}",
        "",
        f"EAGLE 3.1 draft head (flags: {', '.join(summary['flags']) or 'none (EAGLE-3)'}) for "
        "SmolLM2-135M-Instruct, in the official EAGLE-3 layout (`config.json` + `model.safetensors`).",
        "",
        "| | |",
        "|---|---|",
        f"| capture indices | {summary['capture_indices']} (residual stream entering those layers) |",
        f"| draft vocabulary | {summary['draft_vocab_size']} tokens, covering {100 * summary['vocab_coverage']:.2f}% "
        "of reply tokens in the training data |",
        f"| training data | `{', '.join(config.get('data_files', []))}` from ../shared/data/train "
        f"(MIT / Apache-2.0 sources; Spec-Bench and MT-bench never used); {summary['train_samples']} "
        f"conversations available, {tokens} tokens seen in {summary['steps']} steps |",
        f"| seed | {config.get('seed')} |",
        f"| training wall time | {seconds / 60:.1f} min (sum of step times, 2-core CPU) |",
        f"| TTT steps / decay | {config.get('ttt_steps')} / {config.get('step_decay')} |",
        f"| held-out per-step accuracy (depth 1..) | {accuracies} |",
        f"| held-out acceptance estimate (greedy chain, teacher forcing) | {ev.get('accept_estimate', 0.0):.2f} |",
        f"| files | {size / 2**20:.1f} MiB |",
        "",
        "Training command (resumable: run it again to continue):",
        "",
        "```bash",
        command,
        "```",
        "",
        "Limitations: trained for minutes on a 2-core CPU on a small, math- and code-heavy instruction mix with the",
        "dataset's own replies (no self-distillation), so acceptance is far below a GPU-trained head's. The output",
        "of speculative decoding does not depend on the head: it is always exactly the target's.",
    ]
    card = head_dir / "MODEL_CARD.md"
    card.write_text("\n".join(lines) + "\n")
    return card
