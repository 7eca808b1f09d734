"""`eagle31::accept_greedy` and `eagle31::accept_sample`: verification of a draft tree on the device.

The torch definitions are `verify_greedy` / `verify_sample` in `eagle_compile/core/verify.py` (they are the
references here, called as they are); the vocabulary (root, accepted tokens, bonus token, acceptance
length) and the `Acceptance` layout are those of docs/INTERNALS.md. Unfused, one verification is a few dozen
small torch kernels over `[B, M]`, `[B, M, M]` and `[B, V]` tensors; here it is one program per batch row
that holds the row's tree in registers (node-by-node relations as `[M, M]` one-hot matrices, M <= a few
hundred) and streams the target distribution over V in tiles only where sampling needs it.

- Greedy (EAGLE31_SPEC.md §5.1): node i is correct iff valid and `tokens[i] == argmax(logits[parents[i]])`;
  the deepest node whose whole root path is correct wins (lowest index among equally deep ones); the bonus
  token is the argmax at that node. The argmax over V is torch's (`argmax` returns the first maximum).
- Sampling (§5.2, deterministic drafts): from the root, the node's children (node order, at most K) are
  tried in turn; child x is accepted iff `u < p[x] / (mass left)`; a rejected x is removed from p; an accepted
  child becomes the current node with a fresh p. The bonus token is drawn by inverse CDF from the current p
  (residual after rejections, or the fresh distribution). Masses and the CDF are accumulated in fp64 like
  the reference, so the two agree except when a uniform falls within rounding of a decision boundary.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from eagle_compile.kernels import _dispatch

tl = None  # triton.language, bound by _dispatch.kernel on first launch


def _accept_kernel(
    tok_ptr, par_ptr, dep_ptr, val_ptr, am_ptr, probs_ptr, u_ptr, fu_ptr,
    len_ptr, path_ptr, out_ptr,
    st_b, st_m, spa_b, spa_m, sd_b, sd_m, sva_b, sva_m, sam_b, sam_m,
    sp_b, sp_m, sp_v, su_b, su_d, su_k, sfu_b,
    sl_b, sph_b, sph_s, so_b, so_s,
    M, V, D, NK,
    SAMPLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    zero = tl.program_id(0) * 0  # int32 scalar: seeds loop-carried scalars with a fixed type
    i = tl.arange(0, BLOCK_M)
    i_ok = i < M
    tok = tl.load(tok_ptr + b * st_b + i * st_m, mask=i_ok, other=0)
    par = tl.maximum(tl.load(par_ptr + b * spa_b + i * spa_m, mask=i_ok, other=0), 0).to(tl.int32)
    dep = tl.load(dep_ptr + b * sd_b + i * sd_m, mask=i_ok, other=0)
    val = (tl.load(val_ptr + b * sva_b + i * sva_m, mask=i_ok, other=0) != 0) & i_ok

    if SAMPLE:
        tok_v = tl.minimum(tl.maximum(tok, 0), V - 1)  # padding ids may be anything; never accepted
        # the root's parent is clamped to 0 like its children's: `i > 0` keeps it out of their sibling ranks
        earlier = (val & (i > 0))[None, :] & (i[None, :] < i[:, None])
        earlier_sibling = (par[:, None] == par[None, :]) & earlier
        rank = tl.reduce(earlier_sibling.to(tl.int32), 1, tl.standard._sum_combine)  # among valid siblings
        is_child = val & (i > 0) & (rank < NK)
        r = tl.arange(0, BLOCK_K)
        node = zero
        active = zero + 1
        for level in range(0, D):
            kid_of = (par[None, :] == node) & is_child[None, :] & (rank[None, :] == r[:, None])  # [K, M]
            kid = tl.reduce(tl.where(kid_of, i[None, :], 0), 1, tl.standard._sum_combine)
            kid_tok = tl.reduce(tl.where(kid_of, tok_v[None, :], 0), 1, tl.standard._sum_combine)
            # (a product, not `&`: the interpreter mis-types `block & scalar` masks)
            tried = tl.reduce(kid_of.to(tl.int32), 1, tl.standard._sum_combine) * active > 0
            accepted = zero
            new_node = node
            if tl.reduce(tried.to(tl.int32), 0, tl.standard._sum_combine) > 0:
                row_p = probs_ptr + b * sp_b + node.to(tl.int64) * sp_m
                same_earlier = ((kid_tok[:, None] == kid_tok[None, :]) & tried[None, :]
                                & (r[None, :] < r[:, None]))
                repeated = tl.reduce(same_earlier.to(tl.int32), 1, tl.standard._sum_combine) > 0
                mass = tl.load(row_p + kid_tok * sp_v, mask=tried, other=0.0).to(tl.float64)
                mass = tl.where(tried & ~repeated, mass, 0.0)
                others = zero.to(tl.float64)  # mass on tokens that are not tried children
                for v0 in range(0, V, BLOCK_V):
                    v = v0 + tl.arange(0, BLOCK_V)
                    p = tl.load(row_p + v * sp_v, mask=v < V, other=0.0).to(tl.float64)
                    hit = tl.reduce(((v[:, None] == kid_tok[None, :]) & tried[None, :]).to(tl.int32), 1,
                                    tl.standard._sum_combine) > 0
                    others += tl.reduce(tl.where(hit, 0.0, p), 0, tl.standard._sum_combine)
                # child k is tried after 0..k-1 were removed: mass left = others + masses of children k..K-1
                left = others + tl.reduce(tl.where(r[None, :] >= r[:, None], mass[None, :], 0.0), 1,
                                          tl.standard._sum_combine)
                ratio = tl.where(left > 0.0, mass / tl.where(left > 0.0, left, 1.0), 0.0)
                u = tl.load(u_ptr + b * su_b + level * su_d + r * su_k, mask=tried, other=1.0).to(tl.float64)
                take = (u < ratio) & tried
                accepted = tl.reduce(take.to(tl.int32), 0, tl.standard._sum_combine)
                first = tl.reduce(tl.where(take, r, BLOCK_K), 0, tl.standard._elementwise_min)
                new_node = tl.reduce(tl.where(r == first, kid, 0), 0, tl.standard._sum_combine)
            active = accepted
            node = tl.where(accepted > 0, new_node, node)

        # bonus token: inverse CDF of p at `node` minus the children rejected there (none if still active)
        kid_of = (par[None, :] == node) & is_child[None, :] & (rank[None, :] == r[:, None])
        kid_tok = tl.reduce(tl.where(kid_of, tok_v[None, :], 0), 1, tl.standard._sum_combine)
        inactive = (active == 0).to(tl.int32)
        rejected = tl.reduce(kid_of.to(tl.int32), 1, tl.standard._sum_combine) * inactive > 0
        row_p = probs_ptr + b * sp_b + node.to(tl.int64) * sp_m
        total = zero.to(tl.float64)
        last = zero  # last token with mass (0 if none)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            p = tl.load(row_p + v * sp_v, mask=v < V, other=0.0).to(tl.float64)
            hit = tl.reduce(((v[:, None] == kid_tok[None, :]) & rejected[None, :]).to(tl.int32), 1,
                            tl.standard._sum_combine) > 0
            p = tl.where(hit, 0.0, p)
            total += tl.reduce(p, 0, tl.standard._sum_combine)
            last = tl.maximum(last, tl.reduce(tl.where(p > 0.0, v, 0), 0, tl.standard._elementwise_max))
        threshold = tl.load(fu_ptr + b * sfu_b).to(tl.float64) * total
        below = zero  # tokens whose CDF is <= threshold: the drawn token is the first one above it
        carry = zero.to(tl.float64)
        for v0 in range(0, V, BLOCK_V):
            v = v0 + tl.arange(0, BLOCK_V)
            p = tl.load(row_p + v * sp_v, mask=v < V, other=0.0).to(tl.float64)
            hit = tl.reduce(((v[:, None] == kid_tok[None, :]) & rejected[None, :]).to(tl.int32), 1,
                            tl.standard._sum_combine) > 0
            p = tl.where(hit, 0.0, p)
            cdf = carry + tl.associative_scan(p, 0, tl.standard._sum_combine)
            below += tl.reduce(((cdf <= threshold) & (v < V)).to(tl.int32), 0, tl.standard._sum_combine)
            carry += tl.reduce(p, 0, tl.standard._sum_combine)
        bonus = tl.minimum(below, last).to(tl.int64)  # rounding can put the threshold on the total
    else:
        argmax = tl.load(am_ptr + b * sam_b + i * sam_m, mask=i_ok, other=0)
        is_parent = par[:, None] == i[None, :]  # [M, M]: j is the parent of i
        parent_argmax = tl.reduce(tl.where(is_parent, argmax[None, :], 0), 1, tl.standard._sum_combine)
        correct = ((val & (tok == parent_argmax)) | (i == 0)) & i_ok
        on_path = correct.to(tl.int32)
        for _ in range(0, D):  # one level of ancestry per step
            on_path = correct.to(tl.int32) * tl.reduce(tl.where(is_parent, on_path[None, :], 0), 1,
                                                        tl.standard._sum_combine)
        key = tl.where(on_path > 0, dep * M + (M - 1 - i), -1)  # deepest, then lowest index: unique
        best = tl.reduce(key, 0, tl.standard._elementwise_max)
        node = tl.reduce(tl.where(key == best, i, BLOCK_M), 0, tl.standard._elementwise_min)
        bonus = tl.reduce(tl.where(i == node, argmax, 0), 0, tl.standard._sum_combine).to(tl.int64)

    # Acceptance: path = root .. node (slots after accept_len repeat node), tokens = path[1:] tokens + bonus
    accept_len = tl.reduce(tl.where(i == node, dep, 0), 0, tl.standard._sum_combine).to(tl.int64)
    s = tl.arange(0, BLOCK_P)
    path = tl.full([BLOCK_P], 0, tl.int64) + node
    out = tl.where(s == accept_len, bonus, -1)
    cur = node
    for t in range(0, D + 1):
        path = tl.where(s == accept_len - t, cur, path)
        cur_tok = tl.reduce(tl.where(i == cur, tok, 0), 0, tl.standard._sum_combine)
        out = tl.where(s == accept_len - t - 1, cur_tok, out)
        cur = tl.reduce(tl.where(i == cur, par, 0), 0, tl.standard._sum_combine)
    tl.store(len_ptr + b * sl_b, accept_len)
    tl.store(path_ptr + b * sph_b + s * sph_s, path, mask=s < D + 1)
    tl.store(out_ptr + b * so_b + s * so_s, out, mask=s < D + 1)


def _check_tree(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor,
                max_depth: int) -> None:
    if tokens.dim() != 2 or any(t.shape != tokens.shape for t in (parents, depth, valid)):
        raise ValueError(f"accept: tokens {tuple(tokens.shape)}, parents {tuple(parents.shape)}, depth "
                         f"{tuple(depth.shape)} and valid {tuple(valid.shape)} should all be [B, M]")
    if any(t.dtype != torch.int64 for t in (tokens, parents, depth)) or valid.dtype != torch.bool:
        raise ValueError(f"accept: tokens/parents/depth must be int64 and valid bool; got {tokens.dtype}, "
                         f"{parents.dtype}, {depth.dtype}, {valid.dtype}")
    if max_depth < 0:
        raise ValueError(f"accept: max_depth={max_depth}; the tree depth D must be >= 0")


def _check_sample(tokens: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor,
                  final_uniform: torch.Tensor, max_depth: int) -> None:
    b, m = tokens.shape
    if probs.dim() != 3 or tuple(probs.shape[:2]) != (b, m) or not probs.is_floating_point():
        raise ValueError(f"accept_sample: probs {tuple(probs.shape)} {probs.dtype} should be float [B, M, V] "
                         f"with B, M = {b}, {m}")
    if (uniforms.dim() != 3 or uniforms.shape[0] != b or uniforms.shape[1] < max_depth
            or uniforms.shape[2] < 1):
        raise ValueError(f"accept_sample: uniforms {tuple(uniforms.shape)} should be [B, D, K] with B = {b}, "
                         f"D >= max_depth = {max_depth}, K >= 1")
    if final_uniform.shape != (b,):
        raise ValueError(f"accept_sample: final_uniform {tuple(final_uniform.shape)} should be [B] = [{b}]")


def _outputs(tokens: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = tokens.shape[0]
    return (tokens.new_empty(b), tokens.new_empty(b, max_depth + 1), tokens.new_empty(b, max_depth + 1))


def accept_greedy_reference(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                            valid: torch.Tensor, target_logits: torch.Tensor, max_depth: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`core.verify.verify_greedy` on the tree given as tensors.

    Args:
        tokens, parents, depth: [B, M] int64 draft tree (INTERNALS.md "Draft tree"); valid: [B, M] bool.
        target_logits: [B, M, V] target logits at every node.
        max_depth: D, the deepest level of the tree.

    Returns:
        accept_len [B], path [B, D + 1], tokens [B, D + 1] (int64; INTERNALS.md "Verification").
    """
    # imported here: the runtime imports the kernels, not the other way round at import time
    from eagle_compile.core.verify import verify_greedy

    _check_tree(tokens, parents, depth, valid, max_depth)
    tree = SimpleNamespace(tokens=tokens, parents=parents, depth=depth, valid=valid, max_depth=max_depth)
    acc = verify_greedy(tree, target_logits)
    return acc.accept_len, acc.path, acc.tokens


def accept_sample_reference(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                            valid: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor,
                            final_uniform: torch.Tensor, max_depth: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`core.verify.verify_sample` on the tree given as tensors.

    Args:
        tokens, parents, depth, valid, max_depth: the draft tree, as in `accept_greedy_reference`.
        probs: [B, M, V] target distribution at every node (after temperature / top-k / top-p).
        uniforms: [B, D', K] in [0, 1), D' >= D; uniforms[:, d, k] decides the k-th child tried at depth d+1.
        final_uniform: [B] in [0, 1), draws the bonus token.

    Returns:
        accept_len [B], path [B, D + 1], tokens [B, D + 1] (int64).
    """
    from eagle_compile.core.verify import verify_sample

    _check_tree(tokens, parents, depth, valid, max_depth)
    _check_sample(tokens, probs, uniforms, final_uniform, max_depth)
    tree = SimpleNamespace(tokens=tokens, parents=parents, depth=depth, valid=valid, max_depth=max_depth)
    acc = verify_sample(tree, probs, uniforms, final_uniform)
    return acc.accept_len, acc.path, acc.tokens


def _launch(tokens, parents, depth, valid, argmax, probs, uniforms, final_uniform, max_depth, sample, out,
            interpret, block_v):
    b, m = tokens.shape
    if interpret is None:
        interpret = tokens.device.type != "cuda" or _dispatch.interpreter_requested()
    if out is None:
        out = _outputs(tokens, max_depth)
    accept_len, path, emitted = out
    valid_u8 = valid.view(torch.uint8)
    vocab = probs.shape[2] if sample else 1
    children = uniforms.shape[2] if sample else 1
    if block_v is None:
        block_v = min(1024, _dispatch.next_power_of_2(vocab))
    probs_strides = probs.stride() if sample else (0, 0, 0)
    u_strides = uniforms.stride() if sample else (0, 0, 0)
    _dispatch.kernel(_accept_kernel, interpret)[(b,)](
        tokens, parents, depth, valid_u8, argmax, probs, uniforms, final_uniform,
        accept_len, path, emitted,
        *tokens.stride(), *parents.stride(), *depth.stride(), *valid_u8.stride(), *argmax.stride(),
        *probs_strides, *u_strides, final_uniform.stride(0) if sample else 0,
        accept_len.stride(0), *path.stride(), *emitted.stride(),
        m, vocab, max_depth, children,
        SAMPLE=sample, BLOCK_M=_dispatch.next_power_of_2(m), BLOCK_K=_dispatch.next_power_of_2(children),
        BLOCK_V=block_v, BLOCK_P=_dispatch.next_power_of_2(max_depth + 1),
    )
    return out


def accept_greedy_triton(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                         valid: torch.Tensor, target_logits: torch.Tensor, max_depth: int, *,
                         out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                         interpret: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch argmax over V, then the Triton kernel for the path matching.

    Args:
        tokens, parents, depth: [B, M] int64; valid: [B, M] bool; one program per row holds M nodes.
        target_logits: [B, M, V] any float dtype.
        max_depth: D.
        out: optional (accept_len [B], path [B, D+1], tokens [B, D+1]) int64 buffers (tests poison them).
        interpret: run through the Triton interpreter; default: unless the tensors are on CUDA.

    Returns:
        (accept_len, path, tokens) as in `accept_greedy_reference`.
    """
    _check_tree(tokens, parents, depth, valid, max_depth)
    argmax = target_logits.argmax(dim=-1)  # [B, M]
    return _launch(tokens, parents, depth, valid, argmax, argmax, argmax, argmax, max_depth, False, out,
                   interpret, None)


def accept_sample_triton(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                         valid: torch.Tensor, probs: torch.Tensor, uniforms: torch.Tensor,
                         final_uniform: torch.Tensor, max_depth: int, *,
                         out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                         interpret: bool | None = None, block_v: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the Triton kernel in sampling mode.

    Args:
        tokens, parents, depth, valid, max_depth: the draft tree as in `accept_greedy_triton`.
        probs: [B, M, V] float (fp32 or fp64; read and accumulated in fp64).
        uniforms: [B, D', K] float, D' >= D; K = children tried per node (tile of next pow2 of K).
        final_uniform: [B] float.
        out: optional (accept_len, path, tokens) int64 buffers.
        interpret: run through the Triton interpreter; default: unless the tensors are on CUDA.
        block_v: vocabulary tile, default min(1024, next pow2 of V).

    Returns:
        (accept_len, path, tokens) as in `accept_sample_reference`.
    """
    _check_tree(tokens, parents, depth, valid, max_depth)
    _check_sample(tokens, probs, uniforms, final_uniform, max_depth)
    return _launch(tokens, parents, depth, valid, tokens, probs, uniforms, final_uniform, max_depth, True,
                   out, interpret, block_v)


@torch.library.custom_op("eagle31::accept_greedy", mutates_args=())
def accept_greedy(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor,
                  target_logits: torch.Tensor,
                  max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accept_len [B], path [B, D+1], tokens [B, D+1]) of greedy verification (see the module doc)."""
    choice = _dispatch.choose(tokens.device, dtypes=None)
    if choice.impl == _dispatch.REFERENCE:
        outs = accept_greedy_reference(tokens, parents, depth, valid, target_logits, max_depth)
        return tuple(t.contiguous() for t in outs)
    return accept_greedy_triton(tokens, parents, depth, valid, target_logits, max_depth,
                                interpret=choice.impl == _dispatch.INTERPRETER)


@accept_greedy.register_fake
def _(tokens, parents, depth, valid, target_logits, max_depth):
    _check_tree(tokens, parents, depth, valid, max_depth)
    return _outputs(tokens, max_depth)


@torch.library.custom_op("eagle31::accept_sample", mutates_args=())
def accept_sample(tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, valid: torch.Tensor,
                  probs: torch.Tensor, uniforms: torch.Tensor, final_uniform: torch.Tensor,
                  max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accept_len [B], path [B, D+1], tokens [B, D+1]) of lossless tree sampling (see the module doc)."""
    choice = _dispatch.choose(tokens.device, dtypes=None)
    if choice.impl == _dispatch.REFERENCE:
        outs = accept_sample_reference(tokens, parents, depth, valid, probs, uniforms, final_uniform,
                                       max_depth)
        return tuple(t.contiguous() for t in outs)
    return accept_sample_triton(tokens, parents, depth, valid, probs, uniforms, final_uniform, max_depth,
                                interpret=choice.impl == _dispatch.INTERPRETER)


@accept_sample.register_fake
def _(tokens, parents, depth, valid, probs, uniforms, final_uniform, max_depth):
    _check_tree(tokens, parents, depth, valid, max_depth)
    _check_sample(tokens, probs, uniforms, final_uniform, max_depth)
    return _outputs(tokens, max_depth)
