"""What ties a captured program's dynamo state to the program's own life, so that a dropped program (its decoder,
its model) is freed with everything dynamo made for it.

What dynamo keeps would otherwise keep every program ever built:

* the backend: `torch.compile(fn, backend=b)` keeps `b` for the life of the process
  (`torch._dynamo.eval_frame.cached_backends`, cleared only by `torch._dynamo.reset()`), and our backends are
  the programs' own methods (the passes and the lowering run there): `WeakBackend` is kept instead;
* the cache entries: dynamo stores a function's compiled graphs on its code object, and the graphs themselves as
  globals of its module, deleted only when the transformed code dies. All `TargetProgram`s shared the code of
  `TargetProgram._forward`, so their entries piled up there for the process's life, each holding its FX graph
  (after one tiny-model test module: 64 graphs, 26,067 FX nodes, 24,819 fake tensors). `own_code` gives each
  program a copy of the function on a code object of its own;
* the ties back to that code: dynamo's `orig_code_map` holds the original code while its transformed code lives
  (and the cache entry holding the transformed code lives as long as the original: a cycle through C data), and
  `guard_failures` records recompiles per code until `reset()`. When the program goes, `_release` drops the
  code's cache entries and that record, and its entries, transformed code and graphs die with it.

Measured on the test suite before this: one pytest process held every model its tests built, its heap grew by
about 650,000 objects per test module, and every later garbage collection and `footprint` scan slowed with it
(tests/runtime/test_soak.py's soak ran 5 s alone, 59 s late in a worker).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.eval_frame
import torch._dynamo.utils

#: {function name: {id: code}} the live programs' own code objects (`footprint` counts their cache entries).
#: Keyed by id: code objects compare equal by content, and every copy has the same content.
_LIVE: dict[str, weakref.WeakValueDictionary] = {}


def own_code(method: Callable) -> Callable:
    """A copy of the bound method `method` whose code object is its own: torch.compile of the copy keeps its cache
    entries on that object, which lives as long as the method's instance does."""
    func, owner = method.__func__, method.__self__
    code = func.__code__.replace()
    copy = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = func.__kwdefaults__, func.__qualname__
    _LIVE.setdefault(func.__qualname__, weakref.WeakValueDictionary())[id(code)] = code
    weakref.finalize(owner, _release, code)
    return types.MethodType(copy, owner)


def _release(code: types.CodeType) -> None:
    """A dead program's code, released from dynamo: its cache entries (each holds its transformed code, which
    dynamo's `orig_code_map` ties back to `code`: a cycle through C data the garbage collector cannot see) and the
    record of its recompiles' guard failures (`torch._dynamo.utils.guard_failures`, kept until
    `torch._dynamo.reset()`). Nobody can call the code any more, so nothing races with this."""
    torch._dynamo.eval_frame.remove_from_cache(code)
    failures = getattr(torch._dynamo.utils, "guard_failures", None)
    if failures is not None:
        failures.pop(code, None)


def live_codes(qualname: str) -> list[types.CodeType]:
    """The code objects of the live copies `own_code` made of the function named `qualname`."""
    return list(_LIVE.get(qualname, {}).values())


class WeakBackend:
    """`backend(gm, example_inputs)` -> `method.__self__.<method>(gm, example_inputs)`, the instance held weakly
    (a capture only happens inside one of the program's own calls, so it is alive then)."""

    def __init__(self, method: Callable) -> None:
        self._method = weakref.WeakMethod(method)

    def __call__(self, gm: Any, example_inputs: list) -> Callable:
        method = self._method()
        if method is None:
            raise RuntimeError("a captured program's backend ran after its program was freed")
        return method(gm, example_inputs)
