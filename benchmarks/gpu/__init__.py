"""The GPU check, one file per check as it grows; `benchmarks/gpu_check.py` stays the one entry script (arguments,
preflight, the section order, the report).

* `base.py`: what every section shares (the run's bookkeeping, random targets and heads, byte counts).
* `memory.py`: the peak memory of one call, on CUDA and on the CPU.
* `long_context.py`: section (l), the 128K-token soak.
"""
