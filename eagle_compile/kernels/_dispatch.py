"""Which implementation of a kernel runs, and why: Triton on CUDA, the torch reference elsewhere.

Triton is an optional dependency and is imported lazily, on the first launch or query, never when
`eagle_compile` is imported. Kernel bodies are plain module-level functions whose `tl` global is bound here on
first use; `kernel(fn, device)` wraps them as a compiled `JITFunction` for CUDA tensors, or as the Triton
interpreter's `InterpretedFunction` when the user asks for the interpreter (`EAGLE31_TRITON_INTERPRET=1`),
which is how CPU CI runs the Triton kernels.

Why not `TRITON_INTERPRET`: that variable only takes effect for functions decorated with `@triton.jit`
after it was set, and `import torch._dynamo` already imports Triton, so it cannot be relied on inside a
torch.compile process. We build `InterpretedFunction` explicitly instead, and the kernels avoid the
`@jit`-wrapped helpers of `triton.language.standard` (`tl.sum`, `tl.max`, `tl.cumsum`, `tl.zeros`), which the
interpreter cannot call unless Triton itself was imported in interpreter mode: they call `tl.reduce` /
`tl.associative_scan` with the standard combine functions, which the interpreter maps to numpy in any
process.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

INTERPRET_ENV = "EAGLE31_TRITON_INTERPRET"

#: Floating dtypes the compute kernels take (they accumulate in fp32). Others run the reference.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

REFERENCE = "reference"
TRITON = "triton"
INTERPRETER = "triton-interpreter"


@dataclass(frozen=True)
class Choice:
    """The implementation a kernel call uses (`impl`: reference | triton | triton-interpreter) and why."""

    impl: str
    reason: str


@functools.cache
def import_triton() -> tuple[ModuleType | None, str]:
    """(the triton module or None, a description): imported once, on demand."""
    try:
        import triton
        import triton.language  # noqa: F401  (binds triton.language)
    except Exception as e:  # ImportError, or a broken install (missing libs) raising something else
        return None, f"triton is not importable ({type(e).__name__}: {e})"
    return triton, f"triton {triton.__version__}"


def interpreter_requested() -> bool:
    return os.environ.get(INTERPRET_ENV, "").strip() not in ("", "0")


def choose(device: torch.device | str, dtype: torch.dtype | None = None,
           dtypes: tuple[torch.dtype, ...] | None = FLOAT_DTYPES) -> Choice:
    """Pick the implementation for tensors on `device` with `dtype` (None: any; `dtypes=None`: any dtype)."""
    device = torch.device(device)
    if dtype is not None and dtypes is not None and dtype not in dtypes:
        return Choice(REFERENCE, f"{dtype} inputs: the Triton kernel takes {_names(dtypes)} "
                                 "(fp32 accumulation); other dtypes run the torch reference")
    if interpreter_requested():
        triton, why = import_triton()
        if triton is None:
            return _degraded(f"{INTERPRET_ENV}=1 asks for the Triton interpreter but {why}; running the "
                             "torch reference")
        return Choice(INTERPRETER, f"{INTERPRET_ENV}=1: the Triton kernel runs through the Triton "
                                   f"interpreter ({why}; slow, meant for tests)")
    if device.type == "cuda":
        triton, why = import_triton()
        if triton is None:
            return _degraded(f"CUDA tensors but {why}; running the torch reference (pip install "
                             "'eagle_compile[triton]')")
        return Choice(TRITON, f"CUDA tensors with {why}")
    if device.type == "cpu":
        return Choice(REFERENCE, f"CPU tensors run the torch reference (set {INTERPRET_ENV}=1 to run the "
                                 "Triton kernels through the Triton interpreter)")
    return Choice(REFERENCE, f"{device.type} tensors: no Triton path, the torch reference runs")


_warned: set[str] = set()


def _degraded(reason: str) -> Choice:
    """A requested fast path that cannot run: warn once per reason (STYLE.md habit 7)."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"eagle_compile kernels: {reason}", RuntimeWarning, stacklevel=3)
    return Choice(REFERENCE, reason)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


_built: dict[tuple[Callable, bool], Any] = {}


def kernel(fn: Callable, interpret: bool) -> Any:
    """`fn` (a module-level kernel body) as a launchable Triton kernel: compiled, or interpreted."""
    key = (fn, interpret)
    if key not in _built:
        triton, why = import_triton()
        if triton is None:
            raise RuntimeError(f"cannot launch the Triton kernel {fn.__name__}: {why}")
        fn.__globals__["tl"] = triton.language
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction
            _built[key] = InterpretedFunction(fn)
        else:
            from triton.runtime.jit import JITFunction
            _built[key] = JITFunction(fn)
    return _built[key]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def dot_in_fp32(dtype: torch.dtype, interpret: bool) -> bool:
    """The interpreter multiplies bf16 bit patterns in `tl.dot` (COMPILE_FACTS.md §5): upcast there only."""
    return interpret and dtype == torch.bfloat16
