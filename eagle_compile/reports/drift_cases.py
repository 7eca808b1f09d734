"""The prompts of the drift report (`eagle31 drift`): the same long documents cut to several context lengths, and
short chat prompts under the target's chat template, a changed system prompt and a changed template.

Context cases: each of `documents` long summarization documents (LEval, ../shared/data/long_context) long enough for
the longest length is cut so that the whole prompt (chat template + document prefix + the document's own
instruction) is exactly the requested length; the same document prefix grows with the length, so the only thing that
changes between lengths is how much context precedes the reply. A length whose prompt plus the new tokens would not
fit the target's window is cut to fit (`DriftCase.length` is what ran; `name` keeps the requested length).

Prompt cases: the first `per_set` questions of each EAGLE eval set (alpaca, gsm8k, humaneval), each formatted three
ways: `default` (the tokenizer's chat template as it is), `system` (a different system message), `template` (the
same question in the Alpaca instruction format, as plain text without the chat template's special tokens).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from eagle_compile.errors import OptionsError

#: Summarization sets of LEval whose documents reach 8K tokens of SmolLM2's tokenizer (meeting has 18 such).
DOCUMENT_FILES = ("meeting_summ", "tv_show_summ", "patent_summ", "news_summ", "gov_report_summ")
CHAT_SETS = ("alpaca", "gsm8k", "humaneval")
SYSTEM_PROMPT = ("You are a meticulous research librarian. Answer in formal British English, state your "
                 "assumptions first, and keep to the facts you are given.")
ALPACA_TEMPLATE = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{question}\n\n### Response:\n")
VARIANTS = ("default", "system", "template")


@dataclass(frozen=True)
class DriftCase:
    group: str          # "context" or "prompt"
    name: str           # the requested length ("512") or the prompt variant ("default", "system", "template")
    prompt_id: str      # which document or question
    ids: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def key(self) -> tuple[str, str, str]:
        return self.group, self.name, self.prompt_id


def default_data_dir() -> Path:
    """``$EAGLE_COMPILE_DATA``, else ``../shared/data`` next to this repository."""
    env = os.environ.get("EAGLE_COMPILE_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"


def context_cases(tokenizer, data: Path, lengths: list[int], documents: int, window: int,
                  new_tokens: int) -> list[DriftCase]:
    """`documents` documents x `lengths` prompts of exactly min(length, window - new_tokens) tokens."""
    if not lengths or min(lengths) < 64:
        raise OptionsError(f"context lengths must be at least 64 tokens, got {lengths}")
    longest = min(max(lengths), window - new_tokens)
    docs = _long_documents(tokenizer, data, documents, longest)
    cases = []
    for doc_id, instruction, doc_ids in docs:
        for requested in lengths:
            length = min(requested, window - new_tokens)
            ids = _fit(tokenizer, instruction, doc_ids, length)
            cases.append(DriftCase("context", str(requested), doc_id, tuple(ids)))
    return cases


def prompt_cases(tokenizer, data: Path, per_set: int) -> list[DriftCase]:
    """The first `per_set` questions of each EAGLE eval set, in each of `VARIANTS`."""
    cases = []
    for name in CHAT_SETS:
        path = data / "eagle_eval" / name / "question.jsonl"
        if not path.is_file():
            raise OptionsError(f"{path} is missing: the drift report's chat prompts come from ../shared/data/"
                               "eagle_eval (pass --data to point at the data folder)")
        with path.open() as f:
            questions = [_question(json.loads(line)) for line, _ in zip(f, range(per_set), strict=False)]
        for i, question in enumerate(questions):
            for variant in VARIANTS:
                cases.append(DriftCase("prompt", variant, f"{name}/{i}", tuple(_format(tokenizer, question, variant))))
    return cases


# -- helpers -------------------------------------------------------------------------------------------------------
def _long_documents(tokenizer, data: Path, count: int, length: int) -> list[tuple[str, str, list[int]]]:
    """(id, instruction, document ids) of the first document of at least `length` tokens in each of
    `DOCUMENT_FILES`, in that order, then further documents of the same files, until `count` are found."""
    pools = []
    for name in DOCUMENT_FILES:
        path = data / "long_context" / "leval" / f"{name}.jsonl"
        if not path.is_file():
            raise OptionsError(f"{path} is missing: the drift report's documents come from ../shared/data/"
                               "long_context/leval (pass --data to point at the data folder)")
        found = []
        with path.open() as f:
            for index, line in enumerate(f):
                record = json.loads(line)
                ids = tokenizer(record["input"], add_special_tokens=False, verbose=False)["input_ids"]
                if len(ids) >= length:
                    found.append((f"{name}/{index}", record["instructions"][0], ids))
        pools.append(found)
    picked = []
    for rank in range(max(len(p) for p in pools)):
        picked += [pool[rank] for pool in pools if rank < len(pool)]
    if len(picked) < count:
        raise OptionsError(f"only {len(picked)} LEval documents have {length} tokens; ask for fewer documents "
                           f"(--documents) or shorter contexts (--lengths)")
    return picked[:count]


def _fit(tokenizer, instruction: str, doc_ids: list[int], length: int) -> list[int]:
    """Chat-template ids of "<document prefix>\\n\\n<instruction>" with exactly `length` tokens in all."""
    def ids_for(n: int) -> list[int]:
        text = tokenizer.decode(doc_ids[:n]) + "\n\n" + instruction
        return _chat(tokenizer, [{"role": "user", "content": text}])

    n = length - len(ids_for(0))
    for _ in range(8):                       # decode/encode round trips can merge tokens at the cut: adjust
        got = len(ids_for(n))
        if got == length:
            return ids_for(n)
        n += length - got
    ids = ids_for(n)
    if len(ids) > length:
        raise OptionsError(f"could not cut a document to exactly {length} tokens (got {len(ids)})")
    return ids


def _format(tokenizer, question: str, variant: str) -> list[int]:
    if variant == "default":
        return _chat(tokenizer, [{"role": "user", "content": question}])
    if variant == "system":
        return _chat(tokenizer, [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}])
    return tokenizer(ALPACA_TEMPLATE.format(question=question), add_special_tokens=False)["input_ids"]


def _chat(tokenizer, messages: list[dict]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def _question(record: dict) -> str:
    turns = record.get("turns")
    if isinstance(turns, list) and turns:
        return str(turns[0])
    for key in ("question", "instruction", "prompt", "input"):
        if key in record:
            return str(record[key])
    raise OptionsError(f"an eval question has none of the fields turns/question/instruction/prompt: {sorted(record)}")
