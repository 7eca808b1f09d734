"""`eagle31::tree_attention`: the verify step's attention, tree queries over the static KV cache.

The tree's T query tokens attend to the whole static cache `[B, Hkv, S, hd]` through an additive mask
`[B, 1, T, S]` (0 = attend, -inf = blocked; INTERNALS.md "KV caches"): the prefix, the node's own ancestors
and itself. It is SDPA with a mask, but two things make a dedicated kernel worth it on CUDA:
- grouped-query heads: the G = Hq / Hkv query heads sharing one KV head are packed into the rows of one tile
  (row = g * T + t), so K/V are read once per KV head instead of G times;
- the cache is static (S = max_cache_len) and mostly empty: KV tiles whose mask is -inf for every row of the
  tile are skipped without loading K or V.

Softmax is the flash-style online softmax in fp32 (exp2 with log2(e) folded into the scale). A query row whose
mask is -inf everywhere (a padding row) gives 0, like torch's SDPA on CPU; the reference enforces that on
every backend.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eagle_compile.kernels import _dispatch

tl = None  # triton.language, bound by _dispatch.kernel on first launch

MAX_HEAD_DIM = 256


def _tree_attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_s, sk_d,
    sv_b, sv_h, sv_s, sv_d,
    sm_b, sm_t, sm_s,
    so_b, so_h, so_t, so_d,
    T, S, HD, HKV, qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    LOG2E: tl.constexpr = 1.4426950408889634
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

    q = tl.load(q_ptr + b * sq_b + hq[:, None] * sq_h + t[:, None] * sq_t + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for start in range(0, S, BLOCK_N):
        s = start + tl.arange(0, BLOCK_N)
        s_ok = s < S
        bias = tl.load(mask_ptr + b * sm_b + t[:, None] * sm_t + s[None, :] * sm_s,
                       mask=row_ok[:, None] & s_ok[None, :], other=float("-inf")).to(tl.float32)
        row_max = tl.reduce(bias, 1, tl.standard._elementwise_max)
        if tl.reduce(row_max, 0, tl.standard._elementwise_max) > float("-inf"):
            kv_ok = s_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + b * sk_b + hkv * sk_h + s[:, None] * sk_s + d[None, :] * sk_d,
                        mask=kv_ok, other=0.0)
            v = tl.load(v_ptr + b * sv_b + hkv * sv_h + s[:, None] * sv_s + d[None, :] * sv_d,
                        mask=kv_ok, other=0.0)
            if DOT_F32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            x = tl.dot(q, tl.trans(k)) * qk_scale + bias * LOG2E  # [BLOCK_M, BLOCK_N], log2 units
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


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor) -> None:
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"tree_attention: expected q [B,Hq,T,hd], k_cache and v_cache [B,Hkv,S,hd]; got q "
                         f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    (b, hq, t, hd), (bk, hkv, s, hdk) = q.shape, k_cache.shape
    if bk != b or hdk != hd or hkv == 0 or hq % hkv:
        raise ValueError(f"tree_attention: q {tuple(q.shape)} does not fit k_cache {tuple(k_cache.shape)}: "
                         "batch and head_dim must match and Hq must be a multiple of Hkv (grouped-query "
                         "attention)")
    if (mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] != 1
            or tuple(mask.shape[2:]) != (t, s)):
        raise ValueError(f"tree_attention: mask {tuple(mask.shape)} should be [B or 1, 1, T, S] = "
                         f"[{b}, 1, {t}, {s}]")
    if not mask.is_floating_point():
        raise ValueError(f"tree_attention: mask dtype {mask.dtype}; give an additive float mask "
                         "(0 = attend, -inf = blocked) in the model dtype")


def tree_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with the additive mask and grouped-query heads; fully masked query rows give 0.

    Args:
        q: [B, Hq, T, hd] tree queries.
        k_cache, v_cache: [B, Hkv, S, hd] the static cache (the tree's own K/V already written).
        mask: [B or 1, 1, T, S] additive float mask.
        scale: softmax scale (1/sqrt(hd) for the supported models).

    Returns:
        [B, Hq, T, hd] in q's dtype.
    """
    _check(q, k_cache, v_cache, mask)
    groups = q.shape[1] // k_cache.shape[1]
    if groups > 1:
        k_cache = k_cache.repeat_interleave(groups, dim=1)
        v_cache = v_cache.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask.to(q.dtype), scale=scale)
    blocked = torch.isneginf(mask).all(dim=-1, keepdim=True)  # [B, 1, T, 1]
    return out.masked_fill(blocked, 0.0)


def tree_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                          scale: float, *, out: torch.Tensor | None = None, interpret: bool | None = None,
                          block_m: int | None = None, block_n: int | None = None,
                          num_warps: int | None = None) -> torch.Tensor:
    """Launch the Triton kernel.

    Args:
        q: [B, Hq, T, hd] fp16/bf16/fp32; any strides.
        k_cache, v_cache: [B, Hkv, S, hd], same dtype; Hq % Hkv == 0; hd <= 256 (tiles use the next power of
            two, at least 16, and mask the rest).
        mask: [B or 1, 1, T, S] additive float mask (any float dtype, read as fp32).
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
    _check(q, k_cache, v_cache, mask)
    b, hq, t, hd = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    if hd > MAX_HEAD_DIM:
        raise ValueError(f"tree_attention: head_dim {hd} > {MAX_HEAD_DIM}, the largest the Triton kernel "
                         "tiles")
    if interpret is None:
        interpret = q.device.type != "cuda" or _dispatch.interpreter_requested()
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    block_d = max(16, _dispatch.next_power_of_2(hd))
    row = block_d * q.element_size()
    if block_m is None:
        block_m = min(64 if row <= 512 else 32, max(16, _dispatch.next_power_of_2(group * t)))
    if block_n is None:
        block_n = 64 if row <= 256 else 32
    if num_warps is None:
        num_warps = 8 if block_m * row >= 16 * 1024 else 4
    mask_b = 0 if mask.shape[0] == 1 else mask.stride(0)
    grid = (_dispatch.cdiv(group * t, block_m), b * hkv)
    _dispatch.kernel(_tree_attention_kernel, interpret)[grid](
        q, k_cache, v_cache, mask, out,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        mask_b, mask.stride(2), mask.stride(3),
        *out.stride(),
        t, s, hd, hkv, scale * math.log2(math.e),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_F32=_dispatch.dot_in_fp32(q.dtype, interpret), num_warps=num_warps,
    )
    return out


@torch.library.custom_op("eagle31::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """[B,Hq,T,hd] attention of the tree queries over the cache with an additive mask (see the module doc)."""
    choice = _dispatch.choose(q.device, q.dtype)
    if choice.impl == _dispatch.REFERENCE:
        return tree_attention_reference(q, k_cache, v_cache, mask, scale).contiguous()
    return tree_attention_triton(q, k_cache, v_cache, mask, scale,
                                 interpret=choice.impl == _dispatch.INTERPRETER)


@tree_attention.register_fake
def _(q, k_cache, v_cache, mask, scale):
    _check(q, k_cache, v_cache, mask)
    return torch.empty_like(q, memory_format=torch.contiguous_format)
