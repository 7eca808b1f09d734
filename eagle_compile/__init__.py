"""eagle_compile: EAGLE 3.1 speculative decoding for PyTorch language models, as a torch.compile backend.

    compiled = torch.compile(model, backend="eagle31", options={"draft": "path/to/eagle3.1-head"})
    out = compiled.generate(input_ids, max_new_tokens=256)     # same tokens as model.generate

The public names are imported lazily so that `import eagle_compile` stays cheap.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from eagle_compile.options import EagleOptions  # noqa: F401
    from eagle_compile.runtime.footprint import Footprint, footprint, growth  # noqa: F401
    from eagle_compile.runtime.generate import generate  # noqa: F401
    from eagle_compile.targets import load_default_target  # noqa: F401

_LAZY = {
    "generate": ("eagle_compile.runtime.generate", "generate"),
    "explain": ("eagle_compile.report", "explain"),
    "EagleOptions": ("eagle_compile.options", "EagleOptions"),
    "load_default_target": ("eagle_compile.targets", "load_default_target"),
    "load_draft": ("eagle_compile.draft.checkpoint", "load_draft"),
    "save_draft": ("eagle_compile.draft.checkpoint", "save_draft"),
    "EagleDraftModel": ("eagle_compile.draft.model", "EagleDraftModel"),
    "footprint": ("eagle_compile.runtime.footprint", "footprint"),
    "growth": ("eagle_compile.runtime.footprint", "growth"),
    "Footprint": ("eagle_compile.runtime.footprint", "Footprint"),
}

__all__ = ["__version__", *_LAZY]

#: Import-time messages of torchao 0.18 (the `quant` extra, imported by transformers whenever installed) that are
#: harmless on a CPU-only torch: two libraries of CUDA kernels that cannot load without libtorch_cuda, and
#: torchao's deprecated registration of its enums with torch's pytree (eagle_compile/targets/quantized.py).
_HARMLESS = {"torchao": ("_C_mxfp8", "_C_cutlass_90a"),
             "torch.utils._pytree": ("is an Enum subclass and is now natively supported",)}


def _drop_harmless(record: logging.LogRecord) -> bool:
    return not any(part in record.getMessage() for part in _HARMLESS.get(record.name, ()))


for _name in _HARMLESS:
    logging.getLogger(_name).addFilter(_drop_harmless)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'eagle_compile' has no attribute {name!r}")
