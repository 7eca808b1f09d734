"""The copy branch's proposals: prompt lookup over a row's own tokens (the prompt and the output so far).

A row whose last n tokens occurred earlier in its history proposes the tokens that followed that earlier
occurrence: the most recent one, for the longest n in [min_ngram, max_ngram] that has a match (the n-gram
proposer of HF's `prompt_lookup_num_tokens` and vLLM's `ngram` method, in spirit). The proposals become a
branch of the cycle's tree (`core/tree.with_copy_branch`) and are verified like every other node, so copied
spans may hold tokens outside the draft vocabulary (d2t) and runs longer than the draft's depth.

Host-side and incremental: each row keeps, per n, the latest start of every n-gram that has at least one token
after it, so a cycle costs O(new tokens x n) dict updates and one lookup per n; no device work, no extra host
read (the tokens are the ones the cycle's one read already brought back).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RowLookup:
    """One row's history and n-gram index."""

    max_ngram: int
    min_ngram: int
    tokens: list[int] = field(default_factory=list)
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)   # n -> gram -> latest start

    def extend(self, new: list[int]) -> None:
        """Append tokens; index every n-gram that now has a successor."""
        old = len(self.tokens)
        self.tokens.extend(int(t) for t in new)
        T = len(self.tokens)
        for n in range(self.min_ngram, self.max_ngram + 1):
            grams = self.index.setdefault(n, {})
            # starts j with j + n <= T - 1 are eligible; the ones that became eligible now: old - n .. T - 1 - n
            for j in range(max(0, old - n), T - n):
                grams[tuple(self.tokens[j:j + n])] = j

    def propose(self, length: int) -> list[int]:
        """Up to `length` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        return self.match(length)[0]

    def match(self, length: int) -> tuple[list[int], int]:
        """(the proposal, the length n of the suffix it matched; 0: no match)."""
        T = len(self.tokens)
        for n in range(min(self.max_ngram, T - 1), self.min_ngram - 1, -1):
            start = self.index.get(n, {}).get(tuple(self.tokens[T - n:]))
            if start is not None:
                return self.tokens[start + n:start + n + length], n
        return [], 0


class PromptLookup:
    """The copy branch's proposer for a batch: one `RowLookup` per row."""

    def __init__(self, length: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.length, self.max_ngram, self.min_ngram = length, max_ngram, min_ngram
        self.rows: list[RowLookup] = []
        self._prompt: list[int] = []
        self.lengths: list[int] = []       # the last proposals' real lengths (their -1 padding left out)

    def begin(self, prompts: list[list[int]]) -> None:
        """A new call: index each row's prompt."""
        self.rows, self._prompt = [], [len(p) for p in prompts]
        for p in prompts:
            row = RowLookup(self.max_ngram, self.min_ngram)
            row.extend(p)
            self.rows.append(row)

    def replace(self, row: int, prompt: list[int]) -> None:
        """A new request in `row` (a running batch, `runtime/session.py`): index its prompt alone."""
        lookup = RowLookup(self.max_ngram, self.min_ngram)
        lookup.extend(prompt)
        self.rows[row], self._prompt[row] = lookup, len(prompt)

    def select(self, index: list[int], live: list[bool]) -> None:
        """The batch regrouped: new row i is old row index[i] where live[i], else an empty padding row."""
        self.rows = [self.rows[i] if on else RowLookup(self.max_ngram, self.min_ngram)
                     for i, on in zip(index, live, strict=True)]
        self._prompt = [self._prompt[i] if on else 0 for i, on in zip(index, live, strict=True)]

    def proposals(self, generated: list[list[int]], active: list[bool]) -> tuple[list[list[int]], list[int]]:
        """Each row's proposal ([B][length], -1 padded; inactive rows and rows with no match: all -1) and the
        length of the n-gram it matched (0: none), after indexing the tokens each row generated since the last
        call (`generated[b]` only grows)."""
        out, ngram, self.lengths = [], [], []
        for row, prompt, gen, on in zip(self.rows, self._prompt, generated, active, strict=True):
            seen = len(row.tokens) - prompt
            if len(gen) > seen:
                row.extend(gen[seen:])
            got, n = row.match(self.length) if on else ([], 0)
            out.append(got + [-1] * (self.length - len(got)))
            ngram.append(n if got else 0)
            self.lengths.append(len(got))
        return out, ngram
