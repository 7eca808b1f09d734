"""State shared by the FX passes of one compilation: inputs they need, what they found, what they rewrote."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch.fx

log = logging.getLogger("eagle_compile.passes")


@dataclass
class PassContext:
    """Inputs and results of one pass pipeline run over one captured graph.

    `capture_indices`: feature taps to expose (None = the EAGLE-3 default for the number of layers found).
    `architecture`: class name of the target, for error messages (found in the graph when not given).
    """

    capture_indices: tuple[int, ...] | None = None
    architecture: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    layer_outputs: list[torch.fx.Node] = field(default_factory=list)
    embedding_output: torch.fx.Node | None = None
    num_original_outputs: int | None = None
    step_examples: Any = None   # runtime.step_program.StepExamples when the graph is a step program
    use_kernels: bool = True    # whether passes may swap traced code for eagle31 fused ops
    kernels_reason: str = ""
    kernels: str = "auto"       # the `kernels` option: "off" also keeps attention over the dense mask
    numerics: str = "eager"     # "batch_invariant": the batch_invariant pass swaps in the invariant kernels

    @property
    def num_layers(self) -> int:
        return len(self.layer_outputs)

    def kernels_off(self, pass_name: str) -> bool:
        """True (and the 0 recorded, with the reason) when fused-kernel substitution is off for this graph."""
        if self.use_kernels:
            return False
        self.record(pass_name, 0, f"kernels off: {self.kernels_reason}")
        return True

    def record(self, pass_name: str, sites: int, detail: str = "") -> None:
        """Count the sites a pass rewrote (0 is a valid, recorded count) and log it."""
        self.counts[pass_name] = sites
        log.info("pass %s: %d site(s)%s", pass_name, sites, f" ({detail})" if detail else "")
