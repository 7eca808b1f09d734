"""A fresh draft head for a target, and the trained head written in the official EAGLE-3 layout."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from eagle_compile.draft.checkpoint import save_draft
from eagle_compile.draft.config import DraftConfig
from eagle_compile.draft.model import EagleDraftModel


def build_head(target: nn.Module, *, d2t: torch.Tensor, t2d: torch.Tensor, flags: dict[str, bool],
               capture_indices: tuple[int, ...] | None, lm_head_init: str, freeze_lm_head: bool,
               dtype: torch.dtype, seed: int) -> EagleDraftModel:
    """A one-layer head shaped like ``target`` with the given vocabulary mapping and flags.

    ``lm_head_init="random"`` keeps PyTorch's init (the official trainer); ``"target"`` copies the target's
    lm_head rows of the draft vocabulary (speculators). fc_norm weights start at 1 (EAGLE31_SPEC.md §6.5).
    The embedding is the target's, frozen.
    """
    overrides = dict(flags)
    if capture_indices is not None:
        overrides["capture_indices"] = tuple(capture_indices)
    config = DraftConfig.for_target(target.config, int(d2t.numel()), **overrides)
    device = target.get_output_embeddings().weight.device
    torch.manual_seed(seed)
    model = EagleDraftModel(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        if lm_head_init == "target":
            rows = target.get_output_embeddings().weight.detach()[t2d.to(device)]
            model.lm_head.weight.copy_(rows.to(dtype))
    model.lm_head.weight.requires_grad_(not freeze_lm_head)
    model.tie_target_embedding(target)
    return model


def save_head(model: EagleDraftModel, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """``config.json`` (flags included) + ``model.safetensors`` in the official EAGLE-3 layout."""
    if dtype is not None and dtype != model.lm_head.weight.dtype:
        model = copy.deepcopy(model).to(dtype)
    save_draft(model, path, layout="eagle3")
    return Path(path)
