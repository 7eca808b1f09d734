"""Drift monitors of the draft tree (DESIGN.md §4): how far the draft wanders from the target as it feeds itself.

Measured inside the step, per row, at each draft depth d of the tree (the tree level that proposes depth d):

* `rms_ratio`: RMS of the hidden state fed to the draft step proposing depth d (its parent's feedback) over the
  RMS of the one fed to the first tree level (the catch-up's feedback, made from the target's own features);
* `sink_mass`: attention mass of that step's queries on the first `SINK_SLOTS` positions (attention sinks);
* `draft_mass`: attention mass on draft-generated positions (this cycle's tree slots);
* `top1`: the draft's top-1 probability at depth d (the best frontier node's best child; depth 1: the root's).

Depth 1's proposals come from the catch-up forward over the target's features, so the first three start at
depth 2. All values stay on the device; the decoder sums them over cycles and reads them once per call. The
attention masses cost one extra dense score pass of the draft's one layer per level (probabilities over every
cache slot), which is why the monitors are an option (`drift_monitors`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SINK_SLOTS = 4
NAMES = ("rms_ratio", "sink_mass", "draft_mass", "top1")


@dataclass
class DriftProbe:
    """Per-level [B] tensors collected while one tree is built."""

    rms: list[torch.Tensor] = field(default_factory=list)
    sink: list[torch.Tensor] = field(default_factory=list)
    drafted: list[torch.Tensor] = field(default_factory=list)
    top1: list[torch.Tensor] = field(default_factory=list)

    def attention(self, q: torch.Tensor, keys: torch.Tensor, mask, scale: float) -> None:
        """Called by the draft's attention with its queries [B, Hq, T, hd], the cache keys [B, Hkv, S, hd] and
        the `SlotMask`: records the mass on sink slots and on the block (draft-generated) slots."""
        groups = q.shape[1] // keys.shape[1]
        k = keys.to(q.dtype).repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) * scale                           # [B, Hq, T, S]
        visible = mask.visible(q.shape[2])[:, None]                          # [B, 1, T, S]
        p = torch.softmax(scores.masked_fill(~visible, -torch.inf), dim=-1)
        slots = torch.arange(keys.shape[2], device=q.device)
        sink = (slots < SINK_SLOTS)[None, None, None, :]
        block = (slots[None, :] >= mask.base[:, None])[:, None, None, :]
        self.sink.append((p * sink).sum(-1).mean((1, 2)))
        self.drafted.append((p * block).sum(-1).mean((1, 2)))

    def stacked(self, depth: int, reference: torch.Tensor) -> torch.Tensor:
        """[B, 4, depth] in `NAMES` order; entries a depth does not have (depth 1's first three) are NaN."""
        b = reference.shape[0]
        out = torch.full((b, len(NAMES), depth), torch.nan, dtype=torch.float32, device=reference.device)
        for i, values in enumerate((self.rms, self.sink, self.drafted)):
            if values:
                out[:, i, 1:1 + len(values)] = torch.stack(values, 1).float()
        out[:, 3, :len(self.top1)] = torch.stack(self.top1, 1).float()
        return out


def rms(x: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [...] root mean square over the last dimension."""
    return x.float().pow(2).mean(-1).sqrt()


class DriftTotals:
    """Sums of the monitors over a call's cycles and rows, kept on the device; `read` is the call's one read."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None       # [4, D]
        self.counts: torch.Tensor | None = None

    def add(self, drift: torch.Tensor, rows: torch.Tensor) -> None:
        """drift: [B, 4, D] of one cycle; rows: [B] bool, the rows that drafted."""
        seen = ~torch.isnan(drift) & rows.to(drift.device)[:, None, None]
        sums = torch.where(seen, drift, 0.0).sum(0)
        counts = seen.sum(0).float()
        if self.sums is None:
            self.sums, self.counts = sums, counts
            return
        depth = max(self.sums.shape[1], sums.shape[1])
        self.sums, sums = _pad(self.sums, depth), _pad(sums, depth)
        self.counts, counts = _pad(self.counts, depth), _pad(counts, depth)
        self.sums, self.counts = self.sums + sums, self.counts + counts

    def read(self) -> dict[str, list[float | None]]:
        """{monitor: mean per depth 1..D (None where never measured)}."""
        if self.sums is None:
            return {}
        means = (self.sums / self.counts.clamp(min=1)).tolist()
        counts = self.counts.tolist()
        return {name: [round(m, 4) if c else None for m, c in zip(means[i], counts[i], strict=True)]
                for i, name in enumerate(NAMES)}


def _pad(x: torch.Tensor, depth: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, depth - x.shape[1]))
