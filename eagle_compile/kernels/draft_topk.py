"""`eagle31::draft_topk`: draft lm_head over the draft vocabulary, log-softmax top-k, d2t mapping.

Each draft step needs only the k best draft tokens of every frontier node and their log-probabilities (the
tree's scores, EAGLE31_SPEC.md §4.3), never the `[N, Vd]` logits. On CUDA they are not materialised:

1. `_draft_topk_tiles_kernel`, grid (row blocks, Vd tiles): the logits tile `[BLOCK_M, BLOCK_V]` =
   normed @ lm_head_tile^T (fp32 accumulation); per row it writes the tile's max and sum of exp (for the
   log-softmax normaliser) and the tile's own top-k candidates (value, draft id).
2. `_draft_topk_merge_kernel`, one program per row: logsumexp over the tile partials, top-k over the
   n_tiles * k candidates, logp = logit - lse, target id = draft id + d2t[draft id].

Scratch is `n_tiles * (2 + 2k)` numbers per row instead of Vd logits.

Ties: equal logits are ordered by lower draft id first, in both the kernel (each selection takes the smallest
id among the maxima) and the reference (a stable sort), so the outputs are deterministic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle_compile.kernels import _dispatch

tl = None  # triton.language, bound by _dispatch.kernel on first launch

_NO_ID = 2**31 - 1  # larger than any draft id: loses every tie, marks empty candidate slots


def _draft_topk_tiles_kernel(
    x_ptr, w_ptr, tmax_ptr, tsum_ptr, cval_ptr, cid_ptr,
    sx_n, sx_k, sw_v, sw_k,
    N, H, VD, N_TILES,
    K: tl.constexpr, NO_ID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    vids = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = vids < VD
    kk = tl.arange(0, BLOCK_K)

    acc = tl.full([BLOCK_M, BLOCK_V], 0.0, tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = k0 + kk < H
        x = tl.load(x_ptr + rows[:, None] * sx_n + (k0 + kk)[None, :] * sx_k,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + vids[:, None].to(tl.int64) * sw_v + (k0 + kk)[None, :] * sw_k,
                    mask=v_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_F32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
    logits = tl.where(v_ok[None, :], acc, float("-inf"))

    # every tile holds at least one real column, so tile_max is finite
    tile_max = tl.reduce(logits, 1, tl.standard._elementwise_max)
    tile_sum = tl.reduce(tl.exp(logits - tile_max[:, None]), 1, tl.standard._sum_combine)
    part = rows * N_TILES + pid_v
    tl.store(tmax_ptr + part, tile_max, mask=row_ok)
    tl.store(tsum_ptr + part, tile_sum, mask=row_ok)

    ids = tl.where(v_ok, vids, NO_ID)[None, :] + tl.full([BLOCK_M, BLOCK_V], 0, tl.int32)
    for i in tl.static_range(K):
        best = tl.reduce(logits, 1, tl.standard._elementwise_max)
        pick = tl.reduce(tl.where(logits == best[:, None], ids, NO_ID), 1, tl.standard._elementwise_min)
        pick = tl.where(best == float("-inf"), NO_ID, pick)  # tile exhausted (fewer than K real columns)
        tl.store(cval_ptr + part * K + i, best, mask=row_ok)
        tl.store(cid_ptr + part * K + i, pick, mask=row_ok)
        logits = tl.where(ids == pick[:, None], float("-inf"), logits)


def _draft_topk_merge_kernel(
    tmax_ptr, tsum_ptr, cval_ptr, cid_ptr, d2t_ptr, logp_ptr, did_ptr, tid_ptr,
    s_d2t, slp_n, slp_k, sdi_n, sdi_k, sti_n, sti_k,
    N_TILES,
    K: tl.constexpr, NO_ID: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    t_ok = t < N_TILES
    tmax = tl.load(tmax_ptr + row * N_TILES + t, mask=t_ok, other=float("-inf"))
    tsum = tl.load(tsum_ptr + row * N_TILES + t, mask=t_ok, other=0.0)
    gmax = tl.reduce(tmax, 0, tl.standard._elementwise_max)
    lse = gmax + tl.log(tl.reduce(tsum * tl.exp(tmax - gmax), 0, tl.standard._sum_combine))

    c = tl.arange(0, BLOCK_C)
    c_ok = c < N_TILES * K
    vals = tl.load(cval_ptr + row * N_TILES * K + c, mask=c_ok, other=float("-inf"))
    ids = tl.load(cid_ptr + row * N_TILES * K + c, mask=c_ok, other=NO_ID)
    for i in tl.static_range(K):
        best = tl.reduce(vals, 0, tl.standard._elementwise_max)
        pick = tl.reduce(tl.where(vals == best, ids, NO_ID), 0, tl.standard._elementwise_min)
        # a row without a comparable logit (NaN/inf, e.g. a poisoned padding row) still emits a valid id (0):
        # an out-of-range id would fault the embedding lookup of the next draft step
        safe = tl.where(pick == NO_ID, 0, pick).to(tl.int64)
        offset = tl.load(d2t_ptr + safe * s_d2t)
        tl.store(logp_ptr + row * slp_n + i * slp_k, best - lse)
        tl.store(did_ptr + row * sdi_n + i * sdi_k, safe)
        tl.store(tid_ptr + row * sti_n + i * sti_k, safe + offset)
        vals = tl.where(ids == pick, float("-inf"), vals)


def _check(normed: torch.Tensor, lm_head_weight: torch.Tensor, d2t: torch.Tensor, k: int) -> None:
    if lm_head_weight.dim() != 2 or normed.dim() < 1 or normed.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(f"draft_topk: normed {tuple(normed.shape)} [..., H] does not fit lm_head_weight "
                         f"{tuple(lm_head_weight.shape)} [Vd, H]")
    vd = lm_head_weight.shape[0]
    if d2t.shape != (vd,) or d2t.dtype != torch.int64:
        raise ValueError(f"draft_topk: d2t {tuple(d2t.shape)} {d2t.dtype} should be int64 offsets "
                         f"[Vd] = [{vd}]")
    if not 1 <= k <= vd:
        raise ValueError(f"draft_topk: k={k}; need 1 <= k <= draft vocabulary size {vd}")
    if normed.dtype != lm_head_weight.dtype:
        raise ValueError(f"draft_topk: normed is {normed.dtype} but lm_head_weight is "
                         f"{lm_head_weight.dtype}; cast them to one dtype")


def draft_topk_reference(normed: torch.Tensor, lm_head_weight: torch.Tensor, d2t: torch.Tensor,
                         k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of log_softmax(normed @ lm_head^T) over the draft vocabulary, mapped to target ids.

    Args:
        normed: [..., H] the draft's final-norm output.
        lm_head_weight: [Vd, H] the draft lm_head, normed's dtype.
        d2t: [Vd] int64 offsets: target id of draft id j = j + d2t[j].
        k: how many tokens per row, 1 <= k <= Vd.

    Returns:
        logp [..., k] fp32 log-probabilities, descending (equal values: lower draft id first);
        draft_ids [..., k] int64; target_ids [..., k] int64.
    """
    _check(normed, lm_head_weight, d2t, k)
    logits = F.linear(normed.float(), lm_head_weight.float())  # [..., Vd], fp32 like the kernel's accumulator
    draft_ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]
    logp = logits.gather(-1, draft_ids) - torch.logsumexp(logits, dim=-1, keepdim=True)
    return logp, draft_ids, draft_ids + d2t[draft_ids]


def draft_topk_triton(normed: torch.Tensor, lm_head_weight: torch.Tensor, d2t: torch.Tensor, k: int, *,
                      out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                      interpret: bool | None = None, block_m: int | None = None, block_v: int | None = None,
                      block_k: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the two Triton kernels.

    Args:
        normed: [..., H] fp16/bf16/fp32, any strides.
        lm_head_weight: [Vd, H], normed's dtype.
        d2t: [Vd] int64 offsets.
        k: 1 <= k <= Vd (a compile-time constant of the kernels: one specialisation per k).
        out: optional (logp [..., k] fp32, draft_ids [..., k] int64, target_ids [..., k] int64) buffers.
        interpret: run through the Triton interpreter; default: unless the tensors are on CUDA.
        block_m: rows per program, default min(64, next pow2 of N), at least 16 (GPU tl.dot minimum).
        block_v: draft-vocabulary tile; default 128, doubled until there are at most 512 tiles (the merge
            kernel holds all n_tiles * k candidates of a row at once).
        block_k: hidden-size tile.

    Returns:
        (logp, draft_ids, target_ids) as in `draft_topk_reference`.
    """
    _check(normed, lm_head_weight, d2t, k)
    if interpret is None:
        interpret = normed.device.type != "cuda" or _dispatch.interpreter_requested()
    x = normed.reshape(-1, normed.shape[-1])  # [N, H]
    n, h = x.shape
    vd = lm_head_weight.shape[0]
    if block_v is None:
        block_v = 128
        while _dispatch.cdiv(vd, block_v) > 512:
            block_v *= 2
    if block_m is None:
        block_m = min(64, max(16, _dispatch.next_power_of_2(n)))
    n_tiles = _dispatch.cdiv(vd, block_v)
    shape = (*normed.shape[:-1], k)
    dev = normed.device
    if out is None:
        out = (torch.empty(shape, dtype=torch.float32, device=dev),
               torch.empty(shape, dtype=torch.int64, device=dev),
               torch.empty(shape, dtype=torch.int64, device=dev))
    logp, draft_ids, target_ids = (o.view(n, k) for o in out)
    tile_max = torch.empty(n, n_tiles, dtype=torch.float32, device=dev)
    tile_sum = torch.empty(n, n_tiles, dtype=torch.float32, device=dev)
    cand_val = torch.empty(n, n_tiles, k, dtype=torch.float32, device=dev)
    cand_id = torch.empty(n, n_tiles, k, dtype=torch.int32, device=dev)

    _dispatch.kernel(_draft_topk_tiles_kernel, interpret)[(_dispatch.cdiv(n, block_m), n_tiles)](
        x, lm_head_weight, tile_max, tile_sum, cand_val, cand_id,
        *x.stride(), *lm_head_weight.stride(),
        n, h, vd, n_tiles,
        K=k, NO_ID=_NO_ID, BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_K=block_k,
        DOT_F32=_dispatch.dot_in_fp32(normed.dtype, interpret),
    )
    _dispatch.kernel(_draft_topk_merge_kernel, interpret)[(n,)](
        tile_max, tile_sum, cand_val, cand_id, d2t, logp, draft_ids, target_ids,
        d2t.stride(0), *logp.stride(), *draft_ids.stride(), *target_ids.stride(),
        n_tiles,
        K=k, NO_ID=_NO_ID, BLOCK_T=_dispatch.next_power_of_2(n_tiles),
        BLOCK_C=_dispatch.next_power_of_2(n_tiles * k),
    )
    return out


@torch.library.custom_op("eagle31::draft_topk", mutates_args=())
def draft_topk(normed: torch.Tensor, lm_head_weight: torch.Tensor, d2t: torch.Tensor,
               k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp [..., k] fp32, draft_ids [..., k], target_ids [..., k]) of the draft lm_head (module doc)."""
    choice = _dispatch.choose(normed.device, normed.dtype)
    if choice.impl == _dispatch.REFERENCE:
        return tuple(t.contiguous() for t in draft_topk_reference(normed, lm_head_weight, d2t, k))
    return draft_topk_triton(normed, lm_head_weight, d2t, k, interpret=choice.impl == _dispatch.INTERPRETER)


@draft_topk.register_fake
def _(normed, lm_head_weight, d2t, k):
    _check(normed, lm_head_weight, d2t, k)
    shape = (*normed.shape[:-1], k)
    return (normed.new_empty(shape, dtype=torch.float32), normed.new_empty(shape, dtype=torch.int64),
            normed.new_empty(shape, dtype=torch.int64))
