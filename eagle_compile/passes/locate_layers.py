"""locate_layers: find each decoder layer's residual-stream output in a dynamo (Torch IR) graph.

Dynamo keeps `meta["nn_module_stack"]` on every node: `{id: (path, class)}` with paths such as
`L['self'].model.model.layers.3`. The output of decoder layer i is the **last node in graph order whose stack
contains `layers.i`** (COMPILE_FACTS.md §2.4): the residual `add` that closes the layer. The embedding
output (capture index 0) is the last node under `embed_tokens`. Paths differ between dynamo and export, so we
match `layers[.[](i)` at the end of a path and require a `*DecoderLayer` class.
"""

from __future__ import annotations

import re

import torch.fx

from eagle_compile.errors import UnsupportedModelError
from eagle_compile.passes.context import PassContext

_LAYER_PATH = re.compile(r"layers(?:\.|\[['\"]?)(\d+)(?:['\"]?\])?$")
_EMBED_PATH = re.compile(r"embed_tokens(?:['\"]?\])?$")
SUPPORTED = "Llama, Qwen2, Qwen3, Mistral, SmolLM (decoder-only models with `model.layers[i]` decoder layers)"


def locate_layers(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Record decoder-layer outputs in `ctx.layer_outputs` (index i = output of layer i); rewrites nothing."""
    last_in_layer: dict[int, torch.fx.Node] = {}
    embeds: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        for path, cls in stack.values():
            cls_name = getattr(cls, "__name__", str(cls))
            match = _LAYER_PATH.search(path)
            if match and _is_layer_class(cls_name):
                last_in_layer[int(match.group(1))] = node
            elif _EMBED_PATH.search(path):
                embeds.append(node)
    ctx.architecture = ctx.architecture or _architecture(gm)
    if not last_in_layer:
        raise UnsupportedModelError(
            f"eagle31 found no decoder layers in the captured graph of {ctx.architecture}: no node belongs to a "
            f"module path ending in 'layers.<i>' with a *DecoderLayer class. Supported targets: {SUPPORTED}."
        )
    indices = sorted(last_in_layer)
    if indices != list(range(len(indices))):
        raise UnsupportedModelError(
            f"decoder layers of {ctx.architecture} are not numbered 0..N-1 in the captured graph (found {indices}); "
            "eagle31 cannot tell which residual stream is which capture index."
        )
    ctx.layer_outputs = [last_in_layer[i] for i in indices]
    ctx.embedding_output = _embedding_feeding(ctx.layer_outputs[0], embeds)
    ctx.record("locate_layers", len(indices), f"{ctx.architecture}, {len(indices)} decoder layers")
    return gm


def _embedding_feeding(layer0: torch.fx.Node, embeds: list[torch.fx.Node]) -> torch.fx.Node | None:
    """The token-embedding output that layer 0 consumes (a step graph also embeds draft tokens elsewhere)."""
    feeding, todo = set(), [layer0]
    while todo:
        node = todo.pop()
        for arg in node.all_input_nodes:
            if arg not in feeding:
                feeding.add(arg)
                todo.append(arg)
    hits = [n for n in embeds if n in feeding and getattr(n.meta.get("example_value"), "dim", lambda: 0)() == 3]
    return hits[-1] if hits else None


def _is_layer_class(cls_name: str) -> bool:
    return cls_name.endswith("DecoderLayer")


def _architecture(gm: torch.fx.GraphModule) -> str:
    """Class names of the outermost modules in the graph's module stacks (dynamo does not record the root
    module itself; for an HF causal LM this is e.g. `LlamaModel`)."""
    entries = [(path.count("."), getattr(cls, "__name__", str(cls)))
               for node in gm.graph.nodes for path, cls in (node.meta.get("nn_module_stack") or {}).values()]
    if not entries:
        return "a graph with no nn.Module calls"
    top = min(depth for depth, _ in entries)
    return "/".join(sorted({name for depth, name in entries if depth == top}))
