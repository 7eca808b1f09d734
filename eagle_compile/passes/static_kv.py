"""static_kv: check that every KV-cache write in the graph is a slot-indexed in-place write to a static buffer.

A step program must have fixed shapes and fixed addresses (CUDA graphs replay pointers): the caches are
preallocated placeholders and every write is `eagle31::kv_write` (or a `scatter_`) at explicit slots
(`runtime/kv_cache.py`, the draft head's KV). A cache that grows by concatenation (HF DynamicCache) would
allocate every step and change shapes: it is refused here with an error naming the fix. The pass rewrites
nothing; its count is the number of verified in-place cache writes.
"""

from __future__ import annotations

import torch

import eagle_compile.kernels.kv_write  # noqa: F401  (registers torch.ops.eagle31.kv_write)
from eagle_compile.errors import UnsupportedModelError
from eagle_compile.passes.context import PassContext

_INPLACE_WRITES = ("scatter_", "index_copy_", "copy_")


def static_kv(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    caches = {n for n in gm.graph.nodes if n.op == "placeholder" and _is_cache_buffer(n)}
    writes = 0
    for node in gm.graph.nodes:
        target = _method_name(node)
        if target in _INPLACE_WRITES and node.args and node.args[0] in caches:
            writes += 1
        elif node.op == "call_function" and node.target in (torch.ops.eagle31.kv_write,
                                                             torch.ops.eagle31.kv_write.default):
            writes += sum(1 for buf in node.args[:2] if buf in caches)
        elif node.op == "call_function" and node.target is torch.cat:
            tensors = node.args[0] if node.args else []
            if any(t in caches for t in tensors if isinstance(t, torch.fx.Node)):
                raise UnsupportedModelError(
                    "a KV cache grows by torch.cat in the captured graph (a dynamic cache): eagle31 needs static "
                    "cache buffers with slot writes; run the target on eagle_compile.runtime.kv_cache.SlotKVCache"
                )
    if writes == 0:
        raise UnsupportedModelError("static_kv found no in-place KV-cache writes in the captured graph")
    ctx.record("static_kv", writes, f"{len(caches)} static cache buffers")
    return gm


def _is_cache_buffer(node: torch.fx.Node) -> bool:
    value = node.meta.get("example_value")
    name = node.target if isinstance(node.target, str) else ""
    return isinstance(value, torch.Tensor) and value.dim() == 4 and ("keys" in name or "values" in name)


def _method_name(node: torch.fx.Node) -> str | None:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", None)
    return None
