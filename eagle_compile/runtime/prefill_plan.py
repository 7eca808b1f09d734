"""How a prompt is cut into prefill chunks: a bounded menu of static sizes (each one captured graph), and the
cheapest cover of the prompt by chunks of those sizes.

Every chunk is one forward of the target over its block, so besides its tokens it pays one pass over every
weight; on a CPU in float32 that pass costs about as much as a few dozen prompt tokens (SmolLM2-135M: a one-token
step of 35-100 ms against 2-3 ms per prompt token in a large chunk). Cutting a 60-token prompt greedily into
four chunks of 16 paid that pass four times; one chunk of 64 with 4 padded positions pays it once. A padded
position costs every row of the batch, the weight pass once per chunk, so `prefill_plan` minimises
`chunks * CHUNK_OVERHEAD_TOKENS / rows + padded length` over covers by menu sizes (40 positions: one chunk of 64
for one row, three of 16 for eight rows). Padded positions write the cache's sentinel slot and their outputs are
never read.
"""

from __future__ import annotations

import functools
import math

#: the smallest prefill chunk; chunk sizes are prefill_chunk, prefill_chunk // 4, ... down to this
MIN_PREFILL_CHUNK = 16

#: what one more chunk costs, in prompt tokens of compute (one pass over the weights; see the module docstring)
CHUNK_OVERHEAD_TOKENS = 32


def prefill_chunk_sizes(largest: int) -> tuple[int, ...]:
    """The static chunk sizes a prefill may use, largest first (at most log4(largest / 16) + 1 of them)."""
    sizes = [largest]
    while sizes[-1] // 4 >= MIN_PREFILL_CHUNK:
        sizes.append(sizes[-1] // 4)
    return tuple(sizes)


def prefill_plan(length: int, largest: int, rows: int = 1) -> list[tuple[int, int]]:
    """(start, size) chunks covering `length` prompt positions of `rows` rows, largest first, of least cost
    (`chunks * CHUNK_OVERHEAD_TOKENS / rows + covered positions`; on a tie, less padding). The last chunk may be
    padded.

    >>> prefill_plan(600, 512)
    [(0, 512), (512, 128)]
    >>> prefill_plan(60, 4096)
    [(0, 64)]
    >>> prefill_plan(40, 4096, rows=8)
    [(0, 16), (16, 16), (32, 16)]
    """
    if length < 1 or rows < 1:
        raise ValueError(f"a prefill needs at least one prompt token and one row, got length {length}, rows {rows}")
    sizes = prefill_chunk_sizes(largest)
    full, rest = divmod(length, largest)
    plan_sizes = [largest] * full + (list(_cheapest_cover(rest, sizes, CHUNK_OVERHEAD_TOKENS / rows)) if rest else [])
    plan, start = [], 0
    for size in plan_sizes:
        plan.append((start, size))
        start += size
    return plan


@functools.lru_cache(maxsize=4096)
def _cheapest_cover(rest: int, sizes: tuple[int, ...], overhead: float) -> tuple[int, ...]:
    """Menu sizes, largest first, covering `rest` (< sizes[0]) positions at least cost (`overhead` positions per
    chunk). Dynamic programme over units of the smallest size: best[u] = the cheapest cover of u units."""
    unit = sizes[-1]
    units = math.ceil(rest / unit)
    best: list[tuple[float, int, tuple[int, ...]]] = [(0.0, 0, ())]         # (cost, covered, sizes) per unit count
    for u in range(1, units + 1):
        options = []
        for size in sizes:
            cost, covered, chosen = best[max(0, u - size // unit)]
            options.append((cost + overhead + size, covered + size, chosen + (size,)))
        best.append(min(options))
    return tuple(sorted(best[units][2], reverse=True))
