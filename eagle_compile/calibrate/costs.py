"""Measured costs: what one cycle of each menu program takes on this device, and c(N)/c(1) of verification.

A cost depends on everything that changes the kernels' work: the device (model name, threads), the dtype, the
target (architecture and sizes), how the programs are lowered (inner backend, numerics, kernels), the batch
bucket and the context (attention reads the live prefix). `CostKey` names all of it plus the package and
torch versions; `CostCache` keeps one JSON file per key and hands back an entry only when the key stored
inside the file equals the key asked for, field by field, so a stale entry (another version) or a foreign
one (another machine, target, bucket; a file copied or renamed) is never used.

Times are medians of interleaved rounds (one call of each program per round, `interleaved_times`), so a change
of the machine's load hits every program alike; the decision rule uses only their ratios.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

#: context buckets: a cost measured at the bucket's edge is used for every context up to it
CONTEXT_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
CACHE_ENV = "EAGLE31_CACHE_DIR"


def context_bucket(length: int) -> int:
    """The smallest context bucket >= `length` (the largest one past the table)."""
    for edge in CONTEXT_BUCKETS:
        if length <= edge:
            return edge
    return CONTEXT_BUCKETS[-1]


def device_name(device: torch.device) -> str:
    """The device as costs depend on it: the accelerator's name, or the CPU model and the threads torch uses."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{device.type}:{cpu}:threads={torch.get_num_threads()}"


def target_fingerprint(model: torch.nn.Module) -> str:
    """Architecture and the sizes that decide the kernels' work (not the weights' values)."""
    c = model.config.get_text_config()
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "head_dim")
    sizes = ",".join(f"{k}={getattr(c, k, None)}" for k in keys)
    return f"{type(model).__name__}({sizes})"


def draft_fingerprint(drafter: Any) -> str:
    """The drafter as costs depend on it: its kind and the head's sizes (a draft level's work), not the weights.
    A random full-vocabulary head's draft level cost 0.31 plain steps of SmolLM2-135M where the shipped head's
    cost 0.06 (2026-12-07): two heads on one target are two cost entries."""
    if drafter is None:
        return "none"
    model = getattr(drafter, "model", None)
    config = getattr(model, "config", None)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "draft_vocab_size",
            "target_hidden_size", "vocab_size")
    sizes = ",".join(f"{k}={getattr(config, k, None)}" for k in keys) if config is not None else ""
    return f"{type(drafter).__name__}[{type(model).__name__}({sizes})]"


@dataclass(frozen=True)
class CostKey:
    """Everything a cost depends on. Two keys are the same entry only if every field is equal (`draft`:
    `draft_fingerprint`)."""

    device: str
    dtype: str
    target: str
    draft: str
    lowering: str
    menu: tuple[str, ...]
    batch_bucket: int
    context_bucket: int
    package: str
    torch: str

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:24]

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["menu"] = list(self.menu)
        return d


@dataclass
class CostTable:
    """Seconds per cycle of each menu program (by name; "plain" is the one-token step), measured at
    `context` tokens of prefix, plus the parts: `verify` c(N) of the target program alone and `draft_level`
    (one draft forward + top-k over the widest frontier), where measured. `source` says where it came from."""

    cycle: dict[str, float]
    context: int
    verify: dict[int, float] = field(default_factory=dict)
    draft_level: float | None = None
    measure_seconds: float = 0.0
    source: str = "measured"

    def relative(self) -> dict[str, float]:
        """Each program's cycle in units of the plain step. A speculative cycle is never taken as cheaper than
        a plain step plus one draft level (it runs a target forward of at least one token and at least the
        draft's catch-up), whatever a noisy measurement said."""
        plain = self.cycle["plain"]
        floor = 1.0 + (self.draft_level / plain if self.draft_level else 0.0)
        return {name: t / plain if name == "plain" else max(t / plain, floor) for name, t in self.cycle.items()}

    def describe(self) -> str:
        rel = ", ".join(f"{name} {r:.2f}" for name, r in self.relative().items())
        extra = ""
        if self.verify and 1 in self.verify:
            curve = sorted(self.verify.items())
            extra = "; c(N)/c(1): " + ", ".join(f"{n}: {t / self.verify[1]:.2f}" for n, t in curve)
        if self.draft_level is not None:
            extra += f"; draft level {self.draft_level / self.cycle['plain']:.2f} plain steps"
        return (f"plain step {self.cycle['plain'] * 1e3:.2f} ms at {self.context} tokens; cycle / plain: {rel}"
                f"{extra} ({self.source})")

    def to_json(self) -> dict[str, Any]:
        return {"cycle": self.cycle, "context": self.context, "verify": {str(n): t for n, t in self.verify.items()},
                "draft_level": self.draft_level, "measure_seconds": self.measure_seconds}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], source: str) -> CostTable:
        return cls(cycle={k: float(v) for k, v in d["cycle"].items()}, context=int(d["context"]),
                   verify={int(n): float(t) for n, t in d.get("verify", {}).items()},
                   draft_level=d.get("draft_level"), measure_seconds=float(d.get("measure_seconds", 0.0)),
                   source=source)


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env) / "costs"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "eagle_compile" / "costs"


class CostCache:
    """On-disk cost tables, one JSON file per `CostKey`; `directory=None` keeps them in memory only."""

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self._memory: dict[CostKey, CostTable] = {}
        self.refused: list[str] = []          # why entries on disk were not used (stale / foreign / unreadable)

    def path(self, key: CostKey) -> Path | None:
        return None if self.directory is None else self.directory / f"{key.digest()}.json"

    def get(self, key: CostKey) -> CostTable | None:
        if key in self._memory:
            return self._memory[key]
        path = self.path(key)
        if path is None or not path.exists():
            return None
        try:
            record = json.loads(path.read_text())
            stored = record["key"]
            table = CostTable.from_json(record["costs"], source=f"cost cache {path}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.refused.append(f"{path}: unreadable ({exc})")
            return None
        wanted = key.as_json()
        if stored != wanted:
            diff = sorted(k for k in wanted if stored.get(k) != wanted[k])
            self.refused.append(f"{path}: stored for another {', '.join(diff)}; measured again")
            return None
        if set(table.cycle) != set(key.menu) | {"plain"}:
            self.refused.append(f"{path}: its programs {sorted(table.cycle)} are not the menu's; measured again")
            return None
        self._memory[key] = table
        return table

    def put(self, key: CostKey, table: CostTable) -> None:
        self._memory[key] = table
        path = self.path(key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key.as_json(), "costs": table.to_json()}, indent=1))
        tmp.replace(path)                      # atomic: a reader never sees half a file


# -- timing ------------------------------------------------------------------------------------------------------
def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_times(calls: Mapping[Any, Callable[[], Any]], *, repeats: int, warmup: int,
                      device: torch.device | None = None) -> dict[Any, dict[str, float]]:
    """Median (and min/max) seconds of each call, timed round-robin (one call of each per round, `warmup`
    untimed rounds first), so that a change of the machine's load during the run affects every call alike.
    On CUDA each call is timed to a device synchronisation."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    _sync(device)
    times: dict[Any, list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[key].append(time.perf_counter() - t0)
    return {key: {"median": statistics.median(t), "min": min(t), "max": max(t), "repeats": repeats}
            for key, t in times.items()}


def verify_call(program, cache, base: int, n: int, generator: torch.Generator | None = None,
                batch: int = 1) -> Callable[[], Any]:
    """A zero-argument call of a target program (`runtime.TargetProgram` interface) verifying a chain of `n`
    tokens at slots base..base+n-1 of `cache` (what a tree of n nodes costs the target)."""
    from eagle_compile.core.masks import SlotMask

    device = cache.layers[0].keys.device
    vocab = program.model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, n), generator=generator).to(device)
    pos = (base + torch.arange(n, device=device)).expand(batch, n).contiguous()
    ancestors = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device)).expand(batch, n, n)
    mask = SlotMask.tree(ancestors, torch.full((batch,), base, device=device), cache.slots)
    return lambda: program(ids, pos, mask, pos, cache)


# -- curves ------------------------------------------------------------------------------------------------------
def interpolate(curve: Mapping[int, float], n: int) -> float:
    """c(n)/c(1) by linear interpolation between measured N."""
    xs = sorted(curve)
    if n in curve:
        return curve[n]
    if not xs[0] < n < xs[-1]:
        raise ValueError(f"N={n} is outside the measured range {xs[0]}..{xs[-1]}; measure it")
    hi = next(x for x in xs if x > n)
    lo = max(x for x in xs if x < n)
    return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)


def monotone(curve: Mapping[int, float]) -> dict[int, float]:
    """Running maximum over N: verifying more tokens cannot cost less, so a measured dip is noise."""
    out, high = {}, 0.0
    for n in sorted(curve):
        high = max(high, curve[n])
        out[n] = high
    return out


def expected_tokens(q: list[float]) -> float:
    """1 + sum_j prod_{i<=j} q[i]: q[i] is the acceptance probability at depth i+1 given the ones above."""
    total, reach = 1.0, 1.0
    for p in q:
        reach *= p
        total += reach
    return total
