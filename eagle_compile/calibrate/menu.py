"""The menu of step programs the calibration layer chooses from each cycle: a plain step and trees of several
sizes, each captured once per batch bucket (static shapes)."""

from __future__ import annotations

from dataclasses import dataclass

from eagle_compile.core.tree import TreeShape

PLAIN = "plain"


@dataclass(frozen=True)
class MenuEntry:
    """One program: `shape` None is the plain step (one target forward, no draft)."""

    name: str
    shape: TreeShape | None

    @property
    def family(self) -> str:
        """Entries whose acceptance per depth is the same event share a family: every chain is "chain"."""
        if self.shape is None:
            return PLAIN
        return "chain" if self.shape.top_k == 1 else self.name

    @property
    def depth(self) -> int:
        return 0 if self.shape is None else self.shape.depth

    @property
    def tokens(self) -> int:
        """N: tokens the target verifies per row (1 for the plain step)."""
        return 1 if self.shape is None else self.shape.total_tokens


def entry_for(shape: TreeShape) -> MenuEntry:
    if shape.top_k == 1 and shape.total_tokens == shape.depth + 1:
        return MenuEntry(f"chain{shape.depth}", shape)
    return MenuEntry(f"tree{shape.depth}x{shape.top_k}x{shape.total_tokens}", shape)


def default_menu(anchor: TreeShape, chains: tuple[int, ...] = (1, 2, 4)) -> tuple[MenuEntry, ...]:
    """Plain, chains of `chains` draft tokens (no deeper than the anchor plus one), and the anchor tree (the
    head's tuned tree, the options' tree, or the EAGLE default)."""
    entries = [MenuEntry(PLAIN, None)]
    for k in chains:
        if k <= max(anchor.depth, 1) + 1:
            entries.append(entry_for(TreeShape.chain(k)))
    top = entry_for(anchor)
    if all(e.shape != anchor for e in entries):
        entries.append(top)
    return tuple(entries)


def families(menu: tuple[MenuEntry, ...]) -> dict[str, int]:
    """{family: deepest depth among its entries}, plain left out."""
    out: dict[str, int] = {}
    for e in menu:
        if e.shape is not None:
            out[e.family] = max(out.get(e.family, 0), e.depth)
    return out
