"""How a rewritten program runs: as its FX graph, compiled by inductor with settings chosen for our programs, or
through torch-tensorrt on CUDA.

`Lowering` is the inner backend of one program (a target program or a step program): `eager` runs the
rewritten FX graph as is; `inductor` hands it to `compile_fx` with `config_patches`, so the inductor settings
apply to our compilations only and never to the user's own `torch.compile` calls (the global
`torch._inductor.config` is not touched). Freezing needs one more thing at trace time: dynamo must install the
model's parameters as graph attributes rather than graph inputs (`torch._dynamo.config.prepare_freezing`),
which `tracing()` scopes to our programs' calls in the same way. Without it, inductor's freezing and its C++
GEMM templates have no constant weights to work with and silently do nothing.

Presets (`inductor_config` values, COMPILE_FACTS.md §4.1):

* `"default"`: inductor's defaults;
* `"freezing"`: weights folded as constants (prepacked GEMM weights, constant folding);
* `"cpp-gemm"`: freezing + max-autotune over inductor's C++ GEMM templates and ATen (bandwidth-bound small-M
  GEMMs run 1.7-2.4x faster than MKL's on our 2-core CPUs, but they round differently from MKL, so greedy text
  can part from HF eager greedy at near-ties, see the batch-invariance issue).

`tensorrt` (CUDA only; the `tensorrt` extra) hands the graph to torch-tensorrt's dynamo backend, traced through
aot_autograd (`use_distributed_mode_trace`: our programs write their KV caches in place, which torch-tensorrt's
default tracer, `aot_export_joint_simple`, refuses; aot_autograd makes the writes functional and applies them
after the engine), with the eagle31 custom ops run by PyTorch (their Triton kernels) between engines and build
failures raised rather than silently run as the FX graph. Written against torch-tensorrt 2.13's API and not run
on our CPU machines (TensorRT cannot be installed there, COMPILE_FACTS.md §7): benchmarks/gpu/tensorrt.py runs
it where torch_tensorrt imports.

Prefill programs run as FX graphs even under inductor (and tensorrt): their GEMMs (hundreds to thousands of rows) are
compute-bound, where MKL is already at its best, and inductor would spend minutes compiling each chunk size
(measured: one SmolLM2 decode program takes ~150 s to compile and autotune under "cpp-gemm" here). Decode and
verify programs, whose GEMMs have a few rows and are bound by reading the weights, get the chosen lowering.

Compile seconds are recorded per graph (`compiled`), for `eagle_compile.explain`. Inductor keeps its compiled
graphs and autotuning results on disk (`TORCHINDUCTOR_CACHE_DIR`, default `/tmp/torchinductor_<user>`; delete
the folder to clear it), so a later process skips the inductor compile of "default" graphs. In torch 2.13 it
does not for "freezing" and "cpp-gemm" graphs: their prepacked mkldnn weights cannot be pickled, so inductor
bypasses its FX-graph cache ("mkldnn tensors unpickleable") and every process compiles them again (measured in
docs/BENCHMARKS.md); dynamo's capture itself is redone by every process in any case (seconds per graph).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle_compile.errors import OptionsError
from eagle_compile.targets.quantized import QuantizedWeights

PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "freezing": {"freezing": True},
    "cpp-gemm": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"},
}


@dataclass
class Lowering:
    """The inner backend of a program: `backend` "eager", "inductor" (with `config` patches) or "tensorrt"."""

    backend: str = "eager"
    config: dict[str, Any] = field(default_factory=dict)
    reason: str = "inner_backend='eager'"
    numerics: str = "eager"          # "batch_invariant": the batch_invariant pass runs on every program
    numerics_reason: str = "numerics='eager'"
    compiled: list[tuple[str, str, float]] = field(default_factory=list)   # (program kind, how, seconds) per graph

    @property
    def compile_seconds(self) -> float:
        return sum(seconds for _, _, seconds in self.compiled)

    @property
    def freezing(self) -> bool:
        return self.backend == "inductor" and bool(self.config.get("freezing"))

    def describe(self) -> str:
        what = {"eager": "eager (the rewritten FX graph)", "tensorrt": "torch-tensorrt (CUDA)"}.get(
            self.backend, f"inductor {self.config or '{}'}")
        return f"{what}: {self.reason}; numerics {self.numerics}: {self.numerics_reason}"

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list, kind: str = "step") -> Callable:
        """A callable running `gm` (after the passes): the graph itself, or inductor's compilation of it.

        Args:
            kind: "step" (decode, verify, a whole speculative cycle) or "prefill" (runs as its FX graph).
        """
        if self.backend == "eager" or kind == "prefill":
            self.compiled.append((kind, "eager" if self.backend == "eager" else "eager (prefill)", 0.0))
            return direct_calls(gm).forward
        t0 = time.perf_counter()
        if self.backend == "tensorrt":
            compiled = tensorrt_compile(gm, example_inputs)
        else:
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs, config_patches=dict(self.config))
        self.compiled.append((kind, self.backend, time.perf_counter() - t0))
        return compiled

    @contextlib.contextmanager
    def tracing(self, kind: str = "step") -> Iterator[None]:
        """Scope for a call of the compiled program: dynamo's recompile cap raised (`allow_many_programs`), and
        with freezing, dynamo traces parameters as attributes."""
        allow_many_programs()
        if not self.freezing or kind == "prefill":
            yield
            return
        with torch._dynamo.config.patch(prepare_freezing=True):
            yield


def direct_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Call the Python implementations of the per-layer eagle31 ops directly in a graph that runs as FX code
    (the same functions the ops dispatch to, minus the dispatcher's overhead)."""
    from eagle_compile.kernels import eager_calls

    impls = eager_calls()
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in impls:
            node.target = impls[node.target]
            changed = True
    if changed:
        gm.recompile()
    return gm


def eager_lowering() -> Lowering:
    return Lowering()


def make_lowering(inner_backend: str, inductor_config: str | Mapping[str, Any] | None, reason: str) -> Lowering:
    """`Lowering` for options (inner_backend "eager" / "inductor" / "tensorrt", inductor_config a preset name or
    patches)."""
    if inner_backend == "eager":
        return Lowering("eager", {}, reason)
    if inner_backend == "tensorrt":       # EagleOptions refuses an inductor_config beside it
        return Lowering("tensorrt", {}, reason)
    return Lowering("inductor", resolve_inductor_config(inductor_config), reason)


TENSORRT_EXTRA = "pip install 'eagle_compile[tensorrt]' (torch-tensorrt for our torch minor; TensorRT's libraries " \
                 "come from pypi.nvidia.com)"


def check_tensorrt(device: torch.device | str) -> None:
    """Raise OptionsError unless inner_backend="tensorrt" can run programs on `device`: CUDA, torch_tensorrt."""
    kind = torch.device(device).type
    if kind != "cuda":
        raise OptionsError(f"inner_backend='tensorrt' builds TensorRT engines for NVIDIA GPUs; this target is on "
                           f"{kind}: move it to CUDA, or use inner_backend 'auto', 'eager' or 'inductor'")
    try:
        import torch_tensorrt  # noqa: F401  (registers the "tensorrt" dynamo backend)
    except Exception as error:      # ImportError, or libnvinfer missing (COMPILE_FACTS.md §7)
        raise OptionsError(f"inner_backend='tensorrt' needs torch_tensorrt, which does not import here "
                           f"({type(error).__name__}: {error}); {TENSORRT_EXTRA}") from error


def tensorrt_compile(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """torch-tensorrt's dynamo backend over `gm` (see the module docstring for the settings and why)."""
    import torch_tensorrt  # noqa: F401

    dtypes = {t.dtype for t in example_inputs if isinstance(t, torch.Tensor) and t.is_floating_point()}
    options = {"use_distributed_mode_trace": True, "pass_through_build_failures": True, "min_block_size": 1,
               "enabled_precisions": dtypes or {torch.float32},
               "torch_executed_ops": {op.default for op in _custom_ops()}}
    return torch._dynamo.lookup_backend("tensorrt")(gm, example_inputs, options=options)


def _custom_ops() -> list:
    import eagle_compile.kernels  # noqa: F401  (registers torch.ops.eagle31.*)

    ops = torch.ops.eagle31
    return [getattr(ops, name) for name in ("tree_attention", "kv_write", "slot_mask") if hasattr(ops, name)]


def resolve_inductor_config(config: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A preset name or a dict of `torch._inductor.config` keys -> the patches; unknown names/keys raise."""
    if config is None:
        return dict(PRESETS["freezing"])
    if isinstance(config, str):
        if config not in PRESETS:
            raise OptionsError(f"inductor_config={config!r}: not a preset; presets: {sorted(PRESETS)}, or give a "
                               "dict of torch._inductor.config keys")
        return dict(PRESETS[config])
    if not isinstance(config, Mapping):
        raise OptionsError(f"inductor_config must be a preset name or a dict, got {type(config).__name__}")
    import torch._inductor.config as inductor_config

    unknown = sorted(k for k in config if not _is_config_key(inductor_config, k))
    if unknown:
        raise OptionsError(f"inductor_config keys {unknown} are not torch._inductor.config settings")
    return dict(config)


def _is_config_key(module, key: str) -> bool:
    try:
        module.get_config_copy()[key]  # noqa: B018
    except KeyError:
        return False
    return True


#: inner_backend="auto", per (device type, dtype): the fastest setting whose greedy output still equals HF eager
#: greedy on the real-target tests (tests/test_real_target.py), measured with benchmarks/plain_path.py
#: (docs/BENCHMARKS.md). Anything not listed runs eager.
AUTO: dict[tuple[str, torch.dtype], tuple[str, str | None, str]] = {}


def auto_lowering(device: torch.device | str, dtype: torch.dtype) -> Lowering:
    """The `Lowering` inner_backend="auto" picks for programs on `device` computing in `dtype`."""
    key = (torch.device(device).type, dtype)
    if key not in AUTO:
        return Lowering("eager", {}, f"inner_backend='auto': eager for {key[0]} {dtype} (no faster exact setting "
                                     "measured)")
    backend, preset, why = AUTO[key]
    return make_lowering(backend, preset, f"inner_backend='auto' on {key[0]} {dtype}: {why}")


def lowering_for(inner_backend: str, inductor_config: str | Mapping[str, Any] | None,
                 device: torch.device | str, dtype: torch.dtype, numerics: str = "eager",
                 quantized: QuantizedWeights | None = None) -> Lowering:
    """The `Lowering` of eagle31 options `inner_backend` / `inductor_config` / `numerics` for a target on
    `device` computing in `dtype`, whose quantised weights are `quantized` (targets/quantized.py)."""
    if inner_backend == "auto":
        if inductor_config is not None:
            raise OptionsError("inductor_config is given but inner_backend='auto' chooses its own settings; set "
                               "inner_backend='inductor' to use inductor_config")
        lowering = auto_lowering(device, dtype)
    else:
        if inner_backend == "tensorrt":
            check_tensorrt(device)
        shown = f", inductor_config={inductor_config!r}" if inductor_config is not None else ""
        lowering = make_lowering(inner_backend, inductor_config, f"inner_backend={inner_backend!r}{shown}")
    lowering.numerics, lowering.numerics_reason = resolve_numerics(numerics, device, dtype, lowering.backend,
                                                                   quantized)
    return lowering


NUMERICS = ("auto", "batch_invariant", "eager")


def resolve_numerics(numerics: str, device: torch.device | str, dtype: torch.dtype,
                     backend: str = "eager", quantized: QuantizedWeights | None = None) -> tuple[str, str]:
    """(numerics the programs get, why) for the `numerics` option.

    "batch_invariant": the kernels of eagle_compile/kernels/batch_invariant.py (float32 CPU targets; a token's
    logits do not depend on the batch or on how many tokens a forward carries, so speculative output equals the
    plain mode's bit for bit). "eager": the traced ops' own kernels (MKL on CPU), equal to HF eager's rounding.
    "auto": batch_invariant where it runs (float32 on CPU, kernels built, programs run as FX graphs), else eager.
    Not with the inductor `backend`: inductor generates its own code for the norms, tiled per shape, which is not
    proven invariant (the batch-invariant kernels cover the linears and attention; torch's eager norms reduce
    each row by itself). Nor for a target with `quantized` weights: `eagle31::bi_linear` takes plain float
    weights, and dequantising would be another model (targets/quantized.py).
    """
    if numerics not in NUMERICS:
        raise OptionsError(f"numerics={numerics!r}; valid values: {list(NUMERICS)}")
    if numerics == "eager":
        return "eager", "numerics='eager': the traced ops' kernels (HF eager's rounding)"
    if quantized:
        if numerics == "batch_invariant":
            raise OptionsError(f"numerics='batch_invariant' needs plain float32 weights; this target has "
                               f"{quantized.describe()}, whose linears run their library's kernels: use "
                               "numerics='auto' or 'eager' (output still equals the quantised model's own greedy)")
        return "eager", f"numerics='auto': eager, the target has {quantized.describe()} (their own kernels; the " \
                        "batch-invariant kernels take plain float weights)"
    kind = torch.device(device).type
    fits = kind == "cpu" and dtype == torch.float32
    if backend in ("inductor", "tensorrt"):
        if numerics == "batch_invariant":
            raise OptionsError(f"numerics='batch_invariant' needs inner_backend 'eager' or 'auto': {backend} "
                               "compiles the norms its own way per shape, which is not proven batch-invariant")
        return "eager", f"numerics='auto' with {backend}: the traced ops' kernels ({backend}'s norms are not " \
                        "proven batch-invariant)"
    if numerics == "batch_invariant":
        if not fits:
            raise OptionsError(f"numerics='batch_invariant' runs float32 CPU targets; this one is {kind} {dtype} "
                               "(use numerics='eager' or 'auto')")
        from eagle_compile.kernels import batch_invariant

        batch_invariant.load()     # raises BuildError naming the fix
        return "batch_invariant", "numerics='batch_invariant'"
    if not fits:
        return "eager", f"numerics='auto': eager for {kind} {dtype} (the batch-invariant kernels are float32 CPU)"
    from eagle_compile.kernels import batch_invariant

    ok, why = batch_invariant.available()
    if not ok:
        return "eager", f"numerics='auto': eager, the batch-invariant kernels are unavailable ({why})"
    return "batch_invariant", f"numerics='auto' on cpu float32: batch-invariant kernels ({why})"


#: dynamo's process-wide cap on the graphs of one code object. Every TargetProgram (StepProgram) compiles the same
#: method, so the cap counts the graphs of all decoders in a process together (each has its own cache through
#: `isolate_recompiles`, and its own per-instance `recompile_limit`); with the calibration menu a decoder holds
#: several program sizes per bucket, and a process with many decoders (a test session) reaches the default 256.
#: torch 2.13 keeps a config override per thread (a ContextVar), so the cap is raised in the scope of every call
#: (`Lowering.tracing`), in the thread that may compile: a serving worker thread starts with dynamo's defaults.
ACCUMULATED_RECOMPILE_LIMIT = 1 << 14


def allow_many_programs() -> None:
    """Raise dynamo's accumulated recompile cap to `ACCUMULATED_RECOMPILE_LIMIT` (never lowers it)."""
    config = torch._dynamo.config
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, ACCUMULATED_RECOMPILE_LIMIT)
