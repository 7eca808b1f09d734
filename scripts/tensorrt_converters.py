"""Regenerate eagle_compile/export/tensorrt_converters.txt: the ops torch-tensorrt's dynamo path handles.

TensorRT cannot be installed on our CPU machines (COMPILE_FACTS.md §7), so `import torch_tensorrt` fails and
its registries cannot be asked at run time. They are plain Python, though, and this script reads them from the
pinned wheel (downloaded without dependencies, 4 MB, from PyPI) with `ast`, running none of its code:

* `convert OP`: a converter, `@dynamo_tensorrt_converter(OP, ...)` under `torch_tensorrt/dynamo/conversion/`;
* `decompose OP`: one of torch-tensorrt's own decompositions, `@register_torch_trt_decomposition(OP, ...)` in
  `dynamo/lowering/_decompositions.py`, applied before conversion;
* `remove OP`: an op a `dynamo/lowering/passes/remove_*.py` pass deletes (asserts, detach, ...).

A decorator on an op packet (`torch.ops.aten.batch_norm`) covers every overload: written `aten.batch_norm.*`.

    python scripts/tensorrt_converters.py            # pip download torch-tensorrt==PIN, rewrite the table
    python scripts/tensorrt_converters.py --wheel W  # from a wheel already downloaded

Where torch_tensorrt imports (a CUDA machine with TensorRT), tests/export/test_tensorrt_export.py compares the
table with the live registry.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "eagle_compile" / "export" / "tensorrt_converters.txt"
sys.path.insert(0, str(REPO))
from eagle_compile.export.tensorrt_ops import TORCH_TENSORRT_PIN  # noqa: E402

PACKAGE = "torch_tensorrt/dynamo/"
#: (kind, files under PACKAGE, the decorator whose first argument names the op; None: every op referenced)
SOURCES = (("convert", "conversion/", "dynamo_tensorrt_converter"),
           ("decompose", "lowering/_decompositions.py", "register_torch_trt_decomposition"),
           ("remove", "lowering/passes/remove_", None))


def handled_ops(wheel: Path) -> list[tuple[str, str]]:
    """(kind, op) for every op the wheel converts, decomposes or removes."""
    found: set[tuple[str, str]] = set()
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not (name.startswith(PACKAGE) and name.endswith(".py")):
                continue
            source = archive.read(name).decode()
            for kind, prefix, decorator in SOURCES:
                if name.removeprefix(PACKAGE).startswith(prefix):
                    found.update((kind, op) for op in _ops_in(source, decorator))
    return sorted(found)


def _ops_in(source: str, decorator: str | None) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if decorator is None:
            text = ast.unparse(node) if isinstance(node, ast.Attribute) else ""
            if text.startswith("torch.ops.") and text.count(".") == 4:
                found.add(_op_name(text))
        elif isinstance(node, ast.Call) and _called(node) == decorator and node.args:
            op = _op_name(ast.unparse(node.args[0]))
            if op is not None:
                found.add(op)
    return found


def _called(node: ast.Call) -> str | None:
    return getattr(node.func, "id", None) or getattr(node.func, "attr", None)


def _op_name(expr: str) -> str | None:
    """`torch.ops.aten.mm.default` -> `aten.mm.default`; a packet `torch.ops.aten.mm` -> `aten.mm.*`;
    `operator.add` and `torch.sym_min` as written; names of variables (plugin ops built at run time) -> None."""
    if expr.startswith(("torch.ops.", "aten.")):
        parts = expr.removeprefix("torch.ops.").split(".")
        return ".".join(parts) if len(parts) == 3 else ".".join(parts) + ".*"
    if expr.startswith(("operator.", "torch.")):
        return expr
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, default=None, help="a torch_tensorrt wheel (default: pip download)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        wheel = args.wheel
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", scratch,
                            f"torch-tensorrt=={TORCH_TENSORRT_PIN}"], check=True)
            wheel = next(Path(scratch).glob("torch_tensorrt-*.whl"))
        ops = handled_ops(wheel)
    header = [f"# the ops torch-tensorrt {TORCH_TENSORRT_PIN}'s dynamo path converts, decomposes or removes, read "
              f"from {wheel.name}", "# by scripts/tensorrt_converters.py (see its docstring); '.*' = every "
              "overload of the op"]
    TABLE.write_text("\n".join([*header, *(f"{kind} {op}" for kind, op in ops)]) + "\n")
    counts = {kind: sum(k == kind for k, _ in ops) for kind, _, _ in SOURCES}
    print(f"wrote {TABLE.relative_to(REPO)}: {counts} from {wheel.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
