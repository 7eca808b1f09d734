"""The decoding host loop: prefill, then draft -> verify -> accept -> commit (or plain steps) until every row stops.

Per row the invariant between cycles is: the sequence has n tokens, the last one (the root) is emitted but not
yet processed by the target, so the target cache holds slots 0..n-2 and the draft cache holds the catch-up
pairs (feature at p, token p+1) for p = 0..n-2 (EAGLE31_SPEC.md §4.1). One cycle:

    tree     = build_tree(draft, seed)                    # M nodes, root = last emitted token
    logits   = target(tree tokens @ positions n-1+depth, tree mask)   # captured graph, writes slots n-1..n-2+M
    accepted = verify(tree, logits)                       # a accepted draft tokens + 1 bonus token
    compact target KV: slot n-1+j <- slot n-1+path[j]     # the cycle's other tree KV is dead
    catch-up: draft(features of path nodes, emitted tokens) at positions n-1..n-1+a   # re-sync from target
    n += a + 1

With `speculate=False` a cycle is one plain step (`runtime/plain_step.py`) and nothing of the draft runs.
The host reads only `accept_len`, the emitted tokens and `finite` (how many of them usable logits decided) once
per cycle, to apply stops, feed a streamer and end a row whose logits went NaN/+inf.
With a copy branch (`draft/lookup.py`) the host also looks each row's last tokens up in its own history before
the cycle (from the tokens that read brought back) and hands the proposals to the step in `StepState.copy`.

Prefill (`_prefill`) covers the longest prompt with chunks from a small menu of static sizes (`prefill_plan.py`),
each one causal block over the live slots; the draft's catch-up over the prompt runs per chunk, as a block of
the same size, right after the target's chunk that produced its features. It writes only the draft's K/V
(`fill_draft`): nothing reads a draft output before the prompt's last position, whose full draft forward runs
once the first token is known. Rows of very different prompt lengths prefill in groups (`prefill_groups`), each
group a batch of its own copied into the batch's cache rows, so short rows are not padded to the longest.
"""

from __future__ import annotations

import math
import time
import warnings

import torch

from eagle_compile.calibrate.costs import CostCache
from eagle_compile.calibrate.menu import MenuEntry
from eagle_compile.capture_indices import default_capture_indices
from eagle_compile.core.masks import SlotMask
from eagle_compile.core.tree import TreeShape
from eagle_compile.core.verify import draw_uniforms
from eagle_compile.draft.drafter import Drafter
from eagle_compile.draft.lookup import PromptLookup
from eagle_compile.draft.model import DraftKV
from eagle_compile.errors import UnsupportedGenerationError
from eagle_compile.lowering import lowering_for
from eagle_compile.options import EagleOptions
from eagle_compile.runtime.calibration import Calibration
from eagle_compile.runtime.context_window import ContextWindow
from eagle_compile.runtime.cuda_graphs import BucketBuffers, CudaGraphRuntime, GraphedStep
from eagle_compile.runtime.kv_cache import SlotKVCache
from eagle_compile.runtime.logits_processors import TokenHistory, process_next
from eagle_compile.runtime.plain_step import PlainStep
from eagle_compile.runtime.prefill_plan import CPU_FORWARD_TOKENS, prefill_groups, prefill_plan
from eagle_compile.runtime.sampling import (
    BatchSampling,
    RowSamplingValues,
    SamplingParams,
    SamplingValues,
    target_probs,
)
from eagle_compile.runtime.session import DecodeSession, RowSettings
from eagle_compile.runtime.stats import GenerationStats
from eagle_compile.runtime.step import (
    CycleRead,
    SpeculativeStep,
    StepState,
    catch_up,
    fill_draft,
    put_rows,
    read_cycle,
    traced_target_forward,
    usable_logits,
)
from eagle_compile.runtime.step_program import StepProgram
from eagle_compile.runtime.stopping import RowView, StopChecker
from eagle_compile.runtime.target_program import TargetProgram
from eagle_compile.targets.quantized import find_quantized

#: sampling program keys whose CUDA graphs (one per bucket) a decoder keeps; the least recently used goes first
MAX_GRAPHED_KEYS = 4


class SpeculativeDecoder:
    """Owns the captured programs of one target model and runs speculative (or plain) generation."""

    def __init__(self, model: torch.nn.Module, drafter: Drafter | None, options: EagleOptions,
                 capture_indices: tuple[int, ...] | None, shape: TreeShape | None = None,
                 tree_source: str = "options", menu: tuple[MenuEntry, ...] | None = None,
                 cost_cache: CostCache | None = None, calibration_reason: str = "") -> None:
        self.model = model
        self.drafter = drafter
        self.options = options
        self.speculate = options.speculate
        if self.speculate and drafter is None:
            raise ValueError("speculative decoding needs a drafter (or options speculate=False)")
        self.shape = shape or TreeShape(options.tree_depth, options.tree_top_k, options.tree_tokens)
        self.tree_source = tree_source
        num_layers = model.config.get_text_config().num_hidden_layers
        self.capture_indices = capture_indices or default_capture_indices(num_layers)
        param = next(model.parameters())
        self.quantized = find_quantized(model)
        self.lowering = lowering_for(options.inner_backend, options.inductor_config, param.device, param.dtype,
                                     options.numerics, self.quantized)
        self.forward_tokens = forward_tokens(options, param.device)
        if drafter is not None and hasattr(drafter, "numerics"):
            drafter.numerics = self.lowering.numerics     # the head rounds like the target's programs
        self.program = TargetProgram(model, self.capture_indices, lowering=self.lowering,
                                     recompile_limit=(8 + len(menu or ())) * len(options.batch_buckets) + 8)
        self._steps: dict = {}
        self.timings: dict[str, float] = {}      # draft / verify / accept seconds of the eager step, cumulative
        self._bucket_buffers: dict[tuple[int, int], BucketBuffers] = {}
        self._warned: set[str] = set()
        self.graph_runtime = CudaGraphRuntime()   # the CUDA graph API; tests put a host stand-in here
        self.calibration_reason = calibration_reason
        self.calibration = (Calibration(self, menu, cost_cache if cost_cache is not None else CostCache(None))
                            if menu is not None and self.speculate else None)
        self.shapes = ([e.shape for e in menu if e.shape is not None] if self.calibration is not None
                       else [self.shape])
        copy = max(s.copy for s in self.shapes) if self.speculate else 0
        self.lookup = PromptLookup(copy, options.copy_ngram) if copy else None
        self._draft_vocab: set[int] | None = None
        head_config = getattr(getattr(drafter, "model", None), "config", None) if self.speculate else None
        self.window = ContextWindow.of(model, head_config, step_program=options.step_program)

    def _step(self, sampling: SamplingParams | BatchSampling) -> SpeculativeStep | StepProgram | PlainStep:
        return self._keyed_step(sampling, None, self.shape if self.speculate else None)

    def step_for(self, sampling: SamplingParams | BatchSampling, entry: MenuEntry
                 ) -> SpeculativeStep | StepProgram | PlainStep:
        """The program of one menu entry (calibration), built on first use."""
        return self._keyed_step(sampling, entry.name, entry.shape, keep_features=True)

    def _keyed_step(self, sampling: SamplingParams | BatchSampling, name: str | None, shape: TreeShape | None,
                    keep_features: bool = False) -> SpeculativeStep | StepProgram | PlainStep:
        """The step of one tree shape (`name`: a menu entry) for the call's sampling. Steps are kept per
        `SamplingParams.program_key` (greedy or sampling, the top-k bucket, top-p on or off), built from its
        `structure()`, and read the call's temperature / top_k / top_p from their `SamplingValues`, loaded here:
        a server with varied settings captures a bounded set of programs, not one per setting. A batch whose rows
        differ (`BatchSampling`) has programs of its own, which read one number per row (`RowSamplingValues`)."""
        key = (sampling.program_key, name)
        step = self._steps.get(key)
        if step is None:
            values = sampling.new_values(next(self.model.parameters()).device)
            step = self._steps[key] = self._build_step(sampling.structure(), values, shape, keep_features)
        values = step.step.values if isinstance(step, StepProgram) else step.values
        values.load(sampling)
        return step

    def _build_step(self, sampling: SamplingParams, values: SamplingValues | RowSamplingValues,
                    shape: TreeShape | None, keep_features: bool = False
                    ) -> SpeculativeStep | StepProgram | PlainStep:
        if shape is None:
            return PlainStep(sampling, self.program, keep_features=keep_features, values=values)
        if not self.options.step_program:
            return SpeculativeStep(self.drafter, shape, sampling, self.program, timings=self.timings,
                                   drift=self.options.drift_monitors, values=values)
        config = self.model.config.get_text_config()
        width = len(self.capture_indices) * config.hidden_size
        step = SpeculativeStep(self.drafter, shape, sampling, traced_target_forward(self.model, width),
                               values=values)
        return StepProgram(step, self.capture_indices, type(self.model).__name__, feature_width=width,
                           vocab_size=self.model.get_output_embeddings().out_features,
                           lowering=self.lowering, kernels=self.options.kernels,
                           recompile_limit=2 * len(self.options.batch_buckets) + 8)

    @staticmethod
    def cycle_writes(shape: TreeShape | None) -> int:
        """Cache slots past the root's that one cycle of `shape` may write (None: a plain step)."""
        if shape is None:
            return 1
        return max(shape.nodes, shape.tree_slots + 1, shape.span + 1)

    @property
    def cuda_graphs_captured(self) -> int:
        """CUDA graphs held now (`cudagraphs=True`: one per bucket and sampling program key)."""
        return sum(len(s.graphs) for s in self._steps.values() if isinstance(s, GraphedStep))

    def books(self) -> dict[str, int]:
        """What this decoder keeps across calls, by kind (`eagle_compile.footprint` sums them): none of them
        may grow once every bucket, program and sampling kind a workload uses has run once."""
        steps = list(self._steps.values())
        calibration = self.calibration
        return {"steps": sum(not isinstance(s, GraphedStep) for s in steps),
                "step_programs": sum(isinstance(s, StepProgram) for s in steps),
                "graphed_steps": sum(isinstance(s, GraphedStep) for s in steps),
                "bucket_buffers": len(self._bucket_buffers),
                "target_graphs": self.program.graphs_captured,
                "lowered_graphs": len(self.lowering.compiled),
                "warned_kinds": len(self._warned),
                "timings": len(self.timings),
                "cost_tables": 0 if calibration is None else len(calibration.tables),
                "cost_cache_entries": 0 if calibration is None else len(calibration.cache._memory),
                "calibration_stash": 0 if calibration is None else len(calibration._stash)}

    @property
    def graphs_captured(self) -> int:
        """FX graphs captured by dynamo (target programs and step programs), not CUDA graphs."""
        steps = sum(s.graphs_captured for s in self._steps.values() if isinstance(s, StepProgram))
        return self.program.graphs_captured + steps

    # -- public ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[torch.Tensor], stopper: StopChecker, sampling: RowSettings,
                 generator: torch.Generator | None = None,
                 inputs: tuple[torch.Tensor, torch.Tensor] | None = None) -> GenerationStats:
        """`sampling`: one setting for every row, or one per prompt. `inputs`: the caller's padded `input_ids` and
        `attention_mask` [R, L], the rows HF's logits processors read (needed when `sampling.processors` is set).
        A `DecodeSession` run to the end."""
        session = self.session(prompts, stopper, sampling, generator, inputs)
        while session.running:
            session.cycle()
        return session.finish()

    def session(self, prompts: list[torch.Tensor], stopper: StopChecker, sampling: RowSettings,
                generator: torch.Generator | None = None, inputs=None, **kwargs) -> DecodeSession:
        """A batch in flight, prefilled: cycle it, join rows into it, regroup it (`runtime/session.py`). Each
        starts by having the target program check its guards once per shape (the model may have changed)."""
        self.program.revalidate()
        return DecodeSession(self, prompts, stopper, sampling, generator, inputs, **kwargs)

    def tree_stats(self) -> dict:
        """The tree (or menu) this decoder runs and where it came from: `GenerationStats.tree`."""
        if not self.speculate:
            return {"speculate": False}
        copy = {} if self.lookup is None else {"copy": self.lookup.length}
        if self.calibration is not None:
            return {"adaptive": [e.name for e in self.calibration.menu], "source": self.calibration_reason,
                    "depth": self.shape.depth, "top_k": self.shape.top_k, "total_tokens": self.shape.total_tokens,
                    **copy}
        return {"depth": self.shape.depth, "top_k": self.shape.top_k, "total_tokens": self.shape.total_tokens,
                "source": self.tree_source, "fixed": self.calibration_reason, **copy}

    # -- setup -----------------------------------------------------------------------------------------------
    def _history(self, sampling: SamplingParams, inputs, batch: int, longest: int, max_new: int
                 ) -> TokenHistory | None:
        """The rows HF's logits processors read, on the device (None when no processor is configured)."""
        if sampling.processors is None:
            return None
        for option in ("step_program", "cudagraphs"):
            if getattr(self.options, option):
                raise UnsupportedGenerationError(
                    f"logits processors ({', '.join(sorted(sampling.processors.configured()))}) are applied by "
                    f"the host-loop step only, not with {option}=True; pass options={{'{option}': False}} or "
                    "drop those generation settings")
        if inputs is None:
            raise ValueError("logits processors need the padded input_ids and attention_mask: "
                             "SpeculativeDecoder.generate(..., inputs=(input_ids, attention_mask))")
        sampling.processors.check_vocabulary(self.model.get_output_embeddings().out_features)
        room = self._reach(longest, max_new) - longest + 1        # what a row may append, a cycle's overrun included
        return TokenHistory.start(*inputs, rows=batch, room=room)

    def _caches(self, batch: int, slots: int, device) -> tuple[SlotKVCache, object]:
        dtype = next(self.model.parameters()).dtype
        cache = SlotKVCache(self.model.config, batch, slots, dtype=dtype, device=device)
        draft_kv = self.drafter.new_state(batch, slots, dtype=dtype, device=device) if self.speculate else None
        return cache, draft_kv

    def _graphed(self, sampling: SamplingParams | BatchSampling, device: torch.device, stats) -> GraphedStep | None:
        if not self.options.cudagraphs:
            return None
        if not self.graph_runtime.supports(device):
            self._note(stats, "cudagraphs", "cudagraphs=True ignored: CUDA graphs need a CUDA device, the target "
                                            f"is on {device.type}")
            return None
        step = self._step(sampling)              # also loads the call's sampling values into the step
        key = ("graphed", sampling.program_key)  # replays read the values from the step's tensors; LRU-bounded
        graphed = self._steps.pop(key, None) or GraphedStep(step, runtime=self.graph_runtime)
        self._steps[key] = graphed               # (re)inserted last: the most recently used
        stale = [k for k in self._steps if k[0] == "graphed"][:-MAX_GRAPHED_KEYS]
        for k in stale:                          # its CUDA graphs go with it
            del self._steps[k]
        return graphed

    def _note(self, stats: GenerationStats, kind: str, note: str) -> None:
        """A note in this call's statistics, and a warning the first time this decoder meets its kind."""
        if kind not in self._warned:
            warnings.warn(note, stacklevel=4)
            self._warned.add(kind)
        stats.notes.append(note)

    def _buffers(self, batch: int, slots: int, device) -> BucketBuffers:
        """Static buffers per (bucket, slots), kept across calls so that captured graphs stay valid."""
        key = (batch, slots)
        if key not in self._bucket_buffers:
            cache, draft_kv = self._caches(batch, slots, device)
            depth, width = (self.shape.span, self.shape.width) if self.speculate else (0, 0)
            uniforms, final = draw_uniforms(batch, depth, width, device=device)
            self._bucket_buffers[key] = BucketBuffers(None, cache, draft_kv, uniforms, final)
        return self._bucket_buffers[key]

    def bucket_for(self, rows: int) -> int:
        """The smallest batch bucket that holds `rows` rows."""
        return self._bucket(rows)

    def _bucket(self, rows: int) -> int:
        for b in self.options.batch_buckets:
            if b >= rows:
                return b
        raise ValueError(f"batch of {rows} rows exceeds the largest batch bucket "
                         f"{self.options.batch_buckets[-1]}; add a larger bucket to options['batch_buckets']")

    def _reach(self, longest: int, max_new: int) -> int:
        """One past the largest position any forward of a call may use, over every program it may run."""
        return max(positions_reached(longest, max_new, shape if self.speculate else None) for shape in self.shapes)

    def slots_needed(self, longest: int, max_new: int, rows: int) -> int:
        """Cache slots (sentinel included, before rounding) for prompts of up to `longest` tokens in a batch of
        `rows`, over every program the decoder may run."""
        return max(cache_slots_needed(longest, max_new, self.options.prefill_chunk,
                                      shape if self.speculate else None, rows=rows,
                                      forward_tokens=self.forward_tokens) for shape in self.shapes)

    def _slots(self, prompts: list[torch.Tensor], max_new: int) -> int:
        """Static cache slots (target and draft caches alike), sentinel included."""
        need = self.slots_needed(max(len(p) for p in prompts), max_new, len(prompts))
        if self.options.max_cache_len is not None:
            if self.options.max_cache_len < need:
                raise ValueError(f"max_cache_len={self.options.max_cache_len} is too small for a prompt of "
                                 f"{max(len(p) for p in prompts)} tokens + {max_new} new tokens"
                                 f"{'' if not self.speculate else f' + a tree of {self.shape.total_tokens}'}: "
                                 f"need {need}")
            return self.options.max_cache_len
        mult = self.options.cache_len_multiple
        return math.ceil(need / mult) * mult

    # -- prefill ---------------------------------------------------------------------------------------------
    def _prefill(self, prompts, cache, draft_kv, sampling, generator, stopper, active, stats,
                 history: TokenHistory | None = None) -> StepState:
        """Prefill every row: in one block, or in groups of rows of neighbouring lengths (`prefill_groups`) when
        that computes fewer positions. Logits processors (a history over the whole batch) and a drafter whose
        cache is not a `DraftKV` prefill in one block."""
        groups = [list(range(len(prompts)))]
        if history is None and (draft_kv is None or isinstance(draft_kv, DraftKV)):
            groups = prefill_groups([len(p) for p in prompts], self.options.prefill_chunk, self._bucket,
                                    span_limit=cache.sentinel, forward_tokens=self.forward_tokens)
        stats.prefill_groups += len(groups)
        if len(groups) == 1:
            return self._prefill_block(prompts, cache, draft_kv, sampling, generator, stopper, active, stats,
                                       history)
        state = None
        for rows in groups:
            sub = BatchSampling.of([sampling.rows[b] for b in rows]) if isinstance(sampling, BatchSampling) \
                else sampling
            new, ran = self.prefill_rows(rows, [prompts[b] for b in rows], sub, [bool(active[b]) for b in rows],
                                         cache, draft_kv, generator, stopper, stats)
            if state is None:              # the batch's state, filled group by group
                state = StepState(n=new.n.new_zeros(len(prompts)), root=new.root.new_zeros(len(prompts)),
                                  seed_feedback=new.seed_feedback.new_zeros(len(prompts), new.seed_feedback.shape[-1]),
                                  seed_head=new.seed_head.new_zeros(len(prompts), new.seed_head.shape[-1]),
                                  active=torch.zeros(len(prompts), dtype=torch.bool, device=new.n.device))
            put_rows(state, new, rows)
            active[torch.tensor(rows)] = torch.tensor(ran)
        return state

    def prefill_rows(self, rows: list[int], prompts, sampling, active: list[bool], cache, draft_kv, generator,
                     stopper, stats) -> tuple[StepState, list[bool]]:
        """Prefill `prompts` into batch rows `rows` of `cache` / `draft_kv` as a batch of their own (the bucket
        that holds them, caches of their own with the batch's slots; the prompts of a prefill group, or of rows
        joining a running batch: `DecodeSession.join`), then copy their K/V rows in. Returns their `StepState`
        (its first len(rows) rows are theirs; `put_rows` copies them) and whether each is still running; their
        NaN errors go to `stats` under their batch row. `stopper` rows past its own (a bucket's padding rows,
        the highest indices) have no stop-checker row."""
        k, sub, device = len(rows), self._bucket(len(rows)), prompts[0].device
        padded = list(prompts) + [prompts[0][:1]] * (sub - k)
        if isinstance(sampling, BatchSampling):
            sampling = BatchSampling.of(list(sampling.rows) + [None] * (sub - k))
        ran = torch.tensor(list(active) + [False] * (sub - k))
        own, own_draft = self._caches(sub, cache.slots, device)
        own_stats = GenerationStats()
        view = RowView(stopper, [b for b in rows if b < len(stopper.generated)])
        new = self._prefill(padded, own, own_draft, sampling, generator, view, ran, own_stats)
        on = torch.tensor(rows, device=device)
        for mine, theirs in zip(cache.layers, own.layers, strict=True):
            mine.keys[on] = theirs.keys[:k]
            mine.values[on] = theirs.values[:k]
        if draft_kv is not None:
            draft_kv.keys[on] = own_draft.keys[:k]
            draft_kv.values[on] = own_draft.values[:k]
        for i, message in own_stats.errors.items():
            stats.errors[rows[i]] = message
        return new, ran[:k].tolist()

    def _prefill_block(self, prompts, cache, draft_kv, sampling, generator, stopper, active, stats,
                       history: TokenHistory | None = None) -> StepState:
        """Chunked prefill through the captured program (each chunk a causal block over the live slots), the
        draft's catch-up over each chunk right after it, the first token, then the catch-up of each row's last
        prompt position (whose next token is that first token)."""
        batch, device = len(prompts), prompts[0].device
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        last = lengths - 1                                                # [B] each row's last prompt position
        plan = prefill_plan(int(lengths.max()), self.options.prefill_chunk, rows=batch,
                            forward_tokens=self.forward_tokens)
        span = plan[-1][0] + plan[-1][1]
        tokens = torch.zeros(batch, span + 1, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            tokens[b, :len(p)] = p
        last_logits = last_feats = None
        for start, size in plan:
            pos = torch.arange(start, start + size, device=device).expand(batch, size)
            real = pos < lengths[:, None]
            write = torch.where(real, pos, cache.sentinel)
            idx = (last - start).clamp(0, size - 1)[:, None]             # [B, 1]: each row's last prompt token
            # a freshly laid-out [B, size] chunk: every chunk of one size has the same strides, so dynamo's
            # stride guards do not recapture the program for new prompt lengths (a slice of `tokens` would)
            chunk = torch.empty(batch, size, dtype=tokens.dtype, device=device)
            chunk.copy_(tokens[:, start:start + size])
            logits, feats = self.program(chunk, torch.where(real, pos, 0),
                                         SlotMask.causal(torch.full((batch,), start, device=device), cache.slots),
                                         write, cache, idx)
            here = ((last >= start) & (last < start + size))[:, None]
            picked = logits[:, 0].float()                                # [B, V]: logits at those positions only
            last_logits = picked if last_logits is None else torch.where(here, picked, last_logits)
            at_last = feats.gather(1, idx[:, :, None].expand(-1, 1, feats.shape[-1]))[:, 0]
            last_feats = at_last if last_feats is None else torch.where(here, at_last, last_feats)
            if self.speculate:                             # draft KV of pairs (feature p, token p+1), p < last
                fill_draft(self.drafter, draft_kv, cache.slots, feats, tokens[:, start + 1:start + size + 1],
                           torch.full_like(lengths, start), torch.minimum(last - 1, pos[:, -1]))
        first, usable = self._sample_one(last_logits, sampling, generator, history)      # [B] each
        if history is not None:
            history.append(first[:, None], torch.ones_like(lengths))
        read = torch.stack([first, usable.long()], 1).tolist()         # the prefill's one host read
        for b in range(len(stopper.generated)):
            if not bool(active[b]):
                continue
            if read[b][1]:
                stopper.extend(b, [read[b][0]])
            else:
                self._poisoned(b, [], stopper, active, stats, "the prefill")
        seed_fb = seed_head = torch.zeros(batch, 0, dtype=last_feats.dtype, device=device)
        if self.speculate:                                               # the pair (feature at last, first token)
            seed_fb, seed_head = catch_up(self.drafter, draft_kv, cache.slots, last_feats[:, None], first[:, None],
                                          last, last)
        return StepState(n=lengths + 1, root=first, seed_feedback=seed_fb, seed_head=seed_head,
                         active=torch.zeros_like(lengths, dtype=torch.bool), history=history)

    # -- one cycle -------------------------------------------------------------------------------------------
    def _cycle(self, state: StepState, cache, draft_kv, sampling, generator, stopper, active, stats, buffers):
        t0 = time.perf_counter()
        depth, width = (self.shape.span, self.shape.width) if self.speculate else (0, 0)
        uniforms, final_uniform = draw_uniforms(state.n.shape[0], depth, width, generator=generator,
                                                device=state.n.device)
        state.active.copy_(active)
        if self.lookup is not None:
            self.fill_copy(state, stopper, active)
        if buffers is not None:
            out = self._steps[("graphed", sampling.program_key)](buffers, uniforms, final_uniform)
        else:
            out = self._step(sampling)(state, cache, draft_kv, uniforms, final_uniform)
        read = read_cycle(out)                        # the one host read of the cycle
        if self.drift is not None and out.drift is not None:
            self.drift.add(out.drift, active & torch.tensor(read.healthy))
        stats.step_time += time.perf_counter() - t0
        self._emit(read, stopper, active, stats)

    def _calibrated_cycle(self, state, cache, draft_kv, sampling, generator, stopper, active, stats, lengths):
        t0 = time.perf_counter()
        longest = max(lengths[b] + len(g) for b, g in enumerate(stopper.generated) if bool(active[b]))
        matched = self.fill_copy(state, stopper, active) if self.lookup is not None else None
        read, _ = self.calibration.cycle(state, cache, draft_kv, sampling, generator, active, longest, matched)
        stats.step_time += time.perf_counter() - t0
        self._emit(read, stopper, active, stats)

    def fill_copy(self, state: StepState, stopper: StopChecker, active: torch.Tensor) -> torch.Tensor:
        """The copy branch's proposals for this cycle into `state.copy`; returns [B] the length of the n-gram
        each row matched (0: no proposal)."""
        batch = state.n.shape[0]
        generated = stopper.generated + [[]] * (batch - len(stopper.generated))
        proposals, ngram = self.lookup.proposals(generated, active.tolist())
        state.copy.copy_(torch.tensor(proposals, dtype=torch.long))
        return torch.tensor(ngram, dtype=torch.long)

    def _emit(self, read: CycleRead, stopper: StopChecker, active: torch.Tensor, stats: GenerationStats) -> None:
        """Hand each active row its accepted tokens and bonus token; rows the stop checker ends go inactive, and
        so do rows whose block was decided by NaN/+inf logits (`StepOutput.finite`).
        Counts the tokens accepted from the copy branch and the emitted tokens outside the draft vocabulary."""
        vocab = self.draft_vocabulary()
        copied = read.copied
        for b in range(len(stopper.generated)):
            if not bool(active[b]):
                continue
            block = read.tokens[b][:read.accept_len[b] + 1]
            if read.finite[b] < len(block):
                self._poisoned(b, block[:read.finite[b]], stopper, active, stats, f"cycle {stats.cycles + 1}")
                continue
            stats.acceptance_lengths.append(len(block))
            stats.row_acceptance.setdefault(b, []).append(len(block))
            if copied is not None:
                stats.copied_tokens += copied[b]
            if vocab is not None:
                stats.outside_draft_vocab = (stats.outside_draft_vocab or 0) + sum(t not in vocab for t in block)
                if copied is not None:      # a copied run is the block's first copied[b] tokens
                    stats.copied_outside_draft_vocab = ((stats.copied_outside_draft_vocab or 0)
                                                        + sum(t not in vocab for t in block[:copied[b]]))
            if stopper.extend(b, block):
                active[b] = False
        stats.cycles += 1

    @staticmethod
    def _poisoned(row: int, kept: list[int], stopper: StopChecker, active: torch.Tensor, stats: GenerationStats,
                  where: str) -> None:
        """End a row whose target logits went NaN/+inf: it keeps the tokens decided before them (`kept`) and its
        statistics say why it ended. Rows never share a cache row, so the others decode on as if alone."""
        active[row] = False
        if stopper.extend(row, kept):
            return                        # a stop (EOS, max_new_tokens, ...) came first: the row ended normally
        n = len(stopper.generated[row])
        stats.errors[row] = (f"the target's logits were NaN or +inf for new token {n + 1} (in {where}); the row "
                             f"stopped there and keeps its {n} new tokens before it. Usual causes: NaN/inf in the "
                             "target's weights, float16 overflow in its activations (run it in bfloat16 or float32), "
                             "or a corrupt embedding row of a token the row read")

    def _report_errors(self, stats: GenerationStats, buffers: BucketBuffers | None) -> None:
        """Say once that rows ended early (a caller without return_dict_in_generate sees only padding), and zero
        their rows of the static buffers that outlive the call (`cudagraphs`): a NaN left in a slot that a later
        call masks out would still poison it, since a masked weight is 0 and 0 * NaN is NaN."""
        if buffers is not None:
            buffers.clear_rows(sorted(stats.errors))
        warnings.warn(f"generate: rows {sorted(stats.errors)} stopped early because the target's logits went NaN "
                      "or +inf (their reasons are in stats.errors, return_dict_in_generate=True); the other rows "
                      "are unaffected", RuntimeWarning, stacklevel=5)   # the caller of eagle_compile.generate

    def draft_vocabulary(self) -> set[int] | None:
        """Target ids the draft can propose (None: plain decoding, or a drafter that does not say)."""
        if self._draft_vocab is None and self.speculate and hasattr(self.drafter, "target_vocab"):
            self._draft_vocab = set(self.drafter.target_vocab().tolist())
        return self._draft_vocab

    def _sample_one(self, logits: torch.Tensor, sampling: SamplingParams | BatchSampling, generator,
                    history: TokenHistory | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first new token, from the prefill's last logits [B, V] (float32, as HF casts them; HF's logits
        processors applied from the prompt rows when set), and [B] bool: those logits were usable
        (`usable_logits`). Unusable rows draw from zeros instead: torch.multinomial refuses a whole batch for
        one row of NaN probabilities."""
        usable = usable_logits(logits)
        if sampling.processors is not None:
            logits = process_next(logits, sampling.processors, history)
        if not sampling.do_sample:
            return logits.argmax(-1), usable
        values = None
        if isinstance(sampling, BatchSampling):     # one setting per row; greedy rows draw their point mass
            values = sampling.new_values(logits.device)
            values.load(sampling)
            sampling = sampling.structure()
        probs = target_probs(torch.where(usable[:, None], logits, 0.0), sampling, values)
        return torch.multinomial(probs, 1, generator=generator)[:, 0], usable


def positions_reached(longest: int, max_new: int, shape: TreeShape | None) -> int:
    """One past the largest position (= slot) a decode forward may use: the committed tokens plus what a cycle
    writes past them (`shape` None: plain steps, one token)."""
    if shape is None:
        return longest + max_new + 1
    # committed <= longest + max_new; a cycle writes M tree slots (target) or (D-1)*K tree slots and D+1
    # catch-up slots (draft) past it; a row that stops mid-cycle may still advance by depth + 1 before it is
    # frozen.
    return longest + max_new + shape.span + 1 + max(shape.nodes, shape.tree_slots, shape.span + 1)


def forward_tokens(options: EagleOptions, device: torch.device) -> int | None:
    """The cap on rows x chunk tokens of one prefill forward: `options.prefill_tokens`, else `CPU_FORWARD_TOKENS`
    on a CPU and none elsewhere."""
    if options.prefill_tokens is not None:
        return options.prefill_tokens
    return CPU_FORWARD_TOKENS if torch.device(device).type == "cpu" else None


def cache_slots_needed(longest: int, max_new: int, prefill_chunk: int, shape: TreeShape | None,
                       rows: int = 1, forward_tokens: int | None = None) -> int:
    """Cache slots a call needs before rounding: the prefill's padded span, or `positions_reached`, whichever is
    more, plus the sentinel. Linear in the prompt: prompt + max_new + a constant of the tree shape."""
    plan = prefill_plan(longest, prefill_chunk, rows, forward_tokens)
    prefill_span = plan[-1][0] + plan[-1][1]
    return max(prefill_span, positions_reached(longest, max_new, shape)) + 2
