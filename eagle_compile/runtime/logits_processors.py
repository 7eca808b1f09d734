"""Hugging Face's logits processors, applied to every tree node from that node's own path.

Plain `generate` processes the logits of each step with the tokens generated so far (`input_ids`: the padded
prompt row, then the new tokens). Verification scores all tree nodes in one forward, and node i's logits are
those of the step that would follow the path root -> i; so node i must be processed with

    sequence(i) = history (padded prompt + emitted tokens, the root last) + draft tokens on the path to i

and nothing else: then every node's scores are exactly the ones HF would compute had that path been generated,
greedy verification takes their argmax, and sampling verification draws from their (warped) distribution
(`sampling.target_probs`), so the output stays lossless. `node_sequences` builds those sequences
`[rows, nodes, S]`; each processor is a few tensor ops over `[rows, nodes, vocab]`, in HF's order
(`GenerationMixin._get_logits_processor`) and with HF's arithmetic (float32 scores, the same ops), so ties
and rounding are HF's too:

    sequence_bias, repetition_penalty, no_repeat_ngram_size, bad_words_ids, min_length, min_new_tokens,
    suppress_tokens, begin_suppress_tokens

The history lives on the device (`TokenHistory`, in the step's row state) and the step appends each cycle's
emitted tokens to it, so nothing here synchronises with the host. With no processor configured
`SamplingParams.processors` is None and none of this runs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from eagle_compile.errors import UnsupportedGenerationError

_Word = tuple[int, ...]


@dataclass(frozen=True)
class ProcessorSettings:
    """The logits processors a generation config asks for, with HF's defaults meaning "off".

    `bad_words_ids` are kept as HF keeps them: deduplicated, without words that are a lone EOS token.
    `suppress_tokens` / `begin_suppress_tokens` are None when not configured (HF adds no processor then).
    """

    sequence_bias: tuple[tuple[_Word, float], ...] = ()
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[_Word, ...] = ()
    min_length: int = 0
    min_new_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    suppress_tokens: tuple[int, ...] | None = None
    begin_suppress_tokens: tuple[int, ...] | None = None

    @classmethod
    def from_generation_config(cls, get: Callable[[str], Any]) -> ProcessorSettings | None:
        """The settings read through `get(name)` (a generation-config field, HF's default when unset); None when
        no processor is configured, so the caller's fast path stays untouched."""
        eos = get("eos_token_id")
        eos = () if eos is None else ((int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos))
        settings = cls(
            sequence_bias=_sequence_bias(get("sequence_bias")),
            repetition_penalty=_penalty(get("repetition_penalty")),
            no_repeat_ngram_size=_non_negative("no_repeat_ngram_size", get("no_repeat_ngram_size") or 0),
            bad_words_ids=_bad_words(get("bad_words_ids"), eos),
            # HF adds the two EOS blockers only when there is an EOS token; a min_new_tokens replaces min_length
            # (`_prepare_generated_length` sets min_length = min_new_tokens + prompt: the same condition)
            min_length=_non_negative("min_length", get("min_length") or 0) if eos and get("min_new_tokens") is None
            else 0,
            min_new_tokens=_non_negative("min_new_tokens", get("min_new_tokens") or 0) if eos else 0,
            eos_token_ids=eos,
            suppress_tokens=_token_list("suppress_tokens", get("suppress_tokens")),
            begin_suppress_tokens=_token_list("begin_suppress_tokens", get("begin_suppress_tokens")),
        )
        return settings if settings.configured() else None

    def configured(self) -> set[str]:
        """Names of the generation settings that add a processor (HF's conditions)."""
        off = ProcessorSettings()
        return {f.name for f in fields(self)
                if f.name != "eos_token_ids" and getattr(self, f.name) != getattr(off, f.name)}

    def check_vocabulary(self, vocab: int) -> None:
        """Refuse token ids outside [0, vocab), as HF does (the scatters here would fail deep in a step)."""
        ids = [t for word, _ in self.sequence_bias for t in word] + [t for w in self.bad_words_ids for t in w]
        ids += list(self.suppress_tokens or ()) + list(self.begin_suppress_tokens or ())
        bad = sorted({t for t in ids if not 0 <= t < vocab})
        if bad:
            raise UnsupportedGenerationError(
                f"token ids {bad} in sequence_bias / bad_words_ids / suppress_tokens / begin_suppress_tokens are "
                f"not in the target's vocabulary [0, {vocab}); tokenize them with the target's tokenizer")


def _penalty(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UnsupportedGenerationError(f"repetition_penalty must be a number > 0, got {value!r} (1.0: off)")
    return float(value)


def _non_negative(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UnsupportedGenerationError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _word(name: str, word: Any) -> _Word:
    if not isinstance(word, (list, tuple)) or not word or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in word):
        raise UnsupportedGenerationError(f"{name}: every entry must be a non-empty list of token ids >= 0, got "
                                         f"{word!r}")
    return tuple(word)


def _sequence_bias(value: Any) -> tuple[tuple[_Word, float], ...]:
    """HF's `{tuple(ids): bias}` in its insertion order (a list of `[ids, bias]` pairs becomes that dict)."""
    if value is None:
        return ()
    pairs = value.items() if isinstance(value, dict) else value
    table: dict[_Word, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not isinstance(pair[1], float):
            raise UnsupportedGenerationError(f"sequence_bias entries must be [token ids, float bias], got {pair!r}")
        table[_word("sequence_bias", pair[0])] = pair[1]
    if not table:
        raise UnsupportedGenerationError("sequence_bias is empty; leave it unset for no bias")
    return tuple(table.items())


def _bad_words(value: Any, eos: tuple[int, ...]) -> tuple[_Word, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not value:
        raise UnsupportedGenerationError(f"bad_words_ids must be a non-empty list of token-id lists, got {value!r}")
    words = [_word("bad_words_ids", w) for w in value]
    return tuple(dict.fromkeys(w for w in words if not (len(w) == 1 and w[0] in eos)))


def _token_list(name: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    return _word(name, value) if len(value) else ()


# -- the history each row's nodes extend ---------------------------------------------------------------------
@dataclass
class TokenHistory:
    """Per row, the `input_ids` HF's processors would see: the padded prompt row, then the emitted tokens.

    `tokens [B, C]` (the last column is a sentinel that writes past the room land in; never read),
    `length [B]` tokens in use, `prompt_length [B]` the padded prompt width (HF's `input_ids_seq_length`, the
    same for every row), `ignore [B]` leading positions the repetition penalty skips (left padding: HF passes
    `prompt_ignore_length`).
    """

    tokens: torch.Tensor
    length: torch.Tensor
    prompt_length: torch.Tensor
    ignore: torch.Tensor

    @classmethod
    def start(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: int, room: int) -> TokenHistory:
        """From the caller's padded `input_ids` / `attention_mask` [R, L]; rows R..rows-1 (bucket padding)
        copy row 0; `room` tokens may follow the prompt."""
        real, width = input_ids.shape
        pick = torch.cat([torch.arange(real), torch.zeros(rows - real, dtype=torch.long)]).to(input_ids.device)
        tokens = torch.full((rows, width + room + 1), -1, dtype=torch.long, device=input_ids.device)
        tokens[:, :width] = input_ids.long()[pick]
        ignore = (attention_mask != 0).int().argmax(1)[pick].long()     # HF: index of the first unmasked token
        full = torch.full((rows,), width, dtype=torch.long, device=input_ids.device)
        return cls(tokens=tokens, length=full, prompt_length=full.clone(), ignore=ignore)

    def append(self, new: torch.Tensor, count: torch.Tensor) -> None:
        """Append the first `count [B]` of `new [B, T]` to each row, in place (count 0: the row is unchanged)."""
        cols = torch.arange(new.shape[1], device=new.device)
        keep = cols < count[:, None]
        sentinel = self.tokens.shape[1] - 1
        write = torch.where(keep, self.length[:, None] + cols, sentinel).clamp(max=sentinel)
        self.tokens.scatter_(1, write, new)
        self.length.add_(count).clamp_(max=sentinel)    # the room covers a call: only runaway scratch rows clamp

    def clone(self) -> TokenHistory:
        return TokenHistory(*(t.clone() for t in (self.tokens, self.length, self.prompt_length, self.ignore)))


# -- the sequence of every node ------------------------------------------------------------------------------
def path_tokens(tree) -> torch.Tensor:
    """[B, M, D] the draft tokens at depths 1..D on each node's root path (the node's own last); -1 past its
    depth. `tree`: a `DraftTree` (ancestors [B, M, M], depth, tokens [B, M], max_depth D)."""
    depths = torch.arange(1, tree.max_depth + 1, device=tree.tokens.device)
    at_depth = tree.ancestors[:, :, None, :] & (tree.depth[:, None, None, :] == depths[:, None])   # [B, M, D, M]
    index = at_depth.long().argmax(-1)                                                              # [B, M, D]
    rows, nodes = tree.tokens.shape
    tokens = tree.tokens[:, None, :].expand(rows, nodes, nodes).gather(2, index)
    return torch.where(at_depth.any(-1), tokens, -1)


def node_sequences(history: TokenHistory, tree) -> tuple[torch.Tensor, torch.Tensor]:
    """`seq [B, M, C + D]`: each node's sequence (history, then its path's draft tokens; -1 past its end) and
    `length [B, M]` (HF's `input_ids.shape[-1]` for the step after that node)."""
    length = history.length[:, None] + tree.depth
    rows, nodes = tree.tokens.shape
    if tree.max_depth == 0:
        return history.tokens[:, None, :].expand(rows, nodes, -1), length
    path = path_tokens(tree)                                                  # [B, M, D]
    span = history.tokens.shape[1] + tree.max_depth
    rel = torch.arange(span, device=path.device) - history.length[:, None]    # [B, S] position past the history
    past = torch.nn.functional.pad(history.tokens, (0, tree.max_depth), value=-1)[:, None, :]
    drafted = path.gather(2, rel.clamp(0, tree.max_depth - 1)[:, None, :].expand(rows, nodes, span))
    seq = torch.where(rel[:, None, :] < 0, past, torch.where(rel[:, None, :] < tree.depth[:, :, None], drafted, -1))
    return seq, length


def history_sequences(history: TokenHistory) -> tuple[torch.Tensor, torch.Tensor]:
    """`node_sequences` of one node per row at the root (the prefill's first token, a plain step)."""
    return history.tokens[:, None, :], history.length[:, None]


# -- the processors ---------------------------------------------------------------------------------------------
def process_nodes(scores: torch.Tensor, settings: ProcessorSettings, history: TokenHistory, tree) -> torch.Tensor:
    """HF's processors on `scores [B, M, V]` (float32, one row of scores per tree node), each node from its own
    path; returns the processed `[B, M, V]`."""
    seq, length = node_sequences(history, tree)
    return apply(scores, settings, seq, length, history)


def process_next(scores: torch.Tensor, settings: ProcessorSettings, history: TokenHistory) -> torch.Tensor:
    """HF's processors on `scores [B, V]`, the next token after each row's history."""
    seq, length = history_sequences(history)
    return apply(scores[:, None], settings, seq, length, history)[:, 0]


def apply(scores: torch.Tensor, s: ProcessorSettings, seq: torch.Tensor, length: torch.Tensor,
          history: TokenHistory) -> torch.Tensor:
    """Every configured processor in HF's order. scores [B, M, V]; seq [B, M, S] (-1 past each node's
    `length [B, M]`)."""
    if s.sequence_bias:
        scores = sequence_bias(scores, seq, length, s.sequence_bias)
    if s.repetition_penalty != 1.0:
        scores = repetition_penalty(scores, seq, history.ignore, s.repetition_penalty)
    if s.no_repeat_ngram_size:
        scores = no_repeat_ngram(scores, seq, length, s.no_repeat_ngram_size)
    if s.bad_words_ids:
        scores = sequence_bias(scores, seq, length, tuple((w, -math.inf) for w in s.bad_words_ids))
    if s.min_length:
        scores = block_tokens(scores, s.eos_token_ids, length < s.min_length)
    if s.min_new_tokens:
        scores = block_tokens(scores, s.eos_token_ids, length - history.prompt_length[:, None] < s.min_new_tokens)
    if s.suppress_tokens is not None:
        scores = block_tokens(scores, s.suppress_tokens, torch.ones_like(length, dtype=torch.bool))
    if s.begin_suppress_tokens is not None:
        scores = block_tokens(scores, s.begin_suppress_tokens, length == history.prompt_length[:, None])
    return scores


def block_tokens(scores: torch.Tensor, tokens: tuple[int, ...], when: torch.Tensor) -> torch.Tensor:
    """`tokens` get -inf at the nodes where `when [B, M]` (min_length, min_new_tokens, suppress_tokens)."""
    return torch.where(when[..., None] & _listed(tokens, scores.shape[-1], scores.device), -math.inf, scores)


@functools.lru_cache(maxsize=64)
def _listed(tokens: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    """[V] bool: the vocabulary entries in `tokens` (built once per setting, not every cycle)."""
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    return torch.isin(torch.arange(vocab, device=device), ids)


def repetition_penalty(scores: torch.Tensor, seq: torch.Tensor, ignore: torch.Tensor, penalty: float
                       ) -> torch.Tensor:
    """HF `RepetitionPenaltyLogitsProcessor`: every token in the node's sequence (positions before `ignore [B]`
    skipped, ids past the vocabulary dropped) gets `s * penalty` when negative, `s / penalty` otherwise."""
    vocab = scores.shape[-1]
    counted = (seq >= 0) & (torch.arange(seq.shape[-1], device=seq.device) >= ignore[:, None, None])
    present = _token_mask(seq, counted, vocab)
    return torch.where(present, torch.where(scores < 0, scores * penalty, scores / penalty), scores)


def no_repeat_ngram(scores: torch.Tensor, seq: torch.Tensor, length: torch.Tensor, n: int) -> torch.Tensor:
    """HF `NoRepeatNGramLogitsProcessor`: a token that would complete an n-gram already in the node's sequence
    gets -inf. Window j (tokens j..j+n-1, all inside the sequence) bans its last token when its first n-1 equal
    the sequence's last n-1."""
    tail = length[..., None] - (n - 1) + torch.arange(n - 1, device=seq.device)         # [B, M, n-1]
    prefix = seq.gather(2, tail.clamp(min=0))
    windows = seq.unfold(2, n, 1)                                                        # [B, M, W, n]
    inside = torch.arange(windows.shape[2], device=seq.device) + n <= length[..., None]  # [B, M, W]
    matches = inside & (windows[..., :-1] == prefix[:, :, None, :]).all(-1)
    banned = _token_mask(windows[..., -1], matches, scores.shape[-1])
    return scores.masked_fill(banned, -math.inf)


def sequence_bias(scores: torch.Tensor, seq: torch.Tensor, length: torch.Tensor,
                  table: tuple[tuple[_Word, float], ...]) -> torch.Tensor:
    """HF `SequenceBiasLogitsProcessor` (and `NoBadWordsLogitsProcessor`, whose bias is -inf): one-token words
    always add their bias; a longer word adds it to its last token when the node's sequence ends with the rest.
    The bias is summed in HF's order (one-token biases, then per prefix length an `index_add_`)."""
    single, groups = _bias_tables(table, scores.shape[-1], scores.device)
    bias = torch.zeros_like(scores) + single
    for prefixes, last, biases in groups:                      # a loop over the configured words' lengths only
        size = prefixes.shape[1]
        tail = (length[..., None] - size + torch.arange(size, device=seq.device)).clamp(min=0)   # [B, M, P]
        ends = seq.gather(2, tail)
        match = (ends[:, :, None, :] == prefixes).all(-1) & (length[..., None] >= size)        # [B, M, G]
        bias.index_add_(2, last, torch.where(match, biases, 0.0).to(bias.dtype))
    return scores + bias


@functools.lru_cache(maxsize=64)
def _bias_tables(table: tuple[tuple[_Word, float], ...], vocab: int, device: torch.device):
    """HF's `_prepare_bias_variables`: the one-token bias [V] and, per prefix length (first-seen order),
    (prefixes [G, P], last tokens [G], biases [G])."""
    single = torch.zeros(vocab, dtype=torch.float, device=device)
    ones = [(w[0], b) for w, b in table if len(w) == 1]
    if ones:
        single[[t for t, _ in ones]] = torch.tensor([b for _, b in ones], device=device)
    by_size: dict[int, list[tuple[_Word, float]]] = {}
    for word, b in table:
        if len(word) > 1:
            by_size.setdefault(len(word) - 1, []).append((word, b))
    groups = [(torch.tensor([w[:-1] for w, _ in g], device=device), torch.tensor([w[-1] for w, _ in g], device=device),
               torch.tensor([b for _, b in g], dtype=torch.float, device=device)) for g in by_size.values()]
    return single, groups


def _token_mask(tokens: torch.Tensor, where: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, M, V] bool: the ids of `tokens [B, M, K]` where `where [B, M, K]` (ids outside [0, V) dropped)."""
    ids = torch.where(where & (tokens >= 0) & (tokens < vocab), tokens, vocab)
    mask = torch.zeros(*tokens.shape[:2], vocab + 1, dtype=torch.bool, device=tokens.device)
    return mask.scatter_(2, ids, True)[..., :vocab]
