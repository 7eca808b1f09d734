"""Which waiting requests decode together (no server, no model)."""

from __future__ import annotations

from eagle_compile.runtime.sampling import SamplingParams
from eagle_compile.serve.protocol import GenerationRequest
from eagle_compile.serve.row import Row
from eagle_compile.serve.scheduler import Scheduler

GREEDY = SamplingParams(do_sample=False)
HOT = SamplingParams(do_sample=True, temperature=0.7)


def row(sampling, seed=None, events=None):
    request = GenerationRequest(kind="completion", model="m", max_tokens=4, sampling=sampling, prompt="x", seed=seed)
    return Row(request, [5], (events if events is not None else []).append, tokenizer=None, stop_ids=frozenset())


def test_batches_group_by_setting_in_arrival_order():
    s = Scheduler(max_rows=2)
    g1, h1, g2, g3, h2 = row(GREEDY), row(HOT), row(GREEDY), row(GREEDY), row(HOT)
    for r in (g1, h1, g2, g3, h2):
        s.submit(r)
    assert s.next_batch(0) == [g1, g2]              # the oldest request's setting, up to max_rows
    assert s.next_batch(0) == [h1, h2]
    assert s.next_batch(0) == [g3]
    assert s.next_batch(0) == []


def test_seeded_sampling_decodes_alone_and_greedy_ignores_the_seed():
    s = Scheduler(max_rows=8)
    a, b, c, d = row(HOT, seed=1), row(HOT, seed=1), row(GREEDY, seed=3), row(GREEDY)
    for r in (a, b, c, d):
        s.submit(r)
    assert s.next_batch(0) == [a]
    assert s.next_batch(0) == [b]
    assert s.next_batch(0) == [c, d]


def test_aborted_waiting_requests_never_reach_the_decoder():
    s = Scheduler(max_rows=8)
    events = []
    gone, kept = row(GREEDY, events=events), row(GREEDY)
    s.submit(gone)
    s.submit(kept)
    gone.abort()
    assert s.next_batch(0) == [kept]
    assert gone.finish_reason == "abort" and events == []     # an aborted row sends nothing
