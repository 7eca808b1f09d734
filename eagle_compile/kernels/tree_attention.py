"""`eagle31::tree_attention`: a block of new tokens attends over a static slot cache, reading only its live part.

The T query tokens of row b occupy the cache slots that start at `base[b]` (a prefill chunk, a one-token step,
a verify tree of T nodes, a draft tree level). Query i sees

* every committed slot `s < base[b]` (the prefix), and
* block slot `base[b] + j` (0 <= j < W) when `local[b, i, j]` (its tree ancestors and itself); `local=None`
  is a causal block (W = T, j <= i): prefill chunks, one-token steps, the draft's catch-up.

Nothing else is visible, and nothing else is read: slots at or past `base[b] + W` are never loaded, so the cost
follows the live context, not the cache's allocated size S (a cache sized for 8K tokens costs a 300-token
conversation what 300 tokens cost). `slot_mask` is the same visibility written as the dense additive
`[B, 1, T, S]` mask HF models take: the traced program builds it for the model and the `tree_attention` pass
proves it redundant, replacing each masked SDPA whose mask is a `slot_mask` with this op.

Implementations:

* CPU: two calls of torch's CPU flash attention, one over the prefix (no
  mask when every row has the same base) and one over the block (`is_causal` or the local mask), merged by
  their log-sum-exp. Grouped-query heads are handled by the flash kernel itself: K/V are never repeated to the
  query-head count. The prefix length is read on the host (free for CPU tensors). Other devices without
  Triton (or float64) run the dense reference.
* CUDA: one Triton kernel. The G = Hq / Hkv query heads sharing a KV head are packed into the rows of one tile
  (row = g * T + t), so K/V are read once per KV head; the prefix loop runs to `base[b]`, read on the device
  (no host synchronisation: CUDA-graph safe). Flash-style online softmax in fp32 (exp2, log2(e) folded into
  the scale).

A query that sees nothing gives 0 (like torch's SDPA with an all -inf mask row on CPU); `tree_attention_reference`
is the dense oracle the tests compare both against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eagle_compile.core.masks import block_width, visible_slots
from eagle_compile.kernels import _dispatch

tl = None  # triton.language, bound by _dispatch.kernel on first launch

MAX_HEAD_DIM = 256


def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, base_ptr, local_ptr, out_ptr,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    sv_b, sv_h, sv_s, sv_d,
    sl_b, sl_t, sl_w,
    so_b, so_h, so_t, so_d,
    T, W, HD, HKV, qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    hkv = (pid_bh % HKV).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (group member g, query t)
    row_ok = rows < GROUP * T
    g = rows // T
    t = rows % T
    hq = hkv * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HD
    base = tl.load(base_ptr + b)

    q = tl.load(q_ptr + b * sq_b + hq[:, None] * sq_h + t[:, None] * sq_t + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_row = k_ptr + b * sk_b + hkv * sk_h
    v_row = v_ptr + b * sv_b + hkv * sv_h

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    # One loop over the prefix tiles (slots [0, base), visible to every query of the row), then the block's
    # tiles (slots base + j, j < W: causal, or as the local mask says). `n_pre` rounds the prefix up to whole
    # tiles, so each tile is entirely prefix or entirely block.
    n_pre = ((base + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    for start in range(0, n_pre + W, BLOCK_N):
        u = start + tl.arange(0, BLOCK_N)
        in_pre = start < n_pre
        j = u - n_pre                                   # block offset (meaningful in block tiles)
        j_ok = (j >= 0) & (j < W)
        slot = tl.where(in_pre, u, base + j)
        slot_ok = tl.where(in_pre, u < base, j_ok)
        if CAUSAL:
            in_block = j[None, :] <= t[:, None]
        else:
            in_block = tl.load(local_ptr + b * sl_b + t[:, None] * sl_t + j[None, :] * sl_w,
                               mask=row_ok[:, None] & j_ok[None, :], other=0) != 0
        visible = row_ok[:, None] & slot_ok[None, :] & (in_pre | in_block)
        kv_ok = slot_ok[:, None] & d_ok[None, :]
        k = tl.load(k_row + slot[:, None] * sk_s + d[None, :] * sk_d, mask=kv_ok, other=0.0)
        v = tl.load(v_row + slot[:, None] * sv_s + d[None, :] * sv_d, mask=kv_ok, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        x = tl.where(visible, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))  # [BLOCK_M, BLOCK_N], log2 units
        m_new = tl.maximum(m_i, tl.reduce(x, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all blocked so far: exp2(-inf) = 0
        p = tl.exp2(x - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # rows that saw nothing: acc == 0 -> 0
    tl.store(out_ptr + b * so_b + hq[:, None] * so_h + t[:, None] * so_t + d[None, :] * so_d,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, base: torch.Tensor,
           local: torch.Tensor | None) -> None:
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"tree_attention: expected q [B,Hq,T,hd], k_cache and v_cache [B,Hkv,S,hd]; got q "
                         f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    (b, hq, t, hd), (bk, hkv, _, hdk) = q.shape, k_cache.shape
    if bk != b or hdk != hd or hkv == 0 or hq % hkv:
        raise ValueError(f"tree_attention: q {tuple(q.shape)} does not fit k_cache {tuple(k_cache.shape)}: "
                         "batch and head_dim must match and Hq must be a multiple of Hkv (grouped-query "
                         "attention)")
    if base.shape != (b,) or base.dtype != torch.int64:
        raise ValueError(f"tree_attention: base must be [B] = [{b}] int64 (first block slot per row), got "
                         f"{tuple(base.shape)} {base.dtype}")
    if local is not None and (local.dim() != 3 or local.shape[:2] != (b, t) or local.dtype != torch.bool):
        raise ValueError(f"tree_attention: local must be [B, T, W] = [{b}, {t}, W] bool (None: a causal block), "
                         f"got {tuple(local.shape)} {local.dtype}")


def tree_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, base: torch.Tensor,
                             local: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The dense oracle: SDPA over every slot with the `visible_slots` mask; queries that see nothing give 0.

    Args:
        q: [B, Hq, T, hd] block queries.
        k_cache, v_cache: [B, Hkv, S, hd] the static cache (the block's own K/V already written).
        base: [B] int64; local: [B, T, W] bool or None (see the module docstring).
        scale: softmax scale.

    Returns:
        [B, Hq, T, hd] in q's dtype.
    """
    _check(q, k_cache, v_cache, base, local)
    visible = visible_slots(base, local, q.shape[2], k_cache.shape[2])[:, None]          # [B, 1, T, S]
    groups = q.shape[1] // k_cache.shape[1]
    k = k_cache.repeat_interleave(groups, dim=1)
    v = v_cache.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(visible, q.dtype), scale=scale)
    return out.masked_fill(~visible.any(-1, keepdim=True), 0.0)


def tree_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, base: torch.Tensor,
                       local: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention over the live slots with torch's CPU flash kernel (shapes as `tree_attention_reference`).

    Keys past the longest row's block end (`max(base) + W`) are never read. One-token steps and small tree
    blocks (verify trees, draft levels) are one flash call over `[0, max(base) + W)`: with no mask at all when
    every row is a one-token step at the same base, else with the live part of the `visible_slots` mask.
    Causal blocks of several tokens (prefill chunks: `is_causal` skips the masked-out half, a mask cannot) and
    large tree blocks are two calls whose log-sum-exps `lse` merge them exactly in real arithmetic,
    out = sum_p exp(lse_p - m) out_p / sum_p exp(lse_p - m): the prefix (no mask when the rows share a base) and
    the block (`is_causal`, or its local mask), so no [T, S] mask is ever built for them. A part a query cannot
    see at all is given lse = -inf (the flash kernel reports 0 for an all-masked row).
    """
    _check(q, k_cache, v_cache, base, local)
    t = q.shape[2]
    width = block_width(t, local)
    lo, hi = int(base.min()), int(base.max())           # host reads; CPU tensors, so no device round trip
    end = hi + width
    if local is None and t == 1 and lo == hi:
        return _like_q(_flash(q, k_cache[:, :, :end], v_cache[:, :, :end], scale, None)[0], q)
    if (local is not None or t == 1) and t * end <= SMALL_BLOCK_ELEMENTS:   # causal blocks of T > 1: is_causal
        mask = visible_slots(base, local, t, end)[:, None]                           # [B, 1, T, end]
        out, lse = _flash(q, k_cache[:, :, :end], v_cache[:, :, :end], scale, mask)
        return _like_q(out.masked_fill(torch.isneginf(lse)[..., None], 0.0), q)
    return _like_q(_split(q, k_cache, v_cache, base, local, scale, lo, hi, width), q)


#: a block whose live mask has at most this many elements a row runs as one masked flash call
SMALL_BLOCK_ELEMENTS = 1 << 16


def _flash(q, k, v, scale: float, visible: torch.Tensor | None, causal: bool = False):
    """(out [B, Hq, T, hd] in q's dtype and layout, lse [B, Hq, T] with -inf where a query saw nothing)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    mask = None if visible is None else additive_mask(visible, q.dtype)
    out, lse = flash(q, k, v, is_causal=causal, attn_mask=mask, scale=scale)[:2]
    if visible is not None:
        lse = lse.masked_fill(~visible.any(-1), float("-inf"))
    return out, lse


def _like_q(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`out` laid out like `torch.empty_like(q)` (the fake's layout; HF's queries are [B, T, H, hd] in memory, so
    the model's transpose back after attention is then free): copied only if it is not already."""
    like = torch.empty_like(q)
    if out.stride() == like.stride() and out.dtype == q.dtype:
        return out
    return like.copy_(out)


def _split(q, k_cache, v_cache, base, local, scale, lo: int, hi: int, width: int) -> torch.Tensor:
    """Prefix and block as two flash calls merged by log-sum-exp (see `tree_attention_cpu`)."""
    b, hkv, hd = q.shape[0], k_cache.shape[1], q.shape[3]
    if lo == hi:
        k_block, v_block = k_cache[:, :, lo:lo + width], v_cache[:, :, lo:lo + width]
    else:
        index = (base[:, None] + torch.arange(width, device=base.device))[:, None, :, None]
        index = index.expand(b, hkv, width, hd)
        k_block, v_block = k_cache.gather(2, index), v_cache.gather(2, index)
    if local is None:                                    # causal: every query sees itself, lse is finite
        out_b, lse_b = _flash(q, k_block, v_block, scale, None, causal=True)
        if hi == 0:
            return out_b
    else:
        out_b, lse_b = _flash(q, k_block, v_block, scale, local[:, None])
    if hi == 0:
        return out_b.masked_fill(torch.isneginf(lse_b)[..., None], 0.0)
    prefix = None if lo == hi else (torch.arange(hi, device=base.device) < base[:, None])[:, None, None, :]
    out_p, lse_p = _flash(q, k_cache[:, :, :hi], v_cache[:, :, :hi], scale, prefix)
    return _merge(out_p, lse_p, out_b, lse_b).to(q.dtype)


def _merge(out_a, lse_a, out_b, lse_b) -> torch.Tensor:
    """Combine two softmax-attention partial results over disjoint key sets by their log-sum-exps."""
    acc = torch.promote_types(out_a.dtype, torch.float32)
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isneginf(m), 0.0, m)                    # both parts empty: weights 0, output 0
    wa, wb = (lse_a - m).exp()[..., None], (lse_b - m).exp()[..., None]
    total = wa + wb
    return (out_a.to(acc) * wa + out_b.to(acc) * wb) / torch.where(total > 0, total, 1.0)


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `visible`, -inf elsewhere, in `dtype`. No tensor constant: decompositions (the TensorRT export
    inlines this as `eagle31::slot_mask`'s reference) cannot hold a `torch.tensor(...)` literal."""
    return torch.full(visible.shape, float("-inf"), dtype=dtype, device=visible.device).masked_fill(visible, 0.0)


def tree_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, base: torch.Tensor,
                          local: torch.Tensor | None, scale: float, *, out: torch.Tensor | None = None,
                          interpret: bool | None = None, block_m: int | None = None, block_n: int | None = None,
                          num_warps: int | None = None) -> torch.Tensor:
    """Launch the Triton kernel.

    Args:
        q: [B, Hq, T, hd] fp16/bf16/fp32; any strides.
        k_cache, v_cache: [B, Hkv, S, hd], same dtype; Hq % Hkv == 0; hd <= 256 (tiles use the next power of
            two, at least 16, and mask the rest).
        base: [B] int64 first block slot per row; local: [B, T, W] bool, or None for a causal block.
        scale: softmax scale.
        out: optional [B, Hq, T, hd] output buffer (tests poison it); allocated when None.
        interpret: run through the Triton interpreter; default: unless the tensors are on CUDA.
        block_m, block_n, num_warps: packed query rows (G*T) per program, cache slots per inner step, warps.
            Defaults scale with the bytes of one head-dim row (`row`, 32 B for hd 16 fp16 .. 1 KiB for hd 256
            fp32): block_m = next pow2 of G*T clamped to [16, 64] (to 32 when row > 512 B); block_n = 64
            (32 when row > 256 B); num_warps = 8 when block_m * row >= 16 KiB, else 4. They keep every
            supported head dim free of register spills in an sm_90 build (checked with cuobjdump by
            tests/kernels/test_gpu_compile.py). GPU tl.dot needs block_m, block_n >= 16.

    Returns:
        `out`, [B, Hq, T, hd] in q's dtype.
    """
    _check(q, k_cache, v_cache, base, local)
    b, hq, t, hd = q.shape
    hkv = k_cache.shape[1]
    if hd > MAX_HEAD_DIM:
        raise ValueError(f"tree_attention: head_dim {hd} > {MAX_HEAD_DIM}, the largest the Triton kernel "
                         "tiles")
    if interpret is None:
        interpret = q.device.type != "cuda" or _dispatch.interpreter_requested()
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    block_d = max(16, _dispatch.next_power_of_2(hd))
    row = block_d * q.element_size()
    if block_m is None:
        block_m = min(64 if row <= 512 else 32, max(16, _dispatch.next_power_of_2(group * t)))
    if block_n is None:
        block_n = 64 if row <= 256 else 32
    if num_warps is None:
        num_warps = 8 if block_m * row >= 16 * 1024 else 4
    causal = local is None
    local_arg = base if causal else local                      # any tensor: the causal kernel never reads it
    local_strides = (0, 0, 0) if causal else local.stride()
    grid = (_dispatch.cdiv(group * t, block_m), b * hkv)
    _dispatch.kernel(_tree_attention_kernel, interpret)[grid](
        q, k_cache, v_cache, base, local_arg, out,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *local_strides, *out.stride(),
        t, block_width(t, local), hd, hkv, scale * math.log2(math.e),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, CAUSAL=causal,
        DOT_F32=_dispatch.dot_in_fp32(q.dtype, interpret), num_warps=num_warps,
    )
    return out


def tree_attention_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, base: torch.Tensor,
                        local: torch.Tensor | None, scale: float) -> torch.Tensor:
    """[B,Hq,T,hd] attention of a block of queries over the live part of the cache (see the module doc)."""
    choice = _dispatch.choose(q.device, q.dtype)
    if choice.impl == _dispatch.REFERENCE:
        if q.device.type == "cpu":
            return tree_attention_cpu(q, k_cache, v_cache, base, local, scale)
        return _like_q(tree_attention_reference(q, k_cache, v_cache, base, local, scale), q)
    return tree_attention_triton(q, k_cache, v_cache, base, local, scale,
                                 interpret=choice.impl == _dispatch.INTERPRETER)


tree_attention = torch.library.custom_op("eagle31::tree_attention", tree_attention_impl, mutates_args=())


@tree_attention.register_fake
def _(q, k_cache, v_cache, base, local, scale):
    _check(q, k_cache, v_cache, base, local)
    return torch.empty_like(q)


def slot_mask_reference(base: torch.Tensor, local: torch.Tensor | None, tokens: int, slots: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """The dense additive mask `[B, 1, T, S]` (0 = attend, -inf = blocked) of `visible_slots`: what an HF model
    takes as its 4-D attention mask. Also what the TensorRT export inlines in place of the op."""
    return additive_mask(visible_slots(base, local, tokens, slots)[:, None], dtype)


@torch.library.custom_op("eagle31::slot_mask", mutates_args=())
def slot_mask(base: torch.Tensor, local: torch.Tensor | None, tokens: int, slots: int,
              dtype: torch.dtype) -> torch.Tensor:
    """`slot_mask_reference` as an op. In a captured program the `tree_attention` pass replaces every SDPA that
    reads it with `eagle31::tree_attention(.., base, local, ..)`, after which it is dead code."""
    return slot_mask_reference(base, local, tokens, slots, dtype)


@slot_mask.register_fake
def _(base, local, tokens, slots, dtype):
    return base.new_empty((base.shape[0], 1, tokens, slots), dtype=dtype)
