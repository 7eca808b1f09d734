"""The drift report: run the drift cases (`drift_cases.py`) through speculative generation for one or more heads,
with the drift monitors on (`draft/drift.py`), and summarise tau and the monitors per context length and per prompt
format.

Every head runs the same fixed tree (a calibrated program would change with the context and confound tau with the
program chosen), greedy, the target's own stops. Each case's record goes to `records.jsonl` as soon as it is
measured, so an interrupted report resumes where it stopped; `summarize` reads only the records.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from pathlib import Path

import torch

from eagle_compile.errors import OptionsError
from eagle_compile.reports.drift_cases import DriftCase

RECORDS = "records.jsonl"
RUN_FILE = "run.json"
LONG = 4096            # the claim under test: tau at contexts of at least this many tokens vs the shortest one
TOLERANCE = 0.10       # "within 10 %"


def measure(model, head, case: DriftCase, tree: dict, new_tokens: int) -> dict:
    """One greedy speculative generate call over `case` with the drift monitors on: its record (no head label)."""
    from eagle_compile.runtime.generate import generate

    ids = torch.tensor([case.ids], dtype=torch.long)
    options = {**tree, "drift_monitors": True}
    start = time.perf_counter()
    out = generate(model, ids, draft=head, options=options, max_new_tokens=new_tokens, do_sample=False,
                   return_dict_in_generate=True)
    wall = time.perf_counter() - start
    stats = out.stats
    return {"group": case.group, "name": case.name, "prompt_id": case.prompt_id, "prompt_tokens": case.length,
            "new_tokens": stats.new_tokens, "cycles": len(stats.acceptance_lengths),
            "emitted": sum(stats.acceptance_lengths), "tau": stats.tau, "histogram": stats.histogram,
            "drift": stats.drift, "prefill_s": stats.prefill_time, "step_s": stats.step_time, "wall_s": wall}


def run(out: Path, heads: dict[str, tuple[object, str]], model, cases: list[DriftCase], tree: dict,
        new_tokens: int, *, fresh: bool = False, log=print) -> list[dict]:
    """Measure every (head, case) not yet in `out/records.jsonl`; returns all records of this run's settings.

    heads: {label: (head module or folder, description)}."""
    out.mkdir(parents=True, exist_ok=True)
    settings = {"tree": tree, "new_tokens": new_tokens, "heads": {k: v[1] for k, v in heads.items()}}
    _check_settings(out, settings, fresh)
    path = out / RECORDS
    done = {(r["head"], r["group"], r["name"], r["prompt_id"]) for r in read_records(path)}
    for label, (head, _) in heads.items():
        for case in cases:
            if (label, *case.key) in done:
                continue
            record = {"head": label, **measure(model, head, case, tree, new_tokens)}
            with path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            log(f"{label:24s} {case.group:7s} {case.name:8s} {case.prompt_id:22s} {case.length:5d} tokens: "
                f"tau {record['tau']:.2f} over {record['cycles']} cycles ({record['wall_s']:.1f} s)")
    return read_records(path)


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(records: list[dict]) -> dict:
    """{head: {"context": {length: row}, "prompt": {variant: row}, "claims": {...}}}; a row pools its cases'
    cycles (tau = emitted tokens / cycles) and averages the monitors per depth weighted by cycles."""
    by_head: dict[str, dict[str, dict[str, list[dict]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in records:
        by_head[r["head"]][r["group"]][r["name"]].append(r)
    summary = {}
    for head, groups in by_head.items():
        context = {name: _pool(rs) for name, rs in sorted(groups.get("context", {}).items(), key=lambda x: int(x[0]))}
        prompt = {name: _pool(rs) for name, rs in groups.get("prompt", {}).items()}
        _relative(context, next(iter(context), None))
        _relative(prompt, "default" if "default" in prompt else None)
        summary[head] = {"context": context, "prompt": prompt, "claims": _claims(context)}
    return summary


# -- helpers -------------------------------------------------------------------------------------------------------
def _check_settings(out: Path, settings: dict, fresh: bool) -> None:
    path = out / RUN_FILE
    if fresh:
        (out / RECORDS).unlink(missing_ok=True)
    elif path.is_file():
        before = json.loads(path.read_text())
        if {k: before.get(k) for k in ("tree", "new_tokens")} != {k: settings[k] for k in ("tree", "new_tokens")}:
            raise OptionsError(f"{out} holds a drift report made with {before.get('tree')} x "
                               f"{before.get('new_tokens')} new tokens; this run asks for {settings['tree']} x "
                               f"{settings['new_tokens']}: pass --fresh to start over or --out for another folder")
        settings = {**settings, "heads": {**before.get("heads", {}), **settings["heads"]}}
    path.write_text(json.dumps(settings, indent=1) + "\n")


def _pool(records: list[dict]) -> dict:
    cycles = sum(r["cycles"] for r in records)
    emitted = sum(r["emitted"] for r in records)
    row = {"cases": len(records), "cycles": cycles, "tau": emitted / cycles if cycles else None,
           "prompt_tokens": round(sum(r["prompt_tokens"] for r in records) / len(records)),
           "per_case": {r["prompt_id"]: round(r["tau"], 3) for r in records},
           "accept_at_depth": _accept_at_depth(records), "drift": _drift(records)}
    return row


def _accept_at_depth(records: list[dict]) -> list[float]:
    """P(a cycle emits more than d tokens) for d = 1.. : the share of cycles whose path reached depth d."""
    counts: dict[int, int] = defaultdict(int)
    for r in records:
        for length, n in r["histogram"].items():
            counts[int(length)] += n
    total = sum(counts.values())
    if not total:
        return []
    longest = max(counts)
    return [round(sum(n for length, n in counts.items() if length > d) / total, 4) for d in range(1, longest)]


def _drift(records: list[dict]) -> dict[str, list[float | None]]:
    sums: dict[str, list[float]] = {}
    weights: dict[str, list[float]] = {}
    for r in records:
        for monitor, values in (r.get("drift") or {}).items():
            s, w = sums.setdefault(monitor, []), weights.setdefault(monitor, [])
            for d, v in enumerate(values):
                if d >= len(s):
                    s.append(0.0)
                    w.append(0.0)
                if v is not None and not math.isnan(v):
                    s[d] += v * r["cycles"]
                    w[d] += r["cycles"]
    return {m: [round(s / w, 4) if w else None for s, w in zip(sums[m], weights[m], strict=True)] for m in sums}


def _relative(rows: dict[str, dict], base: str | None) -> None:
    ref = rows[base]["tau"] if base is not None else None
    for row in rows.values():
        row["tau_rel"] = round(row["tau"] / ref, 4) if ref and row["tau"] is not None else None


def _claims(context: dict[str, dict]) -> dict:
    """The seed's claims, measured: tau at >= 4K within 10 % of tau at the shortest context; hidden RMS flat with
    depth (every depth's rms_ratio within 10 % of 1), at every length."""
    if not context:
        return {}
    base = next(iter(context))
    long_rows = {k: v for k, v in context.items() if int(k) >= LONG and v["tau_rel"] is not None}
    rms = [x for row in context.values() for x in row["drift"].get("rms_ratio", [])[1:] if x is not None]
    worst_rms = max((abs(x - 1) for x in rms), default=None)
    return {"base_length": base,
            "tau_rel_long": {k: v["tau_rel"] for k, v in long_rows.items()},
            "tau_long_within_10pct": (all(abs(v["tau_rel"] - 1) <= TOLERANCE for v in long_rows.values())
                                      if long_rows else None),
            "rms_ratio_range": [round(min(rms), 4), round(max(rms), 4)] if rms else None,
            "rms_flat_within_10pct": None if worst_rms is None else worst_rms <= TOLERANCE}
