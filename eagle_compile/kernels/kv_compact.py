"""`eagle31::kv_compact`: move the accepted path's K/V into place, in place (EAGLE31_SPEC.md §5.4).

After verification the tree's M tokens sit in slots `base .. base+M-1` of each row; the accepted path (root
plus accepted nodes, `Acceptance.path` in INTERNALS.md) must end up contiguous from `base`:
slot `base[b] + j` receives what was in slot `base[b] + path[b, j]`, for j in 0..P-1.

Every source is read before any destination is written: one program owns a (row, head, head-dim block) and
holds the whole path's `[P, BLOCK_D]` tile in registers, with a barrier between the loads and the stores.
With the path's invariants (non-decreasing, `path[j] >= j`) a forward, one-slot-at-a-time copy would also be
correct, but the gather-then-scatter form does not depend on them. Positions after `accept_len` repeat the
last node, so they rewrite slots beyond the accepted length with copies; those slots are stale by definition.
"""

from __future__ import annotations

import torch

from eagle_compile.kernels import _dispatch

tl = None  # triton.language, bound by _dispatch.kernel on first launch


def _kv_compact_kernel(
    k_ptr, v_ptr, base_ptr, path_ptr,
    sk_b, sk_h, sk_s, sk_d,
    sv_b, sv_h, sv_s, sv_d,
    s_base, sp_b, sp_j,
    H, P, HD,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    j = tl.arange(0, BLOCK_P)
    j_ok = j < P
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = j_ok[:, None] & (d < HD)[None, :]

    base = tl.load(base_ptr + b * s_base)
    src = base + tl.load(path_ptr + b * sp_b + j * sp_j, mask=j_ok, other=0)  # [BLOCK_P] int64 slots
    dst = base + j
    k_row = k_ptr + b * sk_b + h * sk_h
    v_row = v_ptr + b * sv_b + h * sv_h
    keys = tl.load(k_row + src[:, None] * sk_s + d[None, :] * sk_d, mask=ok)
    values = tl.load(v_row + src[:, None] * sv_s + d[None, :] * sv_d, mask=ok)
    tl.debug_barrier()  # all sources of this tile are read before any of its slots is overwritten
    tl.store(k_row + dst[:, None] * sk_s + d[None, :] * sk_d, keys, mask=ok)
    tl.store(v_row + dst[:, None] * sv_s + d[None, :] * sv_d, values, mask=ok)


def _check(keys: torch.Tensor, values: torch.Tensor, base: torch.Tensor, path: torch.Tensor) -> None:
    if keys.dim() != 4 or values.shape != keys.shape or values.dtype != keys.dtype:
        raise ValueError(f"kv_compact: keys {tuple(keys.shape)} {keys.dtype} and values "
                         f"{tuple(values.shape)} {values.dtype} should both be [B, H, S, hd] of one dtype")
    b = keys.shape[0]
    if base.shape != (b,) or path.dim() != 2 or path.shape[0] != b:
        raise ValueError(f"kv_compact: base {tuple(base.shape)} and path {tuple(path.shape)} should be [B] "
                         f"and [B, P] with B = {b}")
    if base.dtype != torch.int64 or path.dtype != torch.int64:
        raise ValueError(f"kv_compact: base ({base.dtype}) and path ({path.dtype}) must be int64")


def kv_compact_reference(keys: torch.Tensor, values: torch.Tensor, base: torch.Tensor,
                         path: torch.Tensor) -> None:
    """In place: slot base[b]+j <- slot base[b]+path[b, j] (all sources gathered before writing).

    Args:
        keys, values: [B, H, S, hd] one layer's static cache, modified in place.
        base: [B] int64 slot of each row's root (first tree slot).
        path: [B, P] int64 node offsets from base, non-decreasing, path[:, j] >= j; base + path < S.
    """
    _check(keys, values, base, path)
    p = path.shape[1]
    src = (base[:, None] + path)[:, None, :, None]  # [B, 1, P, 1]
    dst = (base[:, None] + torch.arange(p, device=path.device))[:, None, :, None]
    for buf in (keys, values):
        index = src.expand(-1, buf.shape[1], -1, buf.shape[3])
        moved = buf.gather(2, index)  # a copy: every source is read before the scatter writes
        buf.scatter_(2, dst.expand_as(index), moved)


def kv_compact_triton(keys: torch.Tensor, values: torch.Tensor, base: torch.Tensor, path: torch.Tensor, *,
                      interpret: bool | None = None, block_d: int | None = None) -> None:
    """Launch the Triton kernel (in place).

    Args:
        keys, values: [B, H, S, hd], any dtype and strides.
        base: [B] int64.
        path: [B, P] int64 (P is the tree depth + 1: small; the whole path is one tile).
        interpret: run through the Triton interpreter; default: unless the tensors are on CUDA.
        block_d: head-dim columns per program, default min(64, next pow2 of hd).
    """
    _check(keys, values, base, path)
    if interpret is None:
        interpret = keys.device.type != "cuda" or _dispatch.interpreter_requested()
    b, h, _, hd = keys.shape
    p = path.shape[1]
    if p == 0:
        return
    if block_d is None:
        block_d = min(64, _dispatch.next_power_of_2(hd))
    _dispatch.kernel(_kv_compact_kernel, interpret)[(b * h, _dispatch.cdiv(hd, block_d))](
        keys, values, base, path,
        *keys.stride(), *values.stride(),
        base.stride(0), *path.stride(),
        h, p, hd,
        BLOCK_P=_dispatch.next_power_of_2(p), BLOCK_D=block_d,
    )


@torch.library.custom_op("eagle31::kv_compact", mutates_args=("keys", "values"))
def kv_compact(keys: torch.Tensor, values: torch.Tensor, base: torch.Tensor, path: torch.Tensor) -> None:
    """In place: slot base[b]+j <- slot base[b]+path[b, j] of keys and values (see the module doc)."""
    choice = _dispatch.choose(keys.device, keys.dtype, dtypes=None)
    if choice.impl == _dispatch.REFERENCE:
        kv_compact_reference(keys, values, base, path)
    else:
        kv_compact_triton(keys, values, base, path, interpret=choice.impl == _dispatch.INTERPRETER)


@kv_compact.register_fake
def _(keys, values, base, path):
    _check(keys, values, base, path)
