"""Helpers shared by the benchmark scripts: machine load, environment record, JSON output, timing, the draft head.

Benchmarks are not tests (docs/TESTING.md): they print tables and write JSON/markdown/PNG, and they record what
the numbers depend on (load average, core count, torch threads, versions, git commit, the command line), because
this machine is shared and noisy. Nothing here asserts a time.
"""

from __future__ import annotations

import inspect
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = (REPO_ROOT / ".." / "shared" / "data").resolve()
DEFAULT_OUT_DIR = REPO_ROOT / "bench_out"
UNTRAINED_NOTE = ("UNTRAINED random EAGLE 3.1 head (no trained head ships in this checkout yet): output is still "
                  "exact, but almost no draft token is accepted, so speculative decoding is expected to be SLOWER "
                  "than plain decoding here")


# -- machine and environment -------------------------------------------------------------------------------------
def machine_load() -> dict[str, Any]:
    """Load averages (1, 5, 15 min), usable cores and torch threads, at this moment."""
    one, five, fifteen = os.getloadavg()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "loadavg_15m": round(fifteen, 2),
            "nproc": cores, "torch_threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def print_load(label: str) -> dict[str, Any]:
    """Print the machine load (and a warning when other work competes for the cores); return it."""
    load = machine_load()
    print(f"[load {label}] loadavg 1/5/15 min = {load['loadavg_1m']}/{load['loadavg_5m']}/{load['loadavg_15m']} "
          f"on {load['nproc']} cores, torch threads {load['torch_threads']}", flush=True)
    if load["loadavg_1m"] > 0.5 * load["nproc"]:
        hint = "" if load["torch_threads"] == 1 else "; with other work on the cores prefer --threads 1"
        print(f"[load {label}] WARNING: the machine is busy (load {load['loadavg_1m']} on {load['nproc']} cores); "
              f"timings are noisy, compare ratios from the same run only{hint}", flush=True)
    return load


def set_threads(threads: int | None) -> None:
    """Pin torch's intra-op threads. On a shared machine `--threads 1` is the robust choice: when other processes
    compete for the cores, a multi-threaded forward waits for its descheduled threads and single steps slow down
    erratically, by large factors; one thread degrades gracefully."""
    if threads is not None:
        torch.set_num_threads(threads)


def begin(threads: int | None) -> dict[str, Any]:
    """A benchmark's first lines: no autograd, the thread count, and the machine's load before it runs (returned,
    for the results' record)."""
    torch.set_grad_enabled(False)
    set_threads(threads)
    return print_load("before")


def git_commit() -> dict[str, Any]:
    """HEAD commit and whether the working tree differs from it (read-only git commands)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def environment() -> dict[str, Any]:
    """What the numbers depend on besides the load: versions, machine, commit, the exact command line."""
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "git": git_commit(), "command": shlex.join([sys.executable, *sys.argv])}


def compat_torch_compile(note: Callable[[str], None]) -> None:
    """Keep the runtime's torch.compile keywords working on an older torch (the device image's, for the GPU
    scripts): drop the ones this torch lacks, and raise dynamo's recompile limits, which is what they were for.
    ``note`` is told once what was changed."""
    accepted = set(inspect.signature(torch.compile).parameters)
    missing = {"recompile_limit", "isolate_recompiles"} - accepted
    if not missing:
        return
    from torch import _dynamo

    original = torch.compile

    def compile_compat(*args, **kwargs):
        for key in missing:
            kwargs.pop(key, None)
        return original(*args, **kwargs)

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(_dynamo.config, name):
            setattr(_dynamo.config, name, max(getattr(_dynamo.config, name), 256))
    torch.compile = compile_compat
    note(f"torch {torch.__version__}: torch.compile has no {sorted(missing)}; dropped for this run, dynamo's "
         "recompile limits raised to 256 instead")


# -- files -------------------------------------------------------------------------------------------------------
def write_results(out: Path, name: str, args, rows: list[dict], load_before: dict[str, Any], title: str,
                  header: list[str], cells: Iterable[list[Any]]) -> dict[str, Any]:
    """Write `<name>.json` (environment, load before/after, threads, rows, args) and `<name>.md` (`title` with
    the setting, then the table) into `out`; print the table; return the JSON record."""
    result = {"environment": environment(), "load_before": load_before, "load_after": print_load("after"),
              "threads": torch.get_num_threads(), "rows": rows,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{name}.json", result)
    env = result["environment"]
    text = "\n".join([f"{title}: torch {env['torch']}, {result['threads']} threads, load "
                      f"{load_before['loadavg_1m']} / {result['load_after']['loadavg_1m']}; `{env['command']}`", "",
                      markdown_table(header, cells)])
    (out / f"{name}.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    return result


def write_json(path: Path, obj: Any) -> None:
    """Write `obj` as indented JSON atomically (temporary file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def append_jsonl(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def resumable_log(out: Path, name: str, fresh: bool) -> tuple[Path, set[tuple[str, str]]]:
    """The records file `out/name` of a resumable benchmark (removed first when `fresh`) and the (section, case)
    pairs it already holds, which a rerun skips."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / name
    if fresh and log.exists():
        log.unlink()
    return log, {(r["section"], r["case"]) for r in read_jsonl(log)}


def read_jsonl(path: Path) -> list[dict]:
    """Records of a jsonl file; a truncated last line (an interrupted write) is ignored."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"ignoring an unreadable line of {path} (interrupted write?)", flush=True)
    return records


def markdown_table(header: list[str], rows: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# -- timing ------------------------------------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(result, wall seconds) of one call."""
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def median_time(fn: Callable[[], Any], *, repeats: int, warmup: int) -> dict[str, float]:
    """Median (and min/max) wall seconds of `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = [timed(fn)[1] for _ in range(repeats)]
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "repeats": repeats}


def interleaved_times(calls: dict[Any, Callable[[], Any]], *, repeats: int, warmup: int) -> dict[Any, dict]:
    """Round-robin medians: `eagle_compile.calibrate.costs.interleaved_times` (the calibration layer's own)."""
    from eagle_compile.calibrate.costs import interleaved_times as package_times

    return package_times(calls, repeats=repeats, warmup=warmup)


# -- target and draft head ---------------------------------------------------------------------------------------
def chat_ids(tokenizer, text: str) -> torch.Tensor:
    """[1, L] ids of one user turn with the chat template and the assistant prefix."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def load_head(model, draft: str | None) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The draft head to benchmark and a description of it: `draft` (a folder), else the shipped head, else an
    untrained head built like `eagle31 demo` builds it (seed 0), which the description says loudly."""
    from eagle_compile.draft.checkpoint import load_draft
    from eagle_compile.heads import shipped_head

    folder = Path(draft) if draft is not None else shipped_head()
    if folder is not None:
        head = load_draft(folder, target=model, dtype=model.dtype)
        return head, {"trained": True, "folder": str(folder.resolve()), "note": f"EAGLE head from {folder}"}
    from eagle_compile.draft.model import untrained_head

    return untrained_head(model), {"trained": False, "folder": None, "note": UNTRAINED_NOTE}


def read_options(spec: str | None, head_info: dict[str, Any], default: dict[str, Any],
                 dtype: torch.dtype = torch.float32) -> tuple[dict, str]:
    """eagle31 tree options and where they came from: `spec` (a JSON string or a path to a JSON file), else
    the `tree.json` beside the head when it was chosen for CPU and `dtype` (what eagle31 itself would use, see
    eagle_compile/draft/tree_file.py), else `default`."""
    from eagle_compile.draft.tree_file import head_tree

    if spec:
        path = Path(spec)
        raw = json.loads(path.read_text()) if path.is_file() else json.loads(spec)
        raw.pop("chosen_for", None)
        return raw, str(path.resolve()) if path.is_file() else "--options"
    tree, why = head_tree(head_info.get("folder"), torch.device("cpu"), dtype)
    if tree is not None:
        return tree, why
    return dict(default), f"default {json.dumps(default)} ({why})"


def left_pad(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded [B, L] ids and their attention mask from [1, L_i] prompts."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:], mask[i, width - p.shape[1]:] = p[0], 1
    return ids, mask


def long_report(tokenizer, data: Path, length: int) -> torch.Tensor:
    """One LEval government report cut to `length` tokens [1, length] (the long-context prompts)."""
    with (data / "long_context" / "leval" / "gov_report_summ.jsonl").open() as f:
        for line in f:
            ids = tokenizer(json.loads(line)["input"], return_tensors="pt")["input_ids"]
            if ids.shape[1] >= length:
                return ids[:, :length]
    raise SystemExit(f"no government report has {length} tokens")


def mt_bench(tokenizer, data: Path, count: int) -> list[torch.Tensor]:
    rows = [json.loads(line) for line in (data / "spec_bench" / "question.jsonl").read_text().splitlines()]
    turns = [r["turns"][0] for r in rows if 81 <= r["question_id"] <= 160][:count]
    return [chat_ids(tokenizer, t) for t in turns]


def compare_with_hf(model, compiled, cases: list[tuple[torch.Tensor, torch.Tensor | None]], new: int,
                    rounds: int) -> dict:
    """Total seconds of HF greedy `generate` and eagle31's `compiled.generate` over `cases` ((ids, mask) pairs),
    interleaved for `rounds` rounds after one warm-up call each (captures; also the exactness check); exactness,
    tau, eagle31's prefill seconds, its statistics (the last round's, one per case) and HF's sequences."""
    eagle_stats = []

    def eagle(ids, mask):
        out = compiled.generate(ids, attention_mask=mask, max_new_tokens=new, return_dict_in_generate=True)
        eagle_stats.append(out.stats)
        return out.sequences

    def hf(ids, mask):
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)

    exact, hf_sequences = 0, []
    for ids, mask in cases:                               # warm-up (capture), and the exactness check
        hf_sequences.append(hf(ids, mask))
        exact += int(torch.equal(eagle(ids, mask), hf_sequences[-1]))
    eagle_stats.clear()
    calls = {}
    for i, (ids, mask) in enumerate(cases):
        calls[("eagle31", i)] = lambda ids=ids, mask=mask: eagle(ids, mask)
        calls[("hf", i)] = lambda ids=ids, mask=mask: hf(ids, mask)
    times = interleaved_times(calls, repeats=rounds, warmup=0)
    total = {m: sum(v["median"] for (who, _), v in times.items() if who == m) for m in ("eagle31", "hf")}
    lengths = [n for s in eagle_stats for n in s.acceptance_lengths]
    return {"exact": exact, "cases": len(cases), "hf_s": total["hf"], "eagle31_s": total["eagle31"],
            "speedup": total["hf"] / total["eagle31"], "tau": sum(lengths) / max(1, len(lengths)),
            "prefill_s": sum(s.prefill_time for s in eagle_stats) / max(1, rounds),
            "tree": eagle_stats[-1].tree if eagle_stats else None, "stats": eagle_stats[-len(cases):],
            "hf_sequences": hf_sequences}
