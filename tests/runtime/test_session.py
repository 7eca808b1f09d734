"""`DecodeSession` (runtime/session.py): rows that join a running batch and batches that regroup into another
bucket decode exactly as each row alone (float64 tiny target, so argmax ties cannot flip with the bucket), with
the calibration rotating through every program (plain steps stash features for the draft's re-sync, which a
join or regroup must flush first) and the copy branch on (its per-row history follows the rows)."""

from __future__ import annotations

import pytest
import torch
from tiny import greedy_reference, random_head, rotate_programs, tiny_target

from eagle_compile.calibrate.menu import PLAIN
from eagle_compile.options import parse_options
from eagle_compile.runtime.generate import decoder_for
from eagle_compile.runtime.sampling import SamplingParams
from eagle_compile.runtime.stopping import StopChecker

NEW = 18


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama")
    head = random_head(target, flags=True, seed=3, reduced=False)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (n,), generator=gen) for n in (5, 17, 9, 30, 12)]
    want = [greedy_reference(target, p[None], max_new_tokens=NEW)[0, len(p):].tolist() for p in prompts]
    return target, head, prompts, want


def session_of(setup, monkeypatch, first: list[int], rows: int):
    rotate_programs(monkeypatch)
    target, head, prompts, _ = setup
    options = parse_options({"calibrate": "on", "calibration_cache": "memory", "batch_buckets": [1, 2, 4, 8],
                             "copy": 4})
    decoder = decoder_for(target, head, options)
    pad = prompts[0][:1]
    padded = [prompts[i] for i in first] + [pad] * (rows - len(first))
    stopper = StopChecker(padded, max_new_tokens=NEW, eos_token_ids=())
    for b in range(len(first), rows):
        stopper.finished[b] = True
    session = decoder.session(padded, stopper, SamplingParams(), min_slots=128)
    return session, stopper


def test_rows_join_free_rows_and_regroup_across_buckets(setup, monkeypatch):
    _, _, prompts, want = setup
    session, stopper = session_of(setup, monkeypatch, [0, 1], rows=4)
    who = [0, 1, None, None]                       # which prompt each row of the bucket holds
    done = {}

    def settle():                                  # rows that stopped give their tokens back and become free
        for b, p in enumerate(who):
            if p is not None and not bool(session.active[b]):
                done[p] = list(stopper.generated[b])
                who[b] = None

    for _ in range(3):
        session.cycle()
    settle()
    stopper.replace(2, prompts[2])                 # a padding row taken mid-flight
    session.join([2], [prompts[2]])
    who[2] = 2
    for _ in range(2):
        session.cycle()
    settle()
    order = [b for b in reversed(range(4)) if who[b] is not None]   # grow to 8, rows in another order
    session.regroup(order, 8)
    who = [who[b] for b in order] + [None] * (8 - len(order))
    assert session.batch == 8
    free = session.free_rows()[:2]
    for b, p in zip(free, (3, 4), strict=True):
        stopper.replace(b, prompts[p])
        who[b] = p
    session.join(free, [prompts[3], prompts[4]])
    while session.running:
        session.cycle()
        settle()
        running = [b for b in range(session.batch) if who[b] is not None]
        if running and session.decoder.bucket_for(len(running)) <= session.batch // 2:
            session.regroup(running)               # shrink to the smallest bucket that holds them
            who = [who[b] for b in running] + [None] * (session.batch - len(running))
    settle()
    stats = session.finish()
    assert session.joins == 3 and session.regroups >= 2
    assert session.batch < 8, "the batch never moved to a smaller bucket"
    assert stats.calibration["policy"]["chosen"].get(PLAIN, 0) > 0, "no plain step ran: the re-sync flush went untested"
    for p in range(len(prompts)):
        assert done[p] == want[p], p


def test_join_and_regroup_refuse_running_rows(setup, monkeypatch):
    _, _, prompts, _ = setup
    session, stopper = session_of(setup, monkeypatch, [0, 1], rows=2)
    session.cycle()
    with pytest.raises(ValueError, match="still decoding"):
        session.join([0], [prompts[2]])
    with pytest.raises(ValueError, match="drop running rows"):
        session.regroup([0])
    assert not session.fits(20, 10_000)            # past the caches (and the tiny target's 512-token window)
    assert session.fits(4, 8)


def test_sampled_rows_join_a_greedy_batch_and_the_greedy_rows_stay_exact(setup, monkeypatch):
    """Rows with their own sampling settings join (and regroup with) greedy rows: the batch runs the per-row
    programs while they decode, and the greedy rows' tokens are still exactly each prompt's greedy output."""
    _, _, prompts, want = setup
    hot = SamplingParams(do_sample=True, temperature=0.9, top_k=20, top_p=0.9)
    warm = SamplingParams(do_sample=True, temperature=1.2)
    session, stopper = session_of(setup, monkeypatch, [0, 1], rows=4)
    session.generator = torch.Generator().manual_seed(0)
    session.cycle()
    stopper.replace(2, prompts[2])
    session.join([2], [prompts[2]], hot)
    assert session.sampling.rows[2] == hot                     # a mixed batch: one setting per row
    session.cycle()
    session.regroup([2, 0, 1], 8)                              # the settings follow their rows
    assert session.settings[:3] == [hot, SamplingParams(), SamplingParams()]
    stopper.replace(3, prompts[3])
    session.join([3], [prompts[3]], [warm])
    while session.running:
        session.cycle()
    keys = [key for key in session.decoder._steps if key[0][0] == "rows"]
    assert keys, "no per-row program ran"
    assert stopper.generated[1] == want[0] and stopper.generated[2] == want[1]
    assert len(stopper.generated[0]) == NEW and len(stopper.generated[3]) == NEW   # the sampled rows decoded
