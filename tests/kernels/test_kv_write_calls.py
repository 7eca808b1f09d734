"""kv_write.write: the custom op wherever code is traced, its Python body (same writes) in eager code."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from eagle_compile.kernels import kv_write


def _inputs():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.zeros(2, 2, 8, 4), torch.zeros(2, 2, 8, 4)
    slots = torch.tensor([[1, 5], [0, 7]])
    return keys, values, slots, torch.randn(2, 2, 2, 4, generator=g), torch.randn(2, 2, 2, 4, generator=g)


def test_eager_write_equals_the_op_without_dispatching_it(monkeypatch):
    keys, values, slots, k, v = _inputs()
    ref_k, ref_v = keys.clone(), values.clone()
    torch.ops.eagle31.kv_write(ref_k, ref_v, slots, k, v)
    calls, body = [], kv_write.kv_write_reference
    monkeypatch.setattr(kv_write, "kv_write_reference", lambda *a: (calls.append(1), body(*a))[1])
    kv_write.write(keys, values, slots, k, v)
    assert calls == [1] and torch.equal(keys, ref_k) and torch.equal(values, ref_v)


def test_traced_write_keeps_the_opaque_op():
    def f(keys, values, slots, k, v):
        kv_write.write(keys, values, slots, k, v)
        return keys + 0

    gm = make_fx(f)(*_inputs())
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("kv_write" in t for t in targets) and not any("scatter" in t for t in targets)

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    ins = _inputs()
    out = compiled(*ins)
    ref = _inputs()
    torch.ops.eagle31.kv_write(*ref)
    assert torch.equal(out, ref[0])
