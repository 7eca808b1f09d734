"""Shadow drafting A/B: the calibrated decoder with and without shadow drafting (greedy fallback left on the
re-sync's scored draft proposals, or on probe cycles) against the plain mode, on Spec-Bench quick cases, in one
process, interleaved rounds; prints each case's ratios and (probes, shadow checks) per decoder.

    python benchmarks/shadow_ab.py mt_bench/81,translation/161 --rounds 2 [--random]

Case ids are benchmarks/calibration.py's. --random: the untrained head instead of the shipped one. The
"noshadow" decoder is built with `Calibration.shadow_drafting` False (a comparison switch, not an option).
"""

from __future__ import annotations

import argparse

import torch
from calibration import spec_prompts
from common import DEFAULT_DATA_DIR, DEFAULT_OUT_DIR, interleaved_times, load_head, set_threads

import eagle_compile
from eagle_compile.draft.model import untrained_head
from eagle_compile.runtime import calibration

METHODS = ("plain", "shadow", "noshadow")


def build(model, head, cache_dir):
    """{method: compiled model}; the noshadow decoder's Calibration gets shadow_drafting False when built."""
    building = [None]
    init = calibration.Calibration.__init__

    def tagged(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.shadow_drafting = building[0] != "noshadow"

    calibration.Calibration.__init__ = tagged
    opts = {"plain": {"speculate": False}, "shadow": {"draft": head}, "noshadow": {"draft": head}}
    compiled = {n: torch.compile(model, backend="eagle31", options={**opts[n], "calibration_cache": str(cache_dir / n)})
                for n in METHODS}
    return compiled, building


def case(compiled, building, ids, new: int, rounds: int) -> str:
    last = {}

    def call(name):
        def run():
            building[0] = name          # a decoder is built on its first call
            last[name] = compiled[name].generate(ids, max_new_tokens=new, return_dict_in_generate=True)
        return run

    for name in METHODS:
        call(name)()
    times = interleaved_times({n: call(n) for n in METHODS}, repeats=rounds, warmup=0)
    base = times["plain"]["median"]
    exact = all(torch.equal(last[n].sequences, last["plain"].sequences) for n in METHODS)
    ratios = {n: round(base / times[n]["median"], 3) for n in METHODS}
    policy = {n: last[n].stats.calibration["policy"] for n in ("shadow", "noshadow")}
    checks = {n: (p["probes"], p["shadow_checks"]) for n, p in policy.items()}
    return f"plain {base:.2f}s {ratios} exact {exact} (probes, shadow checks) {checks}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", help="comma-separated Spec-Bench case ids, e.g. mt_bench/81,qa/321")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--random", action="store_true", help="the untrained head")
    args = p.parse_args()
    set_threads(args.threads)
    model, tokenizer = eagle_compile.load_default_target()
    head = untrained_head(model) if args.random else load_head(model, None)[0]
    compiled, building = build(model, head, DEFAULT_OUT_DIR / "shadow_ab_cache")
    want = args.cases.split(",")
    with torch.no_grad():
        for cid, ids in spec_prompts(tokenizer, DEFAULT_DATA_DIR, 1):
            if cid in want:
                print(cid, case(compiled, building, ids, args.new_tokens, args.rounds), flush=True)


if __name__ == "__main__":
    main()
