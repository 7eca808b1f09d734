"""The GPU check: one script, under 8 minutes on one H200, that proves the CUDA paths and times them.

Sections (each guarded: one that crashes is reported and the others still run; timestamps per section):

* (a) kernels: every eagle31 op's Triton kernel against its torch reference on CUDA, in fp16, bf16 and fp32,
  at odd sizes (not multiples of the tiles) and at Llama-3.1-8B sizes, into NaN / -777 poisoned outputs; max
  error, PASS/FAIL, and the median time of the Triton kernel and of the reference. fp32 `tl.dot` runs as TF32
  on the GPU (Triton's default `input_precision`), so fp32 tolerances are TF32's (2e-3 of the output range),
  not the interpreter's 1e-5.
* (b) CUDA graphs: a small random Llama (4 layers, head_dim 128, GQA 8/2) in float32 with a random EAGLE 3.1
  head; for batch buckets (1, 2, 4, 8, 16) and real batch sizes 1, 2, 3, 5, 8, 13 (every bucket hit),
  `eagle_compile.generate(step_program=True, cudagraphs=True)` with the padding rows of the bucket's static
  buffers (target cache, draft cache, seeds) overwritten with stale garbage (1e4) before every cycle, against
  the same call with `cudagraphs=False` (must be token-identical) and against HF greedy `model.generate`
  (float32; on a mismatch the target's top-2 logit margin at the first differing token says whether it is a
  near tie). The replay counter must equal the number of cycles (> 0): the graphs really ran.
* (c) speed: a random-weight Llama-3.1-8B-shaped target (hidden 4096, 32 layers, 32 heads, 8 KV heads,
  intermediate 14336, vocab 128256) in bf16, built on the GPU, with a 1-layer EAGLE 3.1 head (draft vocabulary
  32000); at batch 1, 8 and 64 over a 512-token context: a plain decode step (eager, and dynamo-captured +
  CUDA graph) and a full speculative step (step program + CUDA graph) for chain 4 and a small tree
  (depth 4, top_k 4, 16 nodes); median of CUDA-event timings after warm-up. Bytes per step (weights read, KV
  read) over the time give the achieved bandwidth, set against a device-to-device copy measured in the same
  run. `break-even tau` = speculative step time / plain step time: the mean acceptance length a trained head
  needs for speculative decoding to beat plain decoding at that batch.
* (l) long context (`gpu/long_context.py`): a 32K- and a 130,560-token prompt on the 8B shape of (c), chunked
  prefill and 256 speculative cycles each, then the 128K call in the plain mode: the tokens must equal the plain
  mode's (a first difference at a bf16 near tie is reported and passes), each call's peak
  `torch.cuda.max_memory_allocated` must be its KV caches plus a context-independent activation allowance, and
  the peak must grow from 32K to 128K by the KV bytes of the added slots. It needs about 4 minutes, more than the
  default budget leaves after (a)-(c): run it alone with `--sections l`.
* (t) TensorRT (`gpu/tensorrt.py`): the TensorRT export's programs of a small random Llama checked at buckets
  1, 2, 4 (every op handled by torch-tensorrt); where torch_tensorrt imports, the engines built, loaded and
  compared with the PyTorch programs, and `inner_backend="tensorrt"` decoding against its own plain mode.
* (n) the padded cases of (b) again with NaN instead of garbage: a NaN row must stay in its row. It runs last
  and stops at its first crash, because a crash here is a device-side assert that ends every later CUDA call
  of the process (seen on CPU: the Triton `draft_topk` returns draft id 2**31-1 for an all-NaN row, and the
  draft's embedding lookup of that id fails).

Run (device tool, one H200; prints a table last, writes gpu_check.json and gpu_check.md under --out):

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out $OUT/gpu_check 2>&1 | tee $OUT/gpu_check.log

The device machine has the checkout but not the editable install: this script puts the repo root on sys.path.
Its Python packages are the image's, not our pins (torch >= 2.13, transformers 5.24; KINDS.md lists torch 2.11,
transformers 5.17, triton 3.6 there). The preflight prints the versions and says what differs. transformers
is small enough to carry as a wheel (its dependencies in the image satisfy 5.24's requirements):
`python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0` here (with `/.whl/` in
.git/info/exclude), `carry=[".whl"]`, and prefix the command with
`python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site;`.
torch cannot be carried (too large): if the image's torch.compile lacks a keyword the runtime passes
(`recompile_limit`, `isolate_recompiles`), the preflight drops it for this run and raises dynamo's own
recompile limits instead, and says so.

Without a CUDA device the script says what it would do and exits 0 (`--require-gpu`: exit 2).
`--dry-run-cpu` runs every section on the CPU with tiny shapes, the Triton kernels through the Triton
interpreter (`EAGLE31_TRITON_INTERPRET=1`), no CUDA graphs and wall-clock timers: it exercises the script's
code paths and checks; its timings are not measurements. `--sections a,b` picks sections; `--budget-s` is the
time budget (default 450 s): sub-steps that would start after it are skipped and listed. `--negative-control`
breaks the kernels' outputs (a), poisons a real row (b, n) and changes a prompt token of the plain-mode call
(l): every such check must then fail. Exit status: 0 when every check passed, 1 when any check failed or a
section crashed, 2 for `--require-gpu` without CUDA.

As the script grows each check gets its own file in the package `benchmarks/gpu/` (this file stays the one entry
script): `gpu/base.py` holds what the sections share, `gpu/long_context.py` section (l).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import statistics
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import compat_torch_compile
from gpu.base import (
    LLAMA_8B,
    Run,
    build_head,
    build_target,
    divergence,
    free_memory,
    guarded,
    kv_bytes,
    log,
    weight_bytes,
)
from gpu.long_context import markdown as long_context_markdown
from gpu.long_context import section_long_context
from gpu.tensorrt import markdown as tensorrt_markdown
from gpu.tensorrt import section_tensorrt

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "bench_out" / "gpu_check"
INTERPRET_ENV = "EAGLE31_TRITON_INTERPRET"
PINS = {"torch": "2.13", "transformers": "5.24.0"}
POISON_INT = -777

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
FLOAT_DTYPES = (FP16, BF16, FP32)

# -- shapes ------------------------------------------------------------------------------------------------------
#: (a) kernel shapes: "odd" sizes are not multiples of any tile; "8b" are Llama-3.1-8B decode sizes (timed).
KERNEL_SHAPES = {
    "gpu": {
        "tree_attention": {"odd": dict(b=3, hq=6, hkv=2, t=7, s=301, hd=128),
                           "8b": dict(b=8, hq=32, hkv=8, t=16, s=1024, hd=128)},
        "fc_norm_fuse": {"odd": dict(n=13, a=3, ht=100, h=70), "8b": dict(n=320, a=3, ht=4096, h=4096)},
        "draft_topk": {"odd": dict(n=7, h=72, vd=1000, k=4), "8b": dict(n=256, h=4096, vd=32000, k=4)},
        "kv_compact": {"odd": dict(b=3, h=5, s=77, hd=96, p=5), "8b": dict(b=64, h=8, s=1024, hd=128, p=5)},
        "accept_greedy": {"odd": dict(b=5, m=13, v=3), "8b": dict(b=64, m=16, v=128256)},
        "accept_sample": {"odd": dict(b=5, m=13, v=7, k=3), "8b": dict(b=64, m=16, v=128256, k=4)},
    },
    "dry": {
        "tree_attention": {"odd": dict(b=2, hq=4, hkv=2, t=5, s=37, hd=24)},
        "fc_norm_fuse": {"odd": dict(n=5, a=3, ht=20, h=19)},
        "draft_topk": {"odd": dict(n=5, h=24, vd=100, k=4)},
        "kv_compact": {"odd": dict(b=4, h=3, s=24, hd=20, p=5)},
        "accept_greedy": {"odd": dict(b=5, m=13, v=3)},
        "accept_sample": {"odd": dict(b=5, m=13, v=7, k=3)},
    },
}

#: (b) the small target of the CUDA-graph check (capture indices given: 4 layers are fewer than the default needs)
GRAPH_TARGET = {
    "gpu": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, head_dim=128),
    "dry": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
GRAPH_CHECK = {
    "gpu": dict(buckets=(1, 2, 4, 8, 16), real=(1, 2, 3, 5, 8, 13), draft_vocab=4096, max_new=16),
    "dry": dict(buckets=(1, 4), real=(1, 3), draft_vocab=48, max_new=6),
}
GRAPH_TREE = {"depth": 3, "top_k": 2, "total_tokens": 6, "prefill_chunk": 16}

#: (c) the Llama-3.1-8B shape (random weights) and its timing plan
SPEED_TARGET = {
    "gpu": LLAMA_8B,
    "dry": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
SPEED_PLAN = {
    "gpu": dict(batches=(1, 8, 64), context=512, slots=1024, draft_vocab=32000, prefill_chunk=128,
                warmup=3, repeats=20, copy_bytes=4 << 30),
    "dry": dict(batches=(2,), context=24, slots=128, draft_vocab=64, prefill_chunk=16,
                warmup=1, repeats=2, copy_bytes=16 << 20),
}
SPEED_TREES = {"chain 4": {"chain": 4}, "tree d4 k4 m16": {"depth": 4, "top_k": 4, "total_tokens": 16}}

#: max |kernel - oracle| / max(1, max |oracle|) allowed per compute dtype (GPU fp32 dots are TF32)
FLOAT_TOL = {"gpu": {FP32: 2e-3, FP16: 2e-3, BF16: 2e-2}, "dry": {FP32: 1e-5, FP16: 2e-3, BF16: 2e-2}}
#: max |log-prob error| of draft_topk (logits are O(1): fp16/bf16 products are exact in the fp32 accumulator)
LOGP_TOL = {"gpu": {FP32: 5e-3, FP16: 1e-4, BF16: 1e-4}, "dry": {FP32: 1e-5, FP16: 1e-4, BF16: 1e-4}}


def median_ms(run: Run, fn: Callable[[], Any], *, warmup: int, repeats: int) -> float:
    """Median milliseconds of `fn`: CUDA events around each call on CUDA, the host clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    if run.cuda:
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def range_error(out: torch.Tensor, oracle: torch.Tensor) -> float:
    """max |out - oracle| / max(1, max |oracle|); inf when out holds NaN (an unwritten poisoned element)."""
    if out.isnan().any():
        return math.inf
    scale = max(1.0, oracle.abs().max().item())
    return (out.double() - oracle.double()).abs().max().item() / scale


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- (a) kernels -------------------------------------------------------------------------------------------------
def section_kernels(run: Run) -> None:
    """Every op: Triton kernel vs torch reference, per dtype and shape, poisoned outputs; timed at 8B sizes."""
    from eagle_compile.kernels import KERNELS, TORCH_ONLY

    checkers = {"tree_attention": check_tree_attention, "fc_norm_fuse": check_fc_norm_fuse,
                "draft_topk": check_draft_topk, "kv_compact": check_kv_compact,
                "accept_greedy": check_accept_greedy, "accept_sample": check_accept_sample}
    with_triton = set(KERNELS) - set(TORCH_ONLY)          # TORCH_ONLY ops have no Triton kernel to check
    assert set(checkers) == with_triton, f"ops without a check: {with_triton ^ set(checkers)}"
    if run.cuda:
        run.note("fp32 tl.dot runs as TF32 on the GPU (Triton's default input_precision): fp32 tolerances are "
                 "TF32's")
    shapes = KERNEL_SHAPES["gpu" if run.cuda else "dry"]
    with broken_kernels() if run.negative_control else contextlib.nullcontext():
        _kernel_cases(run, checkers, shapes)


def _kernel_cases(run: Run, checkers: dict, shapes: dict) -> None:
    for op, checker in checkers.items():
        dtypes = (FP32,) if op == "accept_sample" else FLOAT_DTYPES
        for shape_name, shape in shapes[op].items():
            for dtype in dtypes:
                label = f"{op} {shape_name} {short(dtype)}"
                if not run.time_left(f"(a) {label}"):
                    continue
                gen = torch.Generator().manual_seed(zlib.crc32(label.encode()))
                timed = shape_name == "8b" or not run.cuda
                try:
                    row = checker(run, shape, dtype, gen, timed)
                except Exception as e:  # a crash of one case fails that case only
                    traceback.print_exc()
                    row = {"err": math.inf, "tol": None, "ok": False, "detail": f"{type(e).__name__}: {e}"}
                row.update(op=op, shape=shape_name, dims=_dims(shape), dtype=short(dtype))
                run.rows["a"].append(row)
                run.check("a", label, row["ok"], _kernel_detail(row))


@contextlib.contextmanager
def broken_kernels():
    """Negative control of (a): every Triton host wrapper returns a result with one element off by one."""
    from eagle_compile.kernels import accept, draft_topk, fc_norm_fuse, kv_compact, tree_attention

    def corrupt(x):
        for t in x if isinstance(x, tuple) else (x,):
            t.view(-1)[0] += 1

    def broken(original):
        def call(*args, **kwargs):
            out = original(*args, **kwargs)
            corrupt(out if out is not None else args[0])      # kv_compact works in place on its keys
            return out
        return call

    patched = [(m, f"{name}_triton") for m, name in (
        (tree_attention, "tree_attention"), (fc_norm_fuse, "fc_norm_fuse"), (draft_topk, "draft_topk"),
        (kv_compact, "kv_compact"), (accept, "accept_greedy"), (accept, "accept_sample"))]
    originals = [getattr(m, name) for m, name in patched]
    for (m, name), original in zip(patched, originals, strict=True):
        setattr(m, name, broken(original))
    try:
        yield
    finally:
        for (m, name), original in zip(patched, originals, strict=True):
            setattr(m, name, original)


def _dims(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def _kernel_detail(row: dict) -> str:
    parts = [f"err {row['err']:.3g}" + (f" <= tol {row['tol']:.0e}" if row["ok"] and row["tol"] else "")]
    if row.get("detail"):
        parts.append(row["detail"])
    if row.get("triton_ms") is not None:
        parts.append(f"triton {row['triton_ms']:.3f} ms, reference {row['reference_ms']:.3f} ms")
    return "; ".join(parts)


def _timings(run: Run, timed: bool, triton_fn, reference_fn) -> dict:
    if not timed:
        return {"triton_ms": None, "reference_ms": None}
    reps = dict(warmup=3, repeats=20) if run.cuda else dict(warmup=0, repeats=1)
    return {"triton_ms": median_ms(run, triton_fn, **reps), "reference_ms": median_ms(run, reference_fn, **reps)}


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _tree_block(b: int, t: int, s: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(base [B], local [B, T, T]): a random committed prefix per row and a random tree (ancestors + self)
    after it; row 0 has no prefix and its last query sees nothing (a padding row that must give 0)."""
    base = torch.randint(s // 2, s - t + 1, (b,), generator=gen)
    base[0] = 0
    local = torch.zeros(b, t, t, dtype=torch.bool)
    for row in range(b):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, t)]
        for q in range(t):
            node = q
            while node >= 0:
                local[row, q, node] = True
                node = parents[node]
    local[0, -1] = False
    return base, local


def check_tree_attention(run: Run, sh: dict, dtype: torch.dtype, gen, timed: bool) -> dict:
    from eagle_compile.kernels.tree_attention import tree_attention_reference, tree_attention_triton

    dev = run.device
    q = _randn(gen, sh["b"], sh["hq"], sh["t"], sh["hd"]).to(dev, dtype)
    k = _randn(gen, sh["b"], sh["hkv"], sh["s"], sh["hd"]).to(dev, dtype)
    v = _randn(gen, sh["b"], sh["hkv"], sh["s"], sh["hd"]).to(dev, dtype)
    base, local = (x.to(dev) for x in _tree_block(sh["b"], sh["t"], sh["s"], gen))
    scale = 1.0 / math.sqrt(sh["hd"])
    out = tree_attention_triton(q, k, v, base, local, scale, out=torch.full_like(q, float("nan")))
    oracle = tree_attention_reference(q.double(), k.double(), v.double(), base, local, scale)
    err = range_error(out, oracle)
    padded_zero = bool((out[0, :, -1] == 0).all())
    tol = FLOAT_TOL[run.mode][dtype]
    return {"err": err, "tol": tol, "ok": err <= tol and padded_zero,
            "detail": "" if padded_zero else "a fully masked query row is not 0",
            **_timings(run, timed, lambda: tree_attention_triton(q, k, v, base, local, scale),
                       lambda: tree_attention_reference(q, k, v, base, local, scale))}


def check_fc_norm_fuse(run: Run, sh: dict, dtype: torch.dtype, gen, timed: bool) -> dict:
    from eagle_compile.kernels.fc_norm_fuse import fc_norm_fuse_reference, fc_norm_fuse_triton

    dev, a, ht = run.device, sh["a"], sh["ht"]
    chunk_scale = (10.0 ** torch.arange(a)).repeat_interleave(ht)       # low/mid/high layers: very different scales
    x = (_randn(gen, sh["n"], a * ht) * chunk_scale).to(dev, dtype)
    nw = (torch.rand(a, ht, generator=gen) + 0.5).to(dev)
    w = _randn(gen, sh["h"], a * ht, scale=(a * ht) ** -0.5).to(dev, dtype)
    out = fc_norm_fuse_triton(x, nw, 1e-5, w, out=torch.full((sh["n"], sh["h"]), float("nan"), dtype=dtype,
                                                             device=dev))
    oracle = fc_norm_fuse_reference(x, nw, 1e-5, w)     # the draft module's numerics, in the input dtype
    err = range_error(out, oracle)
    tol = FLOAT_TOL[run.mode][dtype]
    return {"err": err, "tol": tol, "ok": err <= tol, "detail": "",
            **_timings(run, timed, lambda: fc_norm_fuse_triton(x, nw, 1e-5, w),
                       lambda: fc_norm_fuse_reference(x, nw, 1e-5, w))}


def check_draft_topk(run: Run, sh: dict, dtype: torch.dtype, gen, timed: bool) -> dict:
    """Value-exact top-k: the kernel's ids may order near-ties differently from the reference (TF32, summation
    order), so the check is that each chosen id's float64 log-prob equals the kernel's log-prob and the sorted
    chosen log-probs equal the true top-k, within the tolerance; ids are distinct; target id = id + d2t[id]."""
    from eagle_compile.kernels.draft_topk import draft_topk_reference, draft_topk_triton

    dev, n, h, vd, k = run.device, sh["n"], sh["h"], sh["vd"], sh["k"]
    normed = _randn(gen, n, h).to(dev, dtype)
    lm_head = _randn(gen, vd, h, scale=h ** -0.5).to(dev, dtype)
    d2t = torch.randint(0, 5, (vd,), generator=gen).cumsum(0).to(dev)
    poisoned = (torch.full((n, k), float("nan"), device=dev), torch.full((n, k), POISON_INT, device=dev),
                torch.full((n, k), POISON_INT, device=dev))
    logp, ids, target_ids = draft_topk_triton(normed, lm_head, d2t, k, out=poisoned)
    if logp.isnan().any() or (ids == POISON_INT).any() or (target_ids == POISON_INT).any():
        return {"err": math.inf, "tol": None, "ok": False, "detail": "unwritten (poisoned) outputs"}
    if not ((ids >= 0) & (ids < vd)).all():
        return {"err": math.inf, "tol": None, "ok": False, "detail": "draft ids out of range"}
    exact = torch.log_softmax(normed.double() @ lm_head.double().T, dim=-1)     # [n, vd] float64 oracle
    best = exact.topk(k, dim=-1).values
    err = max((logp.double() - exact.gather(1, ids)).abs().max().item(),
              (logp.double().sort(dim=1, descending=True).values - best).abs().max().item())
    distinct = all(len(set(r)) == k for r in ids.tolist())
    mapped = bool(torch.equal(target_ids, ids + d2t[ids]))
    same_ids = torch.equal(ids, draft_topk_reference(normed, lm_head, d2t, k)[1])
    tol = LOGP_TOL[run.mode][dtype]
    problems = [p for p, bad in (("ids not distinct", not distinct), ("target ids != id + d2t[id]", not mapped))
                if bad]
    detail = "; ".join(problems + ([] if same_ids else ["ids ordered differently from the reference (near ties)"]))
    return {"err": err, "tol": tol, "ok": err <= tol and not problems, "detail": detail,
            **_timings(run, timed, lambda: draft_topk_triton(normed, lm_head, d2t, k),
                       lambda: draft_topk_reference(normed, lm_head, d2t, k))}


def check_kv_compact(run: Run, sh: dict, dtype: torch.dtype, gen, timed: bool) -> dict:
    """In place, pure data movement: bitwise equal to the reference; something moved (outputs cannot be
    poisoned: the sources live in the same buffer)."""
    from eagle_compile.kernels.kv_compact import kv_compact_reference, kv_compact_triton

    dev, b, p, s = run.device, sh["b"], sh["p"], sh["s"]
    keys = _randn(gen, b, sh["h"], s, sh["hd"]).to(dev, dtype)
    values = _randn(gen, b, sh["h"], s, sh["hd"]).to(dev, dtype)
    steps = torch.randint(0, 3, (b, p), generator=gen)
    steps[:, 0] = 0
    path = (steps + 1).cumsum(1) - 1                                           # path[0] = 0, increasing
    path = torch.where(torch.rand(b, 1, generator=gen) < 0.25, torch.zeros_like(path), path)   # nothing accepted
    base = torch.randint(0, s - int(path.max()) - 1, (b,), generator=gen)
    base, path = base.to(dev), path.to(dev)
    got_k, got_v = keys.clone(), values.clone()
    kv_compact_triton(got_k, got_v, base, path)
    want_k, want_v = keys.clone(), values.clone()
    kv_compact_reference(want_k, want_v, base, path)
    equal = torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    moved = not torch.equal(got_k, keys)
    detail = "; ".join(p for p, bad in (("differs from the reference", not equal), ("nothing moved", not moved))
                       if bad)
    return {"err": 0.0 if equal else math.inf, "tol": 0.0, "ok": equal and moved, "detail": detail,
            **_timings(run, timed, lambda: kv_compact_triton(got_k, got_v, base, path),
                       lambda: kv_compact_reference(want_k, want_v, base, path))}


def _random_trees(b: int, m: int, vocab: int, gen: torch.Generator):
    """Random topological trees (parents[i] < i) with some padding nodes."""
    parents = torch.full((b, m), -1, dtype=torch.long)
    depth = torch.zeros(b, m, dtype=torch.long)
    for i in range(1, m):
        parents[:, i] = (torch.rand(b, generator=gen) * i).long()
        depth[:, i] = depth.gather(1, parents[:, i:i + 1]).squeeze(1) + 1
    valid = torch.rand(b, m, generator=gen) < 0.85
    valid[:, 0] = True
    tokens = torch.randint(0, vocab, (b, m), generator=gen)
    return tokens, parents, depth, valid, int(depth[valid].max())


def _favour_drafts(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, gen, bump: float):
    """Raise the target's score of most draft tokens at their parent, so that deep paths get accepted."""
    b, m = tokens.shape
    pick = (torch.rand(b, m, generator=gen) < 0.7) & (parents >= 0)
    rows = torch.arange(b)[:, None].expand(b, m)[pick]
    scores[rows, parents.clamp(min=0)[pick], tokens[pick]] += bump
    return scores


def _int_outputs(b: int, d: int, dev) -> tuple[torch.Tensor, ...]:
    return (torch.full((b,), POISON_INT, device=dev), torch.full((b, d + 1), POISON_INT, device=dev),
            torch.full((b, d + 1), POISON_INT, device=dev))


def _compare_acceptance(got, want, b: int) -> tuple[bool, str]:
    if any((t == POISON_INT).any() for t in got):
        return False, "unwritten (poisoned) outputs"
    for name, x, y in zip(("accept_len", "path", "tokens"), got, want, strict=True):
        if not torch.equal(x, y):
            rows = int((x != y).reshape(b, -1).any(1).sum())
            return False, f"{name} differs in {rows} of {b} rows"
    return True, f"accept_len max {int(want[0].max())}"


def check_accept_greedy(run: Run, sh: dict, dtype: torch.dtype, gen, timed: bool) -> dict:
    from eagle_compile.kernels.accept import accept_greedy_reference, accept_greedy_triton

    b, m, v = sh["b"], sh["m"], sh["v"]
    tokens, parents, depth, valid, d = _random_trees(b, m, v, gen)
    logits = _favour_drafts(torch.randn(b, m, v, generator=gen), tokens, parents, gen, 20.0 if v > 16 else 0.0)
    args = [t.to(run.device) for t in (tokens, parents, depth, valid)] + [logits.to(run.device, dtype)]
    got = accept_greedy_triton(*args, d, out=_int_outputs(b, d, run.device))
    ok, detail = _compare_acceptance(got, accept_greedy_reference(*args, d), b)
    return {"err": 0.0 if ok else math.inf, "tol": 0.0, "ok": ok, "detail": detail,
            **_timings(run, timed, lambda: accept_greedy_triton(*args, d),
                       lambda: accept_greedy_reference(*args, d))}


def check_accept_sample(run: Run, sh: dict, dtype: torch.dtype, gen, timed: bool) -> dict:
    from eagle_compile.kernels.accept import accept_sample_reference, accept_sample_triton

    b, m, v, k = sh["b"], sh["m"], sh["v"], sh["k"]
    tokens, parents, depth, valid, d = _random_trees(b, m, v, gen)
    logits = _favour_drafts(2.0 * torch.randn(b, m, v, generator=gen), tokens, parents, gen,
                            8.0 if v > 16 else 0.0)
    probs = torch.softmax(logits, dim=-1).to(dtype)
    uniforms = torch.rand(b, d, k, generator=gen, dtype=torch.float64)
    final = torch.rand(b, generator=gen, dtype=torch.float64)
    args = [t.to(run.device) for t in (tokens, parents, depth, valid, probs, uniforms, final)]
    got = accept_sample_triton(*args, d, out=_int_outputs(b, d, run.device))
    ok, detail = _compare_acceptance(got, accept_sample_reference(*args, d), b)
    return {"err": 0.0 if ok else math.inf, "tol": 0.0, "ok": ok, "detail": detail,
            **_timings(run, timed, lambda: accept_sample_triton(*args, d),
                       lambda: accept_sample_reference(*args, d))}


def check_kernel_choices(run: Run, section: str, dtype: torch.dtype) -> None:
    """The fused ops of the step program must run the Triton kernels (interpreted in the dry run)."""
    from eagle_compile.kernels import kernel_choices

    want = "triton" if run.cuda else "triton-interpreter"
    choices = kernel_choices(run.device, dtype)
    wrong = {name: f"{impl} ({why})" for name, (impl, why) in choices.items() if impl != want}
    run.check(section, f"every eagle31 op runs {want} on {run.device.type} {short(dtype)}", not wrong,
              "; ".join(f"{k}: {v}" for k, v in wrong.items()))


# -- (b) and (n) CUDA graphs per bucket, poisoned padding -------------------------------------------------------
#: (b) poisons padding rows with finite garbage (what stale rows of reused buffers hold); (n) with NaN, which is
#: stricter: a NaN row must stay in its row and must not crash the batch. (n) runs last: on a GPU a crash there
#: is a device-side assert, which ends every later CUDA call of the process.
STALE_GARBAGE = 1.0e4


@contextlib.contextmanager
def poisoned_padding(first_row: int, value: float, counter: dict):
    """Before every cycle, set rows `first_row:` of the step's state seeds, target cache and draft cache to `value`
    (with CUDA graphs these are the bucket's `BucketBuffers`, so the replay reads the poison)."""
    from eagle_compile.runtime.decoder import SpeculativeDecoder

    original = SpeculativeDecoder._cycle

    def cycle(self, state, cache, draft_kv, *args, **kwargs):
        tensors = [state.seed_feedback, state.seed_head]
        tensors += [t for layer in cache.layers for t in (layer.keys, layer.values)]
        tensors += [draft_kv.keys, draft_kv.values] if draft_kv is not None else []
        for t in tensors:
            t[first_row:] = value
            counter["elements"] += t[first_row:].numel()
        counter["cycles"] += 1
        return original(self, state, cache, draft_kv, *args, **kwargs)

    SpeculativeDecoder._cycle = cycle
    try:
        yield
    finally:
        SpeculativeDecoder._cycle = original


def ragged_prompts(rows: int, vocab: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of 4..24 tokens."""
    lengths = torch.randint(4, 25, (rows,), generator=gen).tolist()
    width = max(lengths)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, width - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[r, width - n:] = 1
    return ids.to(device), mask.to(device)


def graph_target(run: Run):
    """The (b)/(n) target and head, built once (sections (b) and (n) share their captured programs)."""
    if "graph_target" not in run.keep:
        model = build_target(GRAPH_TARGET[run.mode], FP32, run.device, seed=11, sharpen=8.0)
        head = build_head(model, GRAPH_CHECK[run.mode]["draft_vocab"], seed=3, capture_indices=(1, 2, 3))
        run.keep["graph_target"] = (model, head)
    return run.keep["graph_target"]


def section_graphs(run: Run) -> None:
    """(b): every bucket, every real batch size, padding rows set to finite garbage before every cycle."""
    cfg = GRAPH_CHECK[run.mode]
    check_kernel_choices(run, "b", FP32)
    hit = set()
    for real in cfg["real"]:
        bucket = next(b for b in cfg["buckets"] if b >= real)
        if run.time_left(f"(b) bucket {bucket}, {real} real rows"):
            graph_case(run, "b", real, bucket, STALE_GARBAGE)
            hit.add(bucket)
    missing = [b for b in cfg["buckets"] if b not in hit]
    if missing and not run.skipped:
        run.check("b", "every bucket was checked", False, f"buckets {missing} not hit by real sizes {cfg['real']}")


def section_nan(run: Run) -> None:
    """(n): the cases of (b) that have padding rows, with NaN poison; stops at the first crash."""
    cfg = GRAPH_CHECK[run.mode]
    for real in cfg["real"]:
        bucket = next(b for b in cfg["buckets"] if b >= real)
        if bucket == real or not run.time_left(f"(n) bucket {bucket}, {real} real rows"):
            continue
        try:
            graph_case(run, "n", real, bucket, float("nan"))
        except Exception as e:
            traceback.print_exc()
            cuda_dead = " (a CUDA error ends every later CUDA call of this process)" if run.cuda else ""
            run.check("n", f"bucket {bucket}, {real} real rows: NaN padding rows leave the batch running", False,
                      f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{cuda_dead}")
            return


def graph_case(run: Run, section: str, real: int, bucket: int, poison: float) -> None:
    """One real batch size: CUDA graphs with poisoned padding vs eager vs HF greedy, replays, poison applied."""
    import eagle_compile

    cfg = GRAPH_CHECK[run.mode]
    model, head = graph_target(run)
    label = f"bucket {bucket}, {real} real rows"
    ids, mask = ragged_prompts(real, model.config.vocab_size, torch.Generator().manual_seed(100 + real),
                               run.device)
    options = {**GRAPH_TREE, "step_program": True, "batch_buckets": cfg["buckets"]}
    kwargs = dict(attention_mask=mask, draft=head, max_new_tokens=cfg["max_new"], return_dict_in_generate=True)
    counter = {"elements": 0, "cycles": 0}
    first_poisoned = real - 1 if run.negative_control else real      # negative control: a real row too
    with poisoned_padding(first_poisoned, poison, counter):
        graphed = eagle_compile.generate(model, ids, options={**options, "cudagraphs": True}, **kwargs)
    eager = eagle_compile.generate(model, ids, options={**options, "cudagraphs": False}, **kwargs)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=cfg["max_new"], do_sample=False)
    stats = graphed.stats
    same_eager = torch.equal(graphed.sequences, eager.sequences)
    same_hf = torch.equal(graphed.sequences, hf)
    run.rows[section].append({"bucket": bucket, "real": real, "padding_rows": bucket - real, "poison": poison,
                              "cycles": stats.cycles, "replays": stats.cuda_graph_replays,
                              "poisoned_elements": counter["elements"], "tau": stats.tau,
                              "graphs_eq_eager": same_eager, "eq_hf": same_hf})
    run.check(section, f"{label}: CUDA graphs == eager (same lowered program)", same_eager,
              "" if same_eager else _first_difference(graphed.sequences, eager.sequences))
    run.check(section, f"{label}: == HF greedy", same_hf,
              "" if same_hf else divergence(model, graphed.sequences, hf, mask))
    if run.cuda:
        run.check(section, f"{label}: graphs replayed every cycle", 0 < stats.cuda_graph_replays == stats.cycles,
                  f"{stats.cuda_graph_replays} replays, {stats.cycles} cycles")
    else:
        noted = any("cudagraphs=True ignored" in n for n in stats.notes)
        run.check(section, f"{label}: no CUDA here, graphs said so and did not replay",
                  noted and stats.cuda_graph_replays == 0, f"notes {stats.notes}")
    if bucket > first_poisoned:
        run.check(section, f"{label}: padding rows were poisoned ({poison:g})",
                  counter["elements"] > 0 and counter["cycles"] > 0,
                  f"{counter['elements']} elements over {counter['cycles']} cycles")


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = (a != b).nonzero()
    row, col = (int(x) for x in diff[0])
    return f"first difference at row {row}, column {col}: {int(a[row, col])} vs {int(b[row, col])}"


# -- (c) speed of the 8B shape -----------------------------------------------------------------------------------
def copy_bandwidth(run: Run, nbytes: int) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written)."""
    src = torch.randn(nbytes // 2, dtype=BF16, device=run.device)
    dst = torch.empty_like(src)
    ms = median_ms(run, lambda: dst.copy_(src), warmup=3, repeats=10 if run.cuda else 2)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def spec_bytes(model, head, options: dict, batch: int, context: float) -> float:
    """Fewest bytes one speculative cycle moves: target weights once (verify is one forward), target KV over
    context + tree; per draft forward (depth: depth-1 tree levels + 1 catch-up) the draft layer's weights and
    KV; the draft lm_head once per top-k (depth times); fc and fc_norm once (catch-up)."""
    from eagle_compile.options import parse_options

    opts = parse_options(options)
    depth, nodes = opts.tree_depth, opts.tree_tokens
    element = next(model.parameters()).element_size()
    target = weight_bytes(model, skip=("model.embed_tokens",)) + kv_bytes(model.config, batch, context + nodes,
                                                                        element)
    layer = weight_bytes(head, skip=("lm_head", "fc", "fc_norm")) + kv_bytes(head.config, batch, context, element)
    return (target + depth * layer + depth * weight_bytes(head.lm_head)
            + weight_bytes(head.fc) + (weight_bytes(head.fc_norm) if hasattr(head, "fc_norm") else 0))


def plain_step(model, batch: int, context: int, device, dtype):
    """One plain decode step over a `context`-token static cache: (eager forward, dynamo-captured forward)."""
    from eagle_compile.core.masks import SlotMask
    from eagle_compile.runtime.kv_cache import SlotKVCache

    slots = 64 * math.ceil((context + 2) / 64)
    cache = SlotKVCache(model.config, batch, slots, dtype=dtype, device=device)
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    pos = torch.full((batch, 1), context, device=device)
    mask = SlotMask.causal(pos[:, 0], slots).dense(1, dtype)

    @torch.no_grad()
    def forward():
        return model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, write_slots=pos,
                     use_cache=True).logits

    return forward, torch.compile(forward, backend="eager", fullgraph=True, dynamic=False)


def graph_of(fn: Callable[[], Any]) -> Callable[[], None]:
    """`fn` captured in a CUDA graph (warm-up on a side stream first); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def spec_step(run: Run, model, options: dict, batch: int, plan: dict):
    """(call, state) of one speculative cycle of the decoder that `generate` built for `options`: the bucket's
    CUDA graph on CUDA (its buffers hold the prefilled 512-token context), the lowered step elsewhere."""
    from eagle_compile.core.verify import draw_uniforms
    from eagle_compile.options import parse_options
    from eagle_compile.runtime.cuda_graphs import GraphedStep
    from eagle_compile.runtime.generate import _decoders
    from eagle_compile.runtime.step import StepState

    wanted = parse_options(options)
    (decoder,) = [d for d in _decoders[model].values() if d.options == wanted]
    shape = decoder.shape
    uniforms, final = draw_uniforms(batch, shape.depth, shape.top_k, device=run.device)
    graphed = [s for s in decoder._steps.values() if isinstance(s, GraphedStep)]
    if graphed:
        buffers = decoder._bucket_buffers[(batch, plan["slots"])]
        buffers.state.active.fill_(True)
        return (lambda: graphed[0](buffers, uniforms, final)), buffers.state
    buffers = decoder._buffers(batch, plan["slots"], run.device)       # not prefilled: fill like a 512-token row
    for t in [t for layer in buffers.cache.layers for t in (layer.keys, layer.values)] + [buffers.draft_kv.keys,
                                                                                         buffers.draft_kv.values]:
        t.normal_()
    hidden = model.config.get_text_config().hidden_size
    dtype, rows = next(model.parameters()).dtype, torch.ones(batch, dtype=torch.long, device=run.device)
    state = buffers.hold(StepState(
        n=rows * (plan["context"] + 1), root=torch.randint_like(rows, model.config.vocab_size),
        seed_feedback=torch.randn(batch, hidden, dtype=dtype, device=run.device),
        seed_head=torch.randn(batch, hidden, dtype=dtype, device=run.device), active=rows.bool()))
    (step,) = [s for k, s in decoder._steps.items() if k[0] != "graphed" and k[1] is None]   # the fixed tree's
    return (lambda: step(state, buffers.cache, buffers.draft_kv, uniforms, final)), state


def section_speed(run: Run) -> None:
    from eagle_compile.runtime.generate import _decoders

    plan = SPEED_PLAN[run.mode]
    copy_gbs = copy_bandwidth(run, plan["copy_bytes"])
    log(run, f"device-to-device copy: {copy_gbs:.0f} GB/s (bytes read + written, {plan['copy_bytes'] >> 20} MiB)")
    run.rows["c"].append({"batch": None, "mode": "device-to-device copy", "ms": None, "gb": None,
                          "gbs": copy_gbs, "of_copy": 1.0, "break_even_tau": None, "context": None, "tau": None})
    t = time.perf_counter()
    model = build_target(SPEED_TARGET[run.mode], BF16, run.device, seed=0)
    head = build_head(model, plan["draft_vocab"], seed=1)
    log(run, f"target ({weight_bytes(model) / 1e9:.2f} GB bf16) and head ({weight_bytes(head) / 1e9:.2f} GB) built "
             f"on {run.device} in {time.perf_counter() - t:.1f} s")
    if run.cuda:
        check_kernel_choices(run, "c", BF16)
    plain_ms: dict[int, float] = {}
    for batch in plan["batches"]:
        if run.time_left(f"(c) plain decode, batch {batch}"):
            guarded(run, "c", f"plain decode, batch {batch}",
                    functools.partial(time_plain, run, model, batch, plan, copy_gbs, plain_ms))
    for name, tree in SPEED_TREES.items():
        options = {**tree, "step_program": True, "cudagraphs": True, "batch_buckets": plan["batches"],
                   "max_cache_len": plan["slots"], "prefill_chunk": plan["prefill_chunk"]}
        for batch in plan["batches"]:
            if run.time_left(f"(c) {name}, batch {batch}", need_s=20):
                guarded(run, "c", f"{name}, batch {batch}",
                        functools.partial(time_spec, run, model, head, name, options, batch, plan, copy_gbs, plain_ms))
        _decoders.get(model, {}).clear()       # drop this tree's decoder: its static buffers and graphs
        free_memory(run)


def time_plain(run: Run, model, batch: int, plan: dict, copy_gbs: float, plain_ms: dict) -> None:
    reps = dict(warmup=plan["warmup"], repeats=plan["repeats"])
    eager, captured = plain_step(model, batch, plan["context"], run.device, BF16)
    nbytes = weight_bytes(model, skip=("model.embed_tokens",)) + kv_bytes(model.config, batch, plan["context"] + 1,
                                                                         BF16.itemsize)
    timings = {"plain decode, eager": median_ms(run, eager, **reps)}
    key = "plain decode, CUDA graph" if run.cuda else "plain decode, dynamo (no graph: CPU)"
    timings[key] = median_ms(run, graph_of(captured) if run.cuda else captured, **reps)
    plain_ms[batch] = min(timings.values())           # break-even tau is against the faster plain step
    for mode, ms in timings.items():
        _speed_row(run, batch, mode, ms, nbytes, copy_gbs, plain_ms[batch], plan["context"], None)


def time_spec(run: Run, model, head, name: str, options: dict, batch: int, plan: dict, copy_gbs: float,
              plain_ms: dict) -> None:
    import eagle_compile
    from eagle_compile.options import parse_options

    ids = torch.randint(3, model.config.vocab_size, (batch, plan["context"]), device=run.device)
    t = time.perf_counter()
    out = eagle_compile.generate(model, ids, draft=head, options=options, max_new_tokens=4,
                                 return_dict_in_generate=True)
    log(run, f"{name}, batch {batch}: generate with capture took {time.perf_counter() - t:.1f} s "
             f"({out.stats.graphs_captured} dynamo graphs so far, {out.stats.cuda_graph_replays} replays)")
    if run.cuda:
        run.check("c", f"{name}, batch {batch}: CUDA graph replayed", out.stats.cuda_graph_replays > 0,
                  f"{out.stats.cuda_graph_replays} replays")
    call, state = spec_step(run, model, options, batch, plan)
    calls, opts = plan["warmup"] + plan["repeats"], parse_options(options)
    room = plan["slots"] - int(state.n.max()) - opts.tree_tokens - 2      # a step past it writes out of range
    if not run.check("c", f"{name}, batch {batch}: the cache has room for the timed steps",
                     room >= calls * (opts.tree_depth + 1), f"{room} free slots, {calls} steps"):
        return
    before = state.n.clone()
    ms = median_ms(run, call, warmup=plan["warmup"], repeats=plan["repeats"])
    advanced = int((state.n - before).min())
    run.check("c", f"{name}, batch {batch}: every timed step advanced every row", advanced >= calls,
              f"rows advanced >= {advanced} tokens over {calls} steps")
    context = (before.float().mean().item() + state.n.float().mean().item()) / 2
    nbytes = spec_bytes(model, head, options, batch, context)
    mode = f"speculative {name}, {'CUDA graph' if run.cuda else 'no graph (CPU)'}"
    _speed_row(run, batch, mode, ms, nbytes, copy_gbs, plain_ms.get(batch), context, out.stats.tau)


def _speed_row(run: Run, batch, mode, ms, nbytes, copy_gbs, plain, context, tau) -> None:
    gbs = nbytes / (ms * 1e-3) / 1e9
    row = {"batch": batch, "mode": mode, "ms": ms, "gb": nbytes / 1e9, "gbs": gbs, "of_copy": gbs / copy_gbs,
           "break_even_tau": (ms / plain) if plain and mode.startswith("speculative") else None,
           "context": context, "tau": tau}
    run.rows["c"].append(row)
    log(run, f"batch {batch:3d} {mode:48s} {ms:9.3f} ms  {nbytes / 1e9:7.2f} GB  {gbs:8.1f} GB/s "
             f"({100 * gbs / copy_gbs:5.1f}% of copy)")


# -- output ------------------------------------------------------------------------------------------------------
def markdown(run: Run, env: dict, sections: list[str]) -> str:
    from common import markdown_table

    fmt = lambda x, spec: "" if x is None else (format(x, spec) if math.isfinite(x) else "inf")  # noqa: E731
    where = "DRY RUN on CPU: code paths only, not measurements" if run.mode == "dry" else env["device"]
    parts = [f"# GPU check ({where})", "",
             f"torch {env['torch']}, transformers {env['transformers']}, triton {env['triton']}; "
             f"commit {env['git'].get('commit')}; {env['time']}; {run.elapsed():.0f} s"
             + ("; NEGATIVE CONTROL (deliberately broken: every check should fail)" if run.negative_control else ""),
             ""]
    if "a" in sections:
        parts += ["## (a) kernels vs references", "", markdown_table(
            ["op", "shape", "dtype", "max err", "tol", "result", "triton ms", "reference ms", "reference / triton"],
            [[r["op"], f"{r['shape']} ({r['dims']})", r["dtype"], fmt(r["err"], ".2e"), fmt(r["tol"], ".0e"),
              "PASS" if r["ok"] else "FAIL", fmt(r.get("triton_ms"), ".3f"), fmt(r.get("reference_ms"), ".3f"),
              fmt(r["reference_ms"] / r["triton_ms"] if r.get("triton_ms") else None, ".2f")]
             for r in run.rows["a"]]), ""]
    if "b" in sections:
        parts += _graph_table(run, "b", "(b) CUDA graphs per bucket, padding rows poisoned with finite garbage")
    if "c" in sections:
        parts += ["## (c) decode step time and achieved memory bandwidth (random Llama-3.1-8B shape, bf16)", "",
                  markdown_table(
                      ["batch", "step", "context", "ms (median)", "GB moved", "GB/s", "% of copy", "break-even tau"],
                      [[r["batch"] or "", r["mode"], fmt(r["context"], ".0f"), fmt(r["ms"], ".3f"),
                        fmt(r["gb"], ".2f"), fmt(r["gbs"], ".0f"), fmt(100 * r["of_copy"], ".1f"),
                        fmt(r["break_even_tau"], ".2f")] for r in run.rows["c"]]), "",
                  "GB moved: fewest bytes a step must read (target weights without the embedding table, KV of the "
                  "context; speculative: plus the tree's KV, the draft layer and its KV per draft forward, the draft "
                  "lm_head per level, fc once). break-even tau: speculative step time / plain step time (CUDA "
                  "graph), the acceptance length a trained head must reach to beat plain decoding. The heads here "
                  "are random (tau about 1), so no speedup is claimed.", ""]
    if "l" in sections:
        parts += long_context_markdown(run)
    if "t" in sections:
        parts += tensorrt_markdown(run)
    if "n" in sections:
        parts += _graph_table(run, "n", "(n) CUDA graphs per bucket, NaN-poisoned padding rows")
    if run.notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in run.notes] + [""]
    if run.skipped:
        parts += ["## Skipped (time budget)", ""] + [f"- {s}" for s in run.skipped] + [""]
    failed = run.failed
    parts += [f"**{len(run.checks) - len(failed)} of {len(run.checks)} checks passed.**", ""]
    parts += [f"- FAIL ({c['section']}) {c['name']}: {c['detail']}" for c in failed]
    return "\n".join(parts) + "\n"


def _graph_table(run: Run, key: str, title: str) -> list[str]:
    from common import markdown_table

    return [f"## {title}", "", markdown_table(
        ["bucket", "real rows", "padding rows", "poisoned elements", "cycles", "graph replays", "graphs == eager",
         "== HF greedy", "tau"],
        [[r["bucket"], r["real"], r["padding_rows"], r["poisoned_elements"], r["cycles"], r["replays"],
          r["graphs_eq_eager"], r["eq_hf"], f"{r['tau']:.2f}"] for r in run.rows[key]]), ""]


def write_outputs(run: Run, out: Path, env: dict, args: argparse.Namespace, *, final: bool) -> None:
    """Written after every section (a later crash, even a hard one, leaves what ran); printed at the end."""
    from common import write_json

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "gpu_check.json", {"environment": env, "mode": run.mode, "args": vars(args),
                                        "elapsed_s": run.elapsed(), "section_s": run.section_s,
                                        "checks": run.checks, "rows": run.rows, "notes": run.notes,
                                        "skipped": run.skipped, "complete": final})
    text = markdown(run, env, args.sections)
    (out / "gpu_check.md").write_text(text)
    if final:
        print("\n" + text, flush=True)
        log(run, f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")


# -- preflight and main ------------------------------------------------------------------------------------------
def environment(run: Run) -> dict:
    import transformers
    from common import environment as common_environment

    env = common_environment()
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception as e:  # a broken install raises anything, not only ImportError
        env["triton"] = f"not importable ({type(e).__name__}: {e})"
    env["device"] = torch.cuda.get_device_name() if run.cuda else "cpu"
    env["time"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if run.cuda:
        props = torch.cuda.get_device_properties(0)
        env["sm"] = f"{props.major}.{props.minor}, {props.multi_processor_count} SMs, {props.total_memory >> 30} GiB"
    log(run, f"torch {torch.__version__}, transformers {transformers.__version__}, triton {env['triton']}, "
             f"device {env['device']} {env.get('sm', '')}")
    for name, pin in PINS.items():
        have = torch.__version__ if name == "torch" else transformers.__version__
        if not have.startswith(pin):
            run.note(f"{name} {have} differs from the project's pin ({pin}); results hold for {have}")
    return env


SECTIONS = {"a": ("kernels", section_kernels), "b": ("CUDA graphs, stale padding", section_graphs),
            "c": ("speed", section_speed), "l": ("long-context soak", section_long_context),
            "t": ("TensorRT", section_tensorrt), "n": ("CUDA graphs, NaN padding", section_nan)}
SECTION_ORDER = tuple(SECTIONS)

NO_CUDA_MESSAGE = """\
gpu_check: no CUDA device is present (torch {torch}: torch.cuda.is_available() is False). Nothing was checked.

On a machine with a CUDA GPU (meant for one H200, under 8 minutes) this script would:
  (a) check every eagle31 op (tree_attention, fc_norm_fuse, draft_topk, kv_compact, accept_greedy,
      accept_sample) as a Triton kernel against its torch reference in fp16/bf16/fp32, odd and 8B sizes,
      poisoned outputs, and time both;
  (b) check every CUDA-graph batch bucket (1, 2, 4, 8, 16) with real batch sizes 1, 2, 3, 5, 8, 13 against
      eager and HF greedy, with NaN-poisoned padding rows and the graph replay counter;
  (c) time a plain decode step and a speculative step (chain 4, small tree) of a random Llama-3.1-8B-shaped
      target in bf16 at batch 1, 8, 64 over a 512-token context, as achieved GB/s against a device copy.
  (l) soak a 128K-token prompt (chunked prefill, 256 speculative cycles) on the same 8B shape: exact against
      the plain mode, peak memory against the linear expectation (KV caches + activations); --sections l
      runs it alone (about 4 minutes).
  (t) check the TensorRT export's programs at every bucket and, where torch_tensorrt imports, build the
      engines, compare them with PyTorch and decode with inner_backend='tensorrt'.

Run it there:       python benchmarks/gpu_check.py --out bench_out/gpu_check
Dry run here (CPU): python benchmarks/gpu_check.py --dry-run-cpu   (Triton interpreter, tiny shapes)
This exit is 0; pass --require-gpu to make a missing GPU an error (exit 2)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--sections", default="a,b,c,l,t,n", help="comma-separated subset, run in the order a "
                   "(kernels), b (CUDA graphs, stale padding), c (speed), l (128K long-context soak), t (TensorRT), "
                   "n (CUDA graphs, NaN padding)")
    p.add_argument("--budget-s", type=float, default=450.0, help="time budget; later sub-steps are skipped")
    p.add_argument("--require-gpu", action="store_true", help="exit 2 when no CUDA device is present")
    p.add_argument("--dry-run-cpu", action="store_true", help="run the sections on the CPU with tiny shapes and "
                                                               "the Triton interpreter (code paths only)")
    p.add_argument("--negative-control", action="store_true", help="break the kernels' outputs (a) and poison a "
                   "real row (b, n): every such check must then FAIL, proving the checks can fail")
    args = p.parse_args(argv)
    requested = {s.strip() for s in args.sections.split(",") if s.strip()}
    bad = sorted(requested - set(SECTION_ORDER))
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {', '.join(SECTION_ORDER)}")
    args.sections = [s for s in SECTION_ORDER if s in requested]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run_cpu:
        os.environ[INTERPRET_ENV] = "1"           # read per call by eagle_compile.kernels._dispatch
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print(NO_CUDA_MESSAGE.format(torch=torch.__version__), flush=True)
        return 2 if args.require_gpu else 0
    sys.path.insert(0, str(REPO_ROOT))            # the device machine has the checkout, not the editable install
    run = Run(device=device, mode="dry" if args.dry_run_cpu else "gpu", budget_s=args.budget_s,
              negative_control=args.negative_control)
    what = "DRY RUN: Triton interpreter, tiny shapes, no CUDA graphs" if run.mode == "dry" else "GPU"
    log(run, f"gpu_check on {device} ({what}); sections {args.sections}, budget {args.budget_s:.0f} s")
    env = environment(run)
    compat_torch_compile(run.note)
    for key in args.sections:
        name, fn = SECTIONS[key]
        log(run, f"=== section ({key}) {name}: start")
        t = time.perf_counter()
        try:
            fn(run)
        except Exception as e:  # one section's crash must not stop the others
            traceback.print_exc()
            run.check(key, f"section ({key}) {name} ran to the end", False, f"{type(e).__name__}: {e}")
        run.section_s[key] = time.perf_counter() - t
        log(run, f"=== section ({key}) {name}: done in {run.section_s[key]:.1f} s")
        free_memory(run)
        write_outputs(run, args.out, env, args, final=False)
    write_outputs(run, args.out, env, args, final=True)
    failed = run.failed
    log(run, f"{'ALL CHECKS PASSED' if not failed else f'{len(failed)} CHECK(S) FAILED'} "
             f"({len(run.checks)} checks, {run.elapsed():.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
