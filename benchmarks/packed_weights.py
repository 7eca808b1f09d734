"""What the batch-invariant linears gain from packed weights, and the draft from its 16-bit weights.

    python benchmarks/packed_weights.py --threads-list 1,2 --prefix 512 --repeats 7

The default target (SmolLM2, float32, numerics "auto" = batch_invariant) verifies N = 1, 2, 4, 8 tokens over a
`--prefix`-token cache through its captured program, with the linears reading the packed copies
(kernels/batch_invariant.py `PackedWeights`, the default) and with packing off (a zero budget: `bi_linear` on the
[N, K] weights); and one draft tree level (forward + top-k over one frontier node, the shipped head in float32)
with the head's 16-bit copies and packed weights, and with neither. The two variants of each call run
round-robin in one process; their outputs are compared bit for bit (they must be equal: packing and the 16-bit
copies change memory traffic, never arithmetic). HF's one-token step on a DynamicCache of the same prefix is
timed beside them. Writes packed_weights.json and packed_weights.md in --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import DEFAULT_OUT_DIR, begin, environment, load_head, markdown_table, print_load, set_threads, write_json
from verify_cost import _frontier_calls, cache_slots, hf_step, prefill, verify_call

TOKENS = (1, 2, 4, 8)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads-list", default="1,2", help="comma-separated thread counts, measured in turn")
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--draft", default=None, help="head folder (default: the shipped head)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "packed_weights")
    return p.parse_args(argv)


def same(a: Any, b: Any) -> bool:
    """Bit equality of two program outputs (tensors, or tuples/lists/dicts of them)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def round_robin(variants: dict[str, tuple[Any, dict[Any, Any]]], repeats: int) -> dict[str, dict[Any, float]]:
    """{variant: {call: median seconds}}; `variants` maps a name to (its setup function, {call name: fn}); every
    repeat runs every variant's calls once, variants in turn, after one untimed warm-up round."""
    times: dict[str, dict[Any, list[float]]] = {v: {c: [] for c in calls} for v, (_, calls) in variants.items()}
    for r in range(repeats + 1):
        for name, (setup, calls) in variants.items():
            setup()
            for call, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                if r:
                    times[name][call].append(time.perf_counter() - t0)
    return {v: {c: sorted(ts)[len(ts) // 2] for c, ts in calls.items()} for v, calls in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = begin(None)
    from eagle_compile.draft.drafter import EagleDrafter
    from eagle_compile.kernels import batch_invariant as bi
    from eagle_compile.lowering import lowering_for
    from eagle_compile.runtime.kv_cache import SlotKVCache
    from eagle_compile.runtime.target_program import TargetProgram
    from eagle_compile.targets import load_default_target

    model, _ = load_default_target(torch.float32)
    head, head_info = load_head(model, args.draft)
    lowering = lowering_for("auto", None, model.device, model.dtype, "auto")
    packed, unpacked = bi.PACKED, bi.PackedWeights(budget=0)

    def use(registry):
        def setup():
            bi.PACKED = registry
        return setup

    gen = torch.Generator().manual_seed(0)
    program = TargetProgram(model, None, lowering=lowering, recompile_limit=len(TOKENS) + 8)
    slots = cache_slots(args.prefix, max(TOKENS))
    cache = SlotKVCache(model.config, 1, slots, dtype=model.dtype, device="cpu")
    prefill(program, cache, args.prefix, gen)
    steps = {n: verify_call(program, cache, args.prefix, n, gen) for n in TOKENS}
    fast, plain = EagleDrafter(head, numerics="batch_invariant"), EagleDrafter(head, numerics="batch_invariant")
    plain._narrow = lambda weight: weight                                       # float32 weights as loaded
    levels = {}
    for name, drafter in (("packed", fast), ("unpacked", plain)):
        state = drafter.new_state(1, slots, dtype=torch.float32, device=torch.device("cpu"))
        torch.manual_seed(0)
        forward, top = _frontier_calls(drafter, state, head.config, args.prefix, 1, slots, torch.float32)
        levels[name] = {"draft forward": forward, "draft top-k": top}

    exact = {}
    for name, registry in (("packed", packed), ("unpacked", unpacked)):
        use(registry)()
        exact[name] = ({n: fn() for n, fn in steps.items()}, {c: fn() for c, fn in levels[name].items()})
    bits_equal = same(exact["packed"], exact["unpacked"])
    print(f"packed {len(packed)} weights ({packed.bytes / 1e6:.0f} MB, {packed.declined} declined); "
          f"16-bit draft weights {len(fast._narrow)}; outputs bit-equal: {bits_equal}", flush=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    runs = []
    for threads in [int(t) for t in args.threads_list.split(",")]:
        set_threads(threads)
        med = round_robin({name: (use(reg), {**{f"c({n})": fn for n, fn in steps.items()}, **levels[name]})
                           for name, reg in (("packed", packed), ("unpacked", unpacked))}, args.repeats)
        hf = hf_step(model, args.prefix, args.repeats, 1)["median"]
        runs.append({"threads": threads, "seconds": med, "hf_step_s": hf})
        for name, m in med.items():
            level = m["draft forward"] + m["draft top-k"]
            print(f"  {threads} threads, {name}: " + ", ".join(f"{c} {s * 1e3:.1f} ms" for c, s in m.items())
                  + f"; level/c(1) {level / m['c(1)']:.3f}; HF step {hf * 1e3:.1f} ms", flush=True)
    bi.PACKED = packed
    result = {"environment": environment(), "load_before": load_before, "load_after": print_load("after"),
              "head": head_info, "prefix": args.prefix, "repeats": args.repeats, "weight_bytes": weight_bytes,
              "packed_weights": len(packed), "packed_bytes": packed.bytes, "bits_equal": bits_equal, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "packed_weights.json", result)
    rows = []
    for run in runs:
        for name, m in run["seconds"].items():
            level = m["draft forward"] + m["draft top-k"]
            rows.append([run["threads"], name, *(f"{m[f'c({n})'] * 1e3:.1f}" for n in TOKENS),
                         " / ".join(f"{m[f'c({n})'] / m['c(1)']:.2f}" for n in TOKENS[1:]),
                         f"{weight_bytes / m['c(1)'] / 1e9:.1f}", f"{level * 1e3:.2f}", f"{level / m['c(1)']:.3f}",
                         f"{run['hf_step_s'] * 1e3:.1f}"])
    env = result["environment"]
    text = "\n".join([
        f"packed weights, prefix {args.prefix}, float32, median of {args.repeats} (round-robin): torch "
        f"{env['torch']}, load {load_before['loadavg_1m']} / {result['load_after']['loadavg_1m']}, outputs "
        f"bit-equal {bits_equal}; `{env['command']}`", "",
        markdown_table(["threads", "weights", *(f"c({n}) ms" for n in TOKENS), "c(2)/c(4)/c(8) over c(1)",
                        "weights GB/s at c(1)", "draft level ms", "level / c(1)", "HF step ms"], rows)])
    (args.out / "packed_weights.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return 0 if bits_equal else 1


if __name__ == "__main__":
    sys.exit(main())
