"""The target's forward on a `SlotKVCache`, captured by dynamo and rewritten by the eagle31 passes.

This is what verification, chunked prefill and the plain step run: not the eager model with hooks, but the
captured FX graph of `model(input_ids, position_ids, 4-D mask, cache=SlotKVCache, write_slots)` after
`locate_layers` and `tap_features` made the capture-index residual streams extra outputs and `tree_attention`
replaced attention over the dense mask with attention over the live slots (COMPILE_FACTS.md §2.7: fullgraph,
dynamic=False, one graph per static (batch, tokens, slots) shape). The program takes the mask as a `SlotMask`
(base, local); the dense 4-D mask the HF model is handed is built inside the graph by `eagle31::slot_mask` and
is dead code once the pass has run.

Dynamo's generated code expects the graph's original outputs; the lowered callable returns those and hands the
tap outputs to the program through `_last_taps`, which `__call__` collects right after the run.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from eagle_compile.core.masks import SlotMask
from eagle_compile.lowering import Lowering, eager_lowering
from eagle_compile.passes import PassContext, run_passes
from eagle_compile.runtime.known_calls import KnownCalls, tensor_key
from eagle_compile.runtime.kv_cache import SlotKVCache
from eagle_compile.runtime.program_lifetime import WeakBackend, own_code


class TargetProgram:
    """Callable `(input_ids, position_ids, SlotMask, write_slots, cache[, keep]) -> (logits, features [B,T,A*Ht])`.

    Logits are `[B, T, V]`, or with `keep` (`[B, K]` int64 positions per row, HF's ``logits_to_keep``)
    `[B, K, V]`: only those positions go through the lm_head. Prefill needs one position a row, and the lm_head
    over every position of a chunk is a large share of a prefill forward (V = 49,152 for SmolLM2). A call with
    `keep` is its own captured graph, lowered as a prefill program (`eagle_compile.lowering`).
    """

    def __init__(self, model: torch.nn.Module, capture_indices: tuple[int, ...] | None, *,
                 lowering: Lowering | None = None, recompile_limit: int = 64) -> None:
        self.model = model
        self.capture_indices = capture_indices
        self.lowering = lowering or eager_lowering()
        self.contexts: list[PassContext] = []
        self._last_taps: tuple[torch.Tensor, ...] | None = None
        self._kind = "step"                # "prefill" for calls with `keep` (read if the call (re)captures)
        forward = own_code(self._forward)     # this program's graphs live and die with it (program_lifetime.py)
        self._compiled = KnownCalls(forward, torch.compile(
            forward, backend=WeakBackend(self._backend), fullgraph=True, dynamic=False,
            recompile_limit=recompile_limit, isolate_recompiles=True))

    def _forward(self, input_ids, position_ids, base, local, slots: int, write_slots, cache, keep=None):
        kept = {} if keep is None else {"logits_to_keep": keep}
        dtype = cache.layers[0].keys.dtype
        mask = torch.ops.eagle31.slot_mask(base, local, input_ids.shape[1], slots, dtype)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, cache=cache,
                         write_slots=write_slots, use_cache=True, **kept)
        return out.logits

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        ctx = PassContext(capture_indices=self.capture_indices, architecture=type(self.model).__name__,
                          numerics=self.lowering.numerics)
        gm = run_passes(gm, ctx)
        self.contexts.append(ctx)
        self.capture_indices = ctx.capture_indices
        run = self.lowering.compile(gm, example_inputs, self._kind)
        n_out = ctx.num_original_outputs
        program = weakref.ref(self)   # dynamo keeps this function in a module global while its graph is cached

        def split_taps(*args):
            outs = run(*args)
            program()._last_taps = tuple(outs[n_out:])
            return tuple(outs[:n_out])

        return split_taps

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: SlotMask,
                 write_slots: torch.Tensor, cache: SlotKVCache,
                 keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._last_taps, self._kind = None, ("step" if keep is None else "prefill")
        args = (input_ids, position_ids, mask.base, mask.local, mask.slots, write_slots, cache, keep)
        with self.lowering.tracing(self._kind):
            logits = self._compiled(self._call_key(args), *args)
        taps, self._last_taps = self._last_taps, None
        if taps is None:
            raise RuntimeError("the captured target program ran without producing feature taps")
        return logits, torch.cat(taps, dim=-1)

    def revalidate(self) -> None:
        """Each program shape's next call checks dynamo's guards once (`KnownCalls.revalidate`)."""
        self._compiled.revalidate()

    @staticmethod
    def _call_key(args: tuple) -> tuple:
        """What selects this call's graph (`KnownCalls`): the arguments' shapes, dtypes and None-ness, the slot
        count, and the cache's layout (its tensors' shape and dtype, its type)."""
        cache = args[6]
        layer = cache.layers[0].keys
        return (*(tensor_key(a) for a in args[:6]), tensor_key(args[7]), type(cache), len(cache.layers),
                tensor_key(layer))

    @property
    def graphs_captured(self) -> int:
        return len(self.contexts)

