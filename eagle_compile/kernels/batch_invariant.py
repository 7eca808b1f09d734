"""Batch-invariant float32 CPU kernels: `eagle31::bi_linear` and `eagle31::bi_tree_attention`.

Speculative decoding is lossless only if verifying a token inside a tree of N nodes computes the same logits as
decoding it alone. With MKL (or inductor's autotuned GEMM templates) that fails bit for bit: the GEMM of a
one-row step and the GEMM of an 8-row tree round differently (measured: every row of x[:M] @ W.T differs from
the one-row product for M = 2..64 on SmolLM2's shapes), so greedy decoding can part at a near-tie. These
kernels fix one sequence of floating-point operations per output element, independent of how many tokens the
call carries, the row or tile a token lands in, the thread count and the cache's length
(`cpu/batch_invariant.cpp` states the rules). The `batch_invariant` pass (passes/batch_invariant.py) swaps the
target programs' linears and attention for them under `numerics="batch_invariant"`.

Two copies of weights change only memory traffic, never a bit: `PackedWeights` keeps each linear weight repacked
in 4-column panels (`eagle31::bi_linear_packed`, one contiguous stream per tile instead of four rows; a
one-token SmolLM2 step 1.39x faster at 1 thread and 1.32x at 2, benchmarks/packed_weights.py), or, where the
build has AVX-512, float32 weights in 16-column panels (`eagle31::bi_linear_panels`: vectors across output
columns, the eight lanes of k as eight passes; 2.4-2.6x the 4-column kernel and 2.1-2.2x MKL at 1024 rows, equal
at 1 row in docs/step_overhead/linear_layouts; the ratio depends on the CPU's 512-bit FMA rate: rerun
benchmarks/linear_layouts.py), up to a memory budget; `NarrowWeights` keeps float16 (or
bfloat16) copies of weights whose every value fits (a float16 head run in float32: half the bytes per draft
level). Graphs that run as FX code call `linear`, which picks the packed copy when there is one.

`bi_tree_attention` has two paths with the same bits: one query row at a time (a dot and a horizontal sum per
score: one-token steps and small trees), and on AVX-512 builds a wide path for calls of many queries (prefill
chunks, large trees) with vectors across 16 keys for the scores (K transposed once per call) and across 16 head
dims for the values; `wide_attention_calls` counts the calls that took it.

The same build carries two fused elementwise ops (`cpu/elementwise.cpp`), exact fusions rather than new
numerics: `eagle31::rope` (HF's `q * cos + rotate_half(q) * sin`) and `eagle31::rms_scale` (the tail of HF's
RMSNorm, `weight * (x * rsqrt(variance + eps))`) perform the traced chains' own roundings in one loop, so
passes/fuse_elementwise.py can swap them in without moving a bit.

The C++ sources are compiled on first use with `torch.utils.cpp_extension.load` (g++ and ninja; ~25 s on a
2-core machine), then cached by torch in `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`; delete
it to force a rebuild). The build's name carries the torch version, the instruction set and a digest of the
sources, so a torch upgrade or a kernel change builds afresh into its own folder instead of loading (or
overwriting under a running process) a library compiled from other code; the name is part of `explain`'s
numerics line, so measured calibration costs (keyed by the lowering's description) follow the kernels too.
AVX2+FMA code where the CPU has it, portable C++ otherwise (both batch-invariant; the two round differently
from each other, so compare results on one machine).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).parent / "cpu" / "batch_invariant.cpp"
ELEMENTWISE_SOURCE = Path(__file__).parent / "cpu" / "elementwise.cpp"

torch.library.define("eagle31::bi_linear", "(Tensor input, Tensor weight, Tensor? bias) -> Tensor")
torch.library.define("eagle31::bi_linear_packed", "(Tensor input, Tensor packed, Tensor? bias) -> Tensor")
torch.library.define("eagle31::bi_linear_panels", "(Tensor input, Tensor panels, Tensor? bias) -> Tensor")
torch.library.define("eagle31::rope", "(Tensor x, Tensor cos, Tensor sin) -> Tensor")
torch.library.define("eagle31::rms_scale", "(Tensor x, Tensor variance, Tensor weight, float eps) -> Tensor")
torch.library.define("eagle31::bi_tree_attention",
                     "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor base, Tensor? local, float scale) -> Tensor")


_TREE_ATTENTION: set = set()   # eagle31::tree_attention's packet and overload, filled by kernels/__init__.py


@torch.library.register_fake("eagle31::bi_linear")
def _(input, weight, bias):
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


@torch.library.register_fake("eagle31::bi_linear_packed")
def _(input, packed, bias):
    return input.new_empty((*input.shape[:-1], packed.shape[0] * 4))


@torch.library.register_fake("eagle31::bi_linear_panels")
def _(input, panels, bias):
    return input.new_empty((*input.shape[:-1], panels.shape[0] * 16))


@torch.library.register_fake("eagle31::rope")
def _(x, cos, sin):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("eagle31::rms_scale")
def _(x, variance, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("eagle31::bi_tree_attention")
def _(q, k_cache, v_cache, base, local, scale):
    return torch.empty_like(q)


class BuildError(RuntimeError):
    """The batch-invariant kernels could not be compiled here (no C++ compiler or ninja)."""


def _flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    vector = ["-mavx2", "-mfma", "-mf16c"] if capability in ("AVX2", "AVX512") else []
    vector += ["-mavx512f"] if capability == "AVX512" else []
    return ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", *vector]   # at::parallel_for is OpenMP


def _isa(flags: list[str]) -> str:
    return "avx512" if "-mavx512f" in flags else "avx2" if "-mavx2" in flags else "portable"


def panel_layout() -> bool:
    """Whether float32 weights pack as `bi_linear_panels`' 16-column panels (this build has AVX-512, where a
    vector of 16 output columns doubles the FMA width) rather than `bi_linear_packed`'s 4-column ones."""
    return _isa(_flags()) == "avx512"


@functools.cache
def load() -> str:
    """Build (or load from torch's extension cache) and register the CPU kernels; returns the build's name.

    Raises:
        BuildError: naming what failed and how to fix it.
    """
    from torch.utils import cpp_extension

    _ninja_on_path()
    flags = _flags()
    version = "".join(c if c.isalnum() else "_" for c in torch.__version__)
    sources = [SOURCE, ELEMENTWISE_SOURCE]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()[:10]
    name = f"eagle31_batch_invariant_{_isa(flags)}_torch{version}_{digest}"
    try:
        cpp_extension.load(name=name, sources=[str(path) for path in sources], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], is_python_module=False,
                           verbose=os.environ.get("EAGLE31_BUILD_VERBOSE", "") not in ("", "0"))
    except Exception as e:  # a missing compiler/ninja surfaces as RuntimeError or OSError from cpp_extension
        raise BuildError(f"numerics='batch_invariant' needs its C++ kernels, which did not build here "
                         f"({type(e).__name__}: {e}). Install g++ and ninja (pip install ninja), or use "
                         "numerics='eager'.") from e
    return name


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the one pip installed beside this interpreter counts even when the
    environment is not activated (`.venv/bin/python -m pytest`)."""
    import shutil
    import sysconfig

    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts) is not None:
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with batch-invariant rounding (float32 CPU tensors; the weight may be float16
    or bfloat16, widened exactly: the float32 weight of the same values gives the same bits)."""
    load()
    return torch.ops.eagle31.bi_linear.default(x, weight, bias)


def pack_weight(weight: torch.Tensor, panels: bool | None = None) -> torch.Tensor | None:
    """[N, K] -> the layout `linear` reads fastest here (None when the shape packs in neither):

    - `panels` (default: `panel_layout()`, float32 weights with N a multiple of 16): [N/16, 8, K/8, 16] for
      `bi_linear_panels`, lane l of k (k = 8j + l) of 16 columns side by side;
    - otherwise [N/4, K/8, 4, 8] for `bi_linear_packed`, 4 columns per panel, k in blocks of 8.

    K must be a multiple of 8, N of 4. Both give `bi_linear`'s bits."""
    n, k = weight.shape
    if n % 4 or k % 8:
        return None
    w = weight.detach()
    if (panel_layout() if panels is None else panels) and n % 16 == 0 and w.dtype == torch.float32:
        return w.reshape(n // 16, 16, k // 8, 8).permute(0, 3, 2, 1).contiguous()
    return w.reshape(n // 4, 4, k // 8, 8).permute(0, 2, 1, 3).contiguous()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`bi_linear` from a `pack_weight` copy of either layout (the last dim tells them apart: 16 or 8)."""
    if packed.shape[-1] == 16:
        return torch.ops.eagle31.bi_linear_panels.default(x, packed, bias)
    return torch.ops.eagle31.bi_linear_packed.default(x, packed, bias)


def _default_budget() -> int:
    """Bytes of packed copies kept at most: EAGLE31_PACKED_WEIGHT_BYTES, else a quarter of the machine's memory
    up to 4 GiB (a packed copy doubles the memory of the weights it covers)."""
    if (value := os.environ.get("EAGLE31_PACKED_WEIGHT_BYTES")) is not None:
        return int(value)
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        memory = 16 << 30
    return min(4 << 30, memory // 4)


class PackedWeights:
    """Packed copies (`pack_weight`) of the weights batch-invariant linears read, made on first use and kept per
    weight tensor while it lives; a weight changed in place since (`_version`) is packed again. A one-token
    step reads every weight once from memory, and the packed layout makes SmolLM2's step 1.39x faster at 1 thread
    with identical bits (benchmarks/packed_weights.py; cpu/batch_invariant.cpp), at the cost of a second copy of
    the weights: up to `budget` bytes are packed, weights past it run on `bi_linear` (same bits, slower) and
    `declined` counts them."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = _default_budget() if budget is None else budget
        self.bytes = 0
        self.declined = 0
        self._entries: dict[int, tuple[weakref.ref, int, torch.Tensor | None]] = {}
        self._lock = threading.RLock()     # reentrant: a weakref callback may drop an entry while packing

    def __call__(self, weight: torch.Tensor) -> torch.Tensor | None:
        """`weight`'s packed copy, or None (a shape that does not pack, or past the budget)."""
        if (entry := self._current(weight)) is not None:
            return entry[2]
        with self._lock:                  # a miss (first use, or changed): one thread packs, the count stays right
            if (entry := self._current(weight)) is not None:
                return entry[2]
            self._drop(id(weight))        # a changed weight's stale copy, or nothing
            version = _version(weight)
            size = weight.numel() * weight.element_size()
            packed = pack_weight(weight) if self.bytes + size <= self.budget else None
            if packed is None and weight.shape[0] % 4 == 0 and weight.shape[1] % 8 == 0:
                self.declined += 1
            self.bytes += 0 if packed is None else size
            key = id(weight)
            self._entries[key] = (weakref.ref(weight, lambda _, key=key: self._drop(key)), version, packed)
            return packed

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and entry[2] is not None:
            self.bytes -= entry[2].numel() * entry[2].element_size()

    def clear(self) -> None:
        """Drop every packed copy (they are made again on next use): for a process that keeps models alive it
        no longer runs, such as a test session."""
        for key in list(self._entries):
            self._drop(key)
        self.declined = 0

    def _current(self, weight: torch.Tensor) -> tuple | None:
        """`weight`'s entry if it was made for this tensor as it is now (not a dead tensor's id, not stale)."""
        entry = self._entries.get(id(weight))
        return entry if entry is not None and entry[0]() is weight and entry[1] == _version(weight) else None

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether `weight` (as it is now) has a packed copy here."""
        entry = self._current(weight)
        return entry is not None and entry[2] is not None

    def __len__(self) -> int:
        """How many weights are held packed."""
        return sum(packed is not None for _, _, packed in self._entries.values())


#: the packed copies of every program's batch-invariant linears (one weight is packed once, whoever reads it)
PACKED = PackedWeights()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`bi_linear(x, weight, bias)`, from the weight's packed copy when it has one (the same bits): what graphs
    that run as FX code and the draft's eager forward call (lowering.direct_calls, BatchInvariantMode)."""
    load()
    packed = PACKED(weight) if weight.dim() == 2 and weight.device.type == "cpu" else None
    if packed is None:
        return torch.ops.eagle31.bi_linear.default(x, weight, bias)
    return packed_linear(x, packed, bias)


def bi_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, base: torch.Tensor,
                      local: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`eagle31::tree_attention` (same arguments and visibility) with batch-invariant rounding."""
    load()                      # the op checks the shapes itself (the pass calls it without this wrapper)
    return torch.ops.eagle31.bi_tree_attention.default(q, k_cache, v_cache, base, local, float(scale))


def wide_attention_calls() -> int:
    """How many `bi_tree_attention` calls of this process ran the wide path (AVX-512 builds: vectors across keys
    for many-query calls; the same bits as the one-query path, `cpu/batch_invariant.cpp`): tests read it to
    prove the path they meant to cover ran."""
    load()
    return torch.ops.eagle31.bi_attention_wide_calls()


def available() -> tuple[bool, str]:
    """(whether the kernels run here, why not)."""
    if not hasattr(torch.backends, "cpu"):
        return False, "torch has no CPU backend query"
    try:
        name = load()
    except BuildError as e:
        return False, str(e)
    return True, f"built as {name}"


class NarrowWeights:
    """16-bit copies of float32 weights whose every value is a float16 (else bfloat16) value, made on first use
    and kept per weight tensor: a head shipped in float16 and run in float32 is all such weights. `bi_linear`
    widens a 16-bit weight exactly as it loads it, so the copy gives the same bits in half the memory traffic
    (a draft level is a matrix-vector product per weight: bandwidth-bound). A weight changed in place since
    (its `_version` moved) is checked again; one with a value that fits neither keeps float32."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` itself or its exact 16-bit copy."""
        if weight.dim() != 2 or not _cpu_float32(weight):
            return weight
        entry, version = self._copies.get(id(weight)), _version(weight)
        if entry is None or entry[0] is not weight or entry[1] != version:
            narrow = _exact_narrow(weight.detach())
            entry = (weight, version, weight if narrow is None else narrow)
            self._copies[id(weight)] = entry
        return entry[2]

    def __len__(self) -> int:
        """How many weights are held in 16 bits."""
        return sum(copy.dtype != torch.float32 for _, _, copy in self._copies.values())


def _version(t: torch.Tensor) -> int:
    """The in-place version counter; -1 for an inference-mode tensor, which has none (and cannot be changed in
    place outside inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _exact_narrow(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` in float16 (else bfloat16) when that holds every value exactly; None when neither does."""
    for dtype in (torch.float16, torch.bfloat16):
        narrow = weight.to(dtype)
        if torch.equal(narrow.float(), weight):     # NaN never compares equal: such a weight stays float32
            return narrow
    return None


class BatchInvariantMode(torch.overrides.TorchFunctionMode):
    """Runs eager module code (the draft head's host-loop forward) on the batch-invariant kernels: `F.linear`
    and `eagle31::tree_attention` calls on float32 CPU tensors go to `bi_linear` / `bi_tree_attention`, a
    linear's weight through `weights` (a `NarrowWeights`: the same bits from fewer bytes) when given.
    Captured programs get the same swap from the batch_invariant pass instead. For inference (the kernels have
    no autograd formula)."""

    def __init__(self, weights: NarrowWeights | None = None) -> None:
        super().__init__()
        self.weights = weights

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.linear, torch._C._nn.linear):
            x, weight, bias = _bind(LINEAR_ARGS, args, kwargs)
            if _cpu_float32(x):
                return linear(x, self.weights(weight) if self.weights is not None else weight, bias)
        elif func in _TREE_ATTENTION:
            call = _bind(ATTENTION_ARGS, args, kwargs)
            if _cpu_float32(call[0]):
                return bi_tree_attention(*call)
        return func(*args, **kwargs)


#: argument names of F.linear and of eagle31::tree_attention, in order (what a call may pass by keyword)
LINEAR_ARGS = ("input", "weight", "bias")
ATTENTION_ARGS = ("q", "k_cache", "v_cache", "base", "local", "scale")


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict) -> tuple:
    """Positional arguments of a call given partly by keyword; missing trailing optionals are None."""
    return tuple(args[i] if i < len(args) else kwargs.get(name) for i, name in enumerate(names))


def _cpu_float32(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.float32

