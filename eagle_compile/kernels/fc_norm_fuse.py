"""`eagle31::fc_norm_fuse`: EAGLE 3.1 per-feature RMSNorms + concat + fc in one pass (EAGLE31_SPEC.md §2.1).

The draft's first step fuses the A captured target features `[N, A*Ht]` (capture order low, mid, high) into
its hidden size: `fc(cat(RMSNorm_0(h_0), ..., RMSNorm_{A-1}(h_{A-1})))`. Unfused that is A reductions, A
normalised copies, a concat and a matmul; here each program of the matmul normalises its rows chunk by chunk
on the fly: for every chunk it first reads the chunk once for the row's sum of squares, then streams it again
through the fc tiles. The normalised features are never written to memory.

Numerics are those of the draft module's `RMSNorm` (`eagle_compile/draft/model.py`, HF style): per chunk
`x * rsqrt(mean(x^2) + eps)` in fp32, cast to the input dtype, then times the weight (one rounding to the
input dtype), then the fc matmul with fp32 accumulation. `norm_weight=None` (EAGLE-3, no `fc_norm`) is the
plain fc.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle_compile.kernels import _dispatch

tl = None  # triton.language, bound by _dispatch.kernel on first launch


def _fc_norm_fuse_kernel(
    x_ptr, nw_ptr, w_ptr, out_ptr,
    sx_n, sx_k, snw_a, snw_k, sw_h, sw_k, so_n, so_h,
    N, A, HT, H, eps,
    HAS_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    col_ok = cols < H
    kk = tl.arange(0, BLOCK_K)

    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for a in range(0, A):
        chunk = a * HT
        if HAS_NORM:
            sumsq = tl.full([BLOCK_M], 0.0, tl.float32)
            for k0 in range(0, HT, BLOCK_K):
                k_ok = k0 + kk < HT
                x = tl.load(x_ptr + rows[:, None] * sx_n + (chunk + k0 + kk)[None, :] * sx_k,
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                sumsq += tl.reduce(x * x, 1, tl.standard._sum_combine)
            rstd = 1.0 / tl.sqrt(sumsq / HT + eps)
        for k0 in range(0, HT, BLOCK_K):
            k_ok = k0 + kk < HT
            x = tl.load(x_ptr + rows[:, None] * sx_n + (chunk + k0 + kk)[None, :] * sx_k,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if HAS_NORM:
                nw = tl.load(nw_ptr + a * snw_a + (k0 + kk) * snw_k, mask=k_ok, other=0.0).to(tl.float32)
                # round the normalised x to the input dtype first (as the module does), then the product once:
                # exact in fp32 for an input-dtype weight, so it equals the module's input-dtype multiply
                x = (x.to(tl.float32) * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
                x = (nw[None, :] * x).to(x_ptr.dtype.element_ty)
            w = tl.load(w_ptr + cols[:, None] * sw_h + (chunk + k0 + kk)[None, :] * sw_k,
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
            if DOT_F32:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + rows[:, None] * so_n + cols[None, :] * so_h, acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _check(features: torch.Tensor, norm_weight: torch.Tensor | None, fc_weight: torch.Tensor) -> None:
    if fc_weight.dim() != 2 or features.dim() < 1 or features.shape[-1] != fc_weight.shape[1]:
        raise ValueError(f"fc_norm_fuse: features {tuple(features.shape)} [..., A*Ht] do not fit fc_weight "
                         f"{tuple(fc_weight.shape)} [H, A*Ht]")
    if norm_weight is not None and (norm_weight.dim() != 2 or norm_weight.numel() != features.shape[-1]):
        raise ValueError(f"fc_norm_fuse: norm_weight {tuple(norm_weight.shape)} should be [A, Ht] with "
                         f"A*Ht = {features.shape[-1]} (the width of features)")
    if features.dtype != fc_weight.dtype:
        raise ValueError(f"fc_norm_fuse: features are {features.dtype} but fc_weight is {fc_weight.dtype}; "
                         "cast them to one dtype")


def fc_norm_fuse_reference(features: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                           fc_weight: torch.Tensor) -> torch.Tensor:
    """fc(cat(RMSNorm_i(chunk_i))), chunks in capture order, RMSNorm as the draft module computes it.

    Args:
        features: [..., A*Ht] captured target features, concatenated.
        norm_weight: [A, Ht] the `fc_norm.{i}.weight` rows, or None for no per-feature norm (plain fc).
        eps: RMSNorm epsilon (`rms_norm_eps` of the draft config).
        fc_weight: [H, A*Ht], same dtype as features.

    Returns:
        [..., H] in the features' dtype.
    """
    _check(features, norm_weight, fc_weight)
    if norm_weight is not None:
        dtype = features.dtype
        x = features.unflatten(-1, tuple(norm_weight.shape))  # [..., A, Ht]
        x = x.to(torch.promote_types(dtype, torch.float32))
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
        features = (norm_weight * x).flatten(-2).to(dtype)
    return F.linear(features, fc_weight)


def fc_norm_fuse_triton(features: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                        fc_weight: torch.Tensor, *, out: torch.Tensor | None = None,
                        interpret: bool | None = None, block_m: int | None = None, block_n: int = 64,
                        block_k: int = 64) -> torch.Tensor:
    """Launch the Triton kernel.

    Args:
        features: [..., A*Ht] fp16/bf16/fp32, any strides.
        norm_weight: [A, Ht] (any float dtype, read as fp32) or None.
        eps: RMSNorm epsilon.
        fc_weight: [H, A*Ht], features' dtype.
        out: optional [..., H] contiguous output buffer (tests poison it).
        interpret: run through the Triton interpreter; default: unless the tensors are on CUDA.
        block_m: rows per program, default min(64, next pow2 of N), at least 16 (GPU tl.dot minimum).
        block_n, block_k: output-feature and reduction tile sizes.

    Returns:
        `out`, [..., H] in the features' dtype.
    """
    _check(features, norm_weight, fc_weight)
    if interpret is None:
        interpret = features.device.type != "cuda" or _dispatch.interpreter_requested()
    x = features.reshape(-1, features.shape[-1])  # [N, A*Ht]
    n, h = x.shape[0], fc_weight.shape[0]
    a, ht = (norm_weight.shape[0], norm_weight.shape[1]) if norm_weight is not None else (1, x.shape[1])
    if out is None:
        out = torch.empty(*features.shape[:-1], h, dtype=features.dtype, device=features.device)
    out2 = out.view(n, h)
    if block_m is None:
        block_m = min(64, max(16, _dispatch.next_power_of_2(n)))
    nw = norm_weight if norm_weight is not None else fc_weight  # a placeholder pointer, unread without norm
    grid = (_dispatch.cdiv(n, block_m), _dispatch.cdiv(h, block_n))
    _dispatch.kernel(_fc_norm_fuse_kernel, interpret)[grid](
        x, nw, fc_weight, out2,
        *x.stride(), *nw.stride(), *fc_weight.stride(), *out2.stride(),
        n, a, ht, h, eps,
        HAS_NORM=norm_weight is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_F32=_dispatch.dot_in_fp32(features.dtype, interpret),
    )
    return out


@torch.library.custom_op("eagle31::fc_norm_fuse", mutates_args=())
def fc_norm_fuse(features: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                 fc_weight: torch.Tensor) -> torch.Tensor:
    """[..., H] = fc(cat(per-feature RMSNorm(features))) (see the module doc)."""
    choice = _dispatch.choose(features.device, features.dtype)
    if choice.impl == _dispatch.REFERENCE:
        return fc_norm_fuse_reference(features, norm_weight, eps, fc_weight).contiguous()
    return fc_norm_fuse_triton(features, norm_weight, eps, fc_weight,
                               interpret=choice.impl == _dispatch.INTERPRETER)


@fc_norm_fuse.register_fake
def _(features, norm_weight, eps, fc_weight):
    _check(features, norm_weight, fc_weight)
    return features.new_empty(*features.shape[:-1], fc_weight.shape[0])
