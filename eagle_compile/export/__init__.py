"""Exports: draft heads in the folders serving engines load (``heads``)."""

from eagle_compile.export.heads import ENGINES, export_head

__all__ = ["ENGINES", "export_head"]
