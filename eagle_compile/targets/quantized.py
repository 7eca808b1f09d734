"""Quantised targets: the one place that finds a target's quantised weights and says what the backend does with them.

torchao's weight-only configs (`quantize_(model, Int8WeightOnlyConfig())`, or on CPU
`PrototypeInt4WeightOnlyConfig()`, whose `Int4OpaqueTensor` packs for `aten._weight_int4pack_mm_for_cpu`) replace
each `nn.Linear.weight` by a tensor subclass (`Int8Tensor`, `Int4OpaqueTensor`) whose `F.linear` dispatches to
its own kernel. Dynamo traces through such subclasses (they are traceable wrapper subclasses), so the captured
programs keep calling torchao's kernels and the speculative output equals the quantised model's own greedy output:
verification runs the same quantised linears that `model.generate` runs, only over more tokens.

What the backend cannot do is put those linears on its batch-invariant kernels (`eagle31::bi_linear` takes a
plain float weight: it would have to dequantise, which is a different model). So for a quantised target
`numerics="auto"` resolves to "eager" (torchao's kernels, HF's rounding) with a reason naming what was found, and
`numerics="batch_invariant"` is refused (`eagle_compile.lowering.resolve_numerics`); the batch_invariant pass
itself refuses a subclass weight as a backstop, so a promise of invariance is never silently broken.

bitsandbytes' `Params4bit` / `Int8Params` are `nn.Parameter` subclasses, not wrapper subclasses: they are reported
here too, so numerics falls back to eager for them as well; bitsandbytes 0.50.2's CPU backend traces through the
same programs (the `bnb` extra; tests/targets/test_quantized.py).

`quantize_weight_only` is the two CPU recipes of the pinned torchao (the `quant` extra), in one call, for tests,
benchmarks and users who want the same layouts. Importing torchao 0.18 on a CPU-only torch logs "Failed to load
..._C_mxfp8...so" and "..._C_cutlass_90a.abi3.so": those two libraries hold CUDA kernels (MX-FP8, CUTLASS for
sm90a) linked against libtorch_cuda, which a CPU torch does not have; the weight-only CPU paths never call them
(int8: torchao's Python dequantise-and-linear, int4: torch's own `_weight_int4pack_mm_for_cpu`). transformers
imports torchao whenever it is installed, so `import eagle_compile` filters exactly those lines (and torchao's
deprecated enum registrations with torch's pytree) out of the two loggers (eagle_compile/__init__.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


@dataclass(frozen=True)
class QuantizedWeights:
    """The quantised parameters of a model: `names` (parameter paths) and how many of each tensor type."""

    names: tuple[str, ...] = ()
    types: dict[str, int] = field(default_factory=dict)     # e.g. {"torchao Int8Tensor": 57}

    def __bool__(self) -> bool:
        return bool(self.names)

    def describe(self) -> str:
        if not self.names:
            return "no quantised weights"
        kinds = ", ".join(f"{n} x {kind}" for kind, n in sorted(self.types.items()))
        return f"{len(self.names)} quantised weights ({kinds})"


def find_quantized(model: torch.nn.Module) -> QuantizedWeights:
    """The parameters of `model` that are quantised tensors (tensor subclasses of torchao or bitsandbytes)."""
    names, types = [], Counter()
    for name, param in model.named_parameters(remove_duplicate=True):
        kind = quantized_kind(param)
        if kind is not None:
            names.append(name)
            types[kind] += 1
    return QuantizedWeights(tuple(names), dict(types))


def quantized_kind(tensor: object) -> str | None:
    """"<library> <class>" for a quantised tensor (a torch tensor subclass that is not a plain/fake tensor), else
    None. A FakeTensor or FunctionalTensor of dynamo's tracing is not quantisation; a wrapper subclass is."""
    if not isinstance(tensor, torch.Tensor):
        return None
    cls = type(tensor)
    library = cls.__module__.split(".")[0]
    if is_traceable_wrapper_subclass(tensor):
        return f"{library} {cls.__name__}"
    if library == "bitsandbytes":
        return f"bitsandbytes {cls.__name__}"
    return None


WEIGHT_ONLY = ("int8", "int4")


def import_torchao():
    """torchao (the `quant` extra), or an ImportError that says how to install it."""
    try:
        import torchao
    except ImportError as error:
        raise ImportError("quantised targets need torchao: pip install 'eagle_compile[quant]'") from error
    return torchao


def quantize_weight_only(model: torch.nn.Module, kind: str, *, group_size: int = 128) -> torch.nn.Module:
    """Quantise `model`'s linears in place with torchao weight-only `kind` ("int8": per-row `Int8WeightOnlyConfig`;
    "int4": `PrototypeInt4WeightOnlyConfig`, asymmetric int4 in groups of `group_size` input channels packed for
    torch's CPU int4 kernel). torchao's inductor settings are not applied: they would change every later
    torch.compile of the process, the user's included."""
    import_torchao()
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    if kind == "int8":
        config = Int8WeightOnlyConfig(set_inductor_config=False)
    elif kind == "int4":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        config = PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False)
    else:
        raise ValueError(f"weight-only kind {kind!r}; supported: {list(WEIGHT_ONLY)}")
    quantize_(model, config)
    return model

