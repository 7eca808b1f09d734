"""Lowering: inductor settings apply to eagle31's programs only, never to the user's global inductor config."""

import pytest
import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config

from eagle_compile.errors import OptionsError
from eagle_compile.lowering import Lowering, resolve_inductor_config


def test_inductor_settings_are_scoped_to_our_programs():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 16)
    gm = torch.fx.symbolic_trace(module)
    before = (inductor_config.fallback_random, dynamo_config.prepare_freezing)
    patches = resolve_inductor_config({"fallback_random": not inductor_config.fallback_random})
    lowering = Lowering(backend="inductor", config=patches)
    with torch.no_grad():
        fn = lowering.compile(gm, [x])
        out = fn(x)
    assert torch.allclose(out[0] if isinstance(out, (list, tuple)) else out, module(x), atol=1e-6)
    assert (inductor_config.fallback_random, dynamo_config.prepare_freezing) == before, "a global setting moved"
    assert lowering.compiled and lowering.compiled[0][0] == "step", "the compile was not recorded"
    with Lowering(backend="inductor", config={"freezing": True}).tracing():
        assert dynamo_config.prepare_freezing, "freezing needs parameters traced as attributes inside our scope"
    assert dynamo_config.prepare_freezing == before[1], "the scope leaked"


def test_numerics_resolve_per_device_dtype_and_backend():
    from eagle_compile.lowering import lowering_for

    assert lowering_for("auto", None, "cpu", torch.float32, "auto").numerics == "batch_invariant"
    assert lowering_for("auto", None, "cpu", torch.float64, "auto").numerics == "eager"
    assert lowering_for("eager", None, "cpu", torch.float32, "eager").numerics == "eager"
    assert lowering_for("inductor", None, "cpu", torch.float32, "auto").numerics == "eager"
    with pytest.raises(OptionsError, match="inductor"):
        lowering_for("inductor", None, "cpu", torch.float32, "batch_invariant")
    with pytest.raises(OptionsError, match="float32 CPU"):
        lowering_for("auto", None, "cpu", torch.bfloat16, "batch_invariant")
    with pytest.raises(OptionsError, match="valid values"):
        lowering_for("auto", None, "cpu", torch.float32, "fast")


def test_a_worker_thread_decodes_with_the_raised_recompile_cap():
    """torch 2.13 keeps config overrides per thread: a thread starts with dynamo's defaults, whatever the main
    thread set. A decoder called from a serving thread must raise the cap in that thread, or a process past 256
    programs (a test session, a server with many buckets) refuses to compile (found: the server tests in a full
    test run)."""
    import threading

    from tiny import ScriptedDrafter, greedy_reference, tiny_target

    from eagle_compile.lowering import ACCUMULATED_RECOMPILE_LIMIT, allow_many_programs

    allow_many_programs()
    assert dynamo_config.accumulated_recompile_limit >= ACCUMULATED_RECOMPILE_LIMIT
    model = tiny_target("llama", seed=1)
    ids = torch.tensor([[3, 9, 4, 7]])
    ref = greedy_reference(model, ids, max_new_tokens=6)
    seen: dict = {}

    def work():
        seen["before"] = dynamo_config.accumulated_recompile_limit
        compiled = torch.compile(model, backend="eagle31",
                                 options={"chain": 2, "draft": ScriptedDrafter([ref[0].tolist()], 96, "oracle")})
        seen["out"] = compiled.generate(ids, max_new_tokens=6)
        seen["after"] = dynamo_config.accumulated_recompile_limit

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["before"] < ACCUMULATED_RECOMPILE_LIMIT, "negative control: a new thread sees the default cap"
    assert seen["after"] >= ACCUMULATED_RECOMPILE_LIMIT, "the decoder's calls did not raise the cap in its thread"
    assert torch.equal(seen["out"], ref)
