"""Exports (DESIGN.md §7): draft heads in the folders serving engines load (``heads``), and the target's verify step
and the draft step as ONNX programs (``onnx``, decoded over by ``onnx_runtime``)."""

from eagle_compile.export.heads import ENGINES, export_head

__all__ = ["ENGINES", "export_head"]
