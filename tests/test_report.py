"""eagle_compile.explain reports passes, kernels, CUDA-graph buckets and the tree shape."""

from __future__ import annotations

import pytest
import torch
from tiny import greedy_reference, ragged_batch, random_head, tiny_target

import eagle_compile


def test_explain_before_and_after_generate():
    model = tiny_target("qwen2", seed=8)
    head = random_head(model, flags=True, seed=4, reduced=True)
    compiled = torch.compile(model, backend="eagle31", options={
        "depth": 2, "top_k": 2, "total_tokens": 4, "prefill_chunk": 8, "step_program": True, "draft": head})
    before = eagle_compile.explain(compiled)
    assert "nothing captured yet" in before
    ids, mask = ragged_batch(1, seed=1)
    compiled.generate(ids, attention_mask=mask, max_new_tokens=5)
    after = eagle_compile.explain(compiled)
    assert "tree depth=2 top_k=2 total_tokens=4 (from options)" in after
    assert "lowering: eager (the rewritten FX graph): inner_backend='auto': eager for cpu torch.float64" in after
    assert "prefill graph runs eager" in after and "step graph runs eager" in after
    assert "target program graph: locate_layers 8, tap_features 3, tree_attention 8" in after
    assert "step program graph (greedy): locate_layers 8, tap_features 3" in after
    for op in ("tree_attention", "fc_norm_fuse", "draft_topk", "kv_compact", "accept_greedy", "accept_sample"):
        assert op in after
    assert "reference" in after and "float64" in after          # why the reference runs here


def test_explain_plain_mode_and_an_inductor_lowering_scoped_to_our_programs():
    import torch._inductor.config as inductor_config

    model = tiny_target("llama", seed=8)
    before = inductor_config.get_config_copy()
    compiled = torch.compile(model, backend="eagle31", options={
        "speculate": False, "prefill_chunk": 16, "inner_backend": "inductor", "inductor_config": "default"})
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    out = compiled.generate(ids, max_new_tokens=4, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy_reference(model, ids, max_new_tokens=4))
    text = eagle_compile.explain(compiled)
    assert "plain decoding (speculate=False)" in text
    assert "lowering: inductor {}: inner_backend='inductor', inductor_config='default'" in text
    assert "prefill graph runs eager (prefill)" in text
    assert "step graph runs inductor, compiled in" in text and out.stats.compile_time > 0
    assert inductor_config.get_config_copy() == before, "the user's global inductor config is untouched"


def test_freezing_traces_parameters_as_constants_for_our_programs_only():
    from eagle_compile.lowering import make_lowering

    lowering = make_lowering("inductor", "freezing", "test")
    assert lowering.freezing and not torch._dynamo.config.prepare_freezing
    with lowering.tracing("step"):
        assert torch._dynamo.config.prepare_freezing
    with lowering.tracing("prefill"):
        assert not torch._dynamo.config.prepare_freezing
    assert not torch._dynamo.config.prepare_freezing


def test_cudagraphs_on_cpu_say_so_and_stay_exact():
    model = tiny_target("llama", seed=8)
    head = random_head(model, flags=False, seed=4, reduced=False)
    ids, mask = ragged_batch(3, seed=1)
    with pytest.warns(UserWarning, match="CUDA graphs need a CUDA device"):
        out = eagle_compile.generate(model, ids, attention_mask=mask, draft=head, max_new_tokens=6,
                                     options={"chain": 2, "prefill_chunk": 8, "cudagraphs": True},
                                     return_dict_in_generate=True)
    assert out.stats.cuda_graph_replays == 0
    assert any("cudagraphs=True ignored" in n for n in out.stats.notes)
    assert torch.equal(out.sequences, greedy_reference(model, ids, attention_mask=mask, max_new_tokens=6))
