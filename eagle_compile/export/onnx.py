"""`export_onnx`: the tree-verify step of the target and the draft step of the head as ONNX programs, plus a
manifest (DESIGN.md §7).

`OUT/` receives

* `target.onnx`: `TargetVerifyProgram` (export/programs.py), functional KV in optimum's names
  (`past_key_values.{i}.key` in, `present.{i}.key` out), logits and the EAGLE-3 features out;
* `draft_fuse.onnx` and `draft.onnx`: `DraftFuseProgram` and `DraftStepProgram`;
* `d2t.npy`: the draft-to-target vocabulary offsets (`target id = j + d2t[j]`, int64 `[Vd]`);
* `eagle31_onnx.json` (`MANIFEST`): every program's input and output names with their dimension names, the
  capture indices, the tree shape, the batch buckets, the sizes a runtime needs to allocate the caches.

Every dimension that varies at run time is dynamic (`batch`, `tokens`, `block`, `slots`), so one program serves
prefill, the tree-verify step, plain steps, the draft's tree levels and catch-up, at every bucket. Example sizes
are all >= 2 and distinct, so export specialises none of them (COMPILE_FACTS.md §6b). The custom ops the
programs contain are translated by `onnx_ops.TRANSLATIONS`. `eagle_compile.export.onnx_runtime` runs the folder.
"""

from __future__ import annotations

import inspect
import json
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.export import Dim

from eagle_compile.core.tree import TreeShape
from eagle_compile.errors import OptionsError
from eagle_compile.export.onnx_ops import TRANSLATIONS
from eagle_compile.export.programs import (
    EXAMPLE_SIZES,
    DraftFuseProgram,
    DraftStepProgram,
    TargetVerifyProgram,
    capture_indices,
    draft_example,
    fuse_example,
    head_dim,
    kv_heads,
    load_head,
    past_names,
    present_names,
    target_example,
    tree_shape,
)
from eagle_compile.options import DEFAULT_BUCKETS, parse_options

MANIFEST = "eagle31_onnx.json"
FORMAT_VERSION = 1
OPSETS = (18, 19, 20)
_SIZES = tuple(EXAMPLE_SIZES[k] for k in ("batch", "tokens", "block", "slots"))


def export_onnx(model: torch.nn.Module, head: Any, out: str | Path, *, tree: TreeShape | dict | None = None,
                buckets: tuple[int, ...] = DEFAULT_BUCKETS, opset: int = 18, optimize: bool = False) -> dict:
    """Write the ONNX programs of `model` (an HF decoder-only LM) and `head` (an `EagleDraftModel` or its folder)
    to the folder `out`; returns the manifest (also written as `out/eagle31_onnx.json`).

    Args:
        tree: the tree the runtime builds by default: a `TreeShape`, or eagle31 tree options
            (`{"chain": 3}`, `{"depth": .., "top_k": .., "total_tokens": ..}`); None: as
            `eagle_compile.generate` picks it (the head's tree.json when chosen for this device and dtype, else
            EAGLE's defaults). The programs do not depend on it (their token dims are dynamic).
        buckets: batch sizes the runtime pads a batch to (increasing).
        opset: ONNX opset, 18-20 (the range TensorRT and ONNX Runtime both run; 23's native Attention is not used).
        optimize: run onnxscript's graph optimizer on each program. Off by default: on SmolLM2 it took 147 s of
            the target's 298 s export (2 busy CPU cores), and ONNX Runtime applies its own graph optimizations
            (constant folding included) when it loads a program.
    """
    if opset not in OPSETS:
        raise OptionsError(f"opset={opset}: export_onnx writes opsets {OPSETS[0]}-{OPSETS[-1]}")
    buckets = parse_options({"batch_buckets": tuple(buckets)}).batch_buckets
    head = load_head(model, head, "export_onnx")
    shape, tree_source = _tree(model, head, tree)
    config = model.config.get_text_config()
    capture = capture_indices(head, config.num_hidden_layers)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        target = _export(TargetVerifyProgram(model, capture).eval(), target_example(model, dtype, *_SIZES), opset,
                         optimize, out / "target.onnx", **_target_signature(config.num_hidden_layers))
        fuse = _export(DraftFuseProgram(head).eval(), fuse_example(head, dtype, *_SIZES[:2]), opset, optimize,
                       out / "draft_fuse.onnx", inputs={"features": ("batch", "tokens", None)},
                       outputs={"hidden": ("batch", "tokens", None)})
        draft = _export(DraftStepProgram(head).eval(), draft_example(head, dtype, *_SIZES), opset, optimize,
                        out / "draft.onnx", **_draft_signature())
    np.save(out / "d2t.npy", head.d2t.cpu().numpy().astype(np.int64))
    manifest = {
        "format": "eagle31-onnx", "version": FORMAT_VERSION, "opset": opset,
        "dtype": str(dtype).removeprefix("torch."),
        "target": {**target, "architecture": type(model).__name__, "num_layers": config.num_hidden_layers,
                   "kv_heads": kv_heads(config), "head_dim": head_dim(config),
                   "vocab_size": model.get_output_embeddings().out_features, "hidden_size": config.hidden_size,
                   "eos_token_id": getattr(model.generation_config, "eos_token_id", None)},
        "draft_fuse": fuse,
        "draft": {**draft, "kv_heads": head.config.num_key_value_heads, "head_dim": head.config.head_dim,
                  "hidden_size": head.config.hidden_size, "draft_vocab_size": head.config.draft_vocab_size},
        "capture_indices": list(capture), "feature_width": len(capture) * config.hidden_size,
        "tree": {**asdict(shape), "source": tree_source},
        "buckets": {"batch": list(buckets)},
        "d2t": "d2t.npy",
        "kv_layout": "slot = RoPE position of the token in its row; slot S-1 is the sentinel padding writes; "
                     "present = past with the block's K/V scattered to write_slots",
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _export(program: torch.nn.Module, example: dict[str, torch.Tensor], opset: int, optimize: bool, path: Path, *,
            inputs: dict[str, tuple], outputs: dict[str, tuple]) -> dict:
    """Export `program` called with `example` (keyword order = input order) to `path`; returns its manifest
    entry: file name and the dimension names of every input and output (None: a static dimension)."""
    if list(example) != list(inputs):
        raise AssertionError(f"example inputs {list(example)} != signature {list(inputs)}")
    dims: dict[str, Dim] = {}
    dynamic = [{axis: dims.setdefault(name, Dim(name)) for axis, name in enumerate(names) if name}
               for names in inputs.values()]
    named = [p for p in inspect.signature(program.forward).parameters.values() if p.kind != p.VAR_POSITIONAL]
    if len(named) < len(dynamic):             # `*past`: export wants the varargs' shapes as one tuple
        dynamic = [*dynamic[:len(named)], tuple(dynamic[len(named):])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # torchvision, rename_mapping and tracer notes (§6 "Other notes")
        onnx_program = torch.onnx.export(program, tuple(example.values()), dynamic_shapes=tuple(dynamic),
                                         input_names=list(inputs), output_names=list(outputs),
                                         opset_version=opset, dynamo=True, verbose=False, optimize=optimize,
                                         custom_translation_table=TRANSLATIONS)
    onnx_program.save(str(path))
    return {"file": path.name, "inputs": {k: list(v) for k, v in inputs.items()},
            "outputs": {k: list(v) for k, v in outputs.items()}}


def _target_signature(layers: int) -> dict:
    cache = ("batch", None, "slots", None)
    inputs = {"input_ids": ("batch", "tokens"), "position_ids": ("batch", "tokens"), "mask_base": ("batch",),
              "mask_local": ("batch", "tokens", "block"), "write_slots": ("batch", "tokens"),
              **dict.fromkeys(past_names(layers), cache)}
    outputs = {"logits": ("batch", "tokens", None), "features": ("batch", "tokens", None),
               **dict.fromkeys(present_names(layers), cache)}
    return {"inputs": inputs, "outputs": outputs}


def _draft_signature() -> dict:
    cache = ("batch", None, "slots", None)
    inputs = {"input_ids": ("batch", "tokens"), "hidden": ("batch", "tokens", None),
              "position_ids": ("batch", "tokens"), "mask_base": ("batch",),
              "mask_local": ("batch", "tokens", "block"), "write_slots": ("batch", "tokens"),
              **dict.fromkeys(past_names(1), cache)}
    outputs = {"logits": ("batch", "tokens", None), "feedback": ("batch", "tokens", None),
               **dict.fromkeys(present_names(1), cache)}
    return {"inputs": inputs, "outputs": outputs}


def _tree(model, head, tree) -> tuple[TreeShape, str]:
    shape, source = tree_shape(model, head, tree)
    if shape.copy:
        raise OptionsError(f"tree copy={shape.copy}: the ONNX runtime has no copy branch (prompt lookup) yet; "
                           "export a tree without one")
    return shape, source
