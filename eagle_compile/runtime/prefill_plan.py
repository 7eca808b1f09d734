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

A batch of prompts of different lengths pads every row to the longest: 64 MT-bench first turns hold 7,045 prompt
tokens but cover 64 x 402 positions. `prefill_groups` splits the rows (longest first) into groups, each
prefilled as a batch of its own (a smaller bucket, its own cover) and copied into the batch's cache rows, when
that computes fewer positions than the whole batch at once; a group pays `GROUP_OVERHEAD_TOKENS` (a cache of its
own to fill and copy, the first token's sampling and the draft's catch-up).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

#: the smallest prefill chunk; chunk sizes are prefill_chunk, prefill_chunk // 4, ... down to this
MIN_PREFILL_CHUNK = 16

#: what one more chunk costs, in prompt tokens of compute (one pass over the weights; see the module docstring)
CHUNK_OVERHEAD_TOKENS = 32

#: what prefilling a group of rows apart costs besides its chunks, in prompt tokens of compute
GROUP_OVERHEAD_TOKENS = 2 * CHUNK_OVERHEAD_TOKENS

#: the default cap on rows x chunk tokens of one prefill forward on a CPU (see the module docstring)
CPU_FORWARD_TOKENS = 1024


def prefill_chunk_sizes(largest: int) -> tuple[int, ...]:
    """The static chunk sizes a prefill may use, largest first (at most log4(largest / 16) + 1 of them)."""
    sizes = [largest]
    while sizes[-1] // 4 >= MIN_PREFILL_CHUNK:
        sizes.append(sizes[-1] // 4)
    return tuple(sizes)


def largest_chunk(largest: int, rows: int, forward_tokens: int | None = None) -> int:
    """The largest menu size (`prefill_chunk_sizes(largest)`) whose chunk of `rows` rows carries at most
    `forward_tokens` tokens (None: no cap), or the smallest size when none does.

    >>> largest_chunk(4096, 1, 1024), largest_chunk(4096, 8, 1024), largest_chunk(4096, 64, 1024)
    (1024, 64, 16)
    """
    sizes = prefill_chunk_sizes(largest)
    if forward_tokens is None:
        return largest
    return next((size for size in sizes if size * rows <= forward_tokens), sizes[-1])


def prefill_plan(length: int, largest: int, rows: int = 1, forward_tokens: int | None = None
                 ) -> list[tuple[int, int]]:
    """(start, size) chunks covering `length` prompt positions of `rows` rows, largest first, of least cost
    (`chunks * CHUNK_OVERHEAD_TOKENS / rows + covered positions`; on a tie, less padding), from the menu of
    `largest` up to `largest_chunk(largest, rows, forward_tokens)`. The last chunk may be padded.

    >>> prefill_plan(600, 512)
    [(0, 512), (512, 128)]
    >>> prefill_plan(60, 4096)
    [(0, 64)]
    >>> prefill_plan(40, 4096, rows=8)
    [(0, 16), (16, 16), (32, 16)]
    >>> prefill_plan(2100, 4096, forward_tokens=1024)
    [(0, 1024), (1024, 1024), (2048, 64)]
    """
    if length < 1 or rows < 1:
        raise ValueError(f"a prefill needs at least one prompt token and one row, got length {length}, rows {rows}")
    largest = largest_chunk(largest, rows, forward_tokens)
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


def prefill_cost(length: int, largest: int, rows: int, forward_tokens: int | None = None) -> int:
    """Positions of compute a prefill of `rows` rows up to `length` tokens pays: every row over the cover's span,
    and `CHUNK_OVERHEAD_TOKENS` per chunk."""
    return _plan_cost(length, largest, rows, forward_tokens)[0]


@functools.lru_cache(maxsize=4096)
def _plan_cost(length: int, largest: int, rows: int, forward_tokens: int | None = None) -> tuple[int, int]:
    """(cost, span) of `prefill_plan(length, largest, rows, forward_tokens)`."""
    plan = prefill_plan(length, largest, rows, forward_tokens)
    span = plan[-1][0] + plan[-1][1]
    return rows * span + len(plan) * CHUNK_OVERHEAD_TOKENS, span


def prefill_groups(lengths: Sequence[int], largest: int, bucket: Callable[[int], int],
                   span_limit: int | None = None, forward_tokens: int | None = None) -> list[list[int]]:
    """Rows (indices into `lengths`) grouped for prefill, each group in ascending row order; one group of every row
    when splitting does not pay. A group of k rows runs in `bucket(k)` rows (the padding rows cost like real
    ones) and pays `GROUP_OVERHEAD_TOKENS` besides `prefill_cost`; no group's cover may pass `span_limit`
    positions (the cache's slots before the sentinel; None: no limit). Groups hold rows of neighbouring lengths:
    a dynamic programme over the rows sorted longest first (ties in row order), O(rows^2).

    >>> prefill_groups([400, 20, 30, 380], 512, lambda k: k)
    [[0, 3], [1, 2]]
    >>> prefill_groups([100, 90, 110], 512, lambda k: k)
    [[0, 1, 2]]
    """
    rows = len(lengths)
    if rows < 2:
        return [list(range(rows))]
    order = sorted(range(rows), key=lambda b: (-lengths[b], b))
    whole = prefill_cost(max(lengths), largest, bucket(rows), forward_tokens)
    if whole <= sum(max(n, 1) for n in lengths) + GROUP_OVERHEAD_TOKENS:   # nothing to save
        return [list(range(rows))]
    best: list[float] = [0.0] + [math.inf] * rows    # best[i]: the cheapest grouping of the i longest rows
    cut = [0] * (rows + 1)
    for i in range(1, rows + 1):
        for j in range(i):                           # the group order[j:i]; its longest row is order[j]
            cost, span = _plan_cost(max(lengths[order[j]], 1), largest, bucket(i - j), forward_tokens)
            if span_limit is not None and span > span_limit and (j, i) != (0, rows):
                continue
            total = best[j] + cost + GROUP_OVERHEAD_TOKENS
            if total < best[i]:
                best[i], cut[i] = total, j
    groups, i = [], rows
    while i > 0:
        groups.append(sorted(order[cut[i]:i]))
        i = cut[i]
    return groups[::-1]
