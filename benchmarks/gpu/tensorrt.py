"""(t) TensorRT: the export's programs checked at every bucket, engines built and run where torch_tensorrt
imports, and `inner_backend="tensorrt"` decoding against the plain mode of the same lowering.

A small random Llama (bf16 on the GPU, float32 in the dry run) and a random EAGLE 3.1 head:

1. `export_tensorrt(..., programs_only=True)` at buckets 1, 2, 4: every program holds only ops torch-tensorrt
   converts, decomposes or removes (runs anywhere, also on a GPU machine without TensorRT);
2. where torch_tensorrt imports (CUDA + TensorRT): the engines are built per program and bucket, loaded back, and
   the target engine's logits are compared with the PyTorch program's at a plain step and at the tree's size
   (argmax equal, max |difference| reported);
3. there too: `eagle_compile.generate(..., options={"inner_backend": "tensorrt"})` with a small tree equals the
   same backend's plain mode (`speculate=False`) token for token; ms per generated token is reported against
   `inner_backend="eager"`.

Where torch_tensorrt does not import, 2 and 3 are listed as skipped with the import error (what is missing).
`--negative-control` perturbs the PyTorch side of step 2, which must then fail.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from gpu.base import Run, build_head, build_target, guarded, log

TRT_TARGET = {
    "gpu": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096),
    "dry": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024),
}
TRT_BUCKETS = (1, 2, 4)
TRT_TREE = {"depth": 3, "top_k": 2, "total_tokens": 6}
SLOTS = 256


def torch_tensorrt_status() -> tuple[bool, str]:
    try:
        import torch_tensorrt
    except Exception as error:          # ImportError, or libnvinfer missing (COMPILE_FACTS.md §7)
        return False, f"torch_tensorrt does not import ({type(error).__name__}: {(str(error).splitlines() or [''])[0]})"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    return True, f"torch_tensorrt {torch_tensorrt.__version__}"


def section_tensorrt(run: Run) -> None:
    dtype = torch.bfloat16 if run.cuda else torch.float32
    model = build_target(TRT_TARGET[run.mode], dtype, run.device, seed=0, sharpen=8.0)
    head = build_head(model, 8000 if run.cuda else 64, seed=1, capture_indices=None if run.cuda else (1, 2, 3))
    available, why = torch_tensorrt_status()
    log(run, f"(t) {why}")
    run.keep["trt_status"] = why
    with tempfile.TemporaryDirectory() as scratch:
        guarded(run, "t", "programs at every bucket", lambda: _programs(run, model, head, Path(scratch) / "p"))
        if not available:
            run.skipped.append(f"(t) engines and inner_backend='tensorrt': {why}")
            return
        guarded(run, "t", "engines", lambda: _engines(run, model, head, Path(scratch) / "e"))
    guarded(run, "t", "inner_backend='tensorrt' decode", lambda: _decode(run, model, head))


def _programs(run: Run, model, head, out: Path) -> None:
    from eagle_compile.export.tensorrt import export_tensorrt

    t = time.perf_counter()
    manifest = export_tensorrt(model, head, out, tree=TRT_TREE, buckets=TRT_BUCKETS, max_cache_len=SLOTS,
                               programs_only=True)
    seconds = time.perf_counter() - t
    for name, entry in manifest["programs"].items():
        for bucket, item in entry["buckets"].items():
            ops = item["ops"]
            run.rows["t"].append({"program": name, "bucket": int(bucket), "whole": ops["whole"],
                                  "converted_ops": sum(ops["convert"].values()), "engine": None,
                                  "max_abs_diff": None, "argmax_equal": None})
            run.check("t", f"{name} at batch {bucket}: every op handled by torch-tensorrt", ops["whole"],
                      f"fallback {ops['fallback']} custom {ops['custom']}" if not ops["whole"] else "")
    log(run, f"(t) programs exported and checked in {seconds:.1f} s")


def _engines(run: Run, model, head, out: Path) -> None:
    from eagle_compile.export.programs import TargetVerifyProgram, target_example
    from eagle_compile.export.tensorrt import export_tensorrt

    t = time.perf_counter()
    manifest = export_tensorrt(model, head, out, tree=TRT_TREE, buckets=TRT_BUCKETS, max_cache_len=SLOTS)
    log(run, f"(t) engines built in {time.perf_counter() - t:.1f} s")
    reference = TargetVerifyProgram(model, tuple(manifest["capture_indices"])).eval()
    for bucket in TRT_BUCKETS:
        engine = manifest["programs"]["target"]["buckets"][str(bucket)]["engine"]
        program = torch.export.load(str(out / engine)).module()
        for tokens in (1, TRT_TREE["total_tokens"]):
            inputs = {k: v.to(run.device) for k, v in
                      target_example(model, model.dtype, bucket, tokens, tokens, SLOTS).items()}
            inputs["mask_local"] = torch.ones(bucket, tokens, tokens, dtype=torch.bool, device=run.device).tril()
            with torch.no_grad():
                got = program(*inputs.values())[0].float()
                want = reference(*inputs.values())[0].float()
            if run.negative_control:
                want = want + torch.randn_like(want)
            diff = (got - want).abs().max().item()
            equal = bool(torch.equal(got.argmax(-1), want.argmax(-1)))
            run.rows["t"].append({"program": "target engine", "bucket": bucket, "tokens": tokens, "whole": True,
                                  "engine": engine, "max_abs_diff": diff, "argmax_equal": equal})
            run.check("t", f"target engine at batch {bucket}, {tokens} tokens: argmax equals PyTorch's", equal,
                      f"max |diff| {diff:.3g}")


def _decode(run: Run, model, head) -> None:
    import eagle_compile

    ids = torch.randint(3, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    ids = ids.to(run.device)
    results = {}
    for label, options in (("tensorrt", {"inner_backend": "tensorrt", **TRT_TREE}),
                           ("tensorrt plain", {"inner_backend": "tensorrt", "speculate": False}),
                           ("eager", {"inner_backend": "eager", **TRT_TREE})):
        eagle_compile.generate(model, ids, draft=head, max_new_tokens=4, options=options)       # compile, warm
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = eagle_compile.generate(model, ids, draft=head, max_new_tokens=64, options=options,
                                     return_dict_in_generate=True)
        torch.cuda.synchronize()
        results[label] = (out.sequences, (time.perf_counter() - t) * 1000 / 64)
        run.rows["t"].append({"program": f"generate ({label})", "bucket": 1, "ms_per_token": results[label][1]})
    spec, plain = results["tensorrt"][0], results["tensorrt plain"][0]
    same = torch.equal(spec, plain)
    run.check("t", "inner_backend='tensorrt': speculative == its plain mode (64 tokens)", same,
              "identical" if same else f"first difference at {int((spec != plain).nonzero()[0, 1])}")


def markdown(run: Run) -> list[str]:
    from common import markdown_table

    rows = run.rows["t"]
    lines = [f"## (t) TensorRT ({run.keep.get('trt_status', '')})", ""]
    programs = [r for r in rows if "whole" in r]
    if programs:
        lines += [markdown_table(["program", "bucket", "tokens", "all ops handled", "converted ops", "engine",
                                  "max abs diff", "argmax equal"],
                                 [[r["program"], r["bucket"], r.get("tokens", ""), r["whole"],
                                   r.get("converted_ops", ""), r["engine"] or "", r["max_abs_diff"] or "",
                                   r["argmax_equal"] if r["argmax_equal"] is not None else ""] for r in programs]),
                  ""]
    decode = [r for r in rows if "ms_per_token" in r]
    if decode:
        lines += [markdown_table(["generate", "ms / token"], [[r["program"], f"{r['ms_per_token']:.2f}"]
                                                              for r in decode]), ""]
    return lines
