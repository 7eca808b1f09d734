"""Self-distillation: the target writes the replies the head is trained on (EAGLE31_SPEC.md §6.1).

EAGLE heads are trained on the target's own outputs: the head learns to predict what the target says, not
what the dataset's authors wrote. For each record, the chat-templated prompt (exactly as `data.prompt_ids`
renders it) goes through batched ``model.generate`` (left padding; greedy, or sampling at a temperature,
0.8 in TorchSpec's script) and the reply is written as one jsonl line::

    {"id", "source", "instruction", "input", "output": <decoded reply>, "output_ids": [...], "finished": bool}

``output_ids`` are the generated ids up to and including the first EOS (``finished``) or all
``max_new_tokens`` of them; `data.reply_ids` uses them as they are, so training sees the very tokens the
target produced. The file is appended batch by batch; a run that is interrupted and started again skips
the ids already written (a torn last line is cut off first).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from eagle_compile.train.data import Record, prompt_ids


@dataclass
class RegenerateStats:
    written: int = 0
    skipped: int = 0
    unfinished: int = 0
    new_tokens: int = 0
    seconds: float = 0.0


def done_ids(path: Path) -> set[str]:
    """Ids already in ``path``; a last line without its newline (torn write) is removed from the file."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    return {json.loads(line)["id"] for line in data[:end].decode().splitlines() if line.strip()}


def _left_pad(rows: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def _batch_seed(seed: int, first_id: str) -> int:
    return int(hashlib.sha1(f"{seed}:{first_id}".encode()).hexdigest()[:8], 16)


@torch.no_grad()
def regenerate_responses(model, tokenizer, records: Sequence[Record], out_path: str | Path, *,
                         batch_size: int = 16, max_new_tokens: int = 448, temperature: float = 0.0,
                         seed: int = 0, progress: bool = True) -> RegenerateStats:
    """Generate the target's reply to every record not yet in ``out_path`` (see the module docstring).

    Prompts are sorted by length (longest first) so that a batch pads little and the memory peak comes
    early. ``temperature=0`` is greedy; otherwise plain temperature sampling (no top-k/top-p), seeded per
    batch from ``seed``.
    """
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    done = done_ids(out_path)
    todo = [r for r in records if r.id not in done]
    stats = RegenerateStats(skipped=len(records) - len(todo))
    prompts = {r.id: prompt_ids(tokenizer, r) for r in todo}
    todo.sort(key=lambda r: -len(prompts[r.id]))
    device = next(model.parameters()).device
    # explicit top_k=0 / top_p=1.0: None would mean "the target's generation_config default"
    sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0
                else {"do_sample": False})
    start = time.perf_counter()
    bar = tqdm(total=len(todo), desc="regenerate", unit="reply", disable=not progress)
    for b in range(0, len(todo), batch_size):
        batch = todo[b : b + batch_size]
        ids, mask = _left_pad([prompts[r.id] for r in batch], pad_id)
        if temperature > 0:
            torch.manual_seed(_batch_seed(seed, batch[0].id))
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             eos_token_id=eos_id, pad_token_id=pad_id, **sampling)
        lines = []
        for r, row in zip(batch, out[:, ids.shape[1] :].tolist(), strict=True):
            finished = eos_id in row
            reply = row[: row.index(eos_id) + 1] if finished else row
            stats.unfinished += not finished
            stats.new_tokens += len(reply)
            lines.append(json.dumps({"id": r.id, "source": r.source, "instruction": r.instruction,
                                     "input": r.input, "output": tokenizer.decode(reply, skip_special_tokens=True),
                                     "output_ids": reply, "finished": finished}))
        with out_path.open("a") as f:
            f.write("".join(line + "\n" for line in lines))
        stats.written += len(batch)
        bar.update(len(batch))
    bar.close()
    stats.seconds = time.perf_counter() - start
    return stats
