"""The target distribution that verification samples from: Hugging Face's, exactly.

Lossless sampling means every emitted token follows the distribution plain `model.generate(do_sample=True)`
would sample from. That distribution is HF's: logits cast to float32, then `TemperatureLogitsWarper`,
`TopKLogitsWarper`, `TopPLogitsWarper` in that order, then softmax. `process_logits` repeats those warpers op
for op (same ties, `min_tokens_to_keep=1`), `target_probs` adds the cast and the softmax.

HF's logits processors that read the tokens generated so far (repetition penalty, n-gram blocking, bad words,
sequence bias, min length / min new tokens, suppressed tokens) run before the warpers, per tree node from its
own path (`runtime/logits_processors.py`, settings in `SamplingParams.processors`). Any other generation
setting that would change the distribution (min-p, typical-p, beams, encoder penalties, ...) is refused by
`SamplingParams.from_generation_config` with `UnsupportedGenerationError`; it is never silently ignored,
because the output would then differ from what the user asked for.

Everything here is shape-static and free of host synchronisation: the only branches are on Python values, never
on tensor values. A program that runs many times (a step, a captured step program, a CUDA graph) takes the
numbers from `SamplingValues`, 0-dim tensors rewritten in place before each call, so one program serves every
setting of the same `SamplingParams.program_key`: whether it samples, whether top-p filters, and the top-k bucket
(`torch.topk` needs a static k: the program takes the top `top_k_bucket(k)` values, a power of two, and reads the
k-th among them, the same value HF's `topk(k)[..., -1]` gives). A server with varied temperatures, top-k and
top-p therefore captures a bounded set of programs, not one per setting.

Rows of one batch may each have their own setting (a server's continuous batch): `BatchSampling` holds one
`SamplingParams` per row, and its programs read `RowSamplingValues`, one number per row ([B] tensors), so a row
samples with its own temperature / top-k / top-p and a greedy row takes the point mass on its argmax
(`verify_sample` then accepts only argmax tokens and draws the argmax as bonus: the row's greedy tokens exactly). A
batch whose rows share one setting is that `SamplingParams` (`BatchSampling.of`), and runs the programs above
unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eagle_compile.errors import UnsupportedGenerationError
from eagle_compile.runtime.logits_processors import ProcessorSettings

# transformers fills the generation fields left at None with these (transformers 5.x:
# `GenerationConfig._get_default_generation_params`; 4.x had them as constructor defaults). Only the fields
# read here are listed; a test compares them with the installed transformers.
HF_GENERATION_DEFAULTS: dict[str, Any] = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "typical_p": 1.0,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "num_beams": 1,
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "min_length": 0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "remove_invalid_values": False,
}


@dataclass(frozen=True)
class SamplingParams:
    """How the target distribution is formed. Greedy is `do_sample=False` (the other fields are then unused).

    `top_k=0` and `top_p=1.0` disable those filters, as in Hugging Face. `processors`: HF's history-reading
    logits processors, applied greedy or sampling before the warpers (None: none configured).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    processors: ProcessorSettings | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise UnsupportedGenerationError(f"do_sample must be a bool, got {self.do_sample!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise UnsupportedGenerationError(f"temperature must be a number, got {self.temperature!r}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise UnsupportedGenerationError(
                f"temperature must be a finite number > 0, got {self.temperature!r}; for greedy decoding "
                "pass do_sample=False instead of temperature=0"
            )
        object.__setattr__(self, "temperature", float(self.temperature))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UnsupportedGenerationError(
                f"top_k must be an int >= 0 (0 disables top-k filtering), got {self.top_k!r}"
            )
        top_p_is_number = isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool)
        if not (top_p_is_number and 0.0 <= self.top_p <= 1.0):
            raise UnsupportedGenerationError(
                f"top_p must be a number in [0, 1] (1 disables top-p filtering), got {self.top_p!r}"
            )
        object.__setattr__(self, "top_p", float(self.top_p))

    @property
    def program_key(self) -> tuple[bool, int, bool, ProcessorSettings | None]:
        """What changes a sampling program's code: (do_sample, the top-k bucket (0: no top-k), top-p filtering,
        the logits processors); the temperature, top_k within its bucket and top_p are run-time numbers
        (`SamplingValues`). The processors' settings stay Python values baked into the program (one program per
        distinct processor setting: a workload that varies them per call captures one program per value)."""
        if not self.do_sample:
            return (False, 0, False, self.processors)
        return (True, top_k_bucket(self.top_k), self.top_p < 1.0, self.processors)

    def new_values(self, device: torch.device | str) -> SamplingValues:
        """The run-time numbers of a program of this `program_key` (`load` them before each call)."""
        return SamplingValues(device)

    def structure(self) -> SamplingParams:
        """The one setting that stands for every setting of this `program_key` in a program's code: programs
        are built from it and never read its numbers (a traced value would be guarded, and recompiled per value),
        only `SamplingValues`; the processors are kept as they are."""
        if not self.do_sample:
            return SamplingParams(do_sample=False, processors=self.processors)
        _, bucket, top_p, _ = self.program_key
        return SamplingParams(do_sample=True, top_k=bucket, top_p=0.5 if top_p else 1.0,
                              processors=self.processors)

    @classmethod
    def from_generation_config(cls, generation_config: Any) -> SamplingParams:
        """The sampling parameters of a Hugging Face `GenerationConfig` (or any object with its attributes).

        Fields left at None take transformers' global defaults (`HF_GENERATION_DEFAULTS`: notably `top_k=50`
        when sampling), as `generate` does. Raises `UnsupportedGenerationError` listing every setting that
        would change the target distribution and is not implemented here. Settings that do not change the
        distribution (stops, lengths, `renormalize_logits`, output flags) are left to the caller.
        """
        def get(name: str) -> Any:
            value = getattr(generation_config, name, None)
            return HF_GENERATION_DEFAULTS.get(name) if value is None else value

        problems = _unsupported_settings(get)
        if problems:
            raise UnsupportedGenerationError(
                "speculative decoding cannot honour these generation settings losslessly: "
                + "; ".join(problems)
                + ". Supported: do_sample, temperature, top_k, top_p, repetition_penalty, no_repeat_ngram_size, "
                "bad_words_ids, sequence_bias, min_length, min_new_tokens, suppress_tokens, begin_suppress_tokens "
                "(plus stops and lengths). Remove these settings or decode without eagle_compile."
            )
        processors = ProcessorSettings.from_generation_config(get)
        if not get("do_sample"):
            return cls(do_sample=False, processors=processors)
        return cls(do_sample=True, temperature=get("temperature"), top_k=get("top_k"), top_p=get("top_p"),
                   processors=processors)


def _unsupported_settings(get) -> list[str]:
    """One 'name=value (what it does)' per setting that changes the distribution; empty when all is fine."""
    checks = [
        ("num_beams", lambda v: v > 1, "beam search"),
        ("num_beam_groups", lambda v: v > 1, "group beam search"),
        ("diversity_penalty", lambda v: v != 0.0, "group beam search"),
        ("penalty_alpha", lambda v: v > 0, "contrastive search"),
        ("dola_layers", lambda v: True, "DoLa decoding"),
        ("constraints", lambda v: True, "constrained beam search"),
        ("force_words_ids", lambda v: True, "constrained beam search"),
        ("guidance_scale", lambda v: v != 1, "classifier-free guidance"),
        ("encoder_repetition_penalty", lambda v: v != 1.0,
         "encoder repetition penalty: not implemented per tree node; use repetition_penalty"),
        ("encoder_no_repeat_ngram_size", lambda v: v > 0,
         "encoder n-gram blocking: not implemented per tree node; use no_repeat_ngram_size"),
        ("forced_bos_token_id", lambda v: True, "forced BOS token"),
        ("forced_eos_token_id", lambda v: True, "forced EOS token"),
        ("remove_invalid_values", lambda v: bool(v), "inf/nan logits replaced"),
        ("exponential_decay_length_penalty", lambda v: True, "EOS boosted with length"),
        ("watermarking_config", lambda v: True, "watermarking"),
        ("token_healing", lambda v: bool(v), "token healing rewrites the prompt"),
    ]
    if get("do_sample"):  # HF applies these warpers only when sampling
        checks += [
            ("top_h", lambda v: True, "top-h filtering"),
            ("min_p", lambda v: v > 0, "min-p filtering"),
            ("typical_p", lambda v: v < 1.0, "typical sampling"),
            ("epsilon_cutoff", lambda v: 0.0 < v < 1.0, "epsilon sampling"),
            ("eta_cutoff", lambda v: 0.0 < v < 1.0, "eta sampling"),
        ]
    problems = []
    for name, changes_distribution, what in checks:
        value = get(name)
        if value is not None and changes_distribution(value):
            problems.append(f"{name}={value!r} ({what})")
    return problems


def top_k_bucket(top_k: int) -> int:
    """The static k of a program's `torch.topk` for `top_k` (0: none): the next power of two."""
    return 0 if top_k <= 0 else 1 << (top_k - 1).bit_length()


class SamplingValues:
    """The run-time numbers of a sampling program: 0-dim tensors on the program's device, rewritten in place
    (`load`) before each call, so a captured graph or CUDA graph reads the call's values from the same memory."""

    per_row = False

    def __init__(self, device: torch.device | str) -> None:
        self.temperature = torch.ones((), dtype=torch.float64, device=device)
        self.top_k = torch.zeros((), dtype=torch.long, device=device)
        self.top_p = torch.ones((), dtype=torch.float64, device=device)

    def load(self, params: SamplingParams) -> None:
        self.temperature.fill_(params.temperature)
        self.top_k.fill_(params.top_k)
        self.top_p.fill_(params.top_p)


class RowSamplingValues:
    """`SamplingValues` with one number per row: [B] tensors (`sample`: the row samples; False: greedy). One set
    of tensors per batch size, kept and rewritten in place (`load`), so a program captured for a bucket (or a
    CUDA graph) reads the same memory every call."""

    per_row = True

    def __init__(self, device: torch.device | str) -> None:
        self.device = device
        self._by_rows: dict[int, tuple[torch.Tensor, ...]] = {}

    def load(self, params: BatchSampling) -> None:
        rows = [p if p is not None and p.do_sample else _GREEDY_ROW for p in params.rows]
        tensors = self._by_rows.get(len(rows))
        if tensors is None:
            tensors = self._by_rows[len(rows)] = tuple(
                torch.empty(len(rows), dtype=dtype, device=self.device)
                for dtype in (torch.float64, torch.long, torch.float64, torch.bool))
        self.temperature, self.top_k, self.top_p, self.sample = tensors
        self.temperature.copy_(torch.tensor([p.temperature for p in rows], dtype=torch.float64))
        self.top_k.copy_(torch.tensor([p.top_k for p in rows], dtype=torch.long))
        self.top_p.copy_(torch.tensor([p.top_p for p in rows], dtype=torch.float64))
        self.sample.copy_(torch.tensor([p.do_sample for p in rows], dtype=torch.bool))


def _per_row(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor` [B] shaped to broadcast over `like` [B, ..., V]."""
    return tensor.view(-1, *([1] * (like.dim() - 1)))


_GREEDY_ROW = SamplingParams(do_sample=False)


@dataclass(frozen=True)
class BatchSampling:
    """The settings of a batch whose rows differ: one `SamplingParams` per row (None: a free row, decoded as
    greedy and never read). Build it with `BatchSampling.of`, which returns the one `SamplingParams` when the
    rows agree. Rows must share their logits processors (they are code in the program, not numbers).

    Quacks like `SamplingParams` where programs are chosen and built: `do_sample` (any row samples),
    `processors`, `program_key`, `structure()` (the widest structure of the rows: top-k up to the largest
    bucket, top-p if any row filters) and `new_values` (`RowSamplingValues`)."""

    rows: tuple[SamplingParams | None, ...]

    @staticmethod
    def of(rows: Sequence[SamplingParams | None]) -> SamplingParams | BatchSampling:
        """The sampling of a batch of `rows` settings: a `SamplingParams` when every set row has the same one."""
        distinct = {p for p in rows if p is not None}
        if len(distinct) <= 1:
            return distinct.pop() if distinct else _GREEDY_ROW
        if len({p.processors for p in distinct}) > 1:
            raise UnsupportedGenerationError(
                "rows of one batch have different logits processors (repetition_penalty, bad_words_ids, ...); "
                "they are part of the compiled step, so decode rows with different processors in separate batches")
        return BatchSampling(tuple(rows))

    @property
    def _sampled(self) -> list[SamplingParams]:
        return [p for p in self.rows if p is not None and p.do_sample]

    @property
    def do_sample(self) -> bool:
        return bool(self._sampled)

    @property
    def processors(self) -> ProcessorSettings | None:
        return next(p.processors for p in self.rows if p is not None)

    @property
    def program_key(self) -> tuple:
        """("rows", the structure's key): per-row programs are their own, beside the uniform ones."""
        return ("rows", *self.structure().program_key)

    def structure(self) -> SamplingParams:
        sampled = self._sampled
        if not sampled:
            return SamplingParams(do_sample=False, processors=self.processors)
        bucket = max(top_k_bucket(p.top_k) for p in sampled)
        top_p = any(p.top_p < 1.0 for p in sampled)
        return SamplingParams(do_sample=True, top_k=bucket, top_p=0.5 if top_p else 1.0,
                              processors=self.processors)

    def new_values(self, device: torch.device | str) -> RowSamplingValues:
        return RowSamplingValues(device)


def process_logits(logits: torch.Tensor, params: SamplingParams, values: SamplingValues | None = None
                   ) -> torch.Tensor:
    """Temperature, then top-k, then top-p, exactly as HF's logits warpers; filtered entries become `-inf`.

    Args:
        logits: `[..., V]` in any float dtype; computed in that dtype, as HF does (HF casts to float32 first:
            `target_probs` does that cast).
        params: with `do_sample=False` the logits are returned unchanged (HF applies no warper when greedy).
        values: the numbers as tensors (`SamplingValues`, loaded from a `params` of the same `program_key`):
            the code then depends on `params.program_key` only. Same results: a float32 tensor divided by or
            compared with a 0-dim float64 tensor computes in float32, as with the Python float.
    Returns:
        `[..., V]`, same dtype.
    """
    if not params.do_sample:
        return logits
    if values is not None and values.per_row:
        return _process_rows(logits, params, values)
    if values is not None:
        logits = logits / values.temperature
        if params.top_k > 0:
            logits = _top_k_of_bucket(logits, values.top_k, top_k_bucket(params.top_k))
        if params.top_p < 1.0:
            logits = _top_p(logits, values.top_p)
        return logits
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k > 0:
        logits = _top_k(logits, params.top_k)
    if params.top_p < 1.0:
        logits = _top_p(logits, params.top_p)
    return logits


def _process_rows(logits: torch.Tensor, params: SamplingParams, values: RowSamplingValues) -> torch.Tensor:
    """`process_logits` with one setting per row (`values` [B], `params` the rows' widest structure): each row
    exactly as HF's warpers with its own numbers. The numbers are cast to the logits' dtype first, as a Python
    number is (a [B] float64 tensor would otherwise promote the whole computation to float64); a row without
    top-k (top_k 0) or top-p (top_p 1) keeps its logits as they were."""
    logits = logits / _per_row(values.temperature, logits).to(logits.dtype)
    if params.top_k > 0:
        top_k = _per_row(values.top_k, logits)
        logits = torch.where(top_k > 0, _top_k_of_bucket(logits, top_k, top_k_bucket(params.top_k)), logits)
    if params.top_p < 1.0:
        top_p = _per_row(values.top_p, logits)
        logits = torch.where(top_p < 1.0, _top_p(logits, top_p), logits)
    return logits


def _top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    # HF TopKLogitsWarper: everything strictly below the k-th largest value goes, so ties with it all stay.
    top_k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, -math.inf)


def _top_k_of_bucket(logits: torch.Tensor, top_k: torch.Tensor, bucket: int) -> torch.Tensor:
    # `_top_k` with k a 0-dim tensor <= bucket: the k-th of the top `bucket` values (sorted, ties kept) is the k-th
    # largest value, whatever the bucket
    vocab = logits.shape[-1]
    best = torch.topk(logits, min(bucket, vocab))[0]
    index = (top_k.clamp(max=vocab) - 1).clamp(min=0).expand(*best.shape[:-1], 1)
    return logits.masked_fill(logits < best.gather(-1, index), -math.inf)


def _top_p(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    # HF TopPLogitsWarper: sort ascending, drop the prefix whose cumulative mass is <= 1 - top_p, always keep
    # the largest token (min_tokens_to_keep=1). Same ops as HF so ties resolve identically.
    sorted_logits, sorted_indices = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    limit = 1 - top_p
    if isinstance(limit, torch.Tensor) and limit.dim():        # per row: compared in the logits' dtype, as HF's
        limit = limit.to(cumulative.dtype)                      # Python number is
    sorted_remove = cumulative <= limit
    sorted_remove[..., -1:] = False
    remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
    return logits.masked_fill(remove, -math.inf)


def target_probs(logits: torch.Tensor, params: SamplingParams, values: SamplingValues | None = None
                 ) -> torch.Tensor:
    """The target distribution `[..., V]` that `verify_sample` draws from.

    Computed in float32 like HF `generate` (which casts the logits to float32 before the warpers), or in
    float64 when the logits are float64 (tests). With `do_sample=False` it is the point mass on the argmax
    (first index on ties), so `verify_sample` with greedy parameters accepts what `verify_greedy` accepts.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits = logits.to(dtype)
    if not params.do_sample:
        return _point_mass(logits)
    probs = process_logits(logits, params, values).softmax(dim=-1)
    if values is not None and values.per_row:                  # greedy rows of a mixed batch: their argmax
        probs = torch.where(_per_row(values.sample, probs), probs, _point_mass(logits))
    return probs


def _point_mass(logits: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(logits).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
