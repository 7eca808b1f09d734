"""Target features for training, from the same captured program and passes as inference (DESIGN.md §5).

`FeatureExtractor` runs the target as `TargetProgram` (dynamo capture + ``locate_layers`` + ``tap_features``)
over right-padded ``[B, T]`` batches on a `SlotKVCache` of ``T + 1`` slots (the last one the sentinel that
padding writes to) with the runtime's causal mask. It asks the program for the head's capture indices plus
capture index N (the last layer's pre-norm output), so one forward gives, per position,

* ``features`` ``[B, T, A*Ht]``: what the head fuses, the very tensors inference feeds it;
* ``last_hidden`` ``[B, T, Ht]``: the teacher's source. `TeacherHead` turns it into the target's logits over
  the draft vocabulary, ``lm_head(norm(h_N))[t2d]`` (tests check this equals the program's logits);
* ``target_argmax`` ``[B, T]``: argmax of the full target logits (for the ``t2d[argmax]`` position mask).

Storing ``h_N`` instead of logits keeps an offline cache at ``(A+1)*Ht`` values a token (2,304 for
SmolLM2-135M) instead of ``V`` (49,152), and it does not depend on the draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle_compile.capture_indices import default_capture_indices, validate_capture_indices
from eagle_compile.core.masks import SlotMask
from eagle_compile.errors import UnsupportedModelError
from eagle_compile.runtime.kv_cache import SlotKVCache
from eagle_compile.runtime.target_program import TargetProgram
from eagle_compile.train.data import TokenBatch


@dataclass
class FeatureBatch:
    """A training batch with the target's features."""

    tokens: TokenBatch
    features: torch.Tensor  # [B, T, A*Ht]
    last_hidden: torch.Tensor  # [B, T, Ht]
    target_argmax: torch.Tensor  # [B, T] int64

    def to(self, device: torch.device | str) -> FeatureBatch:
        return FeatureBatch(self.tokens.to(device), self.features.to(device), self.last_hidden.to(device),
                            self.target_argmax.to(device))


def final_norm(target: nn.Module) -> nn.Module:
    """The target's final norm (``model.norm`` of HF Llama/Qwen2/Qwen3/Mistral causal LMs)."""
    base = getattr(target, "model", None)
    norm = getattr(base, "norm", None)
    if not isinstance(norm, nn.Module):
        raise UnsupportedModelError(
            f"{type(target).__name__} has no final norm at .model.norm; the teacher logits are computed as "
            "lm_head(model.norm(h_N)) (Llama, Qwen2, Qwen3, Mistral layouts)"
        )
    return norm


class TeacherHead(nn.Module):
    """The target's logits over the draft vocabulary from its last layer's pre-norm output h_N.

    ``lm_head(norm(h_N))`` restricted to the rows of ``t2d`` (all rows when ``t2d`` is None). The norm is the
    target's own module (shared, frozen); the selected rows are a frozen copy, in float32 at least (a bfloat16
    target's soft targets are computed from float32 rows).
    """

    def __init__(self, target: nn.Module, t2d: torch.Tensor | None) -> None:
        super().__init__()
        self.norm = final_norm(target)
        head = target.get_output_embeddings()
        rows = t2d.to(head.weight.device) if t2d is not None else slice(None)
        dtype = torch.promote_types(head.weight.dtype, torch.float32)
        self.register_buffer("weight", head.weight.detach()[rows].to(dtype, copy=True), persistent=False)
        bias = getattr(head, "bias", None)
        self.register_buffer("bias", bias.detach()[rows].to(dtype, copy=True) if bias is not None else None,
                             persistent=False)

    @torch.no_grad()
    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:  # [..., Ht] -> [..., Vd]
        return F.linear(self.norm(last_hidden.to(self.weight.dtype)), self.weight, self.bias)


class FeatureExtractor:
    """Runs the captured target program on token batches and returns `FeatureBatch` objects.

    ``rows`` pads every batch to that many rows (empty rows) so that the program sees one batch shape;
    together with ``pad_multiple`` on the sequence length this bounds the number of captured graphs.
    """

    def __init__(self, target: nn.Module, capture_indices: tuple[int, ...] | None, *, rows: int | None = None,
                 recompile_limit: int = 64) -> None:
        config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        n = int(config.num_hidden_layers)
        indices = (validate_capture_indices(capture_indices, n) if capture_indices is not None
                   else default_capture_indices(n))
        self.target = target
        self.capture_indices = tuple(indices)
        self.hidden_size = int(config.hidden_size)
        self._last_at = indices.index(n) if n in indices else len(indices)
        program_indices = indices if n in indices else (*indices, n)
        self.program = TargetProgram(target, program_indices, recompile_limit=recompile_limit)
        self.rows = rows

    @property
    def graphs_captured(self) -> int:
        return self.program.graphs_captured

    def __call__(self, batch: TokenBatch) -> FeatureBatch:
        real_rows, t = batch.input_ids.shape
        rows = max(self.rows or 0, real_rows)
        param = next(self.target.parameters())
        device, dtype = param.device, param.dtype
        input_ids = torch.zeros(rows, t, dtype=torch.int64, device=device)
        real = torch.zeros(rows, t, dtype=torch.bool, device=device)
        input_ids[:real_rows], real[:real_rows] = batch.input_ids.to(device), batch.attention_mask.to(device)
        pos = torch.arange(t, device=device).expand(rows, t)
        cache = SlotKVCache(self.target.config, rows, t + 1, dtype=dtype, device=device)
        mask = SlotMask.causal(torch.zeros(rows, dtype=torch.int64, device=device), t + 1)
        logits, taps = self.program(input_ids, torch.where(real, pos, 0), mask, torch.where(real, pos, t), cache)
        taps = taps[:real_rows]  # [B, T, (A or A+1)*Ht], capture order, then N unless N is a capture index
        width = len(self.capture_indices) * self.hidden_size
        last = taps[..., self._last_at * self.hidden_size : (self._last_at + 1) * self.hidden_size]
        return FeatureBatch(tokens=batch.to(device), features=taps[..., :width], last_hidden=last,
                            target_argmax=logits[:real_rows].argmax(-1))
