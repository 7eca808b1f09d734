"""Statistics of one speculative generate call: acceptance length per cycle, its histogram, timings."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """`acceptance_lengths`: tokens emitted per row per cycle (accepted draft tokens + 1 bonus), before stops
    cut a block. `tau` is their mean. Times are wall-clock seconds measured on the host around device work that
    ends in a host read (the per-cycle read of the accepted tokens), so they are complete on CUDA too.

    `errors` names the rows that ended early because the target's logits went NaN or +inf: such a row keeps the
    tokens decided before them and is padded like a finished row; its poisoned cycle is not counted in
    `acceptance_lengths`. The other rows are exactly what they would be decoded alone."""

    tree: dict = field(default_factory=dict)          # shape and where it came from ("source")
    speculate: bool = True                            # False: plain decoding (one target forward per token)
    lowering: str = ""                                # how the programs ran (eagle_compile.lowering)
    acceptance_lengths: list[int] = field(default_factory=list)
    cycles: int = 0
    prefill_time: float = 0.0
    prefill_groups: int = 0                           # batches of rows the prefill ran (prefill_plan.prefill_groups)
    step_time: float = 0.0
    draft_time: float | None = None    # split of step_time; None for a captured step program (one program)
    verify_time: float | None = None
    accept_time: float | None = None
    new_tokens: int = 0
    graphs_captured: int = 0
    compile_time: float = 0.0                         # inductor seconds so far (all calls of this decoder)
    cuda_graph_replays: int = 0
    notes: list[str] = field(default_factory=list)
    calibration: dict | None = None                   # menu, choices, fallback, estimates, costs (adaptive only)
    calibration_time: float = 0.0                     # seconds spent measuring costs in this call
    drift: dict | None = None                         # drift monitors per depth (options drift_monitors=True)
    copied_tokens: int = 0                            # accepted tokens proposed by the copy branch
    outside_draft_vocab: int | None = None            # emitted tokens the draft vocabulary (d2t) cannot propose
    copied_outside_draft_vocab: int | None = None     # ... of them accepted from the copy branch (None: unknown)
    errors: dict[int, str] = field(default_factory=dict)   # {row: why it ended early} (NaN/+inf target logits)
    row_acceptance: dict[int, list[int]] = field(default_factory=dict)   # {row: its acceptance length per cycle}

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.acceptance_lengths).items()))

    def as_dict(self) -> dict:
        return {"tau": self.tau, "histogram": self.histogram, "cycles": self.cycles, "new_tokens": self.new_tokens,
                "prefill_time": self.prefill_time,
                "prefill_groups": self.prefill_groups, "step_time": self.step_time, "draft_time": self.draft_time,
                "verify_time": self.verify_time, "accept_time": self.accept_time, "tree": self.tree,
                "speculate": self.speculate, "lowering": self.lowering, "graphs_captured": self.graphs_captured,
                "compile_time": self.compile_time, "cuda_graph_replays": self.cuda_graph_replays,
                "notes": self.notes, "calibration": self.calibration,
                "calibration_time": self.calibration_time, "drift": self.drift,
                "copied_tokens": self.copied_tokens, "outside_draft_vocab": self.outside_draft_vocab,
                "copied_outside_draft_vocab": self.copied_outside_draft_vocab, "errors": self.errors,
                "row_acceptance": self.row_acceptance}
