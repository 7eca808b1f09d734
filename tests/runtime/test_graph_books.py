"""The CUDA-graph path's books on CPU: `GraphedStep` and the decoder's static bucket buffers, run with a host
stand-in for the CUDA graph API (capture records the step and its outputs, replay reruns it and rewrites
those outputs in place, as a graph rewrites its static output memory).

What this proves: one capture per (bucket, slots), warm-up and capture leave the buffers as they were,
buffers reused across calls with other prompts and row counts carry nothing over, padded rows never change
real rows, outputs are cloned before the next replay, and the replay counter counts cycles. What it cannot
prove: that the CUDA capture itself records what the host runs (that needs a GPU: benchmarks/gpu_check.py).
"""

from __future__ import annotations

import pytest
import torch
from tiny import ScriptedDrafter, greedy_reference, ragged, random_head, tiny_target

import eagle_compile
from eagle_compile.options import parse_options
from eagle_compile.runtime.cuda_graphs import GraphedStep, buffer_tensors
from eagle_compile.runtime.generate import decoder_for
from eagle_compile.runtime.step import StepOutput

OPTIONS = {"depth": 3, "top_k": 2, "total_tokens": 6, "prefill_chunk": 8, "batch_buckets": (1, 2, 4),
           "cudagraphs": True}


class HostReplay:
    """The CUDA graph API's contract, on the host."""

    def __init__(self) -> None:
        self.warmup_runs = 0

    @staticmethod
    def supports(device: torch.device) -> bool:
        return True

    def warm_up(self, run, times: int) -> None:
        for _ in range(times):
            run()
        self.warmup_runs += times

    def capture(self, run):
        out = run()
        return _Replay(run, out), out


class _Replay:
    def __init__(self, run, out: StepOutput) -> None:
        self.run, self.out = run, out

    def replay(self) -> None:
        new = self.run()
        for name in ("accept_len", "tokens", "finite"):
            getattr(self.out, name).copy_(getattr(new, name))


def _half_right(ids, mask, ref):
    """Each row's true continuation with every third token wrong: the oracle's acceptance varies 1..depth+1."""
    width = ids.shape[1]
    rows = []
    for i in range(ids.shape[0]):
        prompt = [t for t, m in zip(ids[i].tolist(), mask[i].tolist(), strict=True) if m]
        new = [(t + 1) % 96 if j % 3 == 2 else t for j, t in enumerate(ref[i, width:].tolist())]
        rows.append(prompt + new)
    return rows


def _graphed_decoder(model, drafter, options):
    decoder = decoder_for(model, drafter, parse_options(options))
    decoder.graph_runtime = HostReplay()
    return decoder


@pytest.mark.parametrize("step_program", [False, True])
def test_buckets_reused_across_calls_give_the_eager_tokens(step_program):
    model = tiny_target("llama", seed=21)
    options = {**OPTIONS, "step_program": step_program}
    if step_program:      # the captured step program needs a traceable drafter: a real (random) head
        drafter = random_head(model, flags=True, seed=4, reduced=True)
    else:                 # the eager step takes a scripted drafter whose acceptance varies
        drafter = ScriptedDrafter([], 96, "oracle")
    decoder = _graphed_decoder(model, drafter, options)
    # bucket 4 (3 rows), bucket 1, bucket 4 again with other prompts (stale buffers), bucket 2
    for lengths, seed in (([4, 13, 9], 1), ([6], 2), ([11, 3, 7], 3), ([5, 9], 4)):
        ids, mask = ragged(lengths, seed)
        ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=14)
        if not step_program:
            drafter.continuations = _half_right(ids, mask, ref)
        out = eagle_compile.generate(model, ids, attention_mask=mask, draft=drafter, options=options,
                                     max_new_tokens=14, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref), lengths
        assert out.stats.cuda_graph_replays == out.stats.cycles > 0
        if not step_program:
            assert len(set(out.stats.acceptance_lengths)) > 1        # partial acceptance did happen
    (graphed,) = [s for s in decoder._steps.values() if isinstance(s, GraphedStep)]
    assert sorted(graphed.graphs) == sorted(decoder._bucket_buffers)    # one capture per (bucket, slots)...
    assert graphed.captures == len(decoder._bucket_buffers) == 3        # ...and the second bucket-4 call reused it
    assert decoder.graph_runtime.warmup_runs == 3 * graphed.warmup


def test_warm_up_and_capture_leave_the_buffers_and_outputs_are_not_overwritten():
    model = tiny_target("qwen2", seed=8)
    head = random_head(model, flags=True, seed=5, reduced=True)
    decoder = _graphed_decoder(model, head, OPTIONS)
    ids, mask = ragged([6, 10], 7)
    eagle_compile.generate(model, ids, attention_mask=mask, draft=head, options=OPTIONS, max_new_tokens=4)
    (graphed,) = [s for s in decoder._steps.values() if isinstance(s, GraphedStep)]
    (buffers,) = decoder._bucket_buffers.values()

    # a fresh capture from these buffers must leave them exactly as they were before it
    buffers.state.active.fill_(True)                  # every row steps, so a step does change the buffers
    before = [t.clone() for t in buffer_tensors(buffers)]
    graphed.graphs.clear()
    u, fu = buffers.uniforms.clone(), buffers.final_uniform.clone()
    first = graphed(buffers, u, fu)
    after_capture_and_one_replay = [t.clone() for t in buffer_tensors(buffers)]
    # what one plain step does to the same starting buffers
    for t, saved in zip(buffer_tensors(buffers), before, strict=True):
        t.copy_(saved)
    plain = graphed.step(buffers.state, buffers.cache, buffers.draft_kv, u, fu)
    for got, want in zip(after_capture_and_one_replay, buffer_tensors(buffers), strict=True):
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    stepped = buffer_tensors(buffers)
    assert not all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(before, stepped, strict=True))
    assert torch.equal(first.tokens, plain.tokens) and torch.equal(first.accept_len, plain.accept_len)
    # the returned output is a copy: the next replay rewrites the graph's outputs, not what the caller holds
    kept = first.tokens.clone()
    graphed(buffers, u, fu)
    assert torch.equal(first.tokens, kept)
