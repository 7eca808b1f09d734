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
        return "chain" if self.shape.top_k == 1 and not self.shape.copy else self.name

    @property
    def depth(self) -> int:
        """The most tokens a cycle accepts (draft depth, or the copy branch's length when longer)."""
        return 0 if self.shape is None else self.shape.span

    @property
    def tokens(self) -> int:
        """N: tokens the target verifies per row (1 for the plain step)."""
        return 1 if self.shape is None else self.shape.nodes

    @property
    def copy_only(self) -> bool:
        """A copy branch with no draft levels: worth running only for rows whose lookup found a match."""
        return self.shape is not None and self.shape.depth == 0


def entry_for(shape: TreeShape) -> MenuEntry:
    copy = f"+copy{shape.copy}" if shape.copy else ""
    if shape.depth == 0:
        return MenuEntry(f"copy{shape.copy}", shape)
    if shape.top_k == 1 and shape.total_tokens == shape.depth + 1:
        return MenuEntry(f"chain{shape.depth}{copy}", shape)
    return MenuEntry(f"tree{shape.depth}x{shape.top_k}x{shape.total_tokens}{copy}", shape)


def default_menu(anchor: TreeShape, chains: tuple[int, ...] = (1, 2, 4), copy: int = 0) -> tuple[MenuEntry, ...]:
    """Plain, chains of `chains` draft tokens (no deeper than the anchor plus one), the anchor tree (the head's
    tuned tree, the options' tree, or the EAGLE default), and with `copy` > 0 a copy branch of that many nodes
    alone (prompt lookup, no draft levels)."""
    entries = [MenuEntry(PLAIN, None)]
    for k in chains:
        if k <= max(anchor.depth, 1) + 1:
            entries.append(entry_for(TreeShape.chain(k)))
    top = entry_for(anchor)
    if all(e.shape != anchor for e in entries):
        entries.append(top)
    if copy:
        entries.append(entry_for(TreeShape(0, 0, 1, copy=copy)))
    return tuple(entries)


def copy_family(entry: MenuEntry, ngram: int) -> str:
    """The acceptance family of a copy-only program's cycles on rows whose lookup matched a suffix of `ngram`
    tokens: a longer match predicts a longer copy, so each length is estimated apart."""
    return f"{entry.family}@{ngram}"


def families(menu: tuple[MenuEntry, ...], ngrams: int = 0) -> dict[str, int]:
    """{family: deepest depth among its entries}, plain left out; copy-only entries add one family per match
    length 1..`ngrams` (`copy_family`)."""
    out: dict[str, int] = {}
    for e in menu:
        if e.shape is not None:
            out[e.family] = max(out.get(e.family, 0), e.depth)
            for n in range(1, ngrams + 1) if e.copy_only else ():
                out[copy_family(e, n)] = e.depth
    return out
