"""(l) long context: a 128K-token soak of the Llama-3.1-8B shape (random weights, bf16, one H200).

A 32K-token prompt, then a 130,560-token one (32 prefill chunks of at most 4096 tokens; attention over up to
128K live slots in the Triton `tree_attention`), each followed by 256 new tokens of speculative decoding with a
small tree (depth 4, top_k 4, 16 nodes) and a random EAGLE 3.1 head (tau about 1: about 256 cycles over the 128K
cache); then the 128K call again in the plain mode (`speculate=False`, the same programs). Checked:

* exact: the speculative tokens equal the plain mode's. In bf16 on a GPU a verify forward over a tree and a
  one-token step round differently (other GEMM shapes), so a first difference at a near tie (top-2 margin at most
  `NEAR_TIE` of the top logit) is reported and passes; any other difference fails (and in the dry run, in
  float32, any difference at all).
* memory, against the linear expectation: each call's peak (`torch.cuda.max_memory_allocated` beyond what was
  live before it) is at least the KV caches it allocates (target + draft, `slots` x bytes per slot) and at most
  that plus an activation allowance that does not depend on the context; from 32K to 128K the peak grows by
  the KV bytes of the added slots, within `SLOPE_TOL`.
* every call produced all its new tokens, in cycles.
Reported: prefill seconds and tokens/s, ms per decode cycle, tau, peak and KV MiB.

The dry run (`--dry-run-cpu`) runs the same code at tiny shapes (float32: speculative == plain bit for bit there)
with the CPU's peak from the profiler's memory timeline. `--negative-control` changes one prompt token of the
plain-mode call: the exactness check must then fail. Run the soak alone with `--sections l` (about 4 minutes on an
H200: it needs more than the default budget leaves after (a)-(c)).
"""

from __future__ import annotations

import time

import torch

from gpu.base import LLAMA_8B, Run, build_head, build_target, kv_bytes, log, top2_margin
from gpu.memory import peak_bytes

LONG_TARGET = {
    "gpu": LLAMA_8B,
    "dry": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=4096),
}
LONG_PLAN = {
    "gpu": dict(contexts=(32768, 130560), max_new=256, prefill_chunk=4096, draft_vocab=32000,
                allowance=6 << 30, need_s=(90, 150), plain_need_s=150),
    "dry": dict(contexts=(256, 1024), max_new=12, prefill_chunk=128, draft_vocab=64,
                allowance=32 << 20, need_s=(0, 0), plain_need_s=0),
}
LONG_TREE = {"depth": 4, "top_k": 4, "total_tokens": 16}
#: a first difference whose top-2 margin is at most this share of the top logit is a bf16 near tie
NEAR_TIE = 2 ** -6
MIB = 2 ** 20
#: the growth of the peak per added slot may differ from the KV bytes per slot by this share (dry: the tiny
#: target's KV is about 1 KiB a slot, the same order as what the first call allocates once, e.g. while capturing)
SLOPE_TOL = {"gpu": 0.1, "dry": 0.25}


def section_long_context(run: Run) -> None:
    plan = LONG_PLAN[run.mode]
    dtype = torch.bfloat16 if run.cuda else torch.float32
    t = time.perf_counter()
    model = build_target(LONG_TARGET[run.mode], dtype, run.device, seed=0, sharpen=8.0)
    indices = None if run.cuda else (1, 2, 3)           # the dry target's 4 layers are fewer than the default needs
    head = build_head(model, plan["draft_vocab"], seed=1, capture_indices=indices)
    log(run, f"target and head built on {run.device} in {time.perf_counter() - t:.1f} s")
    base = {"prefill_chunk": plan["prefill_chunk"]}
    gen = torch.Generator().manual_seed(13)
    prompts = {n: torch.randint(3, model.config.vocab_size, (1, n), generator=gen).to(run.device)
               for n in plan["contexts"]}
    calls = {}
    for context, need in zip(plan["contexts"], plan["need_s"], strict=True):
        if run.time_left(f"(l) speculative, {context}-token prompt", need_s=need):
            calls[context] = soak_call(run, model, head, prompts[context], {**LONG_TREE, **base}, plan)
    longest = plan["contexts"][-1]
    if longest in calls and run.time_left(f"(l) plain mode, {longest}-token prompt", need_s=plan["plain_need_s"]):
        ids = prompts[longest].clone()
        if run.negative_control:
            ids[0, -1] = (ids[0, -1] + 1) % model.config.vocab_size
        plain = soak_call(run, model, head, ids, {"speculate": False, **base}, plan)
        check_exact(run, model, calls[longest], plain, prompts[longest].shape[1])
    check_growth(run, calls)


def soak_call(run: Run, model, head, ids: torch.Tensor, options: dict, plan: dict) -> dict:
    """One generate call, its peak memory against the KV it must hold, its times; a row of the report."""
    import eagle_compile
    from eagle_compile.kernels import batch_invariant
    from eagle_compile.options import parse_options
    from eagle_compile.runtime.generate import _decoders

    speculate = options.get("speculate", True)
    mode = "speculative" if speculate else "plain"
    packs = batch_invariant.PACKED
    t, packed_before = time.perf_counter(), packs.bytes
    out, peak = peak_bytes(lambda: eagle_compile.generate(model, ids, draft=head, options=options,
                                                          max_new_tokens=plan["max_new"],
                                                          return_dict_in_generate=True), run.device)
    wall = time.perf_counter() - t
    # the batch-invariant linears' packed weight copies (CPU) are made on a weight's first use and outlive the
    # call, like the weights themselves: not activations, so not in the peak the checks bound
    packed = packs.bytes - packed_before
    peak -= packed
    (decoder,) = [d for d in _decoders[model].values() if d.options == parse_options(options)]
    slots = decoder._slots([ids[0]], plan["max_new"])
    element = next(model.parameters()).element_size()
    per_slot = kv_bytes(model.config, 1, 1, element) + (kv_bytes(head.config, 1, 1, element) if speculate else 0)
    stats, context = out.stats, ids.shape[1]
    row = {"mode": mode, "context": context, "slots": slots, "new_tokens": stats.new_tokens, "cycles": stats.cycles,
           "tau": stats.tau, "prefill_s": stats.prefill_time, "prefill_tok_s": context / stats.prefill_time,
           "ms_per_cycle": 1e3 * stats.step_time / max(1, stats.cycles), "wall_s": wall, "peak_bytes": peak,
           "kv_bytes": per_slot * slots, "per_slot": per_slot, "packed_weight_bytes": packed, "notes": stats.notes,
           "sequences": out.sequences}
    run.rows["l"].append({k: v for k, v in row.items() if k != "sequences"})
    log(run, f"{mode}, {context}-token prompt: prefill {stats.prefill_time:.1f} s ({row['prefill_tok_s']:.0f} tok/s), "
             f"{stats.cycles} cycles at {row['ms_per_cycle']:.1f} ms, tau {stats.tau:.2f}; peak {peak / MIB:.1f} MiB, "
             f"KV {row['kv_bytes'] / MIB:.1f} MiB ({slots} slots)")
    label = f"{mode}, {context}-token prompt"
    run.check("l", f"{label}: all {plan['max_new']} new tokens, in cycles",
              stats.new_tokens == plan["max_new"] and stats.cycles > 0,
              f"{stats.new_tokens} new tokens, {stats.cycles} cycles")
    over = peak - row["kv_bytes"]
    run.check("l", f"{label}: peak = KV caches + at most {plan['allowance'] / MIB:.0f} MiB of activations",
              0 <= over <= plan["allowance"], f"peak {peak / MIB:.1f} MiB, KV {row['kv_bytes'] / MIB:.1f} MiB, "
                                              f"over KV {over / MIB:.1f} MiB")
    return row


def check_exact(run: Run, model, spec: dict, plain: dict, prompt_len: int) -> None:
    """Speculative tokens == plain-mode tokens; a first difference at a near tie (bf16 rounding) passes."""
    ours, ref = spec["sequences"][:, prompt_len:], plain["sequences"][:, prompt_len:]
    name = f"speculative == plain mode over {ours.shape[1]} new tokens after {prompt_len} prompt tokens"
    if torch.equal(ours, ref):
        run.check("l", name, True, "identical")
        return
    col = int((ours != ref).nonzero()[0, 1])
    margin, top = top2_margin(model, plain["sequences"][:, :prompt_len + col])
    near = margin <= NEAR_TIE * top
    run.check("l", name, near and run.cuda,
              f"first difference at new token {col}: {int(ours[0, col])} vs {int(ref[0, col])}; top-2 margin there "
              f"{margin:.3g} of a top logit {top:.3g} ({'a near tie: bf16 rounding' if near else 'NOT a near tie'})")


def check_growth(run: Run, calls: dict) -> None:
    """From the shortest to the longest context the peak grows by the KV bytes of the added slots."""
    if len(calls) < 2:
        return
    short, long = calls[min(calls)], calls[max(calls)]
    slope = (long["peak_bytes"] - short["peak_bytes"]) / (long["slots"] - short["slots"])
    ratio, tol = slope / long["per_slot"], SLOPE_TOL[run.mode]
    run.check("l", f"peak memory grows linearly: {short['context']} -> {long['context']} tokens adds the KV bytes "
                   f"of the added slots (within {tol:.0%})", abs(ratio - 1) <= tol,
              f"{slope:.0f} bytes per added slot, KV {long['per_slot']:.0f} bytes per slot (x{ratio:.3f})")


def markdown(run: Run) -> list[str]:
    from common import markdown_table

    shape = "random Llama-3.1-8B shape, bf16" if run.cuda else "tiny random target, float32"
    return [f"## (l) long-context soak ({shape})", "", markdown_table(
        ["mode", "prompt", "slots", "new tokens", "cycles", "tau", "prefill s", "prefill tok/s", "ms / cycle",
         "peak MiB", "KV MiB", "peak - KV MiB"],
        [[r["mode"], r["context"], r["slots"], r["new_tokens"], r["cycles"], f"{r['tau']:.2f}",
          f"{r['prefill_s']:.1f}", f"{r['prefill_tok_s']:.0f}", f"{r['ms_per_cycle']:.1f}",
          f"{r['peak_bytes'] / MIB:.1f}", f"{r['kv_bytes'] / MIB:.1f}",
          f"{(r['peak_bytes'] - r['kv_bytes']) / MIB:.1f}"] for r in run.rows["l"]]), "",
        "peak: the call's peak allocation beyond what was live before it (weights excluded; CUDA: "
        "torch.cuda.max_memory_allocated, CPU: the profiler's memory timeline); "
        "KV: the target's and the draft's caches at the call's slots. The head is random (tau about 1).", ""]
