"""KnownCalls: a compiled program's later calls of an already-compiled shape skip dynamo's guards, and anything
that would select another graph still goes through them."""

from __future__ import annotations

import torch
from tiny import tiny_target

from eagle_compile.core.masks import SlotMask
from eagle_compile.lowering import Lowering
from eagle_compile.runtime.known_calls import KnownCalls, guards_every_call, tensor_key
from eagle_compile.runtime.kv_cache import SlotKVCache
from eagle_compile.runtime.target_program import TargetProgram


class Counting:
    """A dynamo backend that counts compilations and runs of its graphs."""

    def __init__(self) -> None:
        self.compiled = 0
        self.runs = 0

    def __call__(self, gm, example_inputs):
        self.compiled += 1

        def run(*args):
            self.runs += 1
            return gm.forward(*args)

        return run


def affine(x, w, scale: int):
    return (x @ w) * scale


def known(backend):
    return KnownCalls(affine, torch.compile(affine, backend=backend, fullgraph=True, dynamic=False))


def call(calls, x, w, scale):
    return calls((tensor_key(x), tensor_key(w), scale), x, w, scale)


def test_a_compiled_key_runs_directly_and_gives_the_same_values():
    torch._dynamo.reset()
    backend = Counting()
    calls = known(backend)
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    first = call(calls, x, w, 2)
    assert (backend.compiled, calls.direct_calls) == (1, 0)
    x2 = torch.randn(2, 3)                                   # new values, same shape: no guard in the way
    again = call(calls, x2, w, 2)
    assert calls.direct_calls == 1 and backend.runs == 2     # the compiled graph ran, dynamo's guards did not
    torch.testing.assert_close(first, affine(x, w, 2), rtol=0, atol=0)
    torch.testing.assert_close(again, affine(x2, w, 2), rtol=0, atol=0)
    torch._dynamo.reset()                 # dynamo drops its cache entries and the globals their code reads
    assert torch.equal(call(calls, x2, w, 2), affine(x2, w, 2)) and calls.direct_calls == 2


def test_a_kept_code_holds_only_the_globals_it_reads():
    """The direct code runs over a copy of the globals it names, not of the whole module: the graphs dynamo
    compiled for other programs (their `__compiled_fn_*` in the same module) stay collectable."""
    torch._dynamo.reset()
    globals()["__compiled_fn_unrelated"] = object()        # another program's graph, as dynamo installs them
    try:
        calls = known(Counting())
        call(calls, torch.randn(2, 3), torch.randn(3, 4), 2)
        [direct] = next(iter(calls.direct.values()))
        kept = direct.run.__globals__
        assert any(name.startswith("__compiled_fn") for name in kept)    # its own graph
        assert "__compiled_fn_unrelated" not in kept and "known" not in kept and "__builtins__" in kept
    finally:
        del globals()["__compiled_fn_unrelated"]


def test_a_new_shape_or_constant_compiles_its_own_graph():
    torch._dynamo.reset()
    backend = Counting()
    calls = known(backend)
    w = torch.randn(3, 4)
    call(calls, torch.randn(2, 3), w, 2)
    out = call(calls, torch.randn(5, 3), w, 2)               # another shape: another key, through the guards
    assert out.shape == (5, 4) and backend.compiled == 2 and calls.direct_calls == 0
    x = torch.randn(2, 3)
    assert torch.equal(call(calls, x, w, 3), affine(x, w, 3))  # another constant: compiled, not the scale-2 graph
    assert backend.compiled == 3
    call(calls, torch.randn(5, 3), w, 2)
    assert calls.direct_calls == 1 and backend.compiled == 3


def test_a_changed_global_state_or_an_active_mode_goes_through_the_guards():
    torch._dynamo.reset()
    backend = Counting()
    calls = known(backend)
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    with torch.no_grad():
        call(calls, x, w, 2)
    with torch.enable_grad():                                # grad mode is guarded: a graph of its own
        call(calls, x, w, 2)
    assert calls.direct_calls == 0 and backend.compiled == 2

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Mode():
        call(calls, x, w, 2)
    assert calls.direct_calls == 0                           # a mode on the stack: dynamo decides
    with torch.no_grad():
        call(calls, x, w, 2)
    assert calls.direct_calls == 1
    with torch.no_grad(), guards_every_call():               # the switch benchmarks use
        call(calls, x, w, 2)
    assert calls.direct_calls == 1


def test_target_program_steps_skip_the_guards_with_unchanged_bits():
    model = tiny_target("llama", seed=3, dtype=torch.float32)
    program = TargetProgram(model, None, lowering=Lowering(numerics="batch_invariant"))
    slots, vocab = 32, model.config.vocab_size
    cache = SlotKVCache(model.config, 2, slots, dtype=torch.float32, device="cpu")
    ids = torch.randint(3, vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    base = torch.zeros(2, dtype=torch.long)
    program(ids, torch.arange(6).expand(2, 6), SlotMask.causal(base, slots), torch.arange(6).expand(2, 6), cache)

    def step(t: int, token: torch.Tensor):
        n = torch.full((2,), t, dtype=torch.long)
        return program(token, n[:, None], SlotMask.causal(n, slots), n[:, None], cache)

    token = torch.randint(3, vocab, (2, 1), generator=torch.Generator().manual_seed(1))
    outs = [step(6, token)]
    assert program._compiled.direct_calls == 0
    outs.append(step(6, token))                              # the same step again: direct
    assert program._compiled.direct_calls == 1
    with guards_every_call():
        control = step(6, token)                             # through dynamo's guards: the same bits
    for a, b in zip(outs[1], control, strict=True):
        assert torch.equal(a, b)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2)   # changed in place: read as it is now
    changed = step(6, token)
    assert program._compiled.direct_calls == 2
    with guards_every_call():
        assert torch.equal(changed[0], step(6, token)[0]) and not torch.equal(changed[0], control[0])


def test_a_module_swapped_between_batches_is_seen_at_revalidation():
    model = tiny_target("llama", seed=4, dtype=torch.float32)
    program = TargetProgram(model, None, lowering=Lowering(numerics="batch_invariant"))
    slots = 16
    cache = SlotKVCache(model.config, 1, slots, dtype=torch.float32, device="cpu")
    token = torch.tensor([[5]])
    n = torch.zeros(1, dtype=torch.long)

    def step():
        return program(token, n[:, None], SlotMask.causal(n, slots), n[:, None], cache)[0]

    before = step()
    step()
    assert program._compiled.direct_calls == 1
    model.model.layers[0].mlp.act_fn = torch.nn.Tanh()        # what a wrapper (LoRA, a patch) would do
    program.revalidate()                                      # a decoder does this as each batch starts
    after = step()                                            # the stale graph's guards fail: dynamo compiles
    assert program._compiled.direct_calls == 1 and program.graphs_captured == 2
    assert not torch.equal(after, before)
    again = step()                                            # the new graph, directly
    assert program._compiled.direct_calls == 2 and torch.equal(again, after)
    with guards_every_call():
        assert torch.equal(step(), after)                     # what dynamo's own lookup runs
    program.revalidate()
    assert torch.equal(step(), after) and program._compiled.direct_calls == 3   # unchanged: checked, still direct
