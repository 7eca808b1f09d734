"""The batch-invariant linear kernels on the default target's shapes, per weight layout, beside MKL.

    python benchmarks/linear_layouts.py --threads-list 1,2 --rows 1,4,8,64,1024 --repeats 9

For each linear shape of the default target (SmolLM2-135M: q/o 576x576, k/v 192x576, gate/up 1536x576, down
576x1536; random float32 weights of those shapes, no checkpoint needed) and each row count M, times in one
process, round-robin: `bi_linear` on the [N, K] weight, `bi_linear_packed` on 4-column panels, `bi_linear_panels`
on 16-column panels (AVX-512 builds; kernels/batch_invariant.py `pack_weight`) and torch's `F.linear` (MKL, not
batch-invariant: the anchor). The three batch-invariant outputs are compared bit for bit (they must be equal:
a layout changes memory order, never arithmetic). Prints milliseconds for all 30 layers' worth of each shape and
the rate in multiply-adds per second; writes linear_layouts.json and .md in --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from common import DEFAULT_OUT_DIR, begin, interleaved_times, set_threads, write_results

from eagle_compile.kernels import batch_invariant as bi

SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536)}   # (N, K)
LAYERS = 30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads-list", default="1,2", help="comma-separated thread counts, measured in turn")
    p.add_argument("--rows", default="1,4,8,64,1024", help="comma-separated row counts M")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "linear_layouts")
    return p.parse_args(argv)


def calls_for(x: torch.Tensor, weights: list[torch.Tensor]) -> dict[str, callable]:
    """One call per kernel that runs the shape's linear once per layer (distinct weights: memory traffic as in
    a forward, not one weight hot in cache)."""
    packed = [bi.pack_weight(w, panels=False) for w in weights]
    calls = {"bi_linear": lambda: [bi.bi_linear(x, w) for w in weights],
             "packed4": lambda: [torch.ops.eagle31.bi_linear_packed(x, p, None) for p in packed],
             "mkl": lambda: [F.linear(x, w) for w in weights]}
    if bi.panel_layout():
        panels = [bi.pack_weight(w, panels=True) for w in weights]
        calls["panels16"] = lambda: [torch.ops.eagle31.bi_linear_panels(x, p, None) for p in panels]
    return calls


def measure(rows: list[int], repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    records = []
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, generator=g) * k ** -0.5 for _ in range(LAYERS)]
        for m in rows:
            x = torch.randn(m, k, generator=g)
            calls = calls_for(x, weights)
            outs = {c: fn() for c, fn in calls.items() if c != "mkl"}
            first = outs["bi_linear"]
            equal = all(torch.equal(a, b) for out in outs.values() for a, b in zip(out, first, strict=True))
            times = interleaved_times(calls, repeats=repeats, warmup=1)
            macs = LAYERS * m * n * k
            record = {"shape": name, "N": n, "K": k, "M": m, "bits_equal": equal, "threads": torch.get_num_threads(),
                      "ms": {c: 1e3 * t["median"] for c, t in times.items()},
                      "gmacs": {c: macs / t["median"] / 1e9 for c, t in times.items()}}
            records.append(record)
            print(record, flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = begin(None)
    print(f"kernels: {bi.load()} (panel layout: {bi.panel_layout()})", flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    kernels = ["bi_linear", "packed4", *(["panels16"] if bi.panel_layout() else []), "mkl"]
    records = []
    for threads in (int(t) for t in args.threads_list.split(",")):
        set_threads(threads)
        records += measure(rows, args.repeats)
    header = ["threads", "shape (N x K)", "M", *[f"{k} ms" for k in kernels], "best invariant GMAC/s",
              "mkl GMAC/s", "bits equal"]
    cells = []
    for r in records:
        best = max((k for k in kernels if k != "mkl"), key=lambda k: r["gmacs"][k])
        cells.append([r["threads"], f"{r['shape']} ({r['N']} x {r['K']})", r["M"],
                      *[f"{r['ms'][k]:.2f}" for k in kernels], f"{r['gmacs'][best]:.1f} ({best})",
                      f"{r['gmacs']['mkl']:.1f}", r["bits_equal"]])
    write_results(args.out, "linear_layouts", args, records, load,
                  f"Batch-invariant linears, {LAYERS} layers' weights per call, median of {args.repeats}",
                  header, cells)
    return 0 if all(r["bits_equal"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
