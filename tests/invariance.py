"""Checks of batch invariance shared by the tiny-model and real-target tests: run one token sequence through a
target program as one-token steps, prefill chunks, the path of verify trees and another row of larger batches,
and report which ways of computing it gave logits or feature taps that differ bit for bit from the one-token
steps."""

from __future__ import annotations

import torch

from eagle_compile.core.masks import SlotMask
from eagle_compile.lowering import Lowering
from eagle_compile.runtime.kv_cache import SlotKVCache
from eagle_compile.runtime.target_program import TargetProgram

SLOTS = 64
LENGTH = 24          # tokens of the test sequence
PREFIX = 8           # committed before the verify tree


def invariant_program(model):
    return TargetProgram(model, None, lowering=Lowering(numerics="batch_invariant"))


def tokens(seed: int, vocab: int, n: int = LENGTH) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


class Sequence:
    """Runs one token sequence (in row `row` of a batch of `batch`, other rows random) through a program."""

    def __init__(self, model, program, tokens: torch.Tensor, *, batch: int = 1, row: int = 0, seed: int = 0):
        self.model, self.program, self.tokens = model, program, tokens
        self.batch, self.row = batch, row
        self.vocab = model.config.vocab_size
        self.cache = SlotKVCache(model.config, batch, SLOTS, dtype=torch.float32, device="cpu")
        self.others = torch.randint(3, self.vocab, (batch, len(tokens)), generator=torch.Generator().manual_seed(seed))

    def call(self, ids_row: torch.Tensor, base: int, positions: torch.Tensor, local: torch.Tensor | None = None):
        """Row `row` gets `ids_row` at slots base.. (positions given); other rows get their own tokens."""
        t = len(ids_row)
        ids = self.others[:, base:base + t].clone() if base + t <= len(self.tokens) else \
            torch.randint(3, self.vocab, (self.batch, t), generator=torch.Generator().manual_seed(base))
        ids[self.row] = ids_row
        pos = (base + torch.arange(t)).expand(self.batch, t).clone()
        pos[self.row] = positions
        bases = torch.full((self.batch,), base, dtype=torch.long)
        loc = None if local is None else local.expand(self.batch, -1, -1)
        mask = SlotMask(bases, loc, SLOTS) if loc is not None else SlotMask.causal(bases, SLOTS)
        slots = (base + torch.arange(t)).expand(self.batch, t)
        logits, taps = self.program(ids, pos, mask, slots, self.cache)
        return logits[self.row], taps[self.row]

    def in_chunks(self, n: int):
        """Logits and taps of every position, the prompt run in chunks of n tokens."""
        outs = [self.call(self.tokens[s:s + n], s, torch.arange(s, min(s + n, LENGTH)))
                for s in range(0, LENGTH, n)]
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    def tree(self, width: int):
        """Prefix in one chunk, then positions PREFIX.. verified as the path of a tree of `width` nodes: path
        nodes at even block slots, decoys (other tokens, siblings) at odd ones."""
        self.call(self.tokens[:PREFIX], 0, torch.arange(PREFIX))
        path = list(range(0, width, 2))
        ids = torch.randint(3, self.vocab, (width,), generator=torch.Generator().manual_seed(width))
        depth = torch.zeros(width, dtype=torch.long)
        local = torch.zeros(1, width, width, dtype=torch.bool)
        for d, j in enumerate(path):
            ids[j] = self.tokens[PREFIX + d]
            depth[j] = d
            local[0, j, path[:d + 1]] = True
            if j + 1 < width:                       # a decoy child of the previous path node
                depth[j + 1] = d
                local[0, j + 1, path[:d] + [j + 1]] = True
        logits, taps = self.call(ids, PREFIX, PREFIX + depth, local)
        return logits[path], taps[path], len(path)


def invariance_failures(model, program, *, chunks=(2, 8, LENGTH), trees=(4, 16),
                        batches=((2, 1), (8, 7))) -> list[str]:
    """Names of the ways of computing the sequence whose logits or taps differ from one-token steps: prefill in
    `chunks` of n tokens, the path of verify `trees` of w nodes, row r of a batch of b (`batches`, prefill in
    chunks of 8)."""
    seq = Sequence(model, program, tokens(1, model.config.vocab_size))
    ref_logits, ref_taps = seq.in_chunks(1)                 # decoded one token at a time
    failures = []

    def check(name, logits, taps, at=slice(None)):
        if not (torch.equal(logits, ref_logits[at]) and torch.equal(taps, ref_taps[at])):
            failures.append(name)

    for n in chunks:
        logits, taps = Sequence(model, program, seq.tokens).in_chunks(n)
        check(f"prefill chunks of {n}", logits, taps)
    for width in trees:
        logits, taps, k = Sequence(model, program, seq.tokens).tree(width)
        check(f"verify tree of {width}", logits, taps, slice(PREFIX, PREFIX + k))
    for batch, row in batches:
        logits, taps = Sequence(model, program, seq.tokens, batch=batch, row=row, seed=batch).in_chunks(8)
        check(f"row {row} of batch {batch}", logits, taps)
    return failures
