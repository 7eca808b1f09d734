"""`EagleOptions`: every knob of the eagle31 backend, in one frozen, validated dataclass.

`torch.compile(model, backend="eagle31", options={...})` hands the dict to the backend untouched (torch does
not validate options of custom backends, COMPILE_FACTS.md §1). We parse it here once: an unknown key or a bad
value raises `OptionsError` naming the valid keys / values. Nothing is silently dropped. The key names
`guard_filter_fn` and `use_aoti` are never used: torch.compile pops them out of the caller's dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from eagle_compile.errors import OptionsError

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_INNER = ("eager", "inductor")
_KERNELS = ("auto", "on", "off")


@dataclass(frozen=True)
class EagleOptions:
    """Options of the eagle31 backend and of `eagle_compile.generate`.

    Tree shape (EAGLE-2 dynamic tree, EAGLE31_SPEC.md §4.3): `depth` draft levels (the longest path holds
    `depth` draft tokens, so an oracle drafter emits `depth + 1` tokens a cycle), `top_k` children per
    expanded node, `total_tokens` tree nodes including the root. Defaults are the official EAGLE ones
    (d=7, k=10, M=60). `chain=k` selects chain drafting of k tokens instead (depth=k, top_k=1, M=k+1).

    Caches are static: `max_cache_len` slots if given, else the prompt + new tokens + tree rounded up to a
    multiple of `cache_len_multiple`, so that calls of similar length reuse the captured graphs.
    `prefill_chunk` is the static number of prompt tokens one prefill forward takes. `inner_backend` runs
    the rewritten graph ("eager": the FX graph as is; "inductor": compile_fx). `step_program=True` captures the
    whole cycle (draft -> verify -> accept -> commit) as one graph and lowers it with the step passes (fused
    eagle31 ops); False runs the cycle as a host loop around the captured target program. `cudagraphs=True`
    captures one CUDA graph per batch bucket around the step and replays it (CUDA only; on other devices the
    statistics say it was not applied). `kernels` decides whether the step passes swap traced code for the
    eagle31 fused ops: "on", "off", or "auto" = on where the Triton kernels run (CUDA, or the interpreter when
    EAGLE31_TRITON_INTERPRET=1); on CPU their torch references are no faster than the traced ops they replace.
    """

    draft: Any = None
    depth: int = 7
    top_k: int = 10
    total_tokens: int = 60
    chain: int | None = None
    batch_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    prefill_chunk: int = 64
    inner_backend: str = "eager"
    step_program: bool = False
    cudagraphs: bool = False
    kernels: str = "auto"
    max_cache_len: int | None = None
    cache_len_multiple: int = 256

    def __post_init__(self) -> None:
        _check_positive_int("depth", self.depth)
        _check_positive_int("top_k", self.top_k)
        _check_positive_int("total_tokens", self.total_tokens)
        _check_positive_int("prefill_chunk", self.prefill_chunk)
        if self.chain is not None:
            _check_positive_int("chain", self.chain)
        if self.total_tokens < 2:
            raise OptionsError(f"total_tokens={self.total_tokens}: a tree needs the root and at least one draft "
                               "token (total_tokens >= 2)")
        buckets = self.batch_buckets
        if (not isinstance(buckets, (tuple, list)) or not buckets
                or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets)
                or list(buckets) != sorted(set(buckets))):
            raise OptionsError(f"batch_buckets={buckets!r}: give a strictly increasing sequence of positive ints, "
                               f"e.g. {DEFAULT_BUCKETS}")
        object.__setattr__(self, "batch_buckets", tuple(buckets))
        if self.kernels not in _KERNELS:
            raise OptionsError(f"kernels={self.kernels!r}; valid values: {list(_KERNELS)}")
        if self.inner_backend not in _INNER:
            raise OptionsError(f"inner_backend={self.inner_backend!r}; valid values: {list(_INNER)}")
        _check_positive_int("cache_len_multiple", self.cache_len_multiple)
        for flag in ("step_program", "cudagraphs"):
            if not isinstance(getattr(self, flag), bool):
                raise OptionsError(f"{flag}={getattr(self, flag)!r}: expected True or False")
        if self.max_cache_len is not None:
            _check_positive_int("max_cache_len", self.max_cache_len)

    # -- derived tree shape ------------------------------------------------------------------------------
    @property
    def tree_depth(self) -> int:
        return self.chain if self.chain is not None else self.depth

    @property
    def tree_top_k(self) -> int:
        return 1 if self.chain is not None else self.top_k

    @property
    def tree_tokens(self) -> int:
        return self.chain + 1 if self.chain is not None else self.total_tokens

    def replace(self, **changes: Any) -> EagleOptions:
        return parse_options({**self.as_dict(), **changes})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


VALID_KEYS = tuple(f.name for f in fields(EagleOptions))


def parse_options(options: Mapping[str, Any] | EagleOptions | None) -> EagleOptions:
    """Turn the user's `options=` dict into `EagleOptions`; unknown keys raise with the list of valid ones."""
    if options is None:
        return EagleOptions()
    if isinstance(options, EagleOptions):
        return options
    if not isinstance(options, Mapping):
        raise OptionsError(f"options must be a dict (or EagleOptions), got {type(options).__name__}")
    unknown = sorted(set(options) - set(VALID_KEYS))
    if unknown:
        raise OptionsError(f"unknown eagle31 option(s) {unknown}; valid keys: {list(VALID_KEYS)}")
    explicit_tree = {"depth", "top_k", "total_tokens"} & set(options)
    if options.get("chain") is not None and explicit_tree:
        raise OptionsError(f"chain={options['chain']} selects chain drafting; do not also give "
                           f"{sorted(explicit_tree)} (tree options)")
    try:
        return EagleOptions(**dict(options))
    except TypeError as exc:  # pragma: no cover - dataclass signature errors are caught above
        raise OptionsError(str(exc)) from exc


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OptionsError(f"{name}={value!r}: expected a positive int")


__all__ = ["EagleOptions", "parse_options", "VALID_KEYS", "DEFAULT_BUCKETS"]
