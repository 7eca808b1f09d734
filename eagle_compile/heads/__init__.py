"""Draft heads that ship inside the package (folders in the official EAGLE-3 layout, each with a MODEL_CARD.md)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_HEAD_NAME = "smollm2-135m-instruct-eagle31"


def shipped_head(name: str = DEFAULT_HEAD_NAME) -> Path | None:
    """Folder of a shipped head, or None when this checkout has none of that name."""
    folder = Path(__file__).parent / name
    return folder if (folder / "config.json").is_file() else None
