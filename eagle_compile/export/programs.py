"""The programs exported to ONNX, written as functional modules: every cache is an input and comes back updated.

Our backend's programs write the KV caches in place (`eagle31::kv_write` into static buffers); ONNX drops such
mutations silently (COMPILE_FACTS.md §6c), so the exported programs take the caches as explicit inputs
`past_key_values.{i}.key/value [B, Hkv, S, hd]` and return `present.{i}.key/value` of the same shape: the past
with the block's new K/V scattered into `write_slots [B, T]`. The layout is the runtime's (docs/INTERNALS.md
"KV caches"): slot = RoPE position of the token in its row, slot S - 1 the sentinel that padding writes, and
what each query sees is the `SlotMask` pair `mask_base [B]`, `mask_local [B, T, W]` (tree ancestors and self;
a causal block is its lower triangle). The math is the backend's: the HF model itself for the target (handed
the dense mask `eagle31::slot_mask` builds, as `TargetProgram` does), and the draft head's own submodules with
`eagle31::tree_attention` for the draft; `onnx_ops.py` translates both ops.

* `TargetVerifyProgram`: tree-verify step, prefill and plain step alike (T is dynamic) ->
  `logits [B, T, V]`, `features [B, T, A*Ht]` (the capture-index residual streams, concatenated in capture order).
* `DraftFuseProgram`: target features `[B, T, A*Ht]` -> draft hidden `[B, T, H]` (`EagleDraftModel.fuse`).
* `DraftStepProgram`: one draft forward -> `logits [B, T, Vd]` over the draft vocabulary, `feedback [B, T, H]`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers.cache_utils import Cache, StaticLayer

from eagle_compile.capture_indices import default_capture_indices, validate_capture_indices
from eagle_compile.core.tree import TreeShape
from eagle_compile.runtime.kv_cache import _write_slots


def past_names(layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def present_names(layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


def scatter_slots(buffer: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`buffer [B, Hkv, S, hd]` with `new [B, Hkv, T, hd]` at slots `slots [B, T]`: a new tensor (ScatterElements),
    never a write into the input."""
    index = slots[:, None, :, None].expand(-1, new.shape[1], -1, new.shape[3])
    return buffer.scatter(2, index, new.to(buffer.dtype))


class _FunctionalSlotLayer(StaticLayer):
    """A `SlotLayer` whose update returns a new buffer instead of writing the old one (`keys` is rebound)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__(max_cache_len=keys.shape[2])
        self.keys, self.values = keys, values
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        slots = _write_slots(kwargs)
        self.keys = scatter_slots(self.keys, slots, key_states)
        self.values = scatter_slots(self.values, slots, value_states)
        return self.keys, self.values


class _FunctionalSlotCache(Cache):
    def __init__(self, past: tuple[torch.Tensor, ...]) -> None:
        super().__init__(layers=[_FunctionalSlotLayer(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)])

    def present(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in (layer.keys, layer.values)]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The HF decoder's `model.layers` (Llama, Qwen2, Qwen3, Mistral, SmolLM)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or getattr(inner, "embed_tokens", None) is None:
        raise TypeError(f"ONNX export needs an HF decoder-only model with model.embed_tokens and model.layers[i] "
                        f"(Llama, Qwen2, Qwen3, Mistral, SmolLM); {type(model).__name__} has neither")
    return layers


class TargetVerifyProgram(nn.Module):
    """`(input_ids [B,T], position_ids [B,T], mask_base [B], mask_local [B,T,W] bool, write_slots [B,T],
    *past) -> (logits [B,T,V], features [B,T,A*Ht], *present)`.

    The features are the capture-index residual streams (capture_indices.py: k = 0 the embeddings, k = i + 1 the
    output of decoder layer i, k = N the last layer's output before the final norm), read by forward hooks while
    the model runs, so no index needs HF's post-norm `hidden_states[N]`."""

    def __init__(self, model: nn.Module, capture_indices: tuple[int, ...]) -> None:
        super().__init__()
        self.model = model
        self.capture_indices = tuple(capture_indices)
        self.layers = decoder_layers(model)

    def forward(self, input_ids, position_ids, mask_base, mask_local, write_slots, *past):
        cache = _FunctionalSlotCache(past)
        mask = torch.ops.eagle31.slot_mask(mask_base, mask_local, input_ids.shape[1], past[0].shape[2],
                                           past[0].dtype)
        streams: dict[int, torch.Tensor] = {}
        hooks = [self.model.model.embed_tokens.register_forward_hook(
            lambda m, args, out: streams.__setitem__(0, out))]
        hooks += [layer.register_forward_hook(lambda m, args, out, k=i + 1: streams.__setitem__(
            k, out if isinstance(out, torch.Tensor) else out[0])) for i, layer in enumerate(self.layers)]
        try:
            logits = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, cache=cache,
                                write_slots=write_slots, use_cache=True).logits
        finally:
            for hook in hooks:
                hook.remove()
        features = torch.cat([streams[k] for k in self.capture_indices], dim=-1)
        return (logits, features, *cache.present())


class DraftFuseProgram(nn.Module):
    """`features [B, T, A*Ht] -> hidden [B, T, H]`: the head's fuse (input_norm, fc_norm, fc)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, features):
        return self.head.fuse(features)


class DraftStepProgram(nn.Module):
    """`(input_ids [B,T], hidden [B,T,H], position_ids [B,T], mask_base [B], mask_local [B,T,W] bool,
    write_slots [B,T], past_key, past_value) -> (logits [B,T,Vd], feedback [B,T,H], present_key, present_value)`.

    `EagleDraftModel.forward` with the KV write made functional: the same submodules in the same order
    (draft/model.py's docstring), attention through `eagle31::tree_attention`."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, input_ids, hidden, position_ids, mask_base, mask_local, write_slots, past_key, past_value):
        head, layer = self.head, self.head.midlayer
        attn = layer.self_attn
        embeds = head.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = head.rotary_emb(hidden, position_ids)
        hidden_n = layer.hidden_norm(hidden)
        residual = hidden_n if layer.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), hidden_n], dim=-1)           # embedding first (§1.3)
        q, k, v = attn.project_qkv(x, cos, sin)
        keys, values = scatter_slots(past_key, write_slots, k), scatter_slots(past_value, write_slots, v)
        out = torch.ops.eagle31.tree_attention(q.to(keys.dtype), keys, values, mask_base, mask_local,
                                               attn.head_dim ** -0.5)
        h = residual + attn.project_out(out.to(q.dtype))
        o = h + layer.mlp(layer.post_attention_layernorm(h))
        normed = head.norm(o)
        feedback = normed if head.config.norm_output else o
        return head.lm_head(normed), feedback, keys, values


# --- what the exports need around the programs: the head, the tree, the capture indices, example inputs ---

#: Example sizes of a traced call: batch, tokens, block width, slots. ONNX traces with every dimension dynamic,
#: so its sizes are all >= 2 and distinct and export specialises none of them (COMPILE_FACTS.md §6b).
EXAMPLE_SIZES = {"batch": 2, "tokens": 3, "block": 5, "slots": 17}


def load_head(model: nn.Module, head, who: str) -> nn.Module:
    """`head` (an `EagleDraftModel` or its checkpoint folder) loaded for `model`, tied to its embedding, in eval."""
    if isinstance(head, (str, Path)):
        from eagle_compile.draft.checkpoint import load_draft

        head = load_draft(head, target=model, dtype=next(model.parameters()).dtype)
    if not hasattr(head, "midlayer") or not hasattr(head, "fuse"):
        raise TypeError(f"{who} exports an EagleDraftModel (or its checkpoint folder), got "
                        f"{type(head).__name__}: other Drafters have no exported program")
    if head.embed_tokens.weight is None:
        head.tie_target_embedding(model)
    return head.eval()


def tree_shape(model: nn.Module, head: nn.Module, tree) -> tuple[TreeShape, str]:
    """(the tree, where it came from): a `TreeShape` as given, or eagle31 tree options resolved as
    `eagle_compile.generate` resolves them (None: the head's tree.json when chosen for this device and dtype)."""
    from eagle_compile.options import parse_options
    from eagle_compile.runtime.generate import _tree_shape

    if isinstance(tree, TreeShape):
        return tree, "given"
    return _tree_shape(model, head, parse_options(tree))


def capture_indices(head: nn.Module, layers: int) -> tuple[int, ...]:
    indices = head.config.capture_indices
    return default_capture_indices(layers) if indices is None else validate_capture_indices(indices, layers)


def kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def mask_example(vocab: int, batch: int, tokens: int, block: int) -> dict[str, torch.Tensor]:
    """Block inputs of a traced call: ids, positions, the `SlotMask` pair (each query sees itself, slot 0 of the
    block and random others) and write slots, rows at different offsets."""
    g = torch.Generator().manual_seed(0)
    local = torch.rand(batch, tokens, block, generator=g) > 0.5
    local[:, :, 0] = True
    base = 4 + 3 * torch.arange(batch)
    return {"input_ids": torch.randint(0, vocab, (batch, tokens), generator=g),
            "position_ids": base[:, None] + torch.arange(tokens), "mask_base": base, "mask_local": local,
            "write_slots": base[:, None] + torch.arange(tokens)}


def target_example(model: nn.Module, dtype: torch.dtype, batch: int, tokens: int, block: int,
                   slots: int) -> dict[str, torch.Tensor]:
    config = model.config.get_text_config()
    cache = (batch, kv_heads(config), slots, head_dim(config))
    past = {name: torch.zeros(cache, dtype=dtype) for name in past_names(config.num_hidden_layers)}
    return {**mask_example(config.vocab_size, batch, tokens, block), **past}


def fuse_example(head: nn.Module, dtype: torch.dtype, batch: int, tokens: int) -> dict[str, torch.Tensor]:
    width = head.config.num_features * head.config.target_hidden_size
    return {"features": torch.zeros(batch, tokens, width, dtype=dtype)}


def draft_example(head: nn.Module, dtype: torch.dtype, batch: int, tokens: int, block: int,
                  slots: int) -> dict[str, torch.Tensor]:
    mask = mask_example(head.config.vocab_size, batch, tokens, block)
    cache = (batch, head.config.num_key_value_heads, slots, head.config.head_dim)
    return {"input_ids": mask.pop("input_ids"),
            "hidden": torch.zeros(batch, tokens, head.config.hidden_size, dtype=dtype),
            **mask, **{name: torch.zeros(cache, dtype=dtype) for name in past_names(1)}}
