"""The plain path against Hugging Face, side by side in one process: prefill, the one-token step over long
contexts with c(N)/c(1), and plain-mode decoding at several batch sizes with its achieved memory bandwidth.

    python benchmarks/plain_path.py --threads 2                         # every section (about an hour here)
    python benchmarks/plain_path.py --sections step --prefixes 512,2048,6144 --threads 1
    python benchmarks/plain_path.py --sections plain --lowerings auto,inductor:cpp-gemm --hf-inductor cpp-gemm

Sections (float32 on the embedded SmolLM2-135M-Instruct target; each measurement interleaved with its HF
counterpart, `--rounds` rounds, medians; the machine is shared, so read ratios within one run):

* `prefill`: eagle31's prefill against HF's. eagle31: `stats.prefill_time` of `eagle_compile.generate(...,
  max_new_tokens=1)` with the shipped head (the target's prefill chunks plus the draft's catch-up over the
  prompt, and the first token). HF: one forward of the prompt on a DynamicCache with `logits_to_keep=1` (what HF
  generate runs before its first token). Prompts: `--prefill-lengths` tokens of LEval government reports
  (../shared/data/long_context, evaluation text; other LEval documents where fewer reports are that long), a
  different document per row, `--prefill-batches` rows.
* `step`: c(1), one token over a cache holding `prefix` tokens, of eagle31's target program (live slots only)
  against HF's decode step (one token on a DynamicCache), at `--prefixes`; and eagle31's c(N)/c(1) for N in
  `--tokens` (a chain of N tokens verified at once) at each prefix.
* `plain`: decoding with speculation off (`speculate=False`: the same programs, one token a step) against HF
  `generate` (eager, DynamicCache) and HF's fastest plain configuration (static cache and `torch.compile` with
  `--hf-inductor` settings, applied only around HF's calls), `--plain-batches` rows of chat prompts x
  `--new-tokens` greedy tokens; the time a token-step takes (generate time minus prefill, / new tokens). Its
  bandwidth: bytes a plain step must read (every weight once, plus the live K/V of every row) / step time,
  against a memory copy timed in the same run (bytes read + written / time). Every eagle31 output is compared
  with HF eager greedy (float32): with `inductor:cpp-gemm` a near-tie can part them (they round differently);
  the table says how many agree.

`--lowerings`: how eagle31's programs run, a comma list of `auto` (what `inner_backend="auto"` picks), `eager`,
`inductor` or `inductor:<preset>` (`eagle_compile.lowering.PRESETS`), each optionally followed by
`@<numerics>` (`auto`, the default; `eager`: the traced ops' kernels; `batch_invariant`), and by `+guards` for
the same programs with dynamo's guards evaluated on every call (as before `eagle_compile.runtime.known_calls`).
First calls (capture, compile) are not timed; their seconds are reported.

Resumable: every measured row is appended to --out/plain_path.records.jsonl as soon as it is done, and a rerun
with the same settings (threads, rounds, new tokens, lowerings' meaning, commit) skips the rows already there;
`--fresh` starts over. Outputs in --out: plain_path.json (everything, with load, versions, commit, command),
plain_path.md (tables, paste verbatim), plain_path.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from common import (
    DEFAULT_DATA_DIR,
    DEFAULT_OUT_DIR,
    append_jsonl,
    begin,
    chat_ids,
    environment,
    git_commit,
    interleaved_times,
    load_head,
    markdown_table,
    print_load,
    read_jsonl,
    timed,
    write_json,
)

SECTIONS = ("prefill", "step", "plain")
COPY_BYTES = 256 * 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list out of {','.join(SECTIONS)}")
    p.add_argument("--lowerings", default="auto", help="eagle31 lowerings (see the docstring)")
    p.add_argument("--prefill-lowerings", default="auto",
                   help="lowerings of the prefill section (prefill graphs run as FX graphs under every lowering)")
    p.add_argument("--prefill-lengths", default="1024,3072,6144")
    p.add_argument("--prefill-batches", default="1,8")
    p.add_argument("--prefixes", default="512,2048,6144")
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--plain-batches", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--hf-inductor", default="cpp-gemm",
                   help="inductor settings of HF's compiled static-cache generate: a preset name or 'none'")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--fresh", action="store_true", help="discard the records of an earlier (interrupted) run")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",")]
    bad = sorted(set(args.sections) - set(SECTIONS))
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {list(SECTIONS)}")
    for name in ("prefill_lengths", "prefill_batches", "prefixes", "tokens", "plain_batches"):
        setattr(args, name, [int(x) for x in getattr(args, name).split(",")])
    args.lowerings = [x.strip() for x in args.lowerings.split(",")]
    args.prefill_lowerings = [x.strip() for x in args.prefill_lowerings.split(",")]
    return args


# -- resume log --------------------------------------------------------------------------------------------------
class Journal:
    """Rows already measured by a run with the same settings (`key`), and the log new rows are appended to."""

    def __init__(self, path: Path, key: dict, fresh: bool) -> None:
        if fresh and path.is_file():
            path.unlink()
        self.path, self.key = path, key
        records = read_jsonl(path)
        foreign = [r for r in records if r["key"] != key]
        if foreign:
            raise SystemExit(f"{path} holds {len(foreign)} rows of other settings ({json.dumps(foreign[0]['key'])});"
                             f" this run is {json.dumps(key)}. Pass --fresh to discard them, or another --out.")
        self.rows = {(r["section"], json.dumps(r["ident"], sort_keys=True)): r["row"] for r in records}

    def get(self, section: str, ident: dict) -> dict | None:
        row = self.rows.get((section, json.dumps(ident, sort_keys=True)))
        if row is not None:
            print(f"  {section} {ident}: done in an earlier run (resumed)", flush=True)
        return row

    def add(self, section: str, ident: dict, row: dict) -> dict:
        append_jsonl(self.path, {"key": self.key, "section": section, "ident": ident, "row": row})
        return row


def run_key(args, model) -> dict[str, Any]:
    return {"threads": torch.get_num_threads(), "rounds": args.rounds, "new_tokens": args.new_tokens,
            "hf_inductor": args.hf_inductor, "commit": git_commit()["commit"],
            "lowerings": {spec: make_lowering(model, spec).describe()
                          for spec in args.lowerings + args.prefill_lowerings}}


# -- lowerings ---------------------------------------------------------------------------------------------------
def lowering_options(spec: str) -> dict[str, Any]:
    """eagle31 options of a `--lowerings` entry: `<backend>[:<preset>][@<numerics>][+guards]`, e.g. `auto`,
    `eager@eager` (MKL, HF eager's rounding), `eager@batch_invariant`, `inductor:cpp-gemm@eager`; `+guards`
    runs the same programs with dynamo's guards evaluated on every call (`runtime.known_calls`: as before
    direct calls), for a before/after in one process."""
    spec = spec.removesuffix(GUARDS)
    spec, _, numerics = spec.partition("@")
    extra = {"numerics": numerics} if numerics else {}
    if spec in ("auto", "eager", "inductor"):
        return {"inner_backend": spec, **extra}
    backend, _, preset = spec.partition(":")
    if backend != "inductor" or not preset:
        raise SystemExit(f"--lowerings entry {spec!r}: use auto, eager, inductor or inductor:<preset>, optionally "
                         "followed by @<numerics> (auto, eager, batch_invariant)")
    return {"inner_backend": "inductor", "inductor_config": preset, **extra}


GUARDS = "+guards"


def guard_scope(spec: str):
    """The scope a `--lowerings` entry's calls run in: every call through dynamo's guards for `+guards`."""
    from eagle_compile.runtime.known_calls import guards_every_call

    return guards_every_call() if spec.endswith(GUARDS) else contextlib.nullcontext()


def make_lowering(model, spec: str):
    from eagle_compile.lowering import lowering_for

    opts = lowering_options(spec)
    return lowering_for(opts["inner_backend"], opts.get("inductor_config"), model.device, model.dtype,
                        opts.get("numerics", "auto"))


# -- prompts -----------------------------------------------------------------------------------------------------
def long_prompts(tokenizer, data: Path, length: int, rows: int) -> torch.Tensor:
    """[rows, length] ids: the first `length` tokens of `rows` different LEval documents, government reports
    first, then the other LEval tasks' documents in file-name order (only 4 reports reach 6144 tokens)."""
    folder = data / "long_context" / "leval"
    first = folder / "gov_report_summ.jsonl"
    files = [first] + sorted(set(folder.glob("*.jsonl")) - {first})
    docs = []
    for path in files:
        with path.open() as f:
            for line in f:
                ids = tokenizer(json.loads(line)["input"], return_tensors="pt")["input_ids"][0]
                if len(ids) >= length:
                    docs.append(ids[:length])
                if len(docs) == rows:
                    return torch.stack(docs)
    raise SystemExit(f"only {len(docs)} LEval documents have {length} tokens; need {rows}")


def chat_prompts(tokenizer, data: Path, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask of `rows` MT-bench first turns (chat template), cycling if needed."""
    questions = [json.loads(line) for line in (data / "spec_bench" / "question.jsonl").read_text().splitlines()]
    texts = [q["turns"][0] for q in questions if q.get("category") in ("writing", "roleplay", "reasoning",
                                                                       "stem", "humanities", "coding")]
    ids = [chat_ids(tokenizer, texts[i % len(texts)])[0] for i in range(rows)]
    width = max(len(x) for x in ids)
    out = torch.full((rows, width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i, x in enumerate(ids):
        out[i, width - len(x):], mask[i, width - len(x):] = x, 1
    return out, mask


# -- prefill -----------------------------------------------------------------------------------------------------
def section_prefill(model, tokenizer, head, args, journal: Journal) -> list[dict]:


    rows = []
    for spec in args.prefill_lowerings:
        options = lowering_options(spec)
        for batch in args.prefill_batches:
            for length in args.prefill_lengths:
                ident = {"lowering": spec, "batch": batch, "tokens": length}
                done = journal.get("prefill", ident)
                if done is not None:
                    rows.append(done)
                    continue
                ids = long_prompts(tokenizer, args.data, length, batch)
                row = {"lowering": spec, "batch": batch, "tokens": length,
                       **prefill_times(model, head, ids, options, args.rounds)}
                row["ratio"] = row["eagle31_prefill_s"] / row["hf_s"]
                rows.append(journal.add("prefill", ident, row))
                print(f"  prefill {spec} batch {batch} x {length}: HF {row['hf_s']:.2f} s, eagle31 "
                      f"{row['eagle31_prefill_s']:.2f} s ({row['ratio']:.2f}x HF)", flush=True)
    return rows


def prefill_times(model, head, ids: torch.Tensor, options: dict, rounds: int) -> dict:
    """eagle31's prefill (`stats.prefill_time` of a 1-token generate) and HF's one forward of the prompt,
    interleaved for `rounds` rounds after eagle31's untimed first call; their first tokens must agree."""
    from transformers import DynamicCache

    import eagle_compile

    prefill: list[float] = []
    hf_first: dict[str, torch.Tensor] = {}

    def eagle():
        out = eagle_compile.generate(model, ids, draft=head, options=options, max_new_tokens=1,
                                     return_dict_in_generate=True)
        prefill.append(out.stats.prefill_time)
        return out

    def hf():
        out = model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
        hf_first["token"] = out.logits[:, -1].argmax(-1)
        return out

    first, warm_s = timed(eagle)                          # captures: not timed
    prefill.clear()
    times = interleaved_times({"eagle31": eagle, "hf": hf}, repeats=rounds, warmup=0)
    assert torch.equal(first.sequences[:, -1], hf_first["token"]), "eagle31's first token differs from HF's"
    return {"hf_s": times["hf"]["median"], "eagle31_call_s": times["eagle31"]["median"], "first_call_s": warm_s,
            "eagle31_prefill_s": statistics.median(prefill)}


# -- step --------------------------------------------------------------------------------------------------------
def section_step(model, args, journal: Journal) -> list[dict]:
    from verify_cost import cost_curve, hf_step

    rows = []
    for spec in args.lowerings:
        lowering = make_lowering(model, spec)
        for prefix in args.prefixes:
            ident = {"lowering": spec, "prefix": prefix, "tokens": args.tokens}
            done = journal.get("step", ident)
            if done is not None:
                rows.append(done)
                continue
            with guard_scope(spec):
                curve = cost_curve(model, prefix, args.tokens, args.rounds, 1, lowering=lowering)
            hf = hf_step(model, prefix, args.rounds, 1)["median"]
            c1 = curve[1]["median"]
            row = {"lowering": spec, "prefix": prefix, "hf_step_s": hf, "c1_s": c1, "ratio": c1 / hf,
                   "c": {str(n): curve[n]["median"] / c1 for n in args.tokens},
                   "capture_s": sum(curve[n]["capture_s"] for n in args.tokens)}
            rows.append(journal.add("step", ident, row))
            print(f"  step {spec} prefix {prefix}: HF {hf * 1e3:.1f} ms, eagle31 c(1) {c1 * 1e3:.1f} ms "
                  f"({row['ratio']:.2f}x HF); " + ", ".join(f"c({n})/c(1) {v:.2f}" for n, v in row["c"].items()),
                  flush=True)
    return rows


# -- plain -------------------------------------------------------------------------------------------------------
def copy_bandwidth(repeats: int) -> float:
    """Bytes moved (read + written) per second by a large tensor copy, median of `repeats`."""
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    times = interleaved_times({"copy": lambda: dst.copy_(src)}, repeats=repeats, warmup=1)
    return 2 * COPY_BYTES / times["copy"]["median"]


def step_bytes(model, rows: int, context: int) -> int:
    """Bytes one plain decode step must read: every weight once (the embedding: `rows` rows of it) and the K/V
    of `context` positions of every row."""
    cfg = model.config
    element = next(model.parameters()).element_size()
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() for p in model.parameters()) - embed.numel() + rows * embed.shape[1]
    if model.get_output_embeddings().weight is embed:          # tied: the lm_head reads the whole table
        weights += embed.numel()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * context * rows
    return (weights + kv) * element


def hf_compiled_generate(model, preset: str):
    """HF generate with a static cache and torch.compile (inductor with `preset` settings, scoped to the call)."""
    import contextlib

    import torch._inductor.config as inductor_config
    from transformers import CompileConfig

    from eagle_compile.lowering import resolve_inductor_config

    patches = {} if preset == "none" else resolve_inductor_config(preset)
    config = CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode=None)
    config._compile_all_devices = True                # transformers compiles on CPU only when asked to

    def run(ids, mask, new):
        scope = inductor_config.patch(patches) if patches else contextlib.nullcontext()
        with scope:
            return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                  cache_implementation="static", compile_config=config)

    return run


def section_plain(model, tokenizer, args, journal: Journal) -> list[dict]:
    hf_static = hf_compiled_generate(model, args.hf_inductor)
    rows = []
    for batch in args.plain_batches:
        ident = {"batch": batch}
        done = journal.get("plain", ident)
        if done is None:
            done = journal.add("plain", ident, plain_row(model, tokenizer, args, batch, hf_static))
        rows.append(done)
        print(f"  plain batch {batch}: " + ", ".join(f"{k} {v * 1e3:.1f} ms/token ({done['gbps'][k]:.1f} GB/s)"
                                                   for k, v in done["per_token_s"].items())
              + f"; same tokens as HF eager: {done['agree_with_hf_eager']}", flush=True)
    return rows


def plain_row(model, tokenizer, args, batch: int, hf_static) -> dict:
    """HF eager, HF static+compiled and eagle31's plain mode (per lowering) on `batch` chat prompts."""
    import eagle_compile

    copy_bps = copy_bandwidth(args.rounds)              # per row: the machine's state when the row ran
    ids, mask = chat_prompts(tokenizer, args.data, batch)
    new = args.new_tokens
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    stats: dict[str, Any] = {}

    def eagle(options: dict, spec: str):
        def run():
            with guard_scope(spec):
                out = eagle_compile.generate(model, ids, attention_mask=mask, options=options, max_new_tokens=new,
                                             do_sample=False, return_dict_in_generate=True)
            stats[spec] = out.stats
            return out.sequences
        return run

    calls = {"hf": lambda: model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False),
             "hf_static": lambda: hf_static(ids, mask, new)}
    calls.update({spec: eagle({**lowering_options(spec), "speculate": False}, spec) for spec in args.lowerings})
    first, agree = {}, {}
    for name, call in calls.items():
        if name != "hf":                                 # first calls capture and compile: not timed
            out, first[name] = timed(call)
            agree[name] = bool(torch.equal(out, ref))
    times = interleaved_times(calls, repeats=args.rounds, warmup=0)
    row = {"batch": batch, "new_tokens": new, "prompt_width": ids.shape[1], "first_call_s": first,
           "agree_with_hf_eager": agree, "copy_gbps": copy_bps / 1e9,
           "step_bytes": step_bytes(model, batch, ids.shape[1] + new // 2),
           "total_s": {k: v["median"] for k, v in times.items()}}
    per_token = {k: v / new for k, v in row["total_s"].items()}
    for spec in args.lowerings:                          # eagle31: the step time alone, without its prefill
        per_token[spec + " (steps)"] = stats[spec].step_time / max(1, stats[spec].cycles)
    row["per_token_s"] = per_token
    row["gbps"] = {k: row["step_bytes"] / v / 1e9 for k, v in per_token.items()}
    return row


# -- report ------------------------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    env, load = result["environment"], result["load_before"]
    lines = [f"plain path on {env['processor']}, torch {env['torch']}, {load['torch_threads']} threads, load "
             f"{load['loadavg_1m']} before / {result['load_after']['loadavg_1m']} after; `{env['command']}`", ""]
    if result.get("prefill"):
        lines += ["**Prefill** (eagle31: target chunks + draft catch-up + first token; HF: one forward, "
                  "logits_to_keep=1), seconds:", "",
                  markdown_table(["lowering", "batch", "tokens", "HF", "eagle31", "eagle31 / HF", "first call"],
                                 [[r["lowering"], r["batch"], r["tokens"], f"{r['hf_s']:.2f}",
                                   f"{r['eagle31_prefill_s']:.2f}", f"{r['ratio']:.2f}", f"{r['first_call_s']:.1f}"]
                                  for r in result["prefill"]]), ""]
    if result.get("step"):
        tokens = list(result["step"][0]["c"])
        lines += ["**One-token step** (eagle31's target program over the live slots vs HF's DynamicCache step) "
                  "and eagle31's c(N)/c(1):", "",
                  markdown_table(["lowering", "prefix", "HF ms", "eagle31 c(1) ms", "c(1) / HF"]
                                 + [f"c({n})/c(1)" for n in tokens[1:]],
                                 [[r["lowering"], r["prefix"], f"{r['hf_step_s'] * 1e3:.1f}",
                                   f"{r['c1_s'] * 1e3:.1f}", f"{r['ratio']:.2f}"]
                                  + [f"{r['c'][n]:.2f}" for n in tokens[1:]] for r in result["step"]]), ""]
    if result.get("plain"):
        names = list(result["plain"][0]["per_token_s"])
        lines += [f"**Plain decoding**, ms per token (achieved GB/s: bytes a step reads / step time; memory copy "
                  f"{result['plain'][0]['copy_gbps']:.1f} GB/s); `hf_static`: static cache + torch.compile with "
                  f"`{result['args']['hf_inductor']}`:", "",
                  markdown_table(["batch"] + names + ["same tokens as HF eager"],
                                 [[r["batch"]] + [f"{r['per_token_s'][n] * 1e3:.1f} ({r['gbps'][n]:.1f})"
                                                  for n in names]
                                  + [", ".join(k for k, v in r["agree_with_hf_eager"].items() if v) or "none"]
                                  for r in result["plain"]]), ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("prefill", "step", "plain") if result.get(k)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, name in zip(axes[0], panels, strict=True):
        if name == "prefill":
            for r_key in sorted({(r["lowering"], r["batch"]) for r in result["prefill"]}):
                pts = [r for r in result["prefill"] if (r["lowering"], r["batch"]) == r_key]
                ax.plot([r["tokens"] for r in pts], [r["ratio"] for r in pts], "o-", label=f"{r_key[0]} b{r_key[1]}")
            ax.set(xlabel="prompt tokens", ylabel="eagle31 prefill / HF prefill", title="prefill")
        elif name == "step":
            for spec in sorted({r["lowering"] for r in result["step"]}):
                pts = [r for r in result["step"] if r["lowering"] == spec]
                ax.plot([r["prefix"] for r in pts], [r["ratio"] for r in pts], "o-", label=spec)
            ax.set(xlabel="context tokens", ylabel="eagle31 c(1) / HF step", title="one-token step")
        else:
            names = list(result["plain"][0]["per_token_s"])
            for n in names:
                ax.plot([r["batch"] for r in result["plain"]], [r["gbps"][n] for r in result["plain"]], "o-", label=n)
            ax.axhline(result["plain"][0]["copy_gbps"], color="grey", ls="--", label="memory copy")
            ax.set(xlabel="batch", ylabel="GB/s", title="plain decoding bandwidth", xscale="log")
        ax.axhline(1.0, color="black", lw=0.5) if name != "plain" else None
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = begin(args.threads)
    from eagle_compile.targets import load_default_target

    model, tokenizer = load_default_target(torch.float32)
    head, head_info = load_head(model, None)
    print(f"draft: {head_info['note']}", flush=True)
    key = run_key(args, model)
    journal = Journal(args.out / "plain_path.records.jsonl", key, args.fresh)
    result: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "environment": environment(), "load_before": load_before, "head": head_info,
                              "key": key}
    if "step" in args.sections:
        result["step"] = section_step(model, args, journal)
    if "prefill" in args.sections:
        result["prefill"] = section_prefill(model, tokenizer, head, args, journal)
    if "plain" in args.sections:
        result["plain"] = section_plain(model, tokenizer, args, journal)
    result["load_after"] = print_load("after")
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "plain_path.json", result)
    text = markdown(result)
    (args.out / "plain_path.md").write_text(text + "\n")
    plot(result, args.out / "plain_path.png")
    print("\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
