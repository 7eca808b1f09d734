"""CUDA graphs for the speculative-step program: one capture per batch bucket, replayed every cycle.

The step program has static shapes per (bucket, cache slots) and no host synchronisation, so on CUDA it is
captured once and replayed (COMPILE_FACTS.md §8):

1. the buffers it reads and writes are static: the row state, both KV caches and the uniforms live in a
   `BucketBuffers` that the decoder keeps per bucket and reuses across generate calls;
2. warm-up runs on a side stream first (lazy cuBLAS init, Triton JIT/autotune, dynamo capture happen there);
3. `torch.cuda.graph(g, pool=shared_pool)` captures one cycle; all buckets share one memory pool;
4. each cycle: copy fresh uniforms into the static input, `replay()`, clone the outputs.

Padded rows of a bucket are frozen rows of their own (rows never share cache slots), so they cannot change
real rows; their writes land in their own rows' slots or the sentinel.

The CUDA calls sit in `CudaGraphRuntime`; `GraphedStep` only keeps the books (one capture per bucket, warm-up
and capture leave the buffers as they were, a replay counter, outputs cloned before the next replay). Tests
swap in a runtime that replays on the host, so the books and the decoder's static-buffer path run on CPU too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_compile.runtime.step import StepOutput, StepState


@dataclass
class BucketBuffers:
    """Static buffers of one (bucket, slots) shape. The row state is laid out from the first prefill's state
    (its seed widths are the drafter's), then rewritten in place by every later call."""

    state: StepState | None
    cache: object
    draft_kv: object
    uniforms: torch.Tensor
    final_uniform: torch.Tensor

    def hold(self, state: StepState) -> StepState:
        """Copy ``state`` into the static row state (allocated on first use) and return the static one."""
        if self.state is None:
            self.state = StepState(*(t.clone() for t in _fields(state)))
        else:
            for dst, src in zip(_fields(self.state), _fields(state), strict=True):
                dst.copy_(src)
        return self.state

    def clear_rows(self, rows: list[int]) -> None:
        """Zero these rows of both KV caches (rows that met NaN/+inf logits; see `SpeculativeDecoder`)."""
        for t in _cache_tensors(self.cache, self.draft_kv):
            t[rows] = 0


class CudaGraphRuntime:
    """torch.cuda's graph API as `GraphedStep` uses it: side-stream warm-up, capture into one shared pool."""

    def __init__(self) -> None:
        self.pool = None

    @staticmethod
    def supports(device: torch.device) -> bool:
        return device.type == "cuda"

    def warm_up(self, run, times: int) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(times):
                run()
        torch.cuda.current_stream().wait_stream(stream)

    def capture(self, run):
        """``(graph, outputs)``: ``graph.replay()`` reruns ``run``'s kernels, rewriting ``outputs`` in place."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        return graph, out


class GraphedStep:
    """Replays one graph per bucket around a step program (`StepProgram` or `SpeculativeStep`)."""

    def __init__(self, step, *, warmup: int = 2, runtime=None) -> None:
        self.step = step
        self.warmup = warmup
        self.runtime = runtime if runtime is not None else CudaGraphRuntime()
        self.graphs: dict[tuple[int, int], tuple[object, StepOutput, BucketBuffers]] = {}
        self.replays = 0
        self.captures = 0

    def __call__(self, buffers: BucketBuffers, uniforms: torch.Tensor, final_uniform: torch.Tensor) -> StepOutput:
        key = (buffers.state.n.shape[0], buffers.cache.slots)
        entry = self.graphs.get(key)
        if entry is None or entry[2] is not buffers:
            entry = self._capture(buffers, key)
        graph, out, _ = entry
        buffers.uniforms.copy_(uniforms)
        buffers.final_uniform.copy_(final_uniform)
        graph.replay()
        self.replays += 1
        return StepOutput(accept_len=out.accept_len.clone(), tokens=out.tokens.clone(), finite=out.finite.clone())

    def _capture(self, b: BucketBuffers, key: tuple[int, int]):
        def run() -> StepOutput:
            return self.step(b.state, b.cache, b.draft_kv, b.uniforms, b.final_uniform)

        snapshot = _snapshot(b)
        self.runtime.warm_up(run, self.warmup)   # warm-up mutates the buffers: restored below
        _restore(b, snapshot)
        graph, out = self.runtime.capture(run)
        _restore(b, snapshot)                     # CUDA capture does not run the kernels; a host stand-in does
        self.captures += 1
        self.graphs[key] = (graph, out, b)
        return self.graphs[key]


def _fields(state: StepState) -> tuple[torch.Tensor, ...]:
    return state.n, state.root, state.seed_feedback, state.seed_head, state.active


def buffer_tensors(b: BucketBuffers) -> list[torch.Tensor]:
    """Every tensor a step reads and rewrites in place: the row state, the target's and the draft's KV."""
    return list(_fields(b.state)) + _cache_tensors(b.cache, b.draft_kv)


def _cache_tensors(cache, draft_kv) -> list[torch.Tensor]:
    """The K/V buffers `[B, Hkv, S, hd]` of the target cache and of the draft's (a drafter without one: none)."""
    out = []
    for layer in cache.layers:
        out += [layer.keys, layer.values]
    if getattr(draft_kv, "keys", None) is not None:
        out += [draft_kv.keys, draft_kv.values]
    return out


def _snapshot(b: BucketBuffers) -> list[torch.Tensor]:
    return [t.clone() for t in buffer_tensors(b)]


def _restore(b: BucketBuffers, snapshot: list[torch.Tensor]) -> None:
    for t, saved in zip(buffer_tensors(b), snapshot, strict=True):
        t.copy_(saved)
