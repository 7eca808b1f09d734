"""The `torch.ops.eagle31.*` custom ops: dispatch, registry, fake implementations and torch.compile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import eagle_compile.kernels as kernels
from eagle_compile.kernels import _dispatch
from eagle_compile.kernels.accept import accept_greedy_reference, accept_sample_reference
from eagle_compile.kernels.draft_topk import draft_topk_reference
from eagle_compile.kernels.fc_norm_fuse import fc_norm_fuse_reference
from eagle_compile.kernels.kv_compact import kv_compact_reference
from eagle_compile.kernels.kv_write import kv_write_reference
from eagle_compile.kernels.tree_attention import tree_attention_reference


def cases() -> dict[str, tuple]:
    """name -> (op, args, reference) with tiny shapes."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 9, 16, generator=g)
    block_base = torch.tensor([5])
    local = torch.tensor([[[True, False, False], [True, True, False], [True, False, True]]])
    features, norm_weight = torch.randn(4, 3 * 8, generator=g), torch.rand(3, 8, generator=g) + 0.5
    fc_weight = torch.randn(6, 24, generator=g)
    normed, lm_head = torch.randn(4, 6, generator=g), torch.randn(20, 6, generator=g)
    d2t = 2 * torch.arange(20)
    keys, values = torch.randn(2, 2, 10, 16, generator=g), torch.randn(2, 2, 10, 16, generator=g)
    base, path = torch.tensor([1, 3]), torch.tensor([[0, 2, 3], [0, 1, 1]])
    slots, new_k, new_v = torch.tensor([[4, 9], [2, 9]]), *torch.randn(2, 2, 2, 2, 16, generator=g)
    tokens = torch.tensor([[5, 7, 3, 9, 2, 4, 1]] * 2)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]] * 2)
    depth = torch.tensor([[0, 1, 1, 2, 2, 2, 3]] * 2)
    valid = torch.ones(2, 7, dtype=torch.bool)
    tree = (tokens, parents, depth, valid)
    logits = torch.randn(2, 7, 10, generator=g)
    probs = torch.softmax(logits, -1)
    uniforms = torch.rand(2, 3, 2, generator=g, dtype=torch.float64)
    final = torch.rand(2, generator=g, dtype=torch.float64)
    ops = torch.ops.eagle31
    return {
        "tree_attention": (ops.tree_attention.default, (q, k, v, block_base, local, 0.25), tree_attention_reference),
        "tree_attention_causal": (ops.tree_attention.default, (q, k, v, block_base, None, 0.25),
                                  tree_attention_reference),
        "fc_norm_fuse": (ops.fc_norm_fuse.default, (features, norm_weight, 1e-5, fc_weight),
                         fc_norm_fuse_reference),
        "fc_norm_fuse_plain": (ops.fc_norm_fuse.default, (features, None, 1e-5, fc_weight),
                               fc_norm_fuse_reference),
        "draft_topk": (ops.draft_topk.default, (normed, lm_head, d2t, 3), draft_topk_reference),
        "kv_compact": (ops.kv_compact.default, (keys, values, base, path), kv_compact_reference),
        "kv_write": (ops.kv_write.default, (keys, values, slots, new_k, new_v), kv_write_reference),
        "accept_greedy": (ops.accept_greedy.default, (*tree, logits, 3), accept_greedy_reference),
        "accept_sample": (ops.accept_sample.default, (*tree, probs, uniforms, final, 3),
                          accept_sample_reference),
    }


CASES = list(cases())


def clone_args(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def as_tuple(out):
    """Op outputs as a tuple; kv_compact and kv_write return None (they mutate)."""
    if out is None:
        return ()
    return out if isinstance(out, tuple) else (out,)


def call(fn, args):
    """Outputs of a call, plus the (possibly mutated) tensor arguments."""
    args = clone_args(args)
    out = fn(*args)
    return [*as_tuple(out), *(a for a in args if isinstance(a, torch.Tensor))]


def assert_equal_outputs(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_cpu_ops_run_the_reference_by_default(name, reference_only):
    op, args, reference = cases()[name]
    assert kernels.kernel_choices("cpu")[op_name(op)][0] == "reference"
    assert_equal_outputs(call(op, args), call(reference, args))


@pytest.fixture
def launches(monkeypatch):
    """Records (kernel name, interpreted) of every Triton kernel the ops launch."""
    launched = []
    real_kernel = _dispatch.kernel

    def spy(fn, interpret):
        launched.append((fn.__name__, interpret))
        return real_kernel(fn, interpret)

    monkeypatch.setattr(_dispatch, "kernel", spy)
    return launched


def op_name(op) -> str:
    return op.name().split("::")[1].split(".")[0]


TRITON_CASES = [name for name in CASES if op_name(cases()[name][0]) not in kernels.TORCH_ONLY]


@pytest.mark.parametrize("name", TRITON_CASES)
def test_interpreter_env_runs_the_triton_kernels(name, interpreter, launches):
    op, args, reference = cases()[name]
    got = call(op, args)
    assert kernels.kernel_choices("cpu")[op_name(op)][0] == "triton-interpreter"
    assert launches and all(interpret for _, interpret in launches), "the Triton kernel ran, interpreted"
    assert_equal_outputs(got, call(reference, args))


@pytest.mark.parametrize("name", TRITON_CASES)
def test_compiles_fullgraph_with_aot_eager(name, interpreter, launches):
    # the custom op inside a compiled graph: the fake impl traces it, the interpreted Triton kernel runs it
    op, args, reference = cases()[name]

    def step(*a):
        out = op(*a)
        return [t * 1 for t in as_tuple(out)] if out is not None else [a[0] + 0]

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = call(compiled, args)
    assert launches, "the compiled graph ran the Triton kernel"
    assert_equal_outputs(got, call(step, args))


@pytest.mark.parametrize("name", CASES)
def test_fake_impls_give_shapes_and_dtypes(name, reference_only):
    op, args, _ = cases()[name]
    real = as_tuple(op(*clone_args(args)))
    mode = FakeTensorMode()
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        fake = as_tuple(op(*fake_args))
    assert all(isinstance(t, torch._subclasses.fake_tensor.FakeTensor) for t in fake)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]
    for f, r in zip(fake, real, strict=True):
        assert f.stride() == r.stride(), "fake strides match the real (contiguous) outputs"


@pytest.mark.parametrize("name", CASES)
def test_opcheck(name, reference_only):
    op, args, _ = cases()[name]
    torch.library.opcheck(op, clone_args(args))


def test_fake_impls_refuse_bad_shapes():
    op, (q, k, v, base, local, scale), _ = cases()["tree_attention"]
    mode = FakeTensorMode()
    fake = [mode.from_tensor(t) for t in (q, k, v, base, local[:, :, :-1])]
    with mode:
        op(*fake, scale)                                     # a narrower block (W < T) is fine
    fake = [mode.from_tensor(t) for t in (q, k, v, base.expand(2), local)]
    with mode, pytest.raises(ValueError, match="base must be"):
        op(*fake, scale)


def test_registry_describes_every_op():
    registered = {name for name in dir(torch.ops.eagle31) if not name.startswith("_")}
    assert set(kernels.KERNELS) <= registered
    choices = kernels.kernel_choices("cuda")
    assert set(choices) == set(kernels.KERNELS)
    assert all(impl == "triton" and "CUDA" in why for name, (impl, why) in choices.items()
               if name not in kernels.TORCH_ONLY)
    assert choices["kv_write"] == ("reference", kernels.TORCH_ONLY["kv_write"])
    fp64 = kernels.kernel_choices("cuda", torch.float64)
    assert fp64["tree_attention"][0] == "reference" and "float64" in fp64["tree_attention"][1]
    assert fp64["kv_compact"][0] == "triton", "data movement takes any dtype"
    assert "EAGLE31_TRITON_INTERPRET" in kernels.kernel_choices("cpu")["draft_topk"][1]


def test_without_triton_everything_runs_the_reference(monkeypatch, reference_only):
    monkeypatch.setattr(_dispatch, "import_triton", lambda: (None, "triton is not importable (test)"))
    monkeypatch.setattr(_dispatch, "_warned", set())
    with pytest.warns(RuntimeWarning, match="CUDA tensors but triton is not importable"):
        impl, why = kernels.kernel_choices("cuda")["tree_attention"]
    assert impl == "reference" and "not importable" in why
    monkeypatch.setenv("EAGLE31_TRITON_INTERPRET", "1")
    op, args, reference = cases()["draft_topk"]
    with pytest.warns(RuntimeWarning, match="EAGLE31_TRITON_INTERPRET=1 asks"):
        got = call(op, args)
    assert_equal_outputs(got, call(reference, args))


def test_importing_the_kernels_does_not_import_triton():
    code = ("import sys, torch, eagle_compile.kernels as k; assert 'triton' not in sys.modules, 'imported'; "
            "k.kernel_choices('cpu'); assert 'triton' not in sys.modules, 'queried'; print(len(k.KERNELS))")
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=repo)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(len(kernels.KERNELS))
