"""Every Triton kernel compiles for the GPU (sm_90, the H200 of the GPU tier) on a machine without one.

The interpreter runs the kernels' arithmetic but not Triton's compiler, so it accepts things a GPU build
rejects, such as a loop-carried value that changes type (the negative control below). Here each host wrapper
runs on meta tensors with the launch intercepted: the kernel it would launch is specialised the way
`JITFunction.run` specialises it (alignment, divisibility, constant 1 strides) and compiled through every
stage (TTIR, TTGIR, LLVM IR, PTX, cubin with the bundled ptxas) for a CUDA sm_90 target. The cubin's resource
usage (bundled cuobjdump) shows register spills, which the default tile sizes must not have. Whether the
kernels are correct and fast on the GPU is still checked only there.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from eagle_compile.kernels import _dispatch
from eagle_compile.kernels.accept import accept_greedy_triton, accept_sample_triton
from eagle_compile.kernels.draft_topk import draft_topk_triton
from eagle_compile.kernels.fc_norm_fuse import fc_norm_fuse_triton
from eagle_compile.kernels.kv_compact import kv_compact_triton
from eagle_compile.kernels.tree_attention import tree_attention_triton

triton = pytest.importorskip("triton")

tl = None  # triton.language for the negative-control kernel below, bound by _dispatch.kernel

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")


def compile_like_launch(jit_fn, args, kwargs):
    """What `jit_fn[grid](*args, **kwargs)` would compile on an sm_90 GPU (Triton 3.x internals)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(jit_fn.signature, jit_fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = jit_fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(jit_fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def stack_bytes(binary, tmp_path) -> int:
    """Per-thread stack frame of the cubin: non-zero when registers spill."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(binary.asm["cubin"])
    usage = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
    return int(re.search(r"STACK:(\d+)", usage.stdout).group(1))


class _CompileInsteadOfLaunch:
    def __init__(self, jit_fn, records: list):
        self.jit_fn, self.records = jit_fn, records

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.records.append(
            (self.jit_fn.__name__, kwargs, compile_like_launch(self.jit_fn, args, kwargs)))


@pytest.fixture
def compiled(monkeypatch, tmp_path):
    """Kernel launches of the host wrappers become sm_90 compilations: [(kernel name, constexprs, binary)]."""
    from triton.runtime.jit import JITFunction

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    records = []

    def compile_instead(fn, interpret):
        assert not interpret
        fn.__globals__["tl"] = triton.language
        return _CompileInsteadOfLaunch(JITFunction(fn), records)

    monkeypatch.setattr(_dispatch, "kernel", compile_instead)
    return records


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def assert_no_spills(records, tmp_path):
    for name, kwargs, binary in records:
        blocks = {k: v for k, v in kwargs.items() if k.startswith("BLOCK") or k == "num_warps"}
        assert stack_bytes(binary, tmp_path) == 0, f"{name} {blocks} spills registers"


@pytest.mark.parametrize(("dtype", "head_dim", "tokens"), [
    (torch.bfloat16, 64, 60), (torch.bfloat16, 128, 60), (torch.bfloat16, 128, 1), (torch.bfloat16, 256, 60),
    (torch.float32, 128, 60), (torch.float32, 256, 60),
])
def test_tree_attention_compiles_without_spills(compiled, tmp_path, dtype, head_dim, tokens):
    # 32 query heads over 8 KV heads (Llama-3-8B): G*T = 4*60 packed rows; a 4096-slot static cache
    q = meta(2, 32, tokens, head_dim, dtype=dtype)
    cache = meta(2, 8, 4096, head_dim, dtype=dtype)
    base, local = meta(2, dtype=torch.int64), meta(2, tokens, tokens, dtype=torch.bool)
    tree_attention_triton(q, cache, cache, base, local, 0.125, out=q, interpret=False)
    assert [name for name, _, _ in compiled] == ["_tree_attention_kernel"]
    assert_no_spills(compiled, tmp_path)


def test_negative_control_spills_are_detected(compiled, tmp_path):
    # fp32, head dim 256, a 64 x 64 tile on 4 warps: far more live values than 255 registers per thread
    q, cache = meta(1, 32, 60, 256), meta(1, 8, 4096, 256)
    base, local = meta(1, dtype=torch.int64), meta(1, 60, 60, dtype=torch.bool)
    tree_attention_triton(q, cache, cache, base, local, 0.125, out=q, interpret=False, block_m=64, block_n=64,
                          num_warps=4)
    assert stack_bytes(compiled[0][2], tmp_path) > 0


def test_fc_norm_fuse_compiles_without_spills(compiled, tmp_path):
    x, w = meta(8, 3 * 576, dtype=torch.bfloat16), meta(576, 3 * 576, dtype=torch.bfloat16)
    fc_norm_fuse_triton(x, meta(3, 576), 1e-5, w, out=meta(8, 576, dtype=torch.bfloat16), interpret=False)
    fc_norm_fuse_triton(x, None, 1e-5, w, out=meta(8, 576, dtype=torch.bfloat16), interpret=False)
    assert [kwargs["HAS_NORM"] for _, kwargs, _ in compiled] == [True, False]
    assert_no_spills(compiled, tmp_path)


def test_draft_topk_compiles_without_spills(compiled, tmp_path):
    outs = (meta(10, 10), meta(10, 10, dtype=torch.int64), meta(10, 10, dtype=torch.int64))
    draft_topk_triton(meta(10, 576, dtype=torch.bfloat16), meta(32000, 576, dtype=torch.bfloat16),
                      meta(32000, dtype=torch.int64), 10, out=outs, interpret=False)
    assert [name for name, _, _ in compiled] == ["_draft_topk_tiles_kernel", "_draft_topk_merge_kernel"]
    assert_no_spills(compiled, tmp_path)


def test_kv_compact_and_accept_compile_without_spills(compiled, tmp_path):
    cache = meta(4, 8, 4096, 128, dtype=torch.bfloat16)
    kv_compact_triton(cache, cache, meta(4, dtype=torch.int64), meta(4, 8, dtype=torch.int64), interpret=False)
    tree = [meta(4, 60, dtype=torch.int64)] * 3 + [meta(4, 60, dtype=torch.bool)]
    outs = (meta(4, dtype=torch.int64), meta(4, 8, dtype=torch.int64), meta(4, 8, dtype=torch.int64))
    accept_greedy_triton(*tree, meta(4, 60, 49152), 7, out=outs, interpret=False)
    accept_sample_triton(*tree, meta(4, 60, 49152), meta(4, 7, 10, dtype=torch.float64),
                         meta(4, dtype=torch.float64), 7, out=outs, interpret=False)
    assert [(name, kwargs.get("SAMPLE")) for name, kwargs, _ in compiled] == [
        ("_kv_compact_kernel", None), ("_accept_kernel", False), ("_accept_kernel", True)]
    assert_no_spills(compiled, tmp_path)


def _loop_type_change_kernel(x_ptr, n):
    total = 0  # a Python int: the loop turns it into an fp32 tensor, which only the compiler refuses
    for i in range(0, n):
        total += tl.load(x_ptr + i)
    tl.store(x_ptr, total)


def test_negative_control_compiler_catches_what_the_interpreter_runs():
    x = torch.arange(1.0, 5.0)
    _dispatch.kernel(_loop_type_change_kernel, True)[(1,)](x, 4)
    assert x[0].item() == 10.0, "the interpreter runs it"
    from triton.runtime.jit import JITFunction

    fn = _loop_type_change_kernel
    fn.__globals__["tl"] = triton.language
    with pytest.raises(Exception, match="Loop-carried variable total"):
        compile_like_launch(JITFunction(fn), (meta(4), 4), {})
