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
