"""The `eagle31` torch.compile backend (registered through the `torch_dynamo_backends` entry point).

`torch.compile(model, backend="eagle31", options={...})` works without importing eagle_compile: torch looks the
name up in the entry-point group when `torch.compile` is called, which imports this module.

* `compiled(...)` (the plain forward): dynamo hands us the target's FX graph; `locate_layers` checks that it is a
  decoder we can speculate on (a clear error otherwise) and the graph runs unchanged, so the call still
  returns the target's logits: as its FX graph, or through inductor when `inner_backend="inductor"` is asked
  for explicitly (`inductor_config` applies; "auto" keeps this pass-through eager: our programs, not the
  user's forward, are what the automatic choice is measured on).
* `compiled.generate(...)`: `torch.compile` wraps the model in an `OptimizedModule`, which forwards unknown
  attributes to the original model, so `compiled.generate` would be HF's plain decoding loop. Importing this
  module wraps `OptimizedModule.__getattr__` once: for a module compiled with *this* backend, `generate`
  resolves to `eagle_compile.generate` bound to the original model and to the options given to torch.compile.
  Every other compiled module is untouched. The speculative step itself is then captured by dynamo with the
  same passes (see `runtime/target_program.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.eval_frame import OptimizedModule, innermost_backend

from eagle_compile.errors import OptionsError
from eagle_compile.lowering import check_tensorrt, make_lowering
from eagle_compile.options import EagleOptions, parse_options
from eagle_compile.passes import PassContext, locate_layers

BACKEND_NAME = "eagle31"


def eagle31_backend(gm: torch.fx.GraphModule, example_inputs: list, *, options: dict | None = None,
                    mode: str | None = None) -> Callable:
    """Backend entry: validate the options, check the graph is a decoder, run it (eager or inductor)."""
    opts = _options(options, mode)
    ctx = PassContext()
    locate_layers(gm, ctx)
    backend = opts.inner_backend if opts.inner_backend in ("inductor", "tensorrt") else "eager"
    if backend == "tensorrt":
        check_tensorrt(next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), "cpu"))
    return make_lowering(backend, opts.inductor_config, f"inner_backend={opts.inner_backend!r}").compile(
        gm, example_inputs)


def _options(options: dict | None, mode: str | None) -> EagleOptions:
    if mode not in (None, "default"):
        raise OptionsError(f"mode={mode!r} is not supported by the eagle31 backend; pass options={{...}} "
                           "(torch.compile does not allow mode and options together)")
    return parse_options(options)


def compiled_options(module: Any) -> EagleOptions | None:
    """The eagle31 options of a module returned by torch.compile(..., backend="eagle31"), else None."""
    if not isinstance(module, OptimizedModule):
        return None
    wrapper = innermost_backend(module.dynamo_ctx.callback)
    if getattr(wrapper, "compiler_fn", None) is not eagle31_backend:
        return None
    return parse_options(wrapper.kwargs.get("options"))


def _install_generate_hook() -> None:
    original = OptimizedModule.__getattr__
    if getattr(original, "_eagle31_hook", False):
        return

    def __getattr__(self, name: str):
        if name == "generate":
            opts = compiled_options(self)
            if opts is not None:
                from eagle_compile.runtime.generate import generate

                return functools.partial(generate, self._orig_mod, options=opts)
        return original(self, name)

    __getattr__._eagle31_hook = True
    OptimizedModule.__getattr__ = __getattr__


_install_generate_hook()
