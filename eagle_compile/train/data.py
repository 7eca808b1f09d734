"""Training conversations: jsonl records -> chat-templated token ids with an assistant-only loss mask.

A record (shared/data/README.md §4) has ``instruction``, ``input`` (may be empty), ``output`` and ``source``;
records written by `regenerate_responses` also carry ``output_ids``, the reply exactly as the target
generated it. One conversation is one user turn and one assistant turn, rendered with the target's chat
template (EAGLE31_SPEC.md §6.1):

    prompt = template(user turn, add_generation_prompt=True)    # exactly what inference feeds the target
    reply  = the assistant turn's tokens after the prompt, up to and including the first EOS
    input_ids = prompt + reply;   loss_mask = 0 on the prompt, 1 on the reply

The prompt is tokenized on its own (not sliced out of the full conversation) so that its ids equal the ids
inference sees; anything the template puts after the reply's EOS (ChatML's trailing newline) is dropped, as
generation stops at EOS. Conversations longer than ``max_len`` are dropped, as the official trainer does: a
truncated conversation teaches replies that never end. ``truncate=True`` keeps their first ``max_len``
tokens instead (more data, biased toward reply openings); conversations whose prompt alone is too long
are dropped either way.

Batches are planned per epoch from a seeded generator: samples are grouped (shards of the offline feature
cache, or random groups), sorted by length inside a group so that a batch pads little, and the batches of a
group are shuffled. The plan depends only on (seed, epoch, lengths, groups), so a resumed run replays it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle_compile.errors import OptionsError


@dataclass(frozen=True)
class Record:
    id: str
    source: str
    instruction: str
    input: str
    output: str
    output_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Sample:
    """One tokenized conversation."""

    id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool, True on assistant tokens

    def __len__(self) -> int:
        return self.input_ids.numel()


@dataclass
class TokenBatch:
    """Right-padded conversations. Padding has token 0, attention and loss mask False."""

    ids: list[str]
    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] bool
    loss_mask: torch.Tensor  # [B, T] bool

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(self.ids, self.input_ids.to(device), self.attention_mask.to(device),
                          self.loss_mask.to(device))


@dataclass
class DataStats:
    records: int = 0
    kept: int = 0
    dropped_too_long: int = 0
    truncated: int = 0
    tokens: int = 0
    loss_tokens: int = 0


# -- reading ------------------------------------------------------------------------------------------------
def read_records(paths: Iterable[Path], sources: Sequence[str] | None = None) -> list[Record]:
    """Records of the jsonl ``paths`` (in file order), keeping only ``sources`` when given."""
    wanted = set(sources) if sources is not None else None
    records: list[Record] = []
    seen_sources: set[str] = set()
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"training data file {path} does not exist; the default is ../shared/data/train/"
                "instruct_mix.jsonl next to the repository (set $EAGLE_COMPILE_TRAIN_DATA or --data-dir)"
            )
        with path.open() as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                rec = _record(json.loads(line), path, line_no)
                seen_sources.add(rec.source)
                if wanted is None or rec.source in wanted:
                    records.append(rec)
    if wanted is not None and not wanted <= seen_sources:
        raise OptionsError(
            f"sources {sorted(wanted - seen_sources)} do not occur in the data; the data has sources "
            f"{sorted(seen_sources)}"
        )
    return records


def _record(d: dict, path: Path, line_no: int) -> Record:
    missing = [k for k in ("instruction", "output") if k not in d]
    if missing:
        raise ValueError(f"{path}:{line_no}: record lacks {missing}; expected instruction/input/output/source")
    ids = d.get("output_ids")
    return Record(id=str(d.get("id", f"{path.name}-{line_no}")), source=str(d.get("source", path.stem)),
                  instruction=d["instruction"], input=d.get("input") or "", output=d["output"],
                  output_ids=tuple(int(i) for i in ids) if ids is not None else None)


def prompt_messages(record: Record) -> list[dict[str, str]]:
    """The user turn: the instruction, then the input (if any) after a blank line."""
    content = record.instruction if not record.input else f"{record.instruction}\n\n{record.input}"
    return [{"role": "user", "content": content}]


# -- tokenizing ---------------------------------------------------------------------------------------------
def prompt_ids(tokenizer, record: Record) -> list[int]:
    """The chat-templated prompt with the generation prompt, as inference tokenizes it."""
    text = tokenizer.apply_chat_template(prompt_messages(record), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reply_ids(tokenizer, record: Record, eos_id: int) -> list[int]:
    """The assistant turn's ids up to and including the first EOS (the generated ids when regenerated)."""
    if record.output_ids is not None:
        ids = list(record.output_ids)
    else:
        messages = prompt_messages(record)
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": record.output}],
                                             tokenize=False)
        if not full.startswith(prompt):
            raise ValueError(
                "the chat template does not render the conversation as the generation prompt followed by "
                f"the reply (record {record.id}), so the assistant tokens cannot be located"
            )
        ids = tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"]
    if eos_id in ids:
        ids = ids[: ids.index(eos_id) + 1]
    return ids


def tokenize_records(tokenizer, records: Sequence[Record], *, max_len: int, truncate: bool = False,
                     eos_id: int | None = None) -> tuple[list[Sample], DataStats]:
    """Samples (prompt + reply ids, loss mask on the reply) and what was dropped or truncated."""
    eos_id = tokenizer.eos_token_id if eos_id is None else eos_id
    if eos_id is None:
        raise ValueError("the tokenizer has no eos_token_id; pass eos_id (the token that ends a reply)")
    stats = DataStats(records=len(records))
    samples = []
    for rec in records:
        prompt, reply = prompt_ids(tokenizer, rec), reply_ids(tokenizer, rec, eos_id)
        ids, mask = prompt + reply, [False] * len(prompt) + [True] * len(reply)
        if len(ids) > max_len:
            if not truncate or len(prompt) >= max_len:
                stats.dropped_too_long += 1
                continue
            ids, mask = ids[:max_len], mask[:max_len]
            stats.truncated += 1
        if not any(mask):
            continue
        samples.append(Sample(rec.id, torch.tensor(ids, dtype=torch.int64), torch.tensor(mask)))
        stats.kept += 1
        stats.tokens += len(ids)
        stats.loss_tokens += sum(mask)
    return samples, stats


# -- split, batches -----------------------------------------------------------------------------------------
def split_eval(samples: Sequence[Sample], eval_samples: int) -> tuple[list[int], list[int]]:
    """(train, eval) indices: the ``eval_samples`` samples with the smallest sha1(id) are held out.

    Hashing the id keeps a conversation on the same side whatever else is filtered or added.
    """
    order = sorted(range(len(samples)), key=lambda i: hashlib.sha1(samples[i].id.encode()).hexdigest())
    held = set(order[:eval_samples])
    return [i for i in range(len(samples)) if i not in held], sorted(held)


def plan_epoch(lengths: Sequence[int], batch_size: int, seed: int, epoch: int,
               groups: Sequence[int] | None = None, group_batches: int = 32) -> list[list[int]]:
    """The batches (lists of positions into ``lengths``) of one epoch.

    ``groups[i]`` is the group of sample i (e.g. its feature-cache shard); without groups, samples are dealt
    into random groups of ``group_batches * batch_size``. Groups are visited in random order; inside one,
    samples are sorted by length, cut into batches, and the batches shuffled.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    n = len(lengths)
    if groups is None:
        perm = torch.randperm(n, generator=gen).tolist()
        size = group_batches * batch_size
        members = [perm[i : i + size] for i in range(0, n, size)]
    else:
        by_group: dict[int, list[int]] = {}
        for i, g in enumerate(groups):
            by_group.setdefault(int(g), []).append(i)
        keys = sorted(by_group)
        members = []
        for k in torch.randperm(len(keys), generator=gen).tolist():
            group = by_group[keys[k]]
            members.append([group[j] for j in torch.randperm(len(group), generator=gen).tolist()])
    batches = []
    for group in members:
        group = sorted(group, key=lambda i: lengths[i])
        chunk = [group[i : i + batch_size] for i in range(0, len(group), batch_size)]
        batches.extend(chunk[j] for j in torch.randperm(len(chunk), generator=gen).tolist())
    return batches


def collate(samples: Sequence[Sample], pad_multiple: int = 1, rows: int | None = None) -> TokenBatch:
    """Right-pad to the longest sample rounded up to ``pad_multiple``; ``rows`` pads the batch with empty rows."""
    longest = max(len(s) for s in samples)
    t = -(-longest // pad_multiple) * pad_multiple
    b = max(rows or 0, len(samples))
    input_ids = torch.zeros(b, t, dtype=torch.int64)
    attention = torch.zeros(b, t, dtype=torch.bool)
    loss = torch.zeros(b, t, dtype=torch.bool)
    for r, s in enumerate(samples):
        n = len(s)
        input_ids[r, :n], attention[r, :n], loss[r, :n] = s.input_ids, True, s.loss_mask
    return TokenBatch([s.id for s in samples], input_ids, attention, loss)


def fingerprint(samples: Sequence[Sample]) -> str:
    """sha256 over the ids, token ids and loss masks of ``samples`` (in order)."""
    h = hashlib.sha256()
    for s in samples:
        h.update(s.id.encode())
        h.update(s.input_ids.to(torch.int64).numpy().tobytes())
        h.update(s.loss_mask.numpy().tobytes())
    return h.hexdigest()
