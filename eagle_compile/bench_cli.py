"""``eagle31 bench``: run the benchmark scripts of a source checkout (``benchmarks/*.py``) by name.

    eagle31 bench --list                                   # each benchmark with the first line of its docstring
    eagle31 bench spec_bench --threads 2 --per-category 2  # everything after the name goes to the script
    eagle31 bench calibration --help                       # a script's own options

The benchmarks measure, print tables and write JSON, markdown and plots (docs/BENCHMARKS.md has their results and
the commands that produced them). They live beside the package in a source checkout, not inside it; point
``$EAGLE_COMPILE_BENCHMARKS`` at the folder when it is elsewhere.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

from eagle_compile.errors import OptionsError

NOT_BENCHMARKS = {"common.py"}          # helpers the scripts import, not benchmarks


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark script of benchmarks/ by name (--list to see them)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("name", nargs="?", help="benchmark name (a file of benchmarks/ without .py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark script")


def run_bench(args) -> int:
    folder = benchmarks_dir()
    scripts = benchmark_scripts(folder)
    if args.list or args.name is None:
        for name, summary in scripts.items():
            print(f"{name:16s} {summary}")
        return 0
    if args.name not in scripts:
        raise OptionsError(f"no benchmark {args.name!r} in {folder}; the benchmarks are {', '.join(scripts)}")
    command = [sys.executable, str(folder / f"{args.name}.py"), *args.args]
    return subprocess.run(command, check=False).returncode


def benchmarks_dir() -> Path:
    """``$EAGLE_COMPILE_BENCHMARKS``, else ``benchmarks/`` beside the package in its source checkout."""
    env = os.environ.get("EAGLE_COMPILE_BENCHMARKS")
    folder = Path(env) if env else Path(__file__).resolve().parents[1] / "benchmarks"
    if not folder.is_dir():
        raise OptionsError(f"no benchmarks folder at {folder}: the benchmarks live in eagle_compile's source "
                           "checkout (benchmarks/); run from a clone, or set $EAGLE_COMPILE_BENCHMARKS to its path")
    return folder


def benchmark_scripts(folder: Path) -> dict[str, str]:
    """{name: first line of the script's docstring} for every benchmark script in `folder`, sorted."""
    out = {}
    for path in sorted(folder.glob("*.py")):
        if path.name in NOT_BENCHMARKS or path.name.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        out[path.stem] = doc.split("\n")[0]
    return out
