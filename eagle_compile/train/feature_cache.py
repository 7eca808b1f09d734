"""Offline target features: computed once, stored in shards on disk, read back per batch.

Layout of a cache folder::

    index.json            format, version, fingerprint, capture indices, widths, dtype, completed shards
    shard_00000.safetensors
        hidden         [tokens, (A+1)*Ht]  cache dtype (float16 by default): A features, then h_N
        input_ids      [tokens] int32
        loss_mask      [tokens] bool
        target_argmax  [tokens] int32       argmax of the full target logits
        offsets        [samples + 1] int64  sample s is rows offsets[s]:offsets[s+1]

Shard k holds samples ``k*S .. (k+1)*S - 1`` of the dataset, in dataset order. A shard is written to a temporary
name and renamed; `index.json` is rewritten (atomically) after each shard, so an interrupted build resumes at
the first shard the index does not list. The fingerprint covers the token ids of every sample, the capture
indices, the target and the dtype: a cache built for other data or another head is refused, never mixed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from eagle_compile.errors import OptionsError
from eagle_compile.train.data import Sample, TokenBatch, collate, fingerprint
from eagle_compile.train.features import FeatureBatch, FeatureExtractor

FORMAT = "eagle_compile.feature_cache"
VERSION = 1
INDEX = "index.json"


def cache_fingerprint(samples: Sequence[Sample], capture_indices: Sequence[int], target_name: str,
                      dtype: str) -> str:
    key = [fingerprint(samples), list(capture_indices), target_name, dtype]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def build_feature_cache(path: str | Path, make_extractor: Callable[[], FeatureExtractor],
                        samples: Sequence[Sample], *, capture_indices: Sequence[int], hidden_size: int,
                        target_name: str, batch_size: int, shard_samples: int, dtype: str = "float16",
                        pad_multiple: int = 64, progress: bool = True) -> FeatureCache:
    """Write (or finish writing) the cache of ``samples``; returns it opened.

    ``make_extractor`` is called only if a shard is missing (a complete cache never runs the target).
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": cache_fingerprint(samples, capture_indices, target_name, dtype),
        "target": target_name,
        "capture_indices": list(capture_indices),
        "hidden_size": hidden_size,
        "dtype": dtype,
        "num_samples": len(samples),
        "shard_samples": shard_samples,
    }
    index = _read_index(path)
    if index is not None:
        stale = [k for k in meta if index.get(k) != meta[k]]
        if stale:
            raise OptionsError(
                f"{path} holds a feature cache for other data or another head (differs in {stale}); point "
                "--feature-cache at a new folder, or delete this one to rebuild it"
            )
    else:
        index = {**meta, "shards": []}
    done = {s["file"] for s in index["shards"]}
    store = getattr(torch, dtype)
    starts = range(0, len(samples), shard_samples)
    bar = tqdm(total=len(samples), desc="target features", unit="seq", disable=not progress)
    for k, start in enumerate(starts):
        members = samples[start : start + shard_samples]
        name = f"shard_{k:05d}.safetensors"
        if name not in done:
            tensors = _extract_shard(make_extractor(), members, batch_size, pad_multiple, store)
            tmp = path / f".{name}.tmp"
            save_file(tensors, str(tmp))
            os.replace(tmp, path / name)
            index["shards"].append({"file": name, "ids": [s.id for s in members],
                                    "lengths": [len(s) for s in members]})
            _write_index(path, index)
        bar.update(len(members))
    bar.close()
    return FeatureCache(path)


def _extract_shard(extractor: FeatureExtractor, members: Sequence[Sample], batch_size: int, pad_multiple: int,
                   store: torch.dtype) -> dict[str, torch.Tensor]:
    order = sorted(range(len(members)), key=lambda i: len(members[i]))  # similar lengths pad little
    rows: list[torch.Tensor | None] = [None] * len(members)
    argmax: list[torch.Tensor | None] = [None] * len(members)
    for b in range(0, len(order), batch_size):
        chosen = order[b : b + batch_size]
        fb = extractor(collate([members[i] for i in chosen], pad_multiple))
        both = torch.cat([fb.features, fb.last_hidden], dim=-1).to(store).cpu()
        if not bool(torch.isfinite(both).all()):
            raise OverflowError(
                f"target features overflow {store} (max |value| {fb.features.abs().max().item():.3g}); "
                "use cache_dtype='bfloat16' or 'float32' (--cache-dtype)"
            )
        for r, i in enumerate(chosen):
            n = len(members[i])
            rows[i], argmax[i] = both[r, :n], fb.target_argmax[r, :n].cpu()
    lengths = torch.tensor([len(s) for s in members])
    return {
        "hidden": torch.cat(rows).contiguous(),
        "input_ids": torch.cat([s.input_ids for s in members]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in members]),
        "target_argmax": torch.cat(argmax).to(torch.int32),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
    }


def _read_index(path: Path) -> dict | None:
    file = path / INDEX
    if not file.is_file():
        return None
    index = json.loads(file.read_text())
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise OptionsError(f"{file} is not an eagle_compile feature cache (version {VERSION})")
    return index


def _write_index(path: Path, index: dict) -> None:
    tmp = path / f".{INDEX}.tmp"
    tmp.write_text(json.dumps(index) + "\n")
    os.replace(tmp, path / INDEX)


class FeatureCache:
    """A complete cache folder, read shard by shard (the last two shards read stay in memory)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = _read_index(self.path)
        if index is None:
            raise FileNotFoundError(f"{self.path} holds no feature cache ({INDEX} missing)")
        expected = -(-index["num_samples"] // index["shard_samples"])
        if len(index["shards"]) != expected:
            raise OptionsError(
                f"the feature cache {self.path} is incomplete ({len(index['shards'])} of {expected} shards); "
                "run the feature stage again to finish it"
            )
        self.index = index
        self.capture_indices = tuple(index["capture_indices"])
        self.hidden_size = index["hidden_size"]
        self.fingerprint = index["fingerprint"]
        self.shards = sorted(index["shards"], key=lambda s: s["file"])
        self.ids = [i for s in self.shards for i in s["ids"]]
        self.lengths = [n for s in self.shards for n in s["lengths"]]
        self.shard_of = [k for k, s in enumerate(self.shards) for _ in s["ids"]]
        self._first = [0]
        for s in self.shards:
            self._first.append(self._first[-1] + len(s["ids"]))
        self._memo: dict[int, dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def _shard(self, k: int) -> dict[str, torch.Tensor]:
        if k not in self._memo:
            from safetensors.torch import load_file

            if len(self._memo) >= 2:
                self._memo.pop(next(iter(self._memo)))
            self._memo[k] = load_file(str(self.path / self.shards[k]["file"]))
        return self._memo[k]

    def batch(self, positions: Sequence[int], pad_multiple: int = 8) -> FeatureBatch:
        """Samples at ``positions`` (dataset order) as a right-padded `FeatureBatch` in the cache dtype."""
        parts = []
        for i in positions:
            k = self.shard_of[i]
            shard, s = self._shard(k), i - self._first[k]
            a, b = int(shard["offsets"][s]), int(shard["offsets"][s + 1])
            parts.append({name: shard[name][a:b] for name in ("hidden", "input_ids", "loss_mask", "target_argmax")})
        longest = max(p["input_ids"].numel() for p in parts)
        t = -(-longest // pad_multiple) * pad_multiple
        width = len(self.capture_indices) * self.hidden_size
        hidden = torch.zeros(len(parts), t, parts[0]["hidden"].shape[-1], dtype=parts[0]["hidden"].dtype)
        input_ids = torch.zeros(len(parts), t, dtype=torch.int64)
        attention = torch.zeros(len(parts), t, dtype=torch.bool)
        loss = torch.zeros(len(parts), t, dtype=torch.bool)
        argmax = torch.zeros(len(parts), t, dtype=torch.int64)
        for r, p in enumerate(parts):
            n = p["input_ids"].numel()
            hidden[r, :n], input_ids[r, :n], attention[r, :n] = p["hidden"], p["input_ids"], True
            loss[r, :n], argmax[r, :n] = p["loss_mask"], p["target_argmax"]
        tokens = TokenBatch([self.ids[i] for i in positions], input_ids, attention, loss)
        return FeatureBatch(tokens=tokens, features=hidden[..., :width], last_hidden=hidden[..., width:],
                            target_argmax=argmax)
