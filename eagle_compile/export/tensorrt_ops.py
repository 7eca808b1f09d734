"""Which ops of a program TensorRT converts, checked without TensorRT.

torch-tensorrt's dynamo path first applies its own decompositions and lowering passes (which delete asserts and
detaches), then turns every op its converter registry knows into TensorRT layers and runs the rest in PyTorch
between engines (its partitioner). What we hand it should convert whole: a program that falls back op by op is
slower than no TensorRT at all. `check_ops` sorts a program's ops into those torch-tensorrt converts, decomposes
or removes, the eagle31 custom ops (their fallbacks: the torch references, inlined by the export, or the
Triton kernels run by PyTorch in the `inner_backend="tensorrt"` path) and the rest, which would fall back.

The table is `tensorrt_converters.txt` (`convert|decompose|remove OP` per line), read from the pinned wheel's
source by scripts/tensorrt_converters.py: TensorRT's libraries cannot be installed here, so `import
torch_tensorrt` fails (COMPILE_FACTS.md §7). `live_converters()` asks the real converter registry where
torch_tensorrt imports, and a test compares the two there. Only op names are checked: some converters also
validate their arguments (dtypes, dynamic dims) when TensorRT builds, which a CPU machine cannot run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: torch-tensorrt pins one torch minor (2.13.0 needs torch>=2.13,<2.14); the `tensorrt` extra pins this.
TORCH_TENSORRT_PIN = "2.13.0"
CONVERTERS_FILE = Path(__file__).with_name("tensorrt_converters.txt")
#: graph nodes TensorRT's partitioner never has to convert (placeholders, outputs, attribute reads)
_STRUCTURAL = ("placeholder", "output", "get_attr")


KINDS = ("convert", "decompose", "remove")


@functools.cache
def handled() -> dict[str, frozenset[str]]:
    """kind -> op names of `tensorrt_converters.txt` (`aten.mm.default`, `aten.batch_norm.*`, `operator.getitem`)."""
    table: dict[str, set[str]] = {kind: set() for kind in KINDS}
    for line in CONVERTERS_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            kind, op = line.split()
            table[kind].add(op)
    return {kind: frozenset(ops) for kind, ops in table.items()}


def live_converters() -> frozenset[str] | None:
    """The names in torch_tensorrt's own converter registry, or None where torch_tensorrt does not import."""
    try:
        from torch_tensorrt.dynamo.conversion._ConverterRegistry import DYNAMO_CONVERTERS
    except Exception:      # ImportError, or the missing libnvinfer raising something else (COMPILE_FACTS §7)
        return None
    return frozenset(op_name(target) for target in DYNAMO_CONVERTERS.keys())


def op_name(target) -> str:
    """The table's name of a graph node's target: `aten.mm.default`, `operator.getitem`, `torch.sym_min`."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target._qualified_op_name.replace('::', '.')}.*"
    module = getattr(target, "__module__", None) or ""
    module = "operator" if module in ("_operator", "operator") else module
    return f"{module}.{getattr(target, '__name__', repr(target))}"


def in_table(name: str, table: frozenset[str]) -> bool:
    """`name` or its op packet (`aten.mm.*`) is listed."""
    packet = name.rsplit(".", 1)[0] + ".*"
    return name in table or packet in table


@dataclass
class OpReport:
    """The ops of one program (name -> count): handled by torch-tensorrt (converted, decomposed before
    conversion, removed by a lowering pass), eagle31 custom ops, or falling back to PyTorch."""

    convert: dict[str, int] = field(default_factory=dict)
    decompose: dict[str, int] = field(default_factory=dict)
    remove: dict[str, int] = field(default_factory=dict)
    custom: dict[str, int] = field(default_factory=dict)
    fallback: dict[str, int] = field(default_factory=dict)

    @property
    def whole(self) -> bool:
        """Every op is handled: the program builds as one TensorRT engine."""
        return not self.custom and not self.fallback

    def as_dict(self) -> dict:
        return {**{kind: getattr(self, kind) for kind in (*KINDS, "custom", "fallback")}, "whole": self.whole}


def check_ops(graph: torch.fx.Graph, table: dict[str, frozenset[str]] | None = None) -> OpReport:
    """Sort the call nodes of `graph` (an ExportedProgram's, after decomposition) by how torch-tensorrt runs
    them; a name in several kinds counts as converted first."""
    table = handled() if table is None else table
    report = OpReport()
    for node in graph.nodes:
        if node.op in _STRUCTURAL:
            continue
        name = op_name(node.target)
        kind = next((k for k in KINDS if node.op == "call_function" and in_table(name, table[k])), None)
        if kind is None:
            kind = "custom" if name.startswith("eagle31.") else "fallback"
        counts = getattr(report, kind)
        counts[name] = counts.get(name, 0) + 1
    return report
