"""Speculative greedy decoding over an `export_onnx` folder with onnxruntime: `OnnxEagle`.

Only the forwards run in ONNX Runtime. Everything between them is the backend's own torch code on CPU tensors
that share memory with the numpy arrays ORT reads and returns: the tree builder (`draft/tree.py`), greedy
verification (`core/verify.py`), KV compaction (`core/compaction.py`), the draft's catch-up and the whole cycle
(`runtime/step.SpeculativeStep`), the stops (`runtime/stopping.StopChecker`). The ONNX programs plug in where
the backend has its strategies: `OnnxTarget` is a `TargetForward` (what `TargetProgram` is in the backend),
`OnnxDrafter` a `Drafter`, and `OnnxKVCache` holds each cache as the tensors the next call feeds back as
`past_key_values.*` (functional KV: every call returns `present.*`, which replaces them). So the tokens are the
PyTorch tokens whenever ORT's target logits have the same argmax as PyTorch's (greedy speculative decoding is
lossless: the draft only changes how many tokens a cycle accepts).

Per cycle this is the decoder's loop (runtime/decoder.py): a batch is padded to the smallest bucket that holds
it (padding rows inactive), the prompt is prefilled in one forward (rows from slot 0, their tails writing the
sentinel), the draft is caught up over it, then `SpeculativeStep` cycles run until every row stops.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from eagle_compile.core.compaction import compact_layer
from eagle_compile.core.masks import SlotMask
from eagle_compile.core.tree import TreeShape
from eagle_compile.core.verify import draw_uniforms
from eagle_compile.errors import OptionsError
from eagle_compile.export.onnx import MANIFEST
from eagle_compile.export.programs import past_names
from eagle_compile.runtime.decoder import cache_slots_needed
from eagle_compile.runtime.sampling import SamplingParams
from eagle_compile.runtime.step import SpeculativeStep, StepState, catch_up, fill_draft
from eagle_compile.runtime.stopping import StopChecker


def _session(path: Path, providers: Sequence[str], threads: int | None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=list(providers))


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.detach().numpy())


def mask_feeds(mask: SlotMask, tokens: int) -> dict[str, np.ndarray]:
    """`mask_base [B]`, `mask_local [B, T, W]` of a `SlotMask`; a causal block becomes its lower triangle."""
    local = mask.local
    if local is None:
        local = torch.ones(tokens, tokens, dtype=torch.bool).tril().expand(mask.base.shape[0], tokens, tokens)
    return {"mask_base": _numpy(mask.base), "mask_local": _numpy(local)}


class OnnxKVCache:
    """A slot cache (`runtime/kv_cache.SlotKVCache`'s layout) held as the tensors the next forward feeds back."""

    def __init__(self, layers: int, batch: int, kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype) -> None:
        self.names = past_names(layers)
        self.tensors = [torch.zeros(batch, kv_heads, slots, head_dim, dtype=dtype) for _ in self.names]
        self.slots = slots

    @property
    def sentinel(self) -> int:
        return self.slots - 1

    def feeds(self) -> dict[str, np.ndarray]:
        return {name: _numpy(t) for name, t in zip(self.names, self.tensors, strict=True)}

    def replace(self, present: Sequence[np.ndarray]) -> None:
        """Take a forward's `present.*` outputs (in `past_key_values.*` order) as the cache."""
        if len(present) != len(self.tensors):
            raise RuntimeError(f"the ONNX program returned {len(present)} present tensors, the cache has "
                               f"{len(self.tensors)}")
        self.tensors = [torch.from_numpy(p if p.flags.writeable else p.copy()) for p in present]

    def compact(self, base: torch.Tensor, path: torch.Tensor) -> None:
        """`SlotKVCache.compact`: slot base+j <- slot base+path[j], every layer."""
        for keys, values in zip(self.tensors[0::2], self.tensors[1::2], strict=True):
            compact_layer(keys, values, base, path)


class OnnxTarget:
    """`(input_ids, position_ids, SlotMask, write_slots, cache) -> (logits [B,T,V], features [B,T,A*Ht])`, the
    target-forward strategy `SpeculativeStep` takes, run by `target.onnx`; updates `cache` (an `OnnxKVCache`)."""

    def __init__(self, session) -> None:
        self.session = session

    def __call__(self, input_ids, position_ids, mask: SlotMask, write_slots, cache: OnnxKVCache):
        feeds = {"input_ids": _numpy(input_ids), "position_ids": _numpy(position_ids),
                 **mask_feeds(mask, input_ids.shape[1]), "write_slots": _numpy(write_slots), **cache.feeds()}
        logits, features, *present = self.session.run(None, feeds)
        cache.replace(present)
        return torch.from_numpy(logits), torch.from_numpy(features)


class OnnxDrafter:
    """A `Drafter` (draft/drafter.py) run by `draft_fuse.onnx` and `draft.onnx`. Its head input is the draft
    logits `[.., Vd]` (the program applies the lm_head), which `top_k` turns into log-probs as `EagleDrafter`."""

    def __init__(self, fuse_session, step_session, d2t: torch.Tensor, kv_heads: int, head_dim: int) -> None:
        self.fuse_session, self.step_session = fuse_session, step_session
        self.d2t = d2t
        self.kv_heads, self.head_dim = kv_heads, head_dim

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.shape[0]

    def target_vocab(self) -> torch.Tensor:
        return torch.arange(self.draft_vocab_size) + self.d2t

    def new_state(self, batch: int, slots: int, *, dtype: torch.dtype, device=None) -> OnnxKVCache:
        return OnnxKVCache(1, batch, self.kv_heads, slots, self.head_dim, dtype)

    def forward(self, state: OnnxKVCache, hidden, tokens, positions, write_slots, mask: SlotMask, *, fuse):
        if fuse:                                  # [B, T, A*Ht] target features -> [B, T, H]
            (hidden,) = self.fuse_session.run(None, {"features": _numpy(hidden)})
            hidden = torch.from_numpy(hidden)
        feeds = {"input_ids": _numpy(tokens), "hidden": _numpy(hidden), "position_ids": _numpy(positions),
                 **mask_feeds(mask, tokens.shape[1]), "write_slots": _numpy(write_slots), **state.feeds()}
        logits, feedback, *present = self.step_session.run(None, feeds)
        state.replace(present)
        return torch.from_numpy(feedback), torch.from_numpy(logits)

    def fill(self, state: OnnxKVCache, hidden, tokens, positions, write_slots) -> None:
        """The draft K/V of these positions: a full forward whose outputs are dropped (a position's K/V depend on
        its own input only, so the mask it attends with does not matter)."""
        self.forward(state, hidden, tokens, positions, write_slots,
                     SlotMask.causal(torch.zeros(tokens.shape[0], dtype=torch.long), state.slots), fuse=True)

    def top_k(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., Vd] draft logits -> (log-probs [..., k] best first, target ids [..., k])."""
        scores, ids = torch.topk(torch.log_softmax(logits, -1), k, dim=-1, sorted=True)
        return scores, ids + self.d2t[ids]


class OnnxEagle:
    """The programs of one `export_onnx` folder and the decode loop over them."""

    def __init__(self, folder: str | Path, *, providers: Sequence[str] = ("CPUExecutionProvider",),
                 threads: int | None = None) -> None:
        folder = Path(folder)
        path = folder / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no {MANIFEST}: not a folder written by export_onnx")
        self.manifest = m = json.loads(path.read_text())
        self.target = OnnxTarget(_session(folder / m["target"]["file"], providers, threads))
        d2t = torch.from_numpy(np.load(folder / m["d2t"])).long()
        self.drafter = OnnxDrafter(_session(folder / m["draft_fuse"]["file"], providers, threads),
                                   _session(folder / m["draft"]["file"], providers, threads), d2t,
                                   m["draft"]["kv_heads"], m["draft"]["head_dim"])
        self.dtype = getattr(torch, m["dtype"])
        self.tree = TreeShape(**{k: m["tree"][k] for k in ("depth", "top_k", "total_tokens", "copy")})
        self.buckets = tuple(m["buckets"]["batch"])
        self.acceptance_lengths: list[int] = []    # tokens emitted per row and cycle by the last generate call

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 eos_token_id: int | Sequence[int] | None = None, tree: TreeShape | None = None) -> list[list[int]]:
        """Greedy speculative decoding: each row's new tokens (what `model.generate` appends, without padding).

        Args:
            prompts: each row's prompt ids (ragged; no padding).
            eos_token_id: ids that end a row (None: the target's, as exported; [] for none).
            tree: the tree to build (default: the manifest's); the programs take any tree without a copy branch.
        """
        shape = tree or self.tree
        if shape.copy:
            raise OptionsError(f"tree copy={shape.copy}: OnnxEagle has no copy branch (prompt lookup)")
        rows = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
        if eos_token_id is None:
            eos_token_id = self.manifest["target"]["eos_token_id"]
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        stopper = StopChecker(rows, max_new_tokens=max_new_tokens, eos_token_ids=eos)
        batch = self._bucket(len(rows))
        padded = rows + [rows[0][:1]] * (batch - len(rows))
        active = torch.tensor([not f for f in stopper.finished] + [False] * (batch - len(rows)))
        longest = max(len(p) for p in padded)
        slots = cache_slots_needed(longest, max_new_tokens, longest, shape, rows=batch)
        t = self.manifest["target"]
        cache = OnnxKVCache(t["num_layers"], batch, t["kv_heads"], slots, t["head_dim"], self.dtype)
        draft_kv = self.drafter.new_state(batch, slots, dtype=self.dtype, device=torch.device("cpu"))
        state = self._prefill(padded, cache, draft_kv, stopper, active)
        active &= torch.tensor([not f for f in stopper.finished] + [False] * (batch - len(rows)))
        step = SpeculativeStep(self.drafter, shape, SamplingParams(), self.target)
        self.acceptance_lengths = []
        while bool(active.any()):
            uniforms, final_uniform = draw_uniforms(batch, shape.span, shape.width)   # unused by greedy verify
            state.active.copy_(active)
            out = step(state, cache, draft_kv, uniforms, final_uniform)
            read = torch.cat([out.accept_len[:, None], out.tokens], 1).tolist()      # the cycle's one read
            for b in range(len(rows)):
                if bool(active[b]):
                    self.acceptance_lengths.append(read[b][0] + 1)
                    active[b] = not stopper.extend(b, read[b][1:read[b][0] + 2])
        return stopper.generated

    def _bucket(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"batch of {rows} rows exceeds the largest exported batch bucket {self.buckets[-1]}; "
                         "export again with a larger bucket in buckets=")

    def _prefill(self, prompts: list[torch.Tensor], cache: OnnxKVCache, draft_kv: OnnxKVCache,
                 stopper: StopChecker, active: torch.Tensor) -> StepState:
        """The decoder's `_prefill` as one causal block over the longest prompt: target forward, the first token,
        the draft's K/V of pairs (feature p, token p+1) for p < last, then the catch-up at each row's last
        prompt position, whose outputs seed the first tree."""
        batch = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts])
        last, span = lengths - 1, int(lengths.max())
        tokens = torch.zeros(batch, span + 1, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = p
        pos = torch.arange(span).expand(batch, span)
        real = pos < lengths[:, None]
        zeros = torch.zeros(batch, dtype=torch.long)
        logits, feats = self.target(tokens[:, :span], torch.where(real, pos, 0), SlotMask.causal(zeros, cache.slots),
                                    torch.where(real, pos, cache.sentinel), cache)
        first = logits.gather(1, last[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0].argmax(-1)   # [B]
        for b in range(len(stopper.generated)):
            if bool(active[b]):
                stopper.extend(b, [int(first[b])])
        fill_draft(self.drafter, draft_kv, cache.slots, feats, tokens[:, 1:span + 1], zeros, last - 1)
        at_last = feats.gather(1, last[:, None, None].expand(-1, 1, feats.shape[-1]))
        seed_fb, seed_head = catch_up(self.drafter, draft_kv, cache.slots, at_last, first[:, None], last, last)
        return StepState(n=lengths + 1, root=first, seed_feedback=seed_fb, seed_head=seed_head,
                         active=torch.zeros(batch, dtype=torch.bool))
