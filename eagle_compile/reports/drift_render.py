"""The drift report's outputs from its summary (`drift.summarize`): `drift.json`, `drift.md` and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from eagle_compile.draft.drift import SINK_SLOTS


def write(out: Path, summary: dict, settings: dict) -> list[Path]:
    """Write drift.json, drift.md and (when matplotlib is installed) the plots; returns the paths written."""
    paths = [out / "drift.json", out / "drift.md"]
    paths[0].write_text(json.dumps({"settings": settings, "summary": summary}, indent=1) + "\n")
    paths[1].write_text(markdown(summary, settings))
    return paths + plots(out, summary)


def markdown(summary: dict, settings: dict) -> str:
    lines = [f"Drift report: tree {json.dumps(settings['tree'])}, {settings['new_tokens']} new tokens per case, "
             "greedy, drift monitors on.", ""]
    for head, s in summary.items():
        lines += [f"### {head}", "", settings["heads"].get(head, ""), ""]
        lines += _context_table(s["context"]) + [""]
        lines += _depth_table(s["context"]) + [""]
        lines += _prompt_table(s["prompt"]) + [""]
        lines += [_claims_line(s["claims"]), ""]
    return "\n".join(lines)


def _context_table(context: dict) -> list[str]:
    if not context:
        return []
    rows = ["Tau against context length (the same documents, cut to each length; tau_rel: against the shortest):", "",
            "| context | prompt tokens | cases | cycles | tau | tau_rel | per document |",
            "|---|---|---|---|---|---|---|"]
    for name, r in context.items():
        per = ", ".join(f"{k} {v:.2f}" for k, v in r["per_case"].items())
        rows.append(f"| {name} | {r['prompt_tokens']} | {r['cases']} | {r['cycles']} | {_f(r['tau'])} | "
                    f"{_f(r['tau_rel'])} | {per} |")
    return rows


def _depth_table(context: dict) -> list[str]:
    if not context:
        return []
    depth = max(len(r["drift"].get("rms_ratio", [])) for r in context.values())
    rows = [f"Per draft depth d = 1..{depth}: rms = RMS of the hidden state fed to the step proposing depth d over "
            f"depth 1's; sink = attention mass on the first {SINK_SLOTS} positions; drafted = mass on this cycle's "
            "draft positions; top1 = the draft's top-1 probability; reach = share of cycles whose accepted path "
            "reached depth d:", "",
            "| context | monitor | " + " | ".join(f"d={d + 1}" for d in range(depth)) + " |",
            "|---|---|" + "---|" * depth]
    for name, r in context.items():
        series = {"rms": r["drift"].get("rms_ratio", []), "sink": r["drift"].get("sink_mass", []),
                  "drafted": r["drift"].get("draft_mass", []), "top1": r["drift"].get("top1", []),
                  "reach": r["accept_at_depth"]}
        for monitor, values in series.items():
            cells = [_f(values[d]) if d < len(values) else "" for d in range(depth)]
            rows.append(f"| {name} | {monitor} | " + " | ".join(cells) + " |")
    return rows


def _prompt_table(prompt: dict) -> list[str]:
    if not prompt:
        return []
    rows = ["Tau with a changed system prompt (`system`) and a changed chat template (`template`: Alpaca format, "
            "plain text), on the same short questions:", "",
            "| format | cases | cycles | tau | tau_rel | top1 d=1 |", "|---|---|---|---|---|---|"]
    for name, r in prompt.items():
        top1 = r["drift"].get("top1") or [None]
        rows.append(f"| {name} | {r['cases']} | {r['cycles']} | {_f(r['tau'])} | {_f(r['tau_rel'])} | {_f(top1[0])} |")
    return rows


def _claims_line(claims: dict) -> str:
    if not claims:
        return ""
    long = ", ".join(f"{k}: {v:.3f}" for k, v in claims["tau_rel_long"].items()) or "no context of 4K or more ran"
    rms = claims["rms_ratio_range"]
    return (f"The claims, measured: tau at 4K+ against {claims['base_length']} tokens: {long} (within 10 %: "
            f"{_yes(claims['tau_long_within_10pct'])}); hidden-state RMS ratio over depths 2+: "
            f"{'not measured' if rms is None else f'{rms[0]:.3f}..{rms[1]:.3f}'} (flat within 10 %: "
            f"{_yes(claims['rms_flat_within_10pct'])}).")


def plots(out: Path, summary: dict) -> list[Path]:
    """tau_vs_context.png, rms_vs_depth.png, sink_vs_depth.png; none without matplotlib (the `bench` extra)."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for head, s in summary.items():
        xs = [r["prompt_tokens"] for r in s["context"].values()]
        ax.plot(xs, [r["tau"] for r in s["context"].values()], marker="o", label=head)
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="tau (tokens per cycle)", title="tau against context length")
    lengths = sorted({r["prompt_tokens"] for s in summary.values() for r in s["context"].values()})
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.minorticks_off()
    ax.legend()
    written.append(_save(fig, out / "tau_vs_context.png"))
    for monitor, label, name in (("rms_ratio", "RMS of fed-back hidden / depth 1", "rms_vs_depth.png"),
                                 ("sink_mass", f"attention mass on first {SINK_SLOTS} positions", "sink_vs_depth.png")):
        fig, axes = plt.subplots(1, len(summary), figsize=(5 * len(summary), 4), squeeze=False)
        for ax, (head, s) in zip(axes[0], summary.items(), strict=True):
            for length, r in s["context"].items():
                values = r["drift"].get(monitor, [])
                pts = [(d + 1, v) for d, v in enumerate(values) if v is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=f"{length} tokens")
            ax.set(xlabel="draft depth", ylabel=label, title=head)
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.legend(fontsize=7)
        written.append(_save(fig, out / name))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _f(x) -> str:
    return "" if x is None else f"{x:.3f}"


def _yes(flag) -> str:
    return "not measured" if flag is None else ("yes" if flag else "no")
