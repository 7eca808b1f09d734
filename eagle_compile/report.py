"""`eagle_compile.explain(compiled)`: what the eagle31 backend did for a model, in words.

Passes run and the sites each rewrote (per captured graph), how each graph runs (FX graph or inductor, with its
compile seconds) and why, the kernel implementation each eagle31 op uses on the model's device and why, the
CUDA-graph buckets captured and replayed, the tree shape with where it came from, and the calibration layer:
adaptive (its menu, the costs in use with where they came from, the last call's choices) or fixed, and why.
"""

from __future__ import annotations


def explain(compiled, *, file=None) -> str:
    """Print and return a report for a model compiled with backend="eagle31" (or a plain model)."""
    from eagle_compile.backend import compiled_options
    from eagle_compile.kernels import kernel_choices
    from eagle_compile.runtime.cuda_graphs import GraphedStep
    from eagle_compile.runtime.generate import _decoders
    from eagle_compile.runtime.step_program import StepProgram

    model = getattr(compiled, "_orig_mod", compiled)
    param = next(model.parameters())
    lines = [f"eagle31 report for {type(model).__name__} on {param.device} ({param.dtype})"]
    opts = compiled_options(compiled)
    if opts is not None:
        shown = {k: (v if k != "draft" else _describe_draft(v)) for k, v in opts.as_dict().items()}
        lines.append(f"torch.compile options: {shown}")
    decoders = list(_decoders.get(model, {}).values())
    if not decoders:
        lines.append("nothing captured yet: call compiled.generate(...) (or eagle_compile.generate) first")
    for i, dec in enumerate(decoders):
        if dec.speculate:
            what = (f"tree depth={dec.shape.depth} top_k={dec.shape.top_k} total_tokens={dec.shape.total_tokens} "
                    f"(from {dec.tree_source})")
            if dec.lookup is not None:
                what += (f"; copy branch of {dec.lookup.length} nodes (prompt lookup, n-grams "
                         f"{dec.lookup.min_ngram}..{dec.lookup.max_ngram})")
        else:
            what = "plain decoding (speculate=False): one target forward per token, no draft"
        lines.append(f"[decoder {i}] {what}; capture indices {list(dec.capture_indices)}; "
                     f"step_program={dec.options.step_program}")
        lines.append(f"  lowering: {dec.lowering.describe()}")
        if dec.quantized:
            lines.append(f"  quantised target: {dec.quantized.describe()}; their linears run the quantised "
                         "library's own kernels in every program")
        lines += _calibration_lines(dec)
        for ctx in dec.program.contexts:
            lines.append(f"  target program graph: {_counts(ctx.counts)}")
        for kind, how, seconds in dec.lowering.compiled:
            lines.append(f"  {kind} graph runs {how}" + (f", compiled in {seconds:.1f} s" if seconds else ""))
        for key, step in dec._steps.items():
            if isinstance(step, StepProgram):
                for ctx in step.contexts:
                    lines.append(f"  step program graph ({_sampling(key)}): {_counts(ctx.counts)}")
            if isinstance(step, GraphedStep):
                buckets = sorted(step.graphs)
                lines.append(f"  CUDA graphs: {step.captures} captured for (bucket, slots) {buckets}, "
                             f"{step.replays} replays")
        if dec.options.cudagraphs and not any(isinstance(s, GraphedStep) for s in dec._steps.values()):
            lines.append("  CUDA graphs: requested but not applied (the target is not on a CUDA device)")
    lines.append("kernels:")
    for name, (impl, reason) in kernel_choices(param.device, param.dtype).items():
        lines.append(f"  {name:15s} {impl:18s} {reason}")
    text = "\n".join(lines)
    print(text, file=file)
    return text


def _calibration_lines(dec) -> list[str]:
    if not dec.speculate:
        return []
    cal = dec.calibration
    if cal is None:
        return [f"  calibration: off, {dec.calibration_reason}"]
    lines = [f"  calibration: {dec.calibration_reason}"]
    for key in cal.tables:
        lines.append(f"  costs in use (batch bucket {key.batch_bucket}, context bucket {key.context_bucket}): "
                     f"{cal.describe_costs(key)}")
    if not cal.tables:
        lines.append("  costs: none measured yet (the first generate call measures them)")
    for note in cal.cache.refused:
        lines.append(f"  cost cache entry not used: {note}")
    summary = cal.policy.stats.as_dict()
    lines.append(f"  last call's choices: {summary}")
    return lines


def _describe_draft(draft) -> str:
    if draft is None or isinstance(draft, str):
        return repr(draft)
    config = getattr(draft, "config", None)
    if config is not None and hasattr(config, "draft_vocab_size"):
        flags = [f for f in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual") if getattr(config, f)]
        return f"{type(draft).__name__}(draft_vocab_size={config.draft_vocab_size}, flags={flags})"
    return type(draft).__name__


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in counts.items())


def _sampling(key) -> str:
    """A step's key in the decoder's books: (`SamplingParams.program_key`, menu entry name or None)."""
    do_sample, top_k, top_p, processors = key[0]
    extra = ", logits processors" if processors is not None else ""
    if not do_sample:
        return "greedy" + extra
    return "sampling" + (f", top-k bucket {top_k}" if top_k else "") + (", top-p" if top_p else "") + extra

