"""Measured costs: the on-disk cache hands back only an entry stored for exactly the key asked for (a stale or
foreign entry is never used), and a decoder measures on first need, then later processes reuse the entry."""

from __future__ import annotations

import dataclasses
import json
import shutil

import torch
from tiny import random_head, tiny_target

import eagle_compile
from eagle_compile.calibrate.costs import (
    CostCache,
    CostKey,
    CostTable,
    context_bucket,
    expected_tokens,
    interpolate,
    monotone,
)
from eagle_compile.runtime.generate import _decoders

KEY = CostKey(device="cpu:test:threads=1", dtype="float32", target="Llama(h=32)", draft="EagleDrafter[h=32]",
              lowering="eager",
              menu=("chain1", "tree3x3x8"), batch_bucket=4, context_bucket=512, package="0.1.0", torch="2.13.0")
TABLE = CostTable(cycle={"plain": 0.01, "chain1": 0.012, "tree3x3x8": 0.02}, context=500, verify={1: 0.009},
                  draft_level=0.001)


def test_an_entry_survives_a_new_process(tmp_path):
    CostCache(tmp_path).put(KEY, TABLE)
    got = CostCache(tmp_path).get(KEY)                        # a new cache object: what a later process sees
    assert got is not None and got.cycle == TABLE.cycle and got.verify == {1: 0.009}
    assert str(tmp_path) in got.source
    assert got.relative()["tree3x3x8"] == 2.0


def test_a_stale_entry_is_not_used(tmp_path):
    CostCache(tmp_path).put(KEY, TABLE)
    for field, value in (("package", "0.2.0"), ("torch", "2.14.0"), ("batch_bucket", 8), ("context_bucket", 1024),
                         ("device", "cuda:H200"), ("lowering", "inductor"), ("menu", ("chain1",)),
                         ("draft", "EagleDrafter[h=64]")):
        other = dataclasses.replace(KEY, **{field: value})
        assert CostCache(tmp_path).get(other) is None, field


def test_a_foreign_entry_under_the_right_name_is_refused(tmp_path):
    """A file copied in from another machine (or renamed) keeps its own key inside: it is not used."""
    cache = CostCache(tmp_path)
    foreign = dataclasses.replace(KEY, device="cpu:another-machine:threads=64")
    cache.put(foreign, TABLE)
    shutil.copy(cache.path(foreign), cache.path(KEY))
    fresh = CostCache(tmp_path)
    assert fresh.get(KEY) is None
    assert "device" in fresh.refused[0]
    cache.path(KEY).write_text("{not json")
    assert CostCache(tmp_path).get(KEY) is None                 # unreadable: measured again, never a crash
    record = json.loads(cache.path(foreign).read_text())
    record["costs"]["cycle"].pop("tree3x3x8")
    cache.path(foreign).write_text(json.dumps(record))
    assert CostCache(tmp_path).get(foreign) is None             # programs missing: not this menu's table


def test_memory_only_cache_writes_nothing(tmp_path):
    cache = CostCache(None)
    cache.put(KEY, TABLE)
    assert cache.get(KEY) is TABLE and cache.path(KEY) is None


def test_curve_helpers():
    assert context_bucket(1) == 256 and context_bucket(257) == 512 and context_bucket(10 ** 9) == 131072
    assert interpolate({1: 1.0, 4: 2.5}, 2) == 1.5
    assert monotone({1: 1.0, 2: 0.9, 4: 1.4}) == {1: 1.0, 2: 1.0, 4: 1.4}
    assert expected_tokens([1.0, 0.5]) == 2.5


def test_a_decoder_measures_once_and_a_new_decoder_reuses_the_cache(tmp_path):
    target = tiny_target("llama", seed=2, dtype=torch.float32)
    head = random_head(target, flags=True, seed=1, reduced=False).float()
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    options = {"chain": 1, "calibrate": "on", "calibration_cache": str(tmp_path), "prefill_chunk": 8}   # menu of 3
    first = eagle_compile.generate(target, ids, draft=head, options=options, max_new_tokens=6,
                                   return_dict_in_generate=True)
    assert first.stats.calibration_time > 0
    (costs,) = first.stats.calibration["costs"].values()
    assert "measured now" in costs and len(list(tmp_path.glob("*.json"))) == 1
    _decoders.pop(target)                                       # a fresh decoder, as in a new process
    second = eagle_compile.generate(target, ids, draft=head, options=options, max_new_tokens=6,
                                    return_dict_in_generate=True)
    (costs,) = second.stats.calibration["costs"].values()
    assert f"cost cache {tmp_path}" in costs and second.stats.calibration_time == 0
    assert torch.equal(first.sequences, second.sequences)
    report = eagle_compile.explain(target, file=open("/dev/null", "w"))
    assert "calibration: adaptive" in report and "cost cache" in report and "cycle / plain" in report
    assert "observed: plain" in report                          # and the cycles observed since (observed.py)


def test_another_head_is_another_cost_entry(tmp_path):
    """A draft level's cost is the head's: a head with another draft vocabulary on the same target and cache is
    measured for itself, while a second head of the same sizes (other weights) reuses the first one's entry."""
    target = tiny_target("llama", seed=2, dtype=torch.float32)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    options = {"chain": 1, "calibrate": "on", "calibration_cache": str(tmp_path), "prefill_chunk": 8}

    def run(head):
        _decoders.pop(target, None)
        out = eagle_compile.generate(target, ids, draft=head, options=options, max_new_tokens=4,
                                     return_dict_in_generate=True)
        (costs,) = out.stats.calibration["costs"].values()
        return costs

    assert "measured now" in run(random_head(target, flags=True, seed=1, reduced=False).float())
    assert "measured now" in run(random_head(target, flags=True, seed=1, reduced=True).float())    # 48-token vocab
    assert "cost cache" in run(random_head(target, flags=True, seed=5, reduced=True).float())      # same sizes
    assert len(list(tmp_path.glob("*.json"))) == 2
