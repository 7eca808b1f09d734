"""The speculative decoding host loop: prefill, then draft -> verify -> accept -> commit until every row stops.

Per row the invariant between cycles is: the sequence has n tokens, the last one (the root) is emitted but not
yet processed by the target, so the target cache holds slots 0..n-2 and the draft cache holds the catch-up
pairs (feature at p, token p+1) for p = 0..n-2 (EAGLE31_SPEC.md §4.1). One cycle:

    tree     = build_tree(draft, seed)                    # M nodes, root = last emitted token
    logits   = target(tree tokens @ positions n-1+depth, tree mask)   # captured graph, writes slots n-1..n-2+M
    accepted = verify(tree, logits)                       # a accepted draft tokens + 1 bonus token
    compact target KV: slot n-1+j <- slot n-1+path[j]     # the cycle's other tree KV is dead
    catch-up: draft(features of path nodes, emitted tokens) at positions n-1..n-1+a   # re-sync from target
    n += a + 1

The host reads only `accept_len` and the emitted tokens once per cycle (to apply stops).
"""

from __future__ import annotations

import math
import time
import warnings

import torch

from eagle_compile.capture_indices import default_capture_indices
from eagle_compile.draft.drafter import Drafter
from eagle_compile.draft.tree import TreeShape
from eagle_compile.options import EagleOptions
from eagle_compile.runtime.cuda_graphs import BucketBuffers, CudaGraphRuntime, GraphedStep
from eagle_compile.runtime.kv_cache import SlotKVCache
from eagle_compile.runtime.masks import causal_mask
from eagle_compile.runtime.sampling import SamplingParams, target_probs
from eagle_compile.runtime.stats import GenerationStats
from eagle_compile.runtime.step import SpeculativeStep, StepState, catch_up, traced_target_forward
from eagle_compile.runtime.step_program import StepProgram
from eagle_compile.runtime.stopping import StopChecker
from eagle_compile.runtime.target_program import TargetProgram
from eagle_compile.runtime.verify import draw_uniforms


class SpeculativeDecoder:
    """Owns the captured target program of one target model and runs speculative generation with a drafter."""

    def __init__(self, model: torch.nn.Module, drafter: Drafter, options: EagleOptions,
                 capture_indices: tuple[int, ...] | None) -> None:
        self.model = model
        self.drafter = drafter
        self.options = options
        self.shape = TreeShape(options.tree_depth, options.tree_top_k, options.tree_tokens)
        num_layers = model.config.get_text_config().num_hidden_layers
        self.capture_indices = capture_indices or default_capture_indices(num_layers)
        self.program = TargetProgram(model, self.capture_indices, inner_backend=options.inner_backend,
                                     recompile_limit=4 * len(options.batch_buckets) + 8)
        self._steps: dict = {}
        self.timings: dict[str, float] = {}      # draft / verify / accept seconds of the eager step, cumulative
        self._bucket_buffers: dict[tuple[int, int], BucketBuffers] = {}
        self._warned: set[str] = set()
        self.graph_runtime = CudaGraphRuntime()   # the CUDA graph API; tests put a host stand-in here

    def _step(self, sampling: SamplingParams) -> SpeculativeStep | StepProgram:
        if sampling not in self._steps:
            self._steps[sampling] = self._build_step(sampling)
        return self._steps[sampling]

    def _build_step(self, sampling: SamplingParams) -> SpeculativeStep | StepProgram:
        if not self.options.step_program:
            return SpeculativeStep(self.drafter, self.shape, sampling, self.program, timings=self.timings)
        config = self.model.config.get_text_config()
        width = len(self.capture_indices) * config.hidden_size
        step = SpeculativeStep(self.drafter, self.shape, sampling, traced_target_forward(self.model, width))
        return StepProgram(step, self.capture_indices, type(self.model).__name__, feature_width=width,
                           vocab_size=self.model.get_output_embeddings().out_features,
                           inner_backend=self.options.inner_backend, kernels=self.options.kernels,
                           recompile_limit=2 * len(self.options.batch_buckets) + 8)

    @property
    def graphs_captured(self) -> int:
        """FX graphs captured by dynamo (target programs and step programs), not CUDA graphs."""
        steps = sum(s.graphs_captured for s in self._steps.values() if isinstance(s, StepProgram))
        return self.program.graphs_captured + steps

    # -- public ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[torch.Tensor], stopper: StopChecker, sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> GenerationStats:
        stats = GenerationStats(tree={"depth": self.shape.depth, "top_k": self.shape.top_k,
                                      "total_tokens": self.shape.total_tokens})
        real = len(prompts)
        batch = self._bucket(real)
        prompts = prompts + [prompts[0][:1]] * (batch - real)
        active = torch.tensor([not f for f in stopper.finished] + [False] * (batch - real))
        slots = self._slots(prompts, stopper.max_new_tokens)
        device = prompts[0].device
        graphed = self._graphed(sampling, device, stats)
        buffers = self._buffers(batch, slots, device) if graphed else None
        cache, draft_kv = (buffers.cache, buffers.draft_kv) if graphed else self._caches(batch, slots, device)

        timings_before = dict(self.timings)
        replays_before = graphed.replays if graphed else 0
        t0 = time.perf_counter()
        state = self._prefill(prompts, cache, draft_kv, sampling, generator, stopper, active)
        stats.prefill_time = time.perf_counter() - t0
        if graphed:
            state = buffers.hold(state)
        active &= torch.tensor([not f for f in stopper.finished] + [False] * (batch - real))
        while bool(active.any()):
            self._cycle(state, cache, draft_kv, sampling, generator, stopper, active, stats, buffers)
        if graphed:
            stats.cuda_graph_replays = graphed.replays - replays_before
        stats.new_tokens = sum(len(g) for g in stopper.generated)
        for phase, seconds in self.timings.items():
            setattr(stats, f"{phase}_time", seconds - timings_before.get(phase, 0.0))
        stats.graphs_captured = self.graphs_captured
        return stats

    # -- setup -----------------------------------------------------------------------------------------------
    def _caches(self, batch: int, slots: int, device) -> tuple[SlotKVCache, object]:
        dtype = next(self.model.parameters()).dtype
        cache = SlotKVCache(self.model.config, batch, slots, dtype=dtype, device=device)
        return cache, self.drafter.new_state(batch, slots, dtype=dtype, device=device)

    def _graphed(self, sampling: SamplingParams, device: torch.device, stats) -> GraphedStep | None:
        if not self.options.cudagraphs:
            return None
        if not self.graph_runtime.supports(device):
            note = f"cudagraphs=True ignored: CUDA graphs need a CUDA device, the target is on {device.type}"
            if note not in self._warned:
                warnings.warn(note, stacklevel=3)
                self._warned.add(note)
            stats.notes.append(note)
            return None
        key = ("graphed", sampling)
        if key not in self._steps:
            self._steps[key] = GraphedStep(self._step(sampling), runtime=self.graph_runtime)
        return self._steps[key]

    def _buffers(self, batch: int, slots: int, device) -> BucketBuffers:
        """Static buffers per (bucket, slots), kept across calls so that captured graphs stay valid."""
        key = (batch, slots)
        if key not in self._bucket_buffers:
            cache, draft_kv = self._caches(batch, slots, device)
            uniforms, final = draw_uniforms(batch, self.shape.depth, self.shape.top_k, device=device)
            self._bucket_buffers[key] = BucketBuffers(None, cache, draft_kv, uniforms, final)
        return self._bucket_buffers[key]

    def _bucket(self, rows: int) -> int:
        for b in self.options.batch_buckets:
            if b >= rows:
                return b
        raise ValueError(f"batch of {rows} rows exceeds the largest batch bucket "
                         f"{self.options.batch_buckets[-1]}; add a larger bucket to options['batch_buckets']")

    def _slots(self, prompts: list[torch.Tensor], max_new: int) -> int:
        """Static cache slots (target and draft caches alike), sentinel included."""
        longest = max(len(p) for p in prompts)
        chunk = self.options.prefill_chunk
        prefill_span = math.ceil(longest / chunk) * chunk
        # committed <= longest + max_new; a cycle writes M tree slots (target) or (D-1)*K tree slots and D+1
        # catch-up slots (draft) past it; +1 sentinel.
        # a row that stops mid-cycle may still advance by depth + 1 before it is frozen
        need = max(prefill_span, longest + max_new + self.shape.depth + 1
                   + max(self.shape.total_tokens, self.shape.tree_slots, self.shape.depth + 1)) + 2
        if self.options.max_cache_len is not None:
            if self.options.max_cache_len < need:
                raise ValueError(f"max_cache_len={self.options.max_cache_len} is too small for a prompt of "
                                 f"{longest} tokens + {max_new} new tokens + a tree of {self.shape.total_tokens}: "
                                 f"need {need}")
            return self.options.max_cache_len
        mult = self.options.cache_len_multiple
        return math.ceil(need / mult) * mult

    # -- prefill ---------------------------------------------------------------------------------------------
    def _prefill(self, prompts, cache, draft_kv, sampling, generator, stopper, active) -> StepState:
        """Chunked prefill through the captured program, first token, then the draft's catch-up over the prompt."""
        batch, chunk = len(prompts), self.options.prefill_chunk
        device = prompts[0].device
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        span = math.ceil(int(lengths.max()) / chunk) * chunk
        tokens = torch.zeros(batch, span, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = p
        # [n_chunks, B, chunk]: every chunk has the same (contiguous) strides whatever the prompt length, so
        # dynamo's stride guards do not recapture the program for new lengths (a slice of `tokens` would).
        # (`.contiguous()` keeps odd strides on size-1 dims, so copy into a freshly laid-out buffer.)
        chunks = torch.empty(span // chunk, batch, chunk, dtype=tokens.dtype, device=device)
        chunks.copy_(tokens.view(batch, span // chunk, chunk).transpose(0, 1))
        feats, last_logits = [], None
        last = lengths - 1
        for start in range(0, span, chunk):
            pos = torch.arange(start, start + chunk, device=device).expand(batch, chunk)
            real = pos < lengths[:, None]
            mask = causal_mask(pos, real, cache.slots, cache.layers[0].keys.dtype)
            write = torch.where(real, pos, cache.sentinel)
            idx = (last - start).clamp(0, chunk - 1)[:, None]            # [B, 1]: each row's last prompt token
            logits, f = self.program(chunks[start // chunk], torch.where(real, pos, 0), mask, write, cache, idx)
            feats.append(f)
            picked = logits[:, 0].float()                                # [B, V]: logits at those positions only
            here = ((last >= start) & (last < start + chunk))[:, None]
            last_logits = picked if last_logits is None else torch.where(here, picked, last_logits)
        first = self._sample_one(last_logits, sampling, generator)      # [B]
        for b in range(len(stopper.generated)):
            if bool(active[b]):
                stopper.extend(b, [int(first[b])])
        features = torch.cat(feats, 1)                                   # [B, span, A*Ht]
        next_tokens = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)
        next_tokens[torch.arange(batch), lengths - 1] = first
        seed_fb, seed_head = catch_up(self.drafter, draft_kv, cache.slots, features, next_tokens,
                                      torch.zeros_like(lengths), lengths - 1, chunk=chunk)
        return StepState(n=lengths + 1, root=first, seed_feedback=seed_fb, seed_head=seed_head,
                         active=torch.zeros_like(lengths, dtype=torch.bool))

    # -- one cycle -------------------------------------------------------------------------------------------
    def _cycle(self, state: StepState, cache, draft_kv, sampling, generator, stopper, active, stats, buffers):
        t0 = time.perf_counter()
        uniforms, final_uniform = draw_uniforms(state.n.shape[0], self.shape.depth, self.shape.top_k,
                                                generator=generator, device=state.n.device)
        state.active.copy_(active)
        if buffers is not None:
            out = self._steps[("graphed", sampling)](buffers, uniforms, final_uniform)
        else:
            out = self._step(sampling)(state, cache, draft_kv, uniforms, final_uniform)
        accept_len = out.accept_len.tolist()          # the one host read of the cycle
        emitted = out.tokens.tolist()
        stats.step_time += time.perf_counter() - t0
        for b in range(len(stopper.generated)):
            if bool(active[b]):
                stats.acceptance_lengths.append(accept_len[b] + 1)
                if stopper.extend(b, emitted[b][:accept_len[b] + 1]):
                    active[b] = False
        stats.cycles += 1

    def _sample_one(self, logits: torch.Tensor, sampling: SamplingParams, generator) -> torch.Tensor:
        """The first new token, from the prefill's last logits [B, V] (float32, as HF casts them)."""
        if not sampling.do_sample:
            return logits.argmax(-1)
        probs = target_probs(logits, sampling)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
