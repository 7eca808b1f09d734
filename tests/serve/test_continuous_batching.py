"""Continuous batching in the engine, driven without HTTP: requests that arrive while a batch decodes join it
between cycles (a free row, or a larger bucket first), the batch moves back to a smaller bucket when few rows
are left, and every answer is still exactly `eagle_compile.generate`'s greedy output for the request alone
(tiny float64 target, so argmax ties cannot flip across bucket sizes)."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("prometheus_client")

import torch  # noqa: E402
from tiny import random_head, tiny_target, tiny_tokenizer  # noqa: E402

import eagle_compile  # noqa: E402
from eagle_compile.serve.engine import Engine  # noqa: E402
from eagle_compile.serve.protocol import parse_request  # noqa: E402

MODEL = "tiny-llama"
EOS = 2
# one options dict for every test and reference: they share one decoder and its captured programs
OPTIONS = {"calibration_cache": "memory", "batch_buckets": [1, 2, 4], "copy": 4}


@pytest.fixture(scope="module")
def parts():
    tok = tiny_tokenizer()
    model = tiny_target("llama", vocab=len(tok))
    head = random_head(model, flags=True, seed=0, reduced=False)
    return tok, model, head


def request(prompt: str, max_tokens: int, **extra):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return parse_request("completion", json.dumps(body).encode(), MODEL)


def reference(parts, options, prompt: str, max_tokens: int) -> list[int]:
    tok, model, head = parts
    ids = tok(prompt)["input_ids"]
    out = eagle_compile.generate(model, torch.tensor([ids]), draft=head, options={"calibrate": "on", **options},
                                 max_new_tokens=max_tokens, eos_token_id=EOS)
    return out[0, len(ids):].tolist()


def run(engine: Engine, first: list, joiners: list, after_tokens: int) -> dict:
    """Decode `first` as a batch on the engine's own thread; the moment the first request has `after_tokens`
    tokens, submit `joiners` (from inside the decode loop: they arrive while the batch runs)."""
    rows, done = {}, {}

    def sink(name):
        def take(event):
            if event["type"] in ("done", "error"):
                done[name] = event
        return take

    for name, req in first:
        rows[name] = engine.submit(req, sink(name))
    lead = rows[first[0][0]]
    original = lead.add

    def add(new, block):
        original(new, block)
        if len(lead.tokens) >= after_tokens and joiners and not any(n in rows for n, _ in joiners):
            for name, req in joiners:
                rows[name] = engine.submit(req, sink(name))

    lead.add = add
    batches = engine.batches
    engine.start()
    try:
        t0 = time.monotonic()
        while len(done) < len(first) + len(joiners):
            assert time.monotonic() - t0 < 600, f"requests never finished: {sorted(done)}"
            time.sleep(0.02)
    finally:
        engine.stop()
    return {"rows": rows, "done": done, "batches": engine.batches - batches}


def test_requests_join_a_running_batch_and_keep_greedy_exact(parts):
    options = OPTIONS
    tok, model, head = parts
    engine = Engine(model, tok, head, options, model_name=MODEL, join_tokens=128)
    first = [("lead", request("count with me: one two three", 40))]
    joiners = [("a", request("the sky is", 9)), ("b", request("1+1=", 14)), ("c", request("once upon a", 6))]
    out = run(engine, first, joiners, after_tokens=5)
    assert out["batches"] == 1, "the joiners decoded in a batch of their own"
    assert engine.joins == 3
    assert engine.regroups >= 2          # 1 row -> bucket 4 for the joiners, back to a smaller bucket after
    for name, req in first + joiners:
        row = out["rows"][name]
        assert row.finish_reason in ("length", "stop"), (name, out["done"][name])
        want = reference(parts, options, req.prompt, req.max_tokens)
        assert row.tokens == want[:len(row.tokens)] and len(row.tokens) == len(want), name
    assert out["rows"]["a"].batch_rows == 4          # it joined a batch of the lead and the other two joiners


def test_joiner_that_does_not_fit_waits_for_the_next_batch(parts):
    options = OPTIONS
    tok, model, head = parts
    engine = Engine(model, tok, head, options, model_name=MODEL, join_tokens=16)     # caches: the lead's 256 slots
    first = [("lead", request("count with me: one two three", 30))]
    joiners = [("small", request("hi", 3)), ("big", request("the sky is blue because the sun", 240))]
    out = run(engine, first, joiners, after_tokens=3)
    assert engine.joins == 1                          # "small" fit the caches, "big" did not
    assert out["batches"] == 2
    for name, req in first + joiners:
        want = reference(parts, options, req.prompt, req.max_tokens)
        assert out["rows"][name].tokens == want, name


def test_sampled_requests_join_a_greedy_batch_and_seeded_ones_decode_alone(parts):
    """A request with its own sampling setting joins the running greedy batch (its row samples, the others stay
    greedy and exact); a seeded one waits and decodes alone, reproducibly."""
    options = OPTIONS
    tok, model, head = parts
    engine = Engine(model, tok, head, options, model_name=MODEL)
    first = [("lead", request("count with me: one two three", 30))]
    joiners = [("seeded", request("the sky", 5, temperature=0.8, seed=3)),
               ("warm", request("the sea", 12, temperature=0.7, top_p=0.9))]
    out = run(engine, first, joiners, after_tokens=3)
    assert engine.joins == 1 and out["batches"] == 2          # "warm" joined; "seeded" had a batch of its own
    assert all(out["rows"][n].finish_reason in ("length", "stop") for n in ("seeded", "warm"))
    assert out["rows"]["warm"].batch_rows == 2
    keys = [key for key in engine.decoder._steps if key[0][0] == "rows"]
    assert keys, "the mixed batch never ran a per-row program"
    lead = first[0][1]
    assert out["rows"]["lead"].tokens == reference(parts, options, lead.prompt, lead.max_tokens)


def test_a_first_batch_smaller_than_its_bucket_decodes(parts):
    """Three requests waiting together start one batch in bucket 4: its padding row takes a setting too (a
    batch whose size is not a bucket once failed with "a sequence of 4 (one per prompt)")."""
    options = OPTIONS
    tok, model, head = parts
    engine = Engine(model, tok, head, options, model_name=MODEL)
    first = [("a", request("the sky is", 7)), ("b", request("1+1=", 5)), ("c", request("once upon a", 6))]
    out = run(engine, first, [], after_tokens=1)
    assert out["batches"] == 1
    assert {out["rows"][n].batch_rows for n, _ in first} == {3}
    for name, req in first:
        assert out["rows"][name].finish_reason in ("length", "stop"), (name, out["done"][name])
        assert out["rows"][name].tokens == reference(parts, options, req.prompt, req.max_tokens), name
