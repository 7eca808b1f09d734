"""`export_tensorrt`: the target's tree-verify step and the head's draft programs as TensorRT engines, one per
batch bucket, built from ExportedPrograms that are checked first (DESIGN.md §7).

The programs are the ONNX export's (export/programs.py): functional, every KV cache an input that comes back
updated, because a TensorRT engine cannot write its inputs in place. Each is exported with `torch.export` once
per batch bucket at that bucket's static shapes, batch = the bucket and slots = `max_cache_len`, with only the
block length free in `1..max_tokens` (a prefill chunk, a plain step and the tree-verify step are one program;
TensorRT builds the engine for that range, tuned at the tree's size). The eagle31 custom ops are replaced by
their torch references (`eagle31::slot_mask` by the dense mask it stands for, `eagle31::tree_attention` by SDPA
over the visible slots), then the program is decomposed to core ATen, so every op it holds is one that
torch-tensorrt's converter registry converts (`tensorrt_ops.check_ops`, checked on CPU against the pinned
registry; an op that would fall back to PyTorch makes the export fail, naming it).

`OUT/` receives, per program and bucket, `programs/<program>_b<bucket>.pt2` (the checked ExportedProgram,
`torch.export.save`) and, where torch_tensorrt imports and CUDA is present, `engines/<program>_b<bucket>.ep`
(`torch_tensorrt.save`: the ExportedProgram with the TensorRT engine embedded, loaded by `torch.export.load`);
plus `eagle31_tensorrt.json`: inputs and outputs with their shapes, the token range, the op report, the tree,
the capture indices and what was or was not built and why. With `programs_only=True` no engine is built (what a
CPU machine can do: a CUDA machine with TensorRT builds them from the same command).
"""

from __future__ import annotations

import inspect
import json
import platform
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.export import Dim

from eagle_compile.core.tree import TreeShape
from eagle_compile.errors import ExportError, OptionsError
from eagle_compile.export.programs import (
    DraftFuseProgram,
    DraftStepProgram,
    TargetVerifyProgram,
    capture_indices,
    draft_example,
    fuse_example,
    head_dim,
    kv_heads,
    load_head,
    present_names,
    target_example,
    tree_shape,
)
from eagle_compile.export.tensorrt_ops import TORCH_TENSORRT_PIN, check_ops
from eagle_compile.kernels.tree_attention import slot_mask_reference, tree_attention_reference
from eagle_compile.options import parse_options

MANIFEST = "eagle31_tensorrt.json"
FORMAT_VERSION = 1
DEFAULT_BUCKETS = (1, 2, 4, 8)
DEFAULT_MAX_CACHE_LEN = 2048
DEFAULT_MAX_TOKENS = 64
PROGRAMS = ("target", "draft_fuse", "draft")


def export_tensorrt(model: torch.nn.Module, head: Any, out: str | Path, *, tree: TreeShape | dict | None = None,
                    buckets: tuple[int, ...] = DEFAULT_BUCKETS, max_cache_len: int = DEFAULT_MAX_CACHE_LEN,
                    max_tokens: int | None = None, programs_only: bool = False) -> dict:
    """Write the checked programs of `model` + `head` per batch bucket to `out`, and their TensorRT engines
    unless `programs_only`; returns the manifest (also `out/eagle31_tensorrt.json`).

    Args:
        tree: as `export_onnx`'s; it sets the size the engines are tuned for (its node count).
        buckets: the batch sizes to build (one engine per program and bucket).
        max_cache_len: KV slots of every cache (static: TensorRT plans the memory).
        max_tokens: longest block one call takes (default: max(64, the tree's node count), at most the slots).
        programs_only: stop after the checked programs (no TensorRT needed).

    Raises:
        ExportError: an op TensorRT would not convert; torch_tensorrt or CUDA missing when engines are asked.
    """
    buckets = parse_options({"batch_buckets": tuple(buckets)}).batch_buckets
    head = load_head(model, head, "export_tensorrt")
    shape, tree_source = tree_shape(model, head, tree)
    max_tokens = _max_tokens(max_tokens, shape, max_cache_len)
    builder = None if programs_only else engine_builder()
    config = model.config.get_text_config()
    capture = capture_indices(head, config.num_hidden_layers)
    dtype = next(model.parameters()).dtype
    out = Path(out)
    (out / "programs").mkdir(parents=True, exist_ok=True)
    entries: dict[str, dict] = {}
    with torch.no_grad():
        for bucket in buckets:
            for name, program, example, signature in _programs(model, head, capture, dtype, bucket,
                                                               max_cache_len, shape.total_tokens):
                ep = export_program(program, example, max_tokens)
                report = check_ops(ep.graph)
                if not report.whole:
                    raise ExportError(f"{name} (batch {bucket}): ops TensorRT {TORCH_TENSORRT_PIN} does not "
                                      f"handle: {sorted({**report.custom, **report.fallback})}; they would run in "
                                      "PyTorch between engines. Report this with the model's architecture.")
                path = out / "programs" / f"{name}_b{bucket}.pt2"
                torch.export.save(ep, str(path))
                entry = entries.setdefault(name, {"inputs": signature[0], "outputs": signature[1], "buckets": {}})
                built = builder.build(ep, example, max_tokens, shape.total_tokens, dtype,
                                      out / "engines" / f"{name}_b{bucket}.ep") if builder else None
                entry["buckets"][str(bucket)] = {"program": str(path.relative_to(out)), "engine": built,
                                                 "ops": report.as_dict()}
    np.save(out / "d2t.npy", head.d2t.cpu().numpy().astype(np.int64))
    manifest = {
        "format": "eagle31-tensorrt", "version": FORMAT_VERSION, "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__, "torch_tensorrt": TORCH_TENSORRT_PIN, "machine": platform.machine(),
        "engines": "built" if builder else ("not asked (programs_only)"),
        "programs": entries, "tokens": {"min": 1, "opt": shape.total_tokens, "max": max_tokens},
        "max_cache_len": max_cache_len, "buckets": {"batch": list(buckets)},
        "target": {"architecture": type(model).__name__, "num_layers": config.num_hidden_layers,
                   "kv_heads": kv_heads(config), "head_dim": head_dim(config),
                   "vocab_size": model.get_output_embeddings().out_features, "hidden_size": config.hidden_size},
        "draft": {"kv_heads": head.config.num_key_value_heads, "head_dim": head.config.head_dim,
                  "hidden_size": head.config.hidden_size, "draft_vocab_size": head.config.draft_vocab_size},
        "capture_indices": list(capture), "tree": {**asdict(shape), "source": tree_source}, "d2t": "d2t.npy",
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _max_tokens(max_tokens: int | None, shape: TreeShape, max_cache_len: int) -> int:
    default = min(max(DEFAULT_MAX_TOKENS, shape.total_tokens), max_cache_len)
    value = default if max_tokens is None else max_tokens
    if isinstance(value, bool) or not isinstance(value, int) or not shape.total_tokens <= value <= max_cache_len:
        raise OptionsError(f"max_tokens={value!r}: give an int from the tree's {shape.total_tokens} nodes to "
                           f"max_cache_len={max_cache_len}")
    return value


def _programs(model, head, capture, dtype, batch: int, slots: int, tokens: int):
    """(name, module, example inputs, (input names, output names)) of each program at one bucket."""
    layers = model.config.get_text_config().num_hidden_layers
    device = next(model.parameters()).device
    block = tokens + 1                    # distinct from `tokens`: export would otherwise tie the two dims
    target = _on(target_example(model, dtype, batch, tokens, block, slots), device)
    draft = _on(draft_example(head, dtype, batch, tokens, block, slots), device)
    yield ("target", TargetVerifyProgram(model, capture).eval(), target,
           (list(target), ["logits", "features", *present_names(layers)]))
    yield ("draft_fuse", DraftFuseProgram(head).eval(), _on(fuse_example(head, dtype, batch, tokens), device),
           (["features"], ["hidden"]))
    yield ("draft", DraftStepProgram(head).eval(), draft, (list(draft), ["logits", "feedback", *present_names(1)]))


def _on(example: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: value.to(device) for name, value in example.items()}


def export_program(program: torch.nn.Module, example: dict[str, torch.Tensor],
                   max_tokens: int) -> torch.export.ExportedProgram:
    """`program` exported at `example`'s static shapes, the block length free in 1..max_tokens (dim 1 of every
    input with a token axis, and the block width of `mask_local`), custom ops replaced by their references,
    decomposed to core ATen."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # torchvision and tracer notes (COMPILE_FACTS.md §6 "Other notes")
        ep = torch.export.export(program, tuple(example.values()),
                                 dynamic_shapes=dynamic_shapes(program, example, max_tokens))
    return ep.run_decompositions(reference_decompositions())


def token_dims(example: dict[str, torch.Tensor], max_tokens: int) -> list[dict | None]:
    """Per input, its dynamic dims: one `tokens` dim (dim 1 of every input with a token axis) and one `block`
    dim (the width of `mask_local`) shared by all inputs; every other dimension static."""
    tokens, block = Dim("tokens", min=1, max=max_tokens), Dim("block", min=1, max=max_tokens)
    return [({1: tokens, 2: block} if name == "mask_local" else {1: tokens}) if name in TOKEN_AXIS else None
            for name in example]


def dynamic_shapes(program: torch.nn.Module, example: dict[str, torch.Tensor], max_tokens: int) -> tuple:
    """torch.export's `dynamic_shapes` of `program`: `token_dims`, the varargs' ones grouped as export wants."""
    dynamic = token_dims(example, max_tokens)
    named = [p for p in inspect.signature(program.forward).parameters.values() if p.kind != p.VAR_POSITIONAL]
    if len(named) < len(dynamic):            # `*past`: export wants the varargs' shapes as one tuple
        dynamic = [*dynamic[:len(named)], tuple(dynamic[len(named):])]
    return tuple(dynamic)


#: the inputs whose dim 1 is the block's tokens
TOKEN_AXIS = ("input_ids", "position_ids", "mask_local", "write_slots", "hidden", "features")


def reference_decompositions() -> dict:
    """Core ATen's decomposition table plus the eagle31 custom ops' torch references."""
    table = torch.export.default_decompositions()
    table[torch.ops.eagle31.slot_mask.default] = slot_mask_reference
    table[torch.ops.eagle31.tree_attention.default] = tree_attention_reference
    return table


def engine_builder() -> EngineBuilder:
    """The TensorRT builder, or an ExportError naming what is missing (torch_tensorrt, its libraries, CUDA)."""
    try:
        import torch_tensorrt
    except Exception as error:     # ImportError, or libnvinfer missing (COMPILE_FACTS.md §7)
        raise ExportError(f"building TensorRT engines needs torch_tensorrt, which does not import here "
                          f"({type(error).__name__}: {error}). On a CUDA machine: pip install "
                          f"'eagle_compile[tensorrt]' (torch-tensorrt=={TORCH_TENSORRT_PIN} and TensorRT's "
                          "libraries from pypi.nvidia.com); or pass programs_only=True (--programs-only) to write "
                          "the checked programs without engines") from error
    if not torch.cuda.is_available():
        raise ExportError("building TensorRT engines needs a CUDA device and none is available; pass "
                          "programs_only=True (--programs-only) to write the checked programs without engines")
    return EngineBuilder(torch_tensorrt)


class EngineBuilder:
    """Builds one engine from a checked ExportedProgram: batch and slots static, the block length a range tuned
    at the tree's size (torch_tensorrt.dynamo.compile, then torch_tensorrt.save as an ExportedProgram).
    Written against torch-tensorrt 2.13's API; never run on our CPU machines (benchmarks/gpu/tensorrt.py runs
    it where torch_tensorrt imports)."""

    def __init__(self, torch_tensorrt) -> None:
        self.trt = torch_tensorrt

    def build(self, ep, example: dict[str, torch.Tensor], max_tokens: int, opt_tokens: int, dtype: torch.dtype,
              path: Path) -> str:
        inputs = [self._input(name, value, max_tokens, opt_tokens) for name, value in example.items()]
        compiled = self.trt.dynamo.compile(ep, arg_inputs=inputs, enabled_precisions={dtype}, min_block_size=1,
                                           require_full_compilation=True, pass_through_build_failures=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.trt.save(compiled, str(path), output_format="exported_program", arg_inputs=list(example.values()),
                      dynamic_shapes=tuple(token_dims(example, max_tokens)))
        return f"{path.parent.name}/{path.name}"

    def _input(self, name: str, value: torch.Tensor, max_tokens: int, opt_tokens: int):
        if name not in TOKEN_AXIS:
            return self.trt.Input(shape=tuple(value.shape), dtype=value.dtype)
        low, opt, high = (list(value.shape) for _ in range(3))
        axes = (1, 2) if name == "mask_local" else (1,)
        for axis in axes:
            low[axis], opt[axis], high[axis] = 1, opt_tokens, max_tokens
        return self.trt.Input(min_shape=tuple(low), opt_shape=tuple(opt), max_shape=tuple(high), dtype=value.dtype)
