"""One speculative cycle as a device-side function: draft -> verify -> accept -> commit.

`SpeculativeStep.__call__` reads and writes only tensors (the row state, both KV caches, pre-drawn uniforms)
and contains no host synchronisation, so the whole cycle can be captured by dynamo as one graph
(`fullgraph=True` fails on any `.item()`, `.tolist()` or data-dependent shape) and lowered: the step program of
DESIGN.md §2. The host reads `StepOutput` once per cycle to apply stops.

The target forward is a strategy: the unlowered path calls the separately captured `TargetProgram`; inside the
captured step program the model is traced inline and `feature_taps` marks where the capture-index features are
needed, which the `tap_features` pass resolves to the residual streams that `locate_layers` found.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eagle_compile.core.masks import SlotMask
from eagle_compile.core.tree import TreeShape, root_tree, with_copy_branch
from eagle_compile.core.verify import verify_greedy, verify_sample
from eagle_compile.draft.drafter import Drafter
from eagle_compile.draft.drift import DriftProbe
from eagle_compile.draft.tree import build_tree
from eagle_compile.runtime.logits_processors import TokenHistory, process_nodes
from eagle_compile.runtime.sampling import SamplingParams, SamplingValues, target_probs

TargetForward = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StepState:
    """Per-row state between cycles (static buffers, updated in place by the step)."""

    n: torch.Tensor              # [B] committed sequence length (root included)
    root: torch.Tensor           # [B] last emitted token, not yet seen by the target
    seed_feedback: torch.Tensor  # [B, H] draft feedback at position n-2
    seed_head: torch.Tensor      # [B, H] draft head input at position n-2
    active: torch.Tensor         # [B] bool: rows still generating (frozen rows keep their n)
    drafting: torch.Tensor | None = None   # [B] bool: rows whose draft nodes may be accepted (calibration)
    floor: torch.Tensor | None = None      # [B] float: nodes with a lower cumulative log-prob are masked
    copy: torch.Tensor | None = None       # [B, L] copy-branch proposals (draft/lookup.py), -1 = none
    history: TokenHistory | None = None    # the tokens HF's logits processors read (SamplingParams.processors)


#: the `StepState` fields a prefill sets per row (the rest are the calibration's and the copy branch's)
PREFILL_FIELDS = ("n", "root", "seed_feedback", "seed_head")


def put_rows(state: StepState, new: StepState, rows: list[int]) -> None:
    """Rows `rows` of `state` take the prefill state of rows 0..len(rows)-1 of `new` (`PREFILL_FIELDS`)."""
    on = torch.tensor(rows, device=state.n.device)
    for name in PREFILL_FIELDS:
        getattr(state, name)[on] = getattr(new, name)[:len(rows)]


@dataclass
class StepOutput:
    accept_len: torch.Tensor     # [B] accepted draft tokens a
    tokens: torch.Tensor         # [B, D+1] emitted: accepted draft tokens, bonus at index a, -1 after
    confidence: torch.Tensor | None = None   # [B, D] the best cumulative draft probability at each depth
    features: torch.Tensor | None = None     # [B, 1, A*Ht] a plain step's target features (draft re-sync)
    drift: torch.Tensor | None = None        # [B, 4, D] drift monitors (draft/drift.py NAMES), when collected
    copied: torch.Tensor | None = None       # [B] accepted tokens that came from the copy branch
    finite: torch.Tensor | None = None       # [B] leading emitted tokens decided by usable logits (finite_prefix)


@dataclass
class CycleRead:
    """A cycle's outcome on the host (`read_cycle`), per row: `StepOutput`'s fields as Python values."""

    accept_len: list[int]
    tokens: list[list[int]]      # emitted: accepted draft tokens, the bonus token at index accept_len, -1 after
    finite: list[int]
    copied: list[int] | None
    extra: torch.Tensor | None   # [B, E] int64 on the CPU: the caller's own columns

    @property
    def healthy(self) -> list[bool]:
        """Rows whose whole emitted block was decided by usable logits."""
        return [f > a for f, a in zip(self.finite, self.accept_len, strict=True)]


def read_cycle(out: StepOutput, extra: torch.Tensor | None = None) -> CycleRead:
    """The cycle's one host read: every per-row result of `out` (and `extra` [B, E] int64) packed into one int64
    tensor, so the host synchronises once per cycle whatever it reads."""
    columns = [out.accept_len[:, None], out.finite[:, None], out.tokens]
    columns += ([] if out.copied is None else [out.copied[:, None]]) + ([] if extra is None else [extra])
    read = torch.cat(columns, 1).cpu()
    t = 2 + out.tokens.shape[1]
    c = t + (out.copied is not None)
    return CycleRead(accept_len=read[:, 0].tolist(), finite=read[:, 1].tolist(), tokens=read[:, 2:t].tolist(),
                     copied=None if out.copied is None else read[:, t].tolist(),
                     extra=None if extra is None else read[:, c:])


@torch.library.custom_op("eagle31::feature_taps", mutates_args=())
def feature_taps(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Marks, inside a traced step, where the target's capture-index features [B, T, width] are used."""
    raise RuntimeError("eagle31::feature_taps only exists inside a captured step program: the tap_features pass "
                       "replaces it with the target's residual streams before the graph runs")


@feature_taps.register_fake
def _(logits, width):
    return logits.new_empty(logits.shape[0], logits.shape[1], width)


def traced_target_forward(model: torch.nn.Module, feature_width: int) -> TargetForward:
    """Target forward for tracing into a step program: logits from the model, features from `feature_taps`."""

    def forward(tokens, positions, mask, write_slots, cache):
        dense = mask.dense(tokens.shape[1], cache.layers[0].keys.dtype)     # removed by the tree_attention pass
        logits = model(input_ids=tokens, position_ids=positions, attention_mask=dense, cache=cache,
                       write_slots=write_slots, use_cache=True).logits
        return logits, feature_taps(logits, feature_width)

    return forward


class SpeculativeStep:
    """The device-side cycle for one tree shape and one sampling structure (both static); with `values` the
    sampling numbers are run-time tensors (`runtime/sampling.py`), else `sampling`'s own."""

    def __init__(self, drafter: Drafter, shape: TreeShape, sampling: SamplingParams,
                 target_forward: TargetForward, *, timings: dict[str, float] | None = None,
                 drift: bool = False, values: SamplingValues | None = None) -> None:
        self.drafter = drafter
        self.drift = drift              # collect the drift monitors (draft/drift.py) into StepOutput.drift
        self.shape = shape
        self.sampling = sampling
        self.values = values            # the sampling numbers as tensors: `sampling` is then only the structure
        self.target_forward = target_forward
        # Host-clock split of the cycle (draft / verify / accept), accumulated when given; only for the eager
        # step (a captured step is one program). Exact on CPU; on CUDA only the whole cycle, which ends in a
        # host read, is timed faithfully.
        self.timings = timings

    def _mark(self, phase: str, since: float) -> float:
        """Add the time since ``since`` to ``phase``; no clock read at all without timings (traced steps)."""
        if self.timings is None:
            return since
        now = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - since
        return now

    def __call__(self, state: StepState, cache, draft_kv, uniforms: torch.Tensor,
                 final_uniform: torch.Tensor) -> StepOutput:
        shape, d_slots = self.shape, cache.slots      # the draft cache has as many slots as the target's
        active = state.active
        t = time.perf_counter() if self.timings is not None else 0.0
        probe = DriftProbe() if self.drift and shape.depth else None
        if shape.depth:
            tree = build_tree(self.drafter, draft_kv, state.seed_feedback, state.seed_head, state.root, state.n,
                              shape, d_slots, active, probe=probe)
        else:
            tree = root_tree(state.root)
        confidence = depth_confidence(tree)           # the draft's nodes only
        if shape.copy:
            if state.copy is None or state.copy.shape[1] != shape.copy:
                raise ValueError(f"a tree with a copy branch of {shape.copy} nodes needs StepState.copy "
                                 f"[B, {shape.copy}] (draft/lookup.py fills it before each cycle)")
            tree = with_copy_branch(tree, state.copy)
        t = self._mark("draft", t)
        base = state.n - 1
        positions = base[:, None] + tree.depth
        nodes = torch.arange(shape.nodes, device=base.device)
        if state.drafting is not None:      # calibration: rows in fallback and low-confidence nodes are masked
            keep = state.drafting[:, None] & (tree.scores >= state.floor[:, None])
            tree = dataclasses.replace(tree, valid=tree.valid & (keep | (nodes == 0)))
        write = torch.where(active[:, None], base[:, None] + nodes, cache.slots - 1)   # inactive: sentinel only
        mask = SlotMask.tree(tree.ancestors, base, cache.slots)
        logits, feats = self.target_forward(tree.tokens, positions, mask, write, cache)
        t = self._mark("verify", t)
        acc = self._verify(tree, self._scores(logits.float(), state, tree), uniforms, final_uniform)
        if not in_place_paths(shape):               # a chain's accepted path already sits in slots base..base+a
            identity = torch.arange(shape.span + 1, device=base.device).expand_as(acc.path)
            cache.compact(base, torch.where(active[:, None], acc.path, identity))   # inactive rows: a no-op move
        t = self._mark("accept", t)
        a = acc.accept_len
        path_feats = feats.gather(1, acc.path[:, :, None].expand(-1, -1, feats.shape[-1]))
        feedback, head = catch_up(self.drafter, draft_kv, d_slots, path_feats, acc.tokens.clamp(min=0), base,
                                  torch.where(active, base + a, base - 1))
        state.seed_feedback.copy_(feedback)
        state.seed_head.copy_(head)
        state.root.copy_(acc.tokens.gather(1, a[:, None])[:, 0])
        state.n.copy_(torch.where(state.active, state.n + a + 1, state.n))
        if state.history is not None:
            state.history.append(acc.tokens, torch.where(active, a + 1, 0))
        self._mark("draft", t)
        copied = torch.where(acc.path[:, 1] >= shape.total_tokens, a, 0) if shape.copy else None
        return StepOutput(accept_len=a, tokens=acc.tokens, confidence=confidence,
                          drift=None if probe is None else probe.stacked(shape.depth, state.seed_feedback),
                          copied=copied, finite=finite_prefix(logits, acc.path))

    def _scores(self, logits: torch.Tensor, state: StepState, tree) -> torch.Tensor:
        """[B, M, V] the scores verification compares: HF's logits processors applied per node, when set."""
        if self.sampling.processors is None:
            return logits
        return process_nodes(logits, self.sampling.processors, state.history, tree)

    def _verify(self, tree, logits, uniforms, final_uniform):
        if not self.sampling.do_sample:
            return verify_greedy(tree, logits)
        return verify_sample(tree, target_probs(logits, self.sampling, self.values), uniforms, final_uniform)


def in_place_paths(shape: TreeShape) -> bool:
    """Whether every accepted path of `shape` is nodes 0, 1, ..., a in order (a chain: each node the child of the
    one before it, in the pool's topological order; or a copy branch alone), so its K/V is already in slots
    base..base+a and compaction would move nothing a later query reads (slots past base+a are rewritten by the
    next cycle before they are read). A chain cycle so skips a gather and a scatter per K and V buffer of every
    layer."""
    if shape.depth == 0:
        return True
    return shape.copy == 0 and shape.top_k == 1 and shape.total_tokens == shape.depth + 1


def usable_logits(logits: torch.Tensor) -> torch.Tensor:
    """[...] bool over `logits [..., V]`: no NaN and no +inf (NaN < inf is False, as is +inf < inf). -inf is a
    token of probability 0, which a model may output on purpose."""
    return (logits < math.inf).all(-1)


def finite_prefix(logits: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """[B] how many of a cycle's emitted tokens were decided by usable target logits. Emitted token j comes from
    the logits at path node j (greedy: their argmax; sampling: the distribution it is accepted or drawn from),
    so the count is the leading run of usable path nodes (finite logits are right: a masked slot adds 0 times a
    finite value). A healthy row gives `P`. Nodes off the path decide nothing, but one whose K/V went NaN still
    poisons every node of its row in the same forward (a masked attention weight is 0, and 0 * NaN is NaN): a
    row whose draft proposes a token with a NaN forward ends too, where plain decoding would have gone on.

    Args:
        logits: [B, M, V] the target's logits at the forward's nodes (only the path's are read).
        path: [B, P] the nodes whose logits decided the emitted tokens (`Acceptance.path`).
    """
    at_path = logits.gather(1, path[:, :, None].expand(-1, -1, logits.shape[-1]))     # [B, P, V]
    return usable_logits(at_path).long().cumprod(1).sum(1)


def depth_confidence(tree) -> torch.Tensor:
    """[B, D] the largest cumulative draft probability among each depth's nodes (0 where a depth has none)."""
    B = tree.scores.shape[0]
    best = torch.full((B, tree.max_depth + 1), -torch.inf, dtype=tree.scores.dtype, device=tree.scores.device)
    best = best.scatter_reduce(1, tree.depth, tree.scores, reduce="amax")
    return best[:, 1:].exp()


def fill_draft(drafter: Drafter, draft_kv, d_slots: int, features: torch.Tensor, tokens: torch.Tensor,
               base: torch.Tensor, last: torch.Tensor) -> None:
    """The K/V half of `catch_up`, for columns whose outputs nobody reads (a prompt's catch-up before its last
    position): the draft KV of pairs (feature at base+j, token at base+j+1), j = 0..last-base, and nothing else.

    Args: as `catch_up`.
    """
    pos = base[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
    real = pos <= last[:, None]
    drafter.fill(draft_kv, features, tokens, torch.where(real, pos, 0), torch.where(real, pos, d_slots - 1))


def catch_up(drafter: Drafter, draft_kv, d_slots: int, features: torch.Tensor, tokens: torch.Tensor,
             base: torch.Tensor, last: torch.Tensor, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-sync the draft from the target: pairs (feature at base+j, token at base+j+1) for j = 0..last-base,
    written to draft slots base+j (columns past `last` are padding and write the sentinel). Returns the
    feedback and head input at position `last`.

    Args:
        features: [B, T, A*Ht]; tokens: [B, T]; base: [B] position of column 0; last: [B] last real position
            (last < base: no real column, the row writes only the sentinel and its returned seeds are unused).
        chunk: columns per draft forward (None: all at once).
    """
    fb, head = catch_up_columns(drafter, draft_kv, d_slots, features, tokens, base, last, chunk)
    return at_last(fb, base, last), at_last(head, base, last)


def at_last(columns: torch.Tensor, base: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[B, H] each row's column at position `last` of `columns [B, T, H]` whose column 0 sits at `base`."""
    idx = (last - base).clamp(min=0)[:, None, None]
    return columns.gather(1, idx.expand(-1, 1, columns.shape[-1]))[:, 0]


def catch_up_columns(drafter: Drafter, draft_kv, d_slots: int, features: torch.Tensor, tokens: torch.Tensor,
                     base: torch.Tensor, last: torch.Tensor, chunk: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`catch_up`'s forward, returning the feedback and head input of every column ([B, T, H] each): column j's
    head input is the draft's state after token base+j+1, from which it proposes token base+j+2 (what a
    depth-1 draft level would propose there)."""
    span = tokens.shape[1]
    chunk = chunk or span
    fbs, heads = [], []
    for start in range(0, span, chunk):
        cols = torch.arange(start, min(start + chunk, span), device=tokens.device)
        pos = base[:, None] + cols
        real = pos <= last[:, None]
        mask = SlotMask.causal(base + start, d_slots)
        write = torch.where(real, pos, d_slots - 1)
        fb, head = drafter.forward(draft_kv, features[:, start:start + len(cols)], tokens[:, start:start + len(cols)],
                                   torch.where(real, pos, 0), write, mask, fuse=True)
        fbs.append(fb)
        heads.append(head)
    return torch.cat(fbs, 1), torch.cat(heads, 1)
