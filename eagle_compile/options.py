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
from eagle_compile.lowering import NUMERICS, resolve_inductor_config

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: the official EAGLE tree (used when no tree key is given and no tree.json beside the head fits the target)
EAGLE_TREE = {"depth": 7, "top_k": 10, "total_tokens": 60}
TREE_KEYS = ("depth", "top_k", "total_tokens", "chain")
DEFAULT_COPY = 0      # copy-branch nodes with calibration when `copy` is not given (docs/BENCHMARKS.md)
_INNER = ("auto", "eager", "inductor", "tensorrt")
_KERNELS = ("auto", "on", "off")
_CALIBRATE = ("auto", "on", "off")


@dataclass(frozen=True)
class EagleOptions:
    """Options of the eagle31 backend and of `eagle_compile.generate`.

    Tree shape (EAGLE-2 dynamic tree, EAGLE31_SPEC.md §4.3): `depth` draft levels (the longest path holds
    `depth` draft tokens, so an oracle drafter emits `depth + 1` tokens a cycle), `top_k` children per
    expanded node, `total_tokens` tree nodes including the root. `chain=k` selects chain drafting of k tokens
    instead (depth=k, top_k=1, M=k+1). With no tree key at all, the shape comes from the `tree.json` beside the
    head when it was chosen for the target's device kind and dtype (`draft/tree_file.py`), else from the
    official EAGLE defaults (d=7, k=10, M=60); a key left out of a partial shape takes the EAGLE default.
    The statistics and `eagle_compile.explain` say where the shape came from.

    `speculate=False` decodes plainly through the same programs (one target forward per token, no draft work;
    a draft, if given, is not run): the floor speculation is measured against.

    Caches are static: `max_cache_len` slots if given, else the prompt + new tokens + tree rounded up to a
    multiple of `cache_len_multiple`, so that calls of similar length reuse the captured graphs.
    `prefill_chunk` is the largest number of prompt tokens one prefill forward takes (static shapes: a prompt
    is covered by chunks of `prefill_chunk`, `prefill_chunk // 4`, ... down to 16 tokens, so the number of
    captured prefill graphs stays bounded; chunks of 1K+ tokens attend as fast as one causal pass over the
    whole prompt). `prefill_tokens` caps the tokens one prefill forward carries over all its rows (rows x chunk:
    the largest of those sizes within it); None (default) is 1024 on a CPU, where larger forwards run slower
    once their activations leave the last-level cache (`runtime/prefill_plan.py` has the measurements), and no
    cap elsewhere. `inner_backend` runs the rewritten graphs: "eager" (the FX graph as
    is), "inductor" (compile_fx with `inductor_config`: a preset of `eagle_compile.lowering.PRESETS` or a dict
    of `torch._inductor.config` settings, applied to our programs only; default preset "freezing"), "tensorrt"
    (torch-tensorrt's dynamo backend, CUDA only, the `tensorrt` extra: `eagle_compile.lowering`), or "auto"
    (the fastest setting whose greedy output matched HF eager greedy on the real-target tests, per device and
    dtype: `eagle_compile.lowering.auto_lowering`). `step_program=True` captures the
    whole cycle (draft -> verify -> accept -> commit) as one graph and lowers it with the step passes (fused
    eagle31 ops); False runs the cycle as a host loop around the captured target program. `cudagraphs=True`
    captures one CUDA graph per batch bucket around the step and replays it (CUDA only; on other devices the
    statistics say it was not applied). `kernels` decides whether the step passes swap traced code for the
    eagle31 fused ops: "on", "off", or "auto" = on where the Triton kernels run (CUDA, or the interpreter when
    EAGLE31_TRITON_INTERPRET=1); on CPU their torch references are no faster than the traced ops they replace.
    `numerics` decides the rounding: "batch_invariant" (float32 CPU: every linear and attention of every
    program on kernels whose result for a token does not depend on the batch or on how many tokens a forward
    carries, so speculative output equals the plain mode's bit for bit, and HF eager's up to rounding at
    near-ties), "eager" (the traced ops' kernels: HF eager's rounding), or "auto" (batch_invariant where it
    runs, else eager; `eagle_compile.lowering.resolve_numerics`).

    `calibrate` (DESIGN.md §4, `eagle_compile/calibrate/`): "on" chooses every cycle among a menu of programs
    (a plain step, chains of 1, 2 and 4 draft tokens, and the tree above) the one with the most expected tokens
    per unit of measured time, masks rows and nodes not worth drafting, and falls back to plain decoding (with
    probes and backoff) when no tree pays; "off" runs the one fixed tree every cycle; "auto" (default) is "on"
    unless a tree key was given (a tree you chose stays fixed) or `cudagraphs=True`. Costs are measured on the
    device the first time a (device, dtype, target, lowering, batch bucket, context bucket) needs them and
    kept in `calibration_cache` (a directory; default $EAGLE31_CACHE_DIR/costs or
    ~/.cache/eagle_compile/costs; "memory": this process only). `drift_monitors=True` measures, per draft
    depth, the RMS of the fed-back hidden state relative to depth 1, the attention mass on the first positions
    and on draft-generated positions, and the draft's top-1 probability (`draft/drift.py`), into the
    statistics' `drift`; off by default (docs/BENCHMARKS.md has what it costs).

    `copy` (EAGLE 3.1's copy branch for rare tokens, `draft/lookup.py`): the tokens that followed the latest
    earlier occurrence of a row's last 1..`copy_ngram` tokens (prompt and output so far) are proposed as `copy`
    extra tree nodes, a chain from the root, and verified like every other node: copied spans may hold tokens
    outside the draft vocabulary and run deeper than the draft. With a fixed tree the branch is merged into it;
    with calibration the menu gains a copy-only program (no draft levels), weighed each cycle only for rows whose
    lookup found a match. None (default): `DEFAULT_COPY` with calibration, 0 with a fixed tree.
    """

    draft: Any = None
    depth: int | None = None
    top_k: int | None = None
    total_tokens: int | None = None
    chain: int | None = None
    speculate: bool = True
    batch_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    prefill_chunk: int = 4096
    prefill_tokens: int | None = None
    inner_backend: str = "auto"
    inductor_config: Any = None
    step_program: bool = False
    cudagraphs: bool = False
    kernels: str = "auto"
    numerics: str = "auto"
    max_cache_len: int | None = None
    cache_len_multiple: int = 256
    calibrate: str = "auto"
    calibration_cache: str | None = None
    drift_monitors: bool = False
    copy: int | None = None
    copy_ngram: int = 3

    def __post_init__(self) -> None:
        for key in TREE_KEYS:
            if getattr(self, key) is not None:
                _check_positive_int(key, getattr(self, key))
        _check_positive_int("prefill_chunk", self.prefill_chunk)
        if self.prefill_tokens is not None:
            _check_positive_int("prefill_tokens", self.prefill_tokens)
        if self.total_tokens is not None and self.total_tokens < 2:
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
        if self.calibrate not in _CALIBRATE:
            raise OptionsError(f"calibrate={self.calibrate!r}; valid values: {list(_CALIBRATE)}")
        if self.calibrate == "on" and self.cudagraphs:
            raise OptionsError("calibrate='on' with cudagraphs=True: the menu's programs are not CUDA-graphed yet; "
                               "use calibrate='off' (a fixed tree, graphed) or cudagraphs=False")
        if self.calibration_cache is not None and not isinstance(self.calibration_cache, str):
            raise OptionsError(f"calibration_cache={self.calibration_cache!r}: a directory path, or 'memory'")
        if self.numerics not in NUMERICS:
            raise OptionsError(f"numerics={self.numerics!r}; valid values: {list(NUMERICS)}")
        if self.inner_backend not in _INNER:
            raise OptionsError(f"inner_backend={self.inner_backend!r}; valid values: {list(_INNER)}")
        _check_positive_int("cache_len_multiple", self.cache_len_multiple)
        if self.inductor_config is not None:
            if self.inner_backend == "tensorrt":
                raise OptionsError("inductor_config is given with inner_backend='tensorrt'; it sets inductor only")
            resolve_inductor_config(self.inductor_config)
        if self.drift_monitors is True and self.step_program is True:
            raise OptionsError("drift_monitors=True runs in the host-loop step only; use step_program=False")
        for flag in ("step_program", "cudagraphs", "speculate", "drift_monitors"):
            if not isinstance(getattr(self, flag), bool):
                raise OptionsError(f"{flag}={getattr(self, flag)!r}: expected True or False")
        if self.max_cache_len is not None:
            _check_positive_int("max_cache_len", self.max_cache_len)
        if self.copy is not None and (not isinstance(self.copy, int) or isinstance(self.copy, bool)
                                      or self.copy < 0):
            raise OptionsError(f"copy={self.copy!r}: the copy branch's length, an int >= 0 (0: no copy branch; "
                               "None: the default)")
        _check_positive_int("copy_ngram", self.copy_ngram)
        if self.copy and (self.step_program or self.cudagraphs):
            raise OptionsError(f"copy={self.copy} runs in the host-loop step only (the step passes do not match "
                               "a tree with a copy branch yet); use step_program=False and cudagraphs=False, "
                               "or copy=0")

    # -- derived tree shape ------------------------------------------------------------------------------
    @property
    def tree_given(self) -> bool:
        """Whether any tree key was given (then tree.json beside the head is not consulted)."""
        return any(getattr(self, k) is not None for k in TREE_KEYS)

    @property
    def tree_depth(self) -> int:
        return self.chain if self.chain is not None else _or(self.depth, "depth")

    @property
    def tree_top_k(self) -> int:
        return 1 if self.chain is not None else _or(self.top_k, "top_k")

    @property
    def tree_tokens(self) -> int:
        return self.chain + 1 if self.chain is not None else _or(self.total_tokens, "total_tokens")

    @property
    def copy_length(self) -> int:
        """Copy-branch nodes of a fixed tree (calibration: `calibrated_copy`)."""
        return self.copy or 0

    @property
    def calibrated_copy(self) -> int:
        """Copy-branch nodes of the calibration menu's copy-only program (0: none)."""
        if self.copy is None:           # the default, where the copy branch runs (the host-loop step)
            return 0 if self.step_program or self.cudagraphs else DEFAULT_COPY
        return self.copy

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
    explicit_tree = {k for k in ("depth", "top_k", "total_tokens") if options.get(k) is not None}
    if options.get("chain") is not None and explicit_tree:
        raise OptionsError(f"chain={options['chain']} selects chain drafting; do not also give "
                           f"{sorted(explicit_tree)} (tree options)")
    try:
        return EagleOptions(**dict(options))
    except TypeError as exc:  # pragma: no cover - dataclass signature errors are caught above
        raise OptionsError(str(exc)) from exc


def _or(value: int | None, key: str) -> int:
    return EAGLE_TREE[key] if value is None else value


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise OptionsError(f"{name}={value!r}: expected a positive int")


__all__ = ["EagleOptions", "parse_options", "VALID_KEYS", "DEFAULT_BUCKETS", "EAGLE_TREE", "TREE_KEYS", "DEFAULT_COPY"]
