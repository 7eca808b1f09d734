"""The EAGLE-3 / EAGLE 3.1 draft head (EAGLE31_SPEC.md §1.2-§1.6, §2.1-§2.5).

One draft step, per position (``e`` token embedding, ``g`` hidden input, both ``[.., H]``)::

    gn = hidden_norm(g);  r = gn if norm_before_residual else g
    h  = r + attn(cat([input_layernorm(e), gn]))          # q/k/v read 2H, o_proj writes H
    o  = h + mlp(post_attention_layernorm(h))
    n  = norm(o);  logits = lm_head(n)                     # never normalised a second time
    feedback = n if norm_output else o                     # EAGLE 3.1 post-norm feedback

``g`` is ``fuse(features)`` for target features (input_norm -> per-feature fc_norm -> fc) and the previous
step's ``feedback`` otherwise. Module names make ``state_dict()`` keys equal the official EAGLE-3 layout
(``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``); the embedding is the target's, frozen,
and never part of the state dict.

The KV cache is static (docs/INTERNALS.md): ``keys/values [B, n_kv_heads, slots, head_dim]``, new keys are
written into explicit ``write_slots`` (``eagle31::kv_write``). Queries see what a ``SlotMask`` (core/masks.py:
committed prefix + the block's own slots) describes, through ``eagle31::tree_attention``, which reads only the
live slots; a dense additive ``[B, 1, T, slots]`` mask (arbitrary visibility, tests) runs SDPA over all slots.

``reference_fuse`` and ``draft_step_reference`` at the bottom are the literal §2.5 computation (append-style
cache, explicit per-head softmax); tests compare the module against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import eagle_compile.kernels  # noqa: F401  (registers torch.ops.eagle31.*)
from eagle_compile.draft.config import DraftConfig
from eagle_compile.kernels import kv_write


@dataclass
class DraftKV:
    """The draft's static KV cache (one layer). ``slot`` = RoPE position of the token in its row."""

    keys: torch.Tensor  # [batch, n_kv_heads, slots, head_dim]
    values: torch.Tensor  # [batch, n_kv_heads, slots, head_dim]
    probe: Any = None   # a draft.drift.DriftProbe while a monitored tree level runs (host-loop step only)


@dataclass
class DraftStepOutput:
    feedback: torch.Tensor  # [batch, tokens, hidden]: the hidden input of the next draft step
    normed: torch.Tensor  # [batch, tokens, hidden]: norm(o), the input of lm_head


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, reduced in at least fp32 and cast back before the weight (as HF)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class DraftMLP(nn.Module):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DraftAttention(nn.Module):
    """Self-attention whose q/k/v read the 2H concat ``[e', g']``; GQA over a static slot cache."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        two_h, hd = 2 * config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        bias = config.attention_bias
        self.q_proj = nn.Linear(two_h, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(two_h, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(two_h, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, config.hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,  # [batch, tokens, 2 * hidden]
        cos: torch.Tensor,  # [batch, tokens, head_dim]
        sin: torch.Tensor,  # [batch, tokens, head_dim]
        kv: DraftKV,
        write_slots: torch.Tensor,  # [batch, tokens] int64
        attn_mask,  # SlotMask, or [batch, 1, tokens, slots] additive
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        kv_write.write(kv.keys, kv.values, write_slots, k, v)
        if not isinstance(attn_mask, torch.Tensor):
            if kv.probe is not None:
                kv.probe.attention(q, kv.keys, attn_mask, self.head_dim ** -0.5)
            out = torch.ops.eagle31.tree_attention(q.to(kv.keys.dtype), kv.keys, kv.values, attn_mask.base,
                                                   attn_mask.local, self.head_dim ** -0.5)
            return self.project_out(out.to(q.dtype))
        groups = self.num_heads // self.num_kv_heads
        keys = kv.keys.to(q.dtype).repeat_interleave(groups, dim=1)  # [batch, heads, slots, head_dim]
        values = kv.values.to(q.dtype).repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask.to(q.dtype))
        return self.project_out(out)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[B, T, 2H] -> q [B, Hq, T, hd], k and v [B, Hkv, T, hd], RoPE applied to q and k (shared by the
        cached inference path and training's block attention, `eagle_compile/train/ttt.py`)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.project_kv(x, cos, sin)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k, v

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """[B, T, 2H] -> k, v [B, Hkv, T, hd], RoPE applied to k."""
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return k * cos + _rotate_half(k) * sin, v

    def project_out(self, attn: torch.Tensor) -> torch.Tensor:
        """[B, Hq, T, hd] attention output -> [B, T, H]."""
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class EagleMidLayer(nn.Module):
    """The single 2H decoder layer (§1.3); returns the pre-final-norm residual stream ``o``."""

    def __init__(self, config: DraftConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = DraftMLP(config)

    def forward(self, embeds, hidden, cos, sin, kv, write_slots, attn_mask) -> torch.Tensor:
        hidden_n = self.hidden_norm(hidden)
        residual = hidden_n if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), hidden_n], dim=-1)  # embedding first (§1.3)
        h = residual + self.self_attn(x, cos, sin, kv, write_slots, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def fill(self, embeds, hidden, cos, sin, kv, write_slots) -> None:
        """Only the K/V `forward` writes for these positions (they depend on the layer's input alone)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        k, v = self.self_attn.project_kv(x, cos, sin)
        kv_write.write(kv.keys, kv.values, write_slots, k, v)


class TargetEmbedding(nn.Module):
    """The target's token embedding ``[V, H]``: frozen, a non-persistent buffer (never saved by state_dict).

    ``owned`` is True when the table came from the draft checkpoint itself (speculators files may carry
    ``embed_tokens.weight``); only then does the speculators saver write it back.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", None, persistent=False)
        self.owned = False

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            raise RuntimeError(
                "the draft head has no token embedding: EAGLE-3 heads use the target's embedding table. "
                "Call draft.tie_target_embedding(target_model) (or load_draft(path, target=...)) first."
            )
        return F.embedding(input_ids, self.weight)


class EagleDraftModel(nn.Module):
    """EAGLE-3 draft head with the EAGLE 3.1 flags (``config.fc_norm``, ``config.norm_output``, ...)."""

    def __init__(self, config: DraftConfig, *, embed_tokens: torch.Tensor | nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        h, ht, eps = config.hidden_size, config.target_hidden_size, config.rms_norm_eps
        a = config.num_features
        if config.use_aux_hidden_state:
            self.fc = nn.Linear(a * ht, h, bias=False)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(ht, eps) for _ in range(a))
        if config.norm_before_fc:
            self.input_norm = RMSNorm(a * ht, eps)
        self.midlayer = EagleMidLayer(config)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        # Identity mapping until a checkpoint says otherwise: draft id j is target id j.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.embed_tokens = TargetEmbedding()
        self.source_dir = None  # the checkpoint folder `load_draft` read (its tree.json gives the default tree)
        self._build_rope()
        if embed_tokens is not None:
            self.tie_target_embedding(embed_tokens)

    # ---------------------------------------------------------------------------------------------
    def _build_rope(self) -> None:
        """transformers' LlamaRotaryEmbedding with the *draft* config's RoPE (§1.5), fp32 frequencies."""
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        device = self.lm_head.weight.device
        with torch.device("cpu"):
            rope = LlamaRotaryEmbedding(self.config.llama_config())
        self._inv_freq32 = rope.inv_freq.clone()  # plain attribute: the fp32 master copy
        self.rotary_emb = rope.to("cpu" if device.type == "meta" else device)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) would also cast the RoPE frequencies; keep them fp32 (HF computes angles in fp32).
        super()._apply(fn, recurse)
        device = self.rotary_emb.inv_freq.device
        self.rotary_emb.inv_freq = self._inv_freq32.to(device)
        self.rotary_emb.original_inv_freq = self._inv_freq32.to(device)
        return self

    def tie_target_embedding(self, target: torch.Tensor | nn.Module, *, owned: bool = False) -> None:
        """Use the target's input embedding (a model, an ``nn.Embedding`` or a ``[V, H]`` tensor), frozen."""
        if isinstance(target, torch.Tensor):
            weight = target
        elif hasattr(target, "get_input_embeddings"):
            weight = target.get_input_embeddings().weight
        else:
            weight = target.weight
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"the target embedding has shape {tuple(weight.shape)} but this draft head needs "
                f"[vocab_size, hidden_size] = {list(expected)}; a head with target_hidden_size != "
                "hidden_size or another vocabulary cannot share the target's table (it needs its own "
                "embed_tokens.weight)"
            )
        ref = self.lm_head.weight
        self.embed_tokens.weight = weight.detach().to(device=ref.device, dtype=ref.dtype)
        self.embed_tokens.owned = owned

    def new_kv(
        self,
        batch: int,
        slots: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> DraftKV:
        """A zero-filled draft KV cache ``[batch, n_kv_heads, slots, head_dim]`` (last slot = sentinel)."""
        ref = self.lm_head.weight
        shape = (batch, self.config.num_key_value_heads, slots, self.config.head_dim)
        kw = {"dtype": dtype or ref.dtype, "device": device if device is not None else ref.device}
        return DraftKV(keys=torch.zeros(shape, **kw), values=torch.zeros(shape, **kw))

    # ---------------------------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features ``[B, T, A*Ht]`` (capture order) -> draft hidden ``[B, T, H]`` (§2.3 order)."""
        cfg = self.config
        width = cfg.num_features * cfg.target_hidden_size
        if features.shape[-1] != width:
            raise ValueError(
                f"target features have width {features.shape[-1]}, expected num_features * "
                f"target_hidden_size = {cfg.num_features} * {cfg.target_hidden_size} = {width}"
            )
        if not cfg.use_aux_hidden_state:
            return features
        if cfg.norm_before_fc:
            features = self.input_norm(features)
        if cfg.fc_norm:
            chunks = features.split(cfg.target_hidden_size, dim=-1)
            features = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(features)

    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, tokens] int64, target-vocabulary ids
        hidden: torch.Tensor,  # [batch, tokens, hidden]: fuse(features) or the previous feedback
        position_ids: torch.Tensor,  # [batch, tokens]
        kv: DraftKV,
        write_slots: torch.Tensor,  # [batch, tokens] int64
        attn_mask,  # SlotMask (core/masks.py), or [batch, 1, tokens, slots] additive float: 0 attend, -inf blocked
    ) -> DraftStepOutput:
        """One draft step; writes this step's keys/values into ``kv`` at ``write_slots`` (in place)."""
        if write_slots.dtype != torch.int64:
            raise TypeError(f"write_slots must be int64 (scatter index), got {write_slots.dtype}")
        if hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"hidden has width {hidden.shape[-1]} but the draft hidden size is "
                f"{self.config.hidden_size}; call fuse() on target features first"
            )
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        o = self.midlayer(embeds, hidden, cos, sin, kv, write_slots, attn_mask)
        normed = self.norm(o)
        return DraftStepOutput(feedback=normed if self.config.norm_output else o, normed=normed)

    def fill(
        self,
        input_ids: torch.Tensor,  # [batch, tokens] int64
        hidden: torch.Tensor,  # [batch, tokens, hidden]
        position_ids: torch.Tensor,  # [batch, tokens]
        kv: DraftKV,
        write_slots: torch.Tensor,  # [batch, tokens] int64
    ) -> None:
        """Write the K/V that ``forward`` would write for these positions, and nothing else.

        A position's K/V depend only on its own input (token embedding and hidden), not on what it attends to,
        so catching the draft up over a prompt needs the attention, MLP and norms of no position but the last:
        this is ~0.3 of a full draft forward (the fc, k_proj and v_proj GEMMs)."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        self.midlayer.fill(embeds, hidden, cos, sin, kv, write_slots)

    def logits(self, normed: torch.Tensor, small_rows_product: bool = True) -> torch.Tensor:
        """Draft-vocabulary logits ``[B, T, Vd]`` of ``normed`` (= ``norm(o)``; never normalised again).

        A few rows on CPU (a draft tree level: K frontier nodes) go through ``W @ x.T``: MKL's GEMM for 2-16 rows
        against the [Vd, H] head is 1.8x slower than that product (8192 x 576, 3 rows: 6.6 vs 3.7 ms, 1 thread),
        and the lm_head is most of a draft level's cost. One row and many rows (training) keep ``F.linear``, and so does
        ``small_rows_product=False`` (the batch-invariant numerics: their own kernel is faster than both)."""
        rows = normed.numel() // normed.shape[-1]
        if (not small_rows_product or normed.device.type != "cpu" or not 2 <= rows <= 16
                or self.lm_head.bias is not None):
            return self.lm_head(normed)
        flat = normed.reshape(rows, normed.shape[-1])
        return torch.mm(self.lm_head.weight, flat.t()).t().reshape(*normed.shape[:-1], -1)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids: ``j + d2t[j]`` (§1.4)."""
        return draft_ids + self.d2t[draft_ids]


# ---------------------------------------------------------------------------------------------------
# Literal reference of EAGLE31_SPEC §2.5 (test oracle): an append-style cache, per-head loops, explicit
# softmax. Written independently of the module code above; only the weights are shared.


def untrained_head(target: nn.Module, *, seed: int = 0) -> EagleDraftModel:
    """A random-weight (seed `seed`) EAGLE 3.1 head sized for `target` (full vocabulary), in its dtype, eval mode,
    tied to its embedding: what the demo and the benchmarks run when no trained head ships, and what tests save."""
    from eagle_compile.draft.config import DraftConfig

    torch.manual_seed(seed)
    head = EagleDraftModel(DraftConfig.for_target(target.config, None, fc_norm=True, norm_output=True))
    head = head.to(next(target.parameters()).dtype).eval()
    head.tie_target_embedding(target)
    return head


def _rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return w * (x32 / torch.sqrt((x32 * x32).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_fuse(model: EagleDraftModel, features: torch.Tensor) -> torch.Tensor:
    """§2.5 ``is_first`` branch: ``[B, T, A*Ht] -> [B, T, H]``."""
    cfg, eps = model.config, model.config.rms_norm_eps
    if not cfg.use_aux_hidden_state:
        return features
    if cfg.norm_before_fc:
        features = _rms_reference(features, model.input_norm.weight, eps)
    if cfg.fc_norm:
        chunks = features.chunk(cfg.num_features, dim=-1)
        features = torch.cat(
            [_rms_reference(c, model.fc_norm[i].weight, eps) for i, c in enumerate(chunks)], dim=-1
        )
    return features @ model.fc.weight.T


def draft_step_reference(
    model: EagleDraftModel,
    tok_ids: torch.Tensor,  # [B, T]
    g_in: torch.Tensor,  # [B, T, A*Ht] when is_first else [B, T, H]
    positions: torch.Tensor,  # [B, T]
    is_first: bool,
    past: tuple[torch.Tensor, torch.Tensor] | None = None,  # keys, values [B, n_kv, P, hd] after RoPE
    allowed: torch.Tensor | None = None,  # [B, T, P + T] bool; default: all past + causal within the step
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Returns ``(logits_draft [B,T,Vd], g_next [B,T,H], (keys, values) incl. this step)``."""
    cfg, eps = model.config, model.config.rms_norm_eps
    W = model.midlayer
    g = reference_fuse(model, g_in) if is_first else g_in
    e = model.embed_tokens.weight[tok_ids]
    gn = _rms_reference(g, W.hidden_norm.weight, eps)
    r = gn if cfg.norm_before_residual else g
    x = torch.cat([_rms_reference(e, W.input_layernorm.weight, eps), gn], dim=-1)

    b, t, _ = x.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    att = W.self_attn
    q = x @ att.q_proj.weight.T
    k = x @ att.k_proj.weight.T
    v = x @ att.v_proj.weight.T
    if cfg.attention_bias:
        q, k, v = q + att.q_proj.bias, k + att.k_proj.bias, v + att.v_proj.bias
    q = q.view(b, t, nh, hd).transpose(1, 2)
    k = k.view(b, t, nkv, hd).transpose(1, 2)
    v = v.view(b, t, nkv, hd).transpose(1, 2)

    if cfg.rope_scaling is None:
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        scale = 1.0
    else:  # scaled RoPE variants: frequencies from transformers (the formulas are theirs)
        inv_freq, scale = model.rotary_emb.inv_freq.cpu(), model.rotary_emb.attention_scaling
    angles = positions.float()[..., None] * inv_freq.to(positions.device)  # fp32 angles, as HF
    angles = torch.cat([angles, angles], dim=-1)
    cos = (angles.cos() * scale).to(x.dtype)[:, None]
    sin = (angles.sin() * scale).to(x.dtype)[:, None]

    def rope(y):
        y1, y2 = y[..., : hd // 2], y[..., hd // 2 :]
        return y * cos + torch.cat([-y2, y1], dim=-1) * sin

    q, k = rope(q), rope(k)
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    p = k.shape[2] - t
    if allowed is None:
        allowed = torch.ones(t, p + t, dtype=torch.bool, device=x.device).tril(diagonal=p).expand(b, t, p + t)

    heads = []
    for head in range(nh):
        kvh = head // (nh // nkv)
        scores = (q[:, head] @ k[:, kvh].transpose(-1, -2)) / hd**0.5  # [B, T, P+T]
        scores = scores.masked_fill(~allowed, float("-inf"))
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        probs = torch.exp(scores - scores.amax(-1, keepdim=True))
        probs = (probs / probs.sum(-1, keepdim=True)).to(x.dtype)
        heads.append(probs @ v[:, kvh])
    attn = torch.cat(heads, dim=-1) @ att.o_proj.weight.T
    if cfg.attention_bias:
        attn = attn + att.o_proj.bias
    h = r + attn
    mlp = W.mlp
    y = _rms_reference(h, W.post_attention_layernorm.weight, eps)
    o = h + (F.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    n = _rms_reference(o, model.norm.weight, eps)
    logits_draft = n @ model.lm_head.weight.T
    g_next = n if cfg.norm_output else o
    return logits_draft, g_next, (k, v)
