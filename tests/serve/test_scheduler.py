"""Which waiting requests decode together (no server, no model)."""

from __future__ import annotations

from eagle_compile.runtime.logits_processors import ProcessorSettings
from eagle_compile.runtime.sampling import SamplingParams
from eagle_compile.serve.protocol import GenerationRequest
from eagle_compile.serve.row import Row
from eagle_compile.serve.scheduler import Scheduler, group_key

GREEDY = SamplingParams(do_sample=False)
HOT = SamplingParams(do_sample=True, temperature=0.7)


def row(sampling, seed=None, events=None):
    request = GenerationRequest(kind="completion", model="m", max_tokens=4, sampling=sampling, prompt="x", seed=seed)
    return Row(request, [5], (events if events is not None else []).append, tokenizer=None, stop_ids=frozenset())


def test_requests_of_any_sampling_setting_share_batches_in_arrival_order():
    s = Scheduler(max_rows=2)
    g1, h1, g2, g3, h2 = row(GREEDY), row(HOT), row(GREEDY), row(GREEDY), row(HOT)
    for r in (g1, h1, g2, g3, h2):
        s.submit(r)
    assert s.next_batch(0) == [g1, h1]              # each row keeps its own setting; up to max_rows
    assert s.next_batch(0) == [g2, g3]
    assert s.next_batch(0) == [h2]
    assert s.next_batch(0) == []


def test_requests_with_other_logits_processors_never_share_a_batch():
    s = Scheduler(max_rows=8)
    penalised = SamplingParams(processors=ProcessorSettings(repetition_penalty=1.3))
    g1, p1, h1 = row(GREEDY), row(penalised), row(HOT)
    for r in (g1, p1, h1):
        s.submit(r)
    assert s.next_batch(0) == [g1, h1]
    assert s.take(group_key(p1), 8, lambda r: True) == [p1]


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
