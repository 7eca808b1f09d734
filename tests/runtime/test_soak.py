"""A short soak: after a warm-up, dozens of mixed `generate` calls (rows, prompt lengths, max_new_tokens, greedy
and sampled with a new temperature / top_k / top_p nearly every call) grow no captured graph, no dynamo cache
entry, no decoder book and no live tensor byte (`eagle_compile.footprint` / `growth`).

Negative controls prove each counter moves: outputs kept alive by the caller show up as live tensor bytes (and
go away when dropped), a tensor kept by one of our objects shows up as held bytes (what a captured program's
pass examples did), a new bucket counts as new graphs and cache entries, a new option value as a new decoder and
its graphs. Steps, step programs and CUDA graphs are kept per sampling program key, not per value (host replay
stand-in for the CUDA graphs, at most `MAX_GRAPHED_KEYS` keys), and a captured step program drops its pass
examples. The long soak with figures is benchmarks/soak.py.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from test_graph_books import HostReplay
from tiny import ragged, random_head, tiny_target

import eagle_compile
from eagle_compile.options import parse_options
from eagle_compile.runtime.decoder import MAX_GRAPHED_KEYS
from eagle_compile.runtime.footprint import footprint, growth, held_tensor_bytes
from eagle_compile.runtime.generate import _decoders, decoder_for
from eagle_compile.runtime.sampling import SamplingParams

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
OPTIONS = {"depth": 3, "top_k": 2, "total_tokens": 6, "prefill_chunk": 64, "batch_buckets": (1, 2, 4)}
RANGES = {"max_rows": 2, "prompts": (3, 40), "new": (1, 12)}
VOCAB = 96


def _soak_module():
    sys.path.insert(0, str(BENCHMARKS))          # soak.py imports the benchmarks' common.py
    spec = importlib.util.spec_from_file_location("soak_benchmark", BENCHMARKS / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module              # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def warm():
    """A compiled tiny target after the soak's warm-up (buckets 1 and 2, both prefill chunk sizes, greedy and
    sampled), one thread (the machine is shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    soak = _soak_module()
    model = tiny_target("llama", seed=11)
    head = random_head(model, flags=True, seed=12, reduced=True)
    compiled = torch.compile(model, backend="eagle31", options={**OPTIONS, "draft": head})
    for call in soak.warmup_calls(OPTIONS["batch_buckets"], **RANGES):
        soak.run_call(compiled, call, VOCAB)
    yield soak, model, head, compiled
    torch.set_num_threads(threads)


def _not_rss(lines: list[str]) -> list[str]:
    return [g for g in lines if not g.startswith("rss_bytes")]     # RSS is the benchmark's figure, not asserted


def test_mixed_calls_after_warm_up_grow_nothing(warm):
    soak, model, _, compiled = warm
    calls = soak.soak_calls(48, seed=5, **RANGES)
    result = soak.run_soak(compiled, calls, [], VOCAB, every=16)
    did = result["did"]
    # the stress happened: both buckets, greedy and many distinct sampling settings, real cycles
    assert did["rows"] == [1, 2] and 0 < did["greedy_calls"] < 48
    assert did["sampling_settings"] >= 20 and did["cycles"] > 48 and did["new_tokens"] > 48
    assert result["before"]["fx_graphs"] > 0 and result["before"]["cache_entries"]["TargetProgram._forward"] > 0
    assert _not_rss(result["growth"]) == []
    keys = {SamplingParams(**c.sampling).program_key for c in calls}
    assert len(keys) == 7        # greedy; top-k buckets 0 / 32 / 64 x top-p on / off
    assert result["after"]["books"]["steps"] == len(keys)  # one host-loop step per key, whatever the values
    assert len({s["fx_graphs"] for s in result["samples"]}) == 1


def test_outputs_kept_by_the_caller_are_caught_and_released(warm):
    soak, _, _, compiled = warm
    calls = soak.soak_calls(4, seed=6, **RANGES)
    before = footprint(compiled)
    kept = []
    for call in calls:
        ids, mask = soak.prompt_ids(call, VOCAB)
        kept.append(compiled.generate(ids, attention_mask=mask, max_new_tokens=call.max_new_tokens, **call.sampling))
    grew = _not_rss(growth(before, footprint(compiled)))
    assert {g.split(":")[0] for g in grew} == {"live_tensors", "live_tensor_bytes"}, grew
    del kept, ids, mask                               # the last prompt too: every tensor counts
    assert _not_rss(growth(before, footprint(compiled))) == []


def test_a_tensor_held_by_our_objects_is_counted(warm):
    _, model, _, compiled = warm
    before = footprint(compiled)
    (decoder,) = _decoders[model].values()
    context = decoder.program.contexts[0]
    context.step_examples = torch.zeros(1000, dtype=torch.float64)     # what captured programs used to keep
    try:
        after = footprint(compiled)
        assert after.held_bytes == before.held_bytes + 8000 == held_tensor_bytes(decoder)
        assert {g.split(":")[0] for g in _not_rss(growth(before, after))} == {"held_bytes", "live_tensors",
                                                                            "live_tensor_bytes"}
    finally:
        context.step_examples = None


def test_a_new_bucket_and_a_new_option_value_count_as_new_graphs(warm):
    soak, model, head, compiled = warm
    before = footprint(compiled)
    ids, mask = ragged([7, 9, 5], seed=8)                     # 3 rows: bucket 4, never run so far
    compiled.generate(ids, attention_mask=mask, max_new_tokens=3)
    grew = {g.split(":")[0] for g in growth(before, footprint(compiled))}
    assert {"fx_graphs", "cache_entries.TargetProgram._forward", "books.target_graphs"} <= grew, grew
    before = footprint(compiled)
    eagle_compile.generate(model, ids[:1], attention_mask=mask[:1], draft=head, options={**OPTIONS, "depth": 2},
                           max_new_tokens=3)                  # another tree depth: another decoder
    grew = {g.split(":")[0] for g in growth(before, footprint(compiled))}
    assert {"decoders", "fx_graphs", "books.steps", "cache_entries.TargetProgram._forward"} <= grew, grew


def test_cuda_graphs_serve_every_value_of_a_program_key_and_keep_a_bounded_number_of_keys():
    model = tiny_target("llama", seed=13)
    head = random_head(model, flags=True, seed=14, reduced=True)
    options = {**OPTIONS, "cudagraphs": True}
    decoder = decoder_for(model, head, parse_options(options))
    decoder.graph_runtime = HostReplay()
    ids, mask = ragged([6], seed=9)

    def call(**sampling):
        eagle_compile.generate(model, ids, attention_mask=mask, draft=head, options=options, max_new_tokens=3,
                               do_sample=True, **sampling)

    for t, k, p in ((0.6, 20, 0.9), (0.9, 17, 0.8), (1.4, 31, 0.5)):     # one program key: top-k bucket 32, top-p
        call(temperature=t, top_k=k, top_p=p)
    assert decoder.books()["graphed_steps"] == 1 and decoder.graph_runtime.warmup_runs == 2     # captured once
    buckets = [1 << i for i in range(MAX_GRAPHED_KEYS + 2)]         # top-k buckets 1, 2, 4, ...: new keys
    for k in buckets:
        call(top_k=k)
    books = decoder.books()
    assert books["graphed_steps"] == MAX_GRAPHED_KEYS and books["steps"] == 1 + len(buckets)
    assert decoder.cuda_graphs_captured == MAX_GRAPHED_KEYS          # one bucket each
    captures = decoder.graph_runtime.warmup_runs
    assert captures == 2 * (1 + len(buckets))
    call(top_k=buckets[-1], temperature=0.7)           # kept: replayed with its new temperature, not recaptured
    assert decoder.graph_runtime.warmup_runs == captures
    call(top_k=buckets[0])                             # evicted: captured again
    assert decoder.graph_runtime.warmup_runs == captures + 2
    assert decoder.books()["graphed_steps"] == MAX_GRAPHED_KEYS


def test_a_step_program_serves_new_sampling_values_without_a_new_capture_and_keeps_no_pass_examples():
    model = tiny_target("llama", seed=15)
    head = random_head(model, flags=True, seed=16, reduced=True)
    options = {**OPTIONS, "step_program": True}
    ids, mask = ragged([5], seed=10)
    for t, k, p in ((0.7, 20, 0.9), (1.3, 25, 0.6)):             # one program key: top-k bucket 32, top-p on
        eagle_compile.generate(model, ids, attention_mask=mask, draft=head, options=options, max_new_tokens=3,
                               do_sample=True, temperature=t, top_k=k, top_p=p)
    decoder = decoder_for(model, head, parse_options(options))
    (program,) = [s for s in decoder._steps.values() if hasattr(s, "contexts")]
    assert program.graphs_captured == 1
    assert all(ctx.step_examples is None for ctx in program.contexts)
    assert held_tensor_bytes(decoder) == 3 * 8          # only its SamplingValues: three 0-dim 8-byte tensors
    before = footprint(model)
    eagle_compile.generate(model, ids, attention_mask=mask, draft=head, options=options, max_new_tokens=3,
                           do_sample=True, top_k=50, top_p=1.0)   # another key: a new program (negative control)
    grew = {g.split(":")[0] for g in growth(before, footprint(model))}
    assert {"fx_graphs", "books.step_programs", "cache_entries.SpeculativeStep.__call__"} <= grew, grew


def test_a_dropped_model_frees_its_decoders_and_captured_graphs():
    """Decoders live on their model (runtime/decoder_registry.py) and each program's dynamo state on the program
    (runtime/program_lifetime.py): once the caller drops a model, its decoders, programs and captured graphs go,
    with no torch._dynamo.reset(). Before, a process kept every model it ever decoded. Negative control: a model
    the caller still holds keeps its graphs and cache entries."""
    import gc
    import weakref

    import eagle_compile.runtime.step as step
    import eagle_compile.runtime.target_program as target_program
    from eagle_compile.runtime.footprint import dynamo_cache_entries

    def graphs() -> int:          # dynamo installs each captured graph as a global of the compiled code's module
        return sum(name.startswith("__compiled_fn") for module in (target_program, step) for name in vars(module))

    def decode(seed: int, programs: tuple[dict, ...]):
        model = tiny_target("llama", seed=seed)
        head = random_head(model, flags=True, seed=seed + 1, reduced=True)
        ids, mask = ragged([6, 4], seed=seed)
        for options in programs:
            eagle_compile.generate(model, ids, attention_mask=mask, draft=head, options=options, max_new_tokens=4)
        return model

    gc.collect()
    before, entries_before = graphs(), dynamo_cache_entries()
    kept = decode(17, (OPTIONS,))
    held, entries_held = graphs(), dynamo_cache_entries()
    assert held > before and entries_held["TargetProgram._forward"] > entries_before["TargetProgram._forward"]
    # a host-loop step and a step program (its own graphs: dynamo's entries on SpeculativeStep.__call__ too)
    dropped = weakref.ref(decode(19, (OPTIONS, {**OPTIONS, "step_program": True})))
    gc.collect()
    assert dropped() is None
    assert graphs() == held and dynamo_cache_entries() == entries_held      # the kept model's stay
    del kept
    gc.collect()
    assert graphs() == before and dynamo_cache_entries() == entries_before
