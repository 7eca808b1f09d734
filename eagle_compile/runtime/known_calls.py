"""Calls of a captured program that skip dynamo's guards once their shape has been compiled.

Every call of a `torch.compile`d function first evaluates the guards of its cached graphs. For a target program that
is ~4,000 checks (a TENSOR_MATCH per parameter and cache tensor, dict and type checks along the paths to them, 43
Python lambdas): 1.1 ms a token of SmolLM2's 17.7 ms plain decoding step at batch 1, 2 threads (docs/BENCHMARKS.md,
`benchmarks/plain_path.py`'s `+guards` lowering). A decoder calls the same few program shapes thousands of times,
and it knows each call's shape exactly, so after the first call of a shape has compiled, later calls of that shape
run dynamo's transformed code for it directly. This is what vLLM does with its compiled models (it swaps the
compiled bytecode in and dispatches to it itself); torch's own `set_stance(skip_guard_eval_unsafe=True)` is a
process-wide flag that would skip the guards of the user's own compiled functions in other threads too, so it is not
used.

How: `KnownCalls.__call__(key, *args)` runs the compiled function the normal way until a call of `key` compiles a
graph; dynamo's bytecode hook (registered once) hands over the transformed code of that compilation, which is
kept per key with the global state it was compiled under (`GlobalStateGuard`: grad mode, autocast, thread count,
default dtype, ...). A later call of the same key whose global state matches, with no TorchFunctionMode active
and the same default device, calls that code: the same Python dynamo would run after its guards passed, which
reads the model's parameters and the caches from the arguments at call time (a parameter replaced or changed in
place is read as it is now).

What the key must hold: everything that selects a different graph, i.e. every tensor argument's shape and
dtype, and every non-tensor argument dynamo specialises on (None-ness, ints). What the key cannot see is a change
of the model's code path (a module swapped, say by a LoRA wrapper; a config field the forward branches on):
`revalidate()` makes each key's next call run dynamo's full guard check of its entry once (~1 ms), and a
decoder calls it as each batch starts, so such a change between calls is caught there (the call goes through
dynamo, which compiles the new graph); within one batch the model is taken as fixed, as HF's generate takes it.
`EAGLE31_DIRECT_CALLS=0` turns the direct calls off (every call evaluates the guards).
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_pending = threading.local()       # (KnownCalls, key) of the call being compiled in this thread
_hook_lock = threading.Lock()
_hook_handle = None
MAX_STATES = 4                     # compiled codes kept per key (one per global state, e.g. thread count)
#: False: every call evaluates dynamo's guards (EAGLE31_DIRECT_CALLS=0; `guards_every_call` scopes it)
ENABLED = os.environ.get("EAGLE31_DIRECT_CALLS", "1") != "0"


def _bytecode_hook(code: types.CodeType, new_code: types.CodeType) -> None:
    pending = getattr(_pending, "call", None)
    if pending is not None and code is pending[0].code:
        _pending.code = new_code
    return None


def _install_hook() -> None:
    global _hook_handle
    with _hook_lock:
        if _hook_handle is None:
            _hook_handle = torch._dynamo.convert_frame.register_bytecode_hook(_bytecode_hook)


class KnownCalls:
    """`compiled(*args)` for a function `fn` that `torch.compile(fn, fullgraph=True)` made, with dynamo's guard
    evaluation skipped for call keys already compiled (see the module docstring).

    Args:
        fn: the plain function (or bound method) that was compiled; its code object identifies compilations.
        compiled: what `torch.compile(fn, ...)` returned.
    """

    def __init__(self, fn: Callable, compiled: Callable) -> None:
        func = getattr(fn, "__func__", fn)
        self.code = func.__code__
        self.globals = func.__globals__
        self.bound = getattr(fn, "__self__", None)     # a bound method's instance: the code's first argument
        self.compiled = compiled
        self.direct: dict[Hashable, list[Direct]] = {}
        self.direct_calls = 0           # calls that skipped the guards (tests read it)
        self.epoch = 0                  # `revalidate` moves it: each key's next call checks the guards once
        _install_hook()

    def revalidate(self) -> None:
        """The next call of each key evaluates its graph's guards once more (a decoder calls this as each batch
        starts): a model changed between calls (a module swapped, a config field set) is seen there."""
        self.epoch += 1

    def __call__(self, key: Hashable, *args):
        entries = self.direct.get(key, []) if ENABLED else []
        for i, direct in enumerate(entries):
            if not direct.state.check() or direct.device != torch.get_default_device() or _modes_active():
                continue
            if direct.epoch != self.epoch:
                if not self._guards_pass(direct.code, args):
                    del entries[i]                     # another graph is due: dynamo finds or compiles it
                    break
                direct.epoch = self.epoch
            self.direct_calls += 1
            return direct.run(*args) if self.bound is None else direct.run(self.bound, *args)
        previous = getattr(_pending, "call", None), getattr(_pending, "code", None)
        _pending.call, _pending.code = ((self, key) if not _modes_active() else None), None
        try:
            out = self.compiled(*args)
            if _pending.code is not None:      # this call compiled key's graph: keep its code, state as now
                self._record(key, _pending.code)
            return out
        finally:
            _pending.call, _pending.code = previous

    def _record(self, key: Hashable, code: types.CodeType) -> None:
        # The code reads the compiled graph from globals dynamo installed in the module for it, and deletes when
        # its cache entry goes (torch._dynamo.reset(), eviction): the code runs over a copy, taken now, of the
        # globals it names (only those: the module's other `__compiled_fn_*`, other programs' graphs, stay
        # collectable).
        run = types.FunctionType(code, _globals_for(code, self.globals))
        state = torch._C._dynamo.guards.GlobalStateGuard()    # grad mode, autocast, threads, ... of this call
        kept = self.direct.get(key, [])[:MAX_STATES - 1]
        self.direct[key] = [Direct(state, torch.get_default_device(), code, run, self.epoch), *kept]

    def _guards_pass(self, code: types.CodeType, args: tuple) -> bool:
        """Dynamo's full guard check of the cache entry that holds `code`, on these arguments (False when the
        entry is gone)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        values = args if self.bound is None else (self.bound, *args)
        names = self.code.co_varnames[:self.code.co_argcount]
        for entry in _debug_get_cache_entry_list(self.code):
            if entry.code is code:
                return bool(entry.guard_manager.check(dict(zip(names, values, strict=True))))
        return False


@dataclass
class Direct:
    """A key's compiled code under one global state: `run` calls `code`; `epoch` is the last `revalidate` epoch
    in which its guards were checked."""

    state: Any
    device: torch.device
    code: types.CodeType
    run: Callable
    epoch: int


@contextlib.contextmanager
def guards_every_call() -> Iterator[None]:
    """Within this scope every program call evaluates dynamo's guards, as without `KnownCalls` (benchmarks
    measure both ways in one process; not thread-scoped)."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before


def _globals_for(code: types.CodeType, module_globals: dict) -> dict:
    """The entries of `module_globals` that `code` (or a code object nested in it) can read, and the builtins."""
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(const for const in c.co_consts if isinstance(const, types.CodeType))
    kept = {name: module_globals[name] for name in names if name in module_globals}
    kept["__builtins__"] = module_globals.get("__builtins__", __builtins__)
    return kept


def _modes_active() -> bool:
    return torch._C._is_torch_function_mode_enabled() and torch._C._len_torch_function_stack() > 0


def tensor_key(value: Any) -> Hashable:
    """What of one argument selects a graph: a tensor's shape, dtype and device; None; an int or other constant."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device.type)
    return value
