"""Fixtures of the kernel tests: Triton kernels (through the interpreter on CPU) against their references.

`TRITON_INTERPRET` is deliberately not set here. The kernels do not need it (`kernels/_dispatch.py` builds the
interpreter's `InterpretedFunction` explicitly and the kernels avoid the `@jit` helpers that would), and a
conftest cannot set it early enough anyway: `import torch._dynamo` imports Triton, and other test packages
are collected before this one. Setting it process-wide would also make every later `@triton.jit` in the
session interpreted, including on a GPU runner.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def interpreter(monkeypatch):
    """CPU custom-op calls run the Triton kernels through the interpreter for the duration of a test."""
    pytest.importorskip("triton")
    monkeypatch.setenv("EAGLE31_TRITON_INTERPRET", "1")


@pytest.fixture
def reference_only(monkeypatch):
    monkeypatch.delenv("EAGLE31_TRITON_INTERPRET", raising=False)
