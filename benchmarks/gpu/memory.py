"""Peak memory of one call, the same measure on CUDA and on the CPU.

CUDA: `torch.cuda.max_memory_allocated` after a reset, minus what was allocated before the call. CPU (no
allocator statistics in torch): the profiler's memory timeline (`profile_memory=True`): every allocation and
free, each counted in the innermost op that made it, summed in start order; the peak of that running sum is the
peak of what the call allocated beyond what was live before it. Both count what the call frees before it
returns, so a transient [T, S] or [S, S] tensor shows up even though nothing keeps it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def peak_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, int]:
    """(fn(), the peak bytes allocated while it ran beyond those live before it)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return out, peak
