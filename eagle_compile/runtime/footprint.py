"""What a compiled model holds, so that a long-running process can prove it does not grow.

`footprint(compiled_or_model)` counts, at one moment:

* the FX graphs our programs captured (`fx_graphs`) and the CUDA graphs around them (`cuda_graphs`);
* dynamo's cache entries on the code objects our programs compile (`cache_entries`, process-wide: summed over
  every live program's own copy of `TargetProgram._forward` and `SpeculativeStep.__call__`) and the backends
  torch keeps alive for `torch._dynamo.reset` (`dynamo_backends`: one per program ever built, never released by
  torch; each a small `program_lifetime.WeakBackend` that does not keep its program);
* each decoder's books (`SpeculativeDecoder.books`: steps and programs, static bucket buffers, cost tables, ...)
  and the decoders kept for the model (one per draft x options combination);
* the tensor bytes reachable from the decoders' own objects (`held_bytes`: buffers, stashes, examples kept by
  a captured program; model and draft weights are not ours and are left out);
* every live tensor storage of the process (`live_tensor_bytes`, weights included: a caller who keeps outputs
  alive shows up here), and the process's resident memory (`rss_bytes`).

`growth(before, after)` lists what grew between two footprints. Counts and tensor bytes must not grow at all in
a steady state; RSS moves with the allocator's own caching, so it counts as growth only past `rss_slack` bytes,
and a cache with a stated bound (`BOUNDS`) only past it. The soak benchmark (`benchmarks/soak.py`) prints these
figures over hundreds of calls; tests/runtime/test_soak.py asserts them over a shorter soak, with negative
controls that make each counter move.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

#: RSS moves with malloc's arenas and torch's CPU allocator caching: growth below this is not reported
RSS_SLACK = 32 << 20
#: caches that grow with new inputs up to a stated size and no further: growth within the bound is not reported
BOUNDS = {"prefill_plan_cache": 4096,     # prefill_plan._cheapest_cover: lru_cache(maxsize=4096)
          "prefill_cost_cache": 4096}     # prefill_plan._plan_cost: lru_cache(maxsize=4096)


@dataclass(frozen=True)
class Footprint:
    """One moment's figures (see the module docstring)."""

    fx_graphs: int
    cuda_graphs: int
    cache_entries: dict[str, int]            # {code object: dynamo cache entries}, process-wide
    dynamo_backends: int                     # torch._dynamo.eval_frame.cached_backends, process-wide
    decoders: int                            # decoders kept for the model
    books: dict[str, int]                    # summed over the model's decoders (`SpeculativeDecoder.books`)
    held_bytes: int                          # tensor bytes reachable from the decoders (weights excluded)
    live_tensors: int                        # live tensor storages of the process
    live_tensor_bytes: int
    rss_bytes: int
    device_bytes: int = 0                    # torch.cuda.memory_allocated() where CUDA is initialised
    bounded: dict[str, int] = field(default_factory=dict)   # caches with a stated bound (`BOUNDS`): may fill up

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, int]:
        """Every figure under one name: `cache_entries.<code>`, `books.<name>`, ..."""
        out: dict[str, int] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                out.update({f"{f.name}.{k}": v for k, v in value.items()})
            else:
                out[f.name] = value
        return out


def footprint(compiled_or_model: Any = None) -> Footprint:
    """The footprint of a model compiled with the eagle31 backend (or the model itself, or a
    `SpeculativeDecoder`); `None`: only the process-wide figures (no decoder books)."""
    decoders = _decoders_of(compiled_or_model)
    fx = cuda = 0
    books: dict[str, int] = {}
    for d in decoders:
        fx += d.graphs_captured
        cuda += d.cuda_graphs_captured
        for name, count in d.books().items():
            books[name] = books.get(name, 0) + count
    from eagle_compile.runtime import prefill_plan

    bounded = {"prefill_plan_cache": prefill_plan._cheapest_cover.cache_info().currsize,
               "prefill_cost_cache": prefill_plan._plan_cost.cache_info().currsize}
    live, live_bytes = live_tensor_storages()
    device = torch.cuda.memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    return Footprint(fx_graphs=fx, cuda_graphs=cuda, cache_entries=dynamo_cache_entries(),
                     dynamo_backends=_dynamo_backends(), decoders=len(decoders), books=books,
                     held_bytes=sum(held_tensor_bytes(d) for d in decoders), live_tensors=live,
                     live_tensor_bytes=live_bytes, rss_bytes=rss_bytes(), device_bytes=device, bounded=bounded)


def growth(before: Footprint, after: Footprint, *, rss_slack: int = RSS_SLACK) -> list[str]:
    """What grew from `before` to `after`, one line each ("fx_graphs: 3 -> 4 (+1)"); empty: nothing grew.
    Every figure but RSS and the bounded caches must not grow at all; RSS only past `rss_slack` bytes, a bounded
    cache only past its bound (`BOUNDS`)."""
    old, new = before.flat(), after.flat()
    grew = []
    for name, value in new.items():
        was = old.get(name, 0)
        if name.startswith("bounded."):
            was = max(was, BOUNDS[name.removeprefix("bounded.")])
        if value > was + (rss_slack if name == "rss_bytes" else 0):
            grew.append(f"{name}: {was} -> {value} (+{value - was})")
    return grew


# -- the figures ---------------------------------------------------------------------------------------------------
def _decoders_of(obj: Any) -> list:
    from eagle_compile.runtime.decoder import SpeculativeDecoder
    from eagle_compile.runtime.generate import _decoders

    if obj is None:
        return []
    if isinstance(obj, SpeculativeDecoder):
        return [obj]
    model = getattr(obj, "_orig_mod", obj)
    return list(_decoders.get(model, {}).values())


PROGRAM_FUNCTIONS = ("TargetProgram._forward", "SpeculativeStep.__call__")    # what our programs compile


def dynamo_cache_entries() -> dict[str, int]:
    """{function: dynamo cache entries}, summed over the live programs' own copies of it (`own_code`)."""
    from torch._dynamo.eval_frame import _get_total_cache_entry_count

    from eagle_compile.runtime.program_lifetime import live_codes

    return {name: sum(_get_total_cache_entry_count(code) for code in live_codes(name)) for name in PROGRAM_FUNCTIONS}


def _dynamo_backends() -> int:
    from torch._dynamo.eval_frame import cached_backends

    return len(cached_backends)


def live_tensor_storages() -> tuple[int, int]:
    """(storages, bytes) of every tensor the garbage collector can see, after a collection; storages shared by
    views count once. Fake and meta tensors (dynamo's tracing) have no memory and are left out."""
    gc.collect()
    sizes: dict[tuple[str, int], int] = {}
    with warnings.catch_warnings():          # isinstance on some torch module objects warns of deprecations
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if not isinstance(obj, torch.Tensor):
                continue
            try:
                if obj.device.type == "meta":
                    continue
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError, TypeError):     # fake / functional / sparse tensors
                continue
            if ptr:
                key = (str(obj.device), ptr)
                sizes[key] = max(sizes.get(key, 0), storage.nbytes())
    return len(sizes), sum(sizes.values())


def held_tensor_bytes(decoder) -> int:
    """Bytes of the tensors reachable from `decoder` through our own objects (eagle_compile classes,
    dataclasses, dicts, lists, tuples, sets), deduplicated by storage. Modules (the target, the draft head, FX
    graph modules) are not walked: their weights are the model's, not what decoding accumulates."""
    seen: set[int] = set()
    storages: dict[tuple[str, int], int] = {}
    stack = [decoder]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                s = obj.untyped_storage()
                storages[(str(obj.device), s.data_ptr())] = s.nbytes()
        elif isinstance(obj, torch.nn.Module):
            continue
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif _ours(obj):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else
                         (getattr(obj, f.name) for f in dataclasses.fields(obj)))
    return sum(storages.values())


def _ours(obj: Any) -> bool:
    module = type(obj).__module__ or ""
    return module.startswith("eagle_compile") and (hasattr(obj, "__dict__") or dataclasses.is_dataclass(obj))


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc), else the peak (getrusage) as the best available."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
