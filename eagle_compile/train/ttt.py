"""Training-time test (TTT): ``L`` unrolled draft steps over whole sequences at once (EAGLE31_SPEC.md §6.3).

Vocabulary: index ``t`` of a sequence ``x_0 .. x_{T-1}``, target feature ``h_t`` (A capture indices), step ``i``
of the unrolled chain (``i = 0 .. L-1``). At every index t in parallel:

    step 0:  hidden = fuse(h_t),               token x_{t+1},   RoPE position t      (the catch-up pass)
    step i:  hidden = feedback of step i-1 at t, token x_{t+1+i}, RoPE position t+i    (chain step i)

``feedback`` is the pre-norm decoder output ``o`` (EAGLE-3) or ``norm(o)`` with ``norm_output`` (EAGLE 3.1);
tokens past the end are 0 (inputs shifted left by one per step, zero padded). Step i at index t predicts
``x_{t+2+i}``: exactly what inference computes at chain depth i+1 after a catch-up over ``0..t``, because the
query of step i at t attends to

* the step-0 keys at indices ``<= t`` (the catch-up KV of the prefix, causal, padding masked), and
* its own keys of steps ``1..i`` at the **same** index t (the chain's earlier draft tokens),

the block-diagonal "suffix" pattern. As one dense mask over ``(i+1)*T`` keys (flex-attention form:
``kv < T and q >= kv`` or ``kv >= T and (kv - q) % T == 0``), T = 3, step 2::

                 step-0 keys   step-1 keys   step-2 keys
      q \\ kv     0  1  2       3  4  5       6  7  8
      t = 0      1  .  .       1  .  .       1  .  .
      t = 1      1  1  .       .  1  .       .  1  .
      t = 2      1  1  1       .  .  1       .  .  1

`ttt_attention_mask` builds that mask (documentation and test oracle); `block_attention` computes the same
attention without materialising it: the causal scores against the step-0 keys plus one score per earlier
step against the keys at the same index, one softmax over both (fp32 or wider).

Every weight is the `EagleDraftModel`'s own (fuse, midlayer norms, q/k/v/o projections, MLP, norm, RoPE), so
a trained head is the module inference runs; tests/train/test_ttt_inference.py checks the outputs against
the module's KV-cache chain in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle_compile.draft.model import EagleDraftModel


@dataclass
class TTTStep:
    """One unrolled step at every index."""

    normed: torch.Tensor  # [B, T, H]: norm(o), the lm_head input (step i at t predicts x_{t+2+i})
    feedback: torch.Tensor  # [B, T, H]: hidden input of step i+1


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x[:, n:]`` followed by ``n`` zeros (False) along dim 1: ``out[:, t] = x[:, t + n]``."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n]) if n <= x.shape[1] else torch.zeros_like(x)
    return torch.cat([x[:, n:], pad], dim=1)[:, : x.shape[1]]


def causal_visibility(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool: query t sees step-0 keys ``j <= t`` that are real.

    A padded query sees every key ``j <= t`` (its output is never used; this only keeps its row non-empty).
    """
    t = attention_mask.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
    real_q, real_k = attention_mask[:, :, None], attention_mask[:, None, :]
    return (causal & (real_k | ~real_q))[:, None]


def ttt_attention_mask(attention_mask: torch.Tensor, step: int) -> torch.Tensor:
    """Dense ``[B, T, (step+1)*T]`` bool mask of step ``step`` over the keys of steps ``0..step`` (docstring)."""
    t = attention_mask.shape[1]
    q = torch.arange(t, device=attention_mask.device)[:, None]
    kv = torch.arange((step + 1) * t, device=attention_mask.device)[None, :]
    own = (kv >= t) & ((kv - q) % t == 0)  # [T, (step+1)T]
    causal = causal_visibility(attention_mask)[:, 0]  # [B, T, T]
    rest = torch.zeros(attention_mask.shape[0], t, step * t, dtype=torch.bool, device=attention_mask.device)
    return torch.cat([causal, rest], dim=-1) | own


def block_attention(
    q: torch.Tensor,  # [B, nh, T, hd]
    keys: list[torch.Tensor],  # steps 0..i, each [B, nkv, T, hd] (after RoPE)
    values: list[torch.Tensor],  # steps 0..i, each [B, nkv, T, hd]
    visible: torch.Tensor,  # [B, 1, T, T] bool, step-0 visibility (causal_visibility)
) -> torch.Tensor:
    """Attention of one TTT step over the block-diagonal pattern; returns ``[B, nh, T, hd]``."""
    groups = q.shape[1] // keys[0].shape[1]
    k = [x.repeat_interleave(groups, dim=1) for x in keys]
    v = [x.repeat_interleave(groups, dim=1) for x in values]
    scale = q.shape[-1] ** -0.5
    causal = (q @ k[0].transpose(-1, -2)) * scale  # [B, nh, T, T]
    causal = causal.masked_fill(~visible, float("-inf"))
    own = [(q * kj).sum(-1, keepdim=True) * scale for kj in k[1:]]  # each [B, nh, T, 1]
    scores = torch.cat([causal, *own], dim=-1)
    probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
    t = causal.shape[-1]
    out = probs[..., :t] @ v[0]
    for j, vj in enumerate(v[1:]):
        out = out + probs[..., t + j : t + j + 1] * vj
    return out


def _step(model: EagleDraftModel, tokens, hidden, positions, keys, values, visible) -> torch.Tensor:
    """The midlayer (EAGLE31_SPEC.md §1.3) with block attention; appends this step's K/V; returns ``o``."""
    mid, att = model.midlayer, model.midlayer.self_attn
    embeds = model.embed_tokens(tokens).to(hidden.dtype)
    cos, sin = model.rotary_emb(hidden, positions)
    hidden_n = mid.hidden_norm(hidden)
    residual = hidden_n if mid.norm_before_residual else hidden
    x = torch.cat([mid.input_layernorm(embeds), hidden_n], dim=-1)  # embedding first
    q, k, v = att.project_qkv(x, cos, sin)
    keys.append(k)
    values.append(v)
    h = residual + att.project_out(block_attention(q, keys, values, visible))
    return h + mid.mlp(mid.post_attention_layernorm(h))


def ttt_forward(
    model: EagleDraftModel,
    features: torch.Tensor,  # [B, T, A*Ht] target features at capture indices (any float dtype)
    input_ids: torch.Tensor,  # [B, T] int64 sequence x_0..x_{T-1} (not shifted)
    attention_mask: torch.Tensor,  # [B, T] bool, right padding
    steps: int,
) -> list[TTTStep]:
    """Run ``steps`` unrolled draft steps; gradients flow through the feedback and the earlier keys."""
    dtype = model.lm_head.weight.dtype
    b, t = input_ids.shape
    hidden = model.fuse(features.to(dtype))
    visible = causal_visibility(attention_mask)
    index = torch.arange(t, device=input_ids.device).expand(b, t)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    out = []
    for i in range(steps):
        o = _step(model, shift_left(input_ids, 1 + i), hidden, index + i, keys, values, visible)
        normed = model.norm(o)
        hidden = normed if model.config.norm_output else o
        out.append(TTTStep(normed=normed, feedback=hidden))
    return out
