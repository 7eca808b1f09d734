"""Batch-invariant float32 CPU kernels: `eagle31::bi_linear` and `eagle31::bi_tree_attention`.

Speculative decoding is lossless only if verifying a token inside a tree of N nodes computes the same logits as
decoding it alone. With MKL (or inductor's autotuned GEMM templates) that fails bit for bit: the GEMM of a
one-row step and the GEMM of an 8-row tree round differently (measured: every row of x[:M] @ W.T differs from
the one-row product for M = 2..64 on SmolLM2's shapes), so greedy decoding can part at a near-tie. These
kernels fix one sequence of floating-point operations per output element, independent of how many tokens the
call carries, the row or tile a token lands in, the thread count and the cache's length
(`cpu/batch_invariant.cpp` states the rules). The `batch_invariant` pass (passes/batch_invariant.py) swaps the
target programs' linears and attention for them under `numerics="batch_invariant"`.

The C++ source is compiled on first use with `torch.utils.cpp_extension.load` (g++ and ninja; ~25 s on a
2-core machine), then cached by torch in `TORCH_EXTENSIONS_DIR` (default `~/.cache/torch_extensions`; delete
it to force a rebuild). The build's name carries the torch version and the instruction set, so a torch upgrade
builds afresh instead of loading a library compiled against other headers. AVX2+FMA code where the CPU has it,
portable C++ otherwise (both batch-invariant; the two round differently from each other, so compare results on
one machine).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).parent / "cpu" / "batch_invariant.cpp"

torch.library.define("eagle31::bi_linear", "(Tensor input, Tensor weight, Tensor? bias) -> Tensor")
torch.library.define("eagle31::bi_tree_attention",
                     "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor base, Tensor? local, float scale) -> Tensor")


_TREE_ATTENTION: set = set()   # eagle31::tree_attention's packet and overload, filled by kernels/__init__.py


@torch.library.register_fake("eagle31::bi_linear")
def _(input, weight, bias):
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


@torch.library.register_fake("eagle31::bi_tree_attention")
def _(q, k_cache, v_cache, base, local, scale):
    return torch.empty_like(q)


class BuildError(RuntimeError):
    """The batch-invariant kernels could not be compiled here (no C++ compiler or ninja)."""


def _flags() -> list[str]:
    capability = torch.backends.cpu.get_cpu_capability()
    vector = ["-mavx2", "-mfma", "-mf16c"] if capability in ("AVX2", "AVX512") else []
    return ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", *vector]   # at::parallel_for is OpenMP


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
    name = f"eagle31_batch_invariant_{'avx2' if '-mavx2' in flags else 'portable'}_torch{version}"
    try:
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                           is_python_module=False,
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


def bi_tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, base: torch.Tensor,
                      local: torch.Tensor | None, scale: float) -> torch.Tensor:
    """`eagle31::tree_attention` (same arguments and visibility) with batch-invariant rounding."""
    load()                      # the op checks the shapes itself (the pass calls it without this wrapper)
    return torch.ops.eagle31.bi_tree_attention.default(q, k_cache, v_cache, base, local, float(scale))


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
        entry = self._copies.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            narrow = _exact_narrow(weight.detach())
            entry = (weight, weight._version, weight if narrow is None else narrow)
            self._copies[id(weight)] = entry
        return entry[2]

    def __len__(self) -> int:
        """How many weights are held in 16 bits."""
        return sum(copy.dtype != torch.float32 for _, _, copy in self._copies.values())


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
                return bi_linear(x, self.weights(weight) if self.weights is not None else weight, bias)
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

