"""A fresh draft head for a target, and the trained head written in the official EAGLE-3 layout."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from eagle_compile.draft.checkpoint import load_draft, save_draft
from eagle_compile.draft.config import DraftConfig
from eagle_compile.draft.model import EagleDraftModel
from eagle_compile.errors import OptionsError


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


def load_head_for_training(path: str | Path, target: nn.Module, *, flags: dict[str, bool],
                           capture_indices: tuple[int, ...] | None, freeze_lm_head: bool,
                           dtype: torch.dtype) -> EagleDraftModel:
    """A trained head to fine-tune: its weights and draft vocabulary, checked against the run's settings.

    The head's flags must be the preset's and its capture indices the requested ones (when given): a
    fine-tuned head that silently changed architecture would not be the head the command asked for.
    """
    model = load_draft(path, target=target, dtype=dtype, device=target.get_output_embeddings().weight.device)
    theirs = {name: getattr(model.config, name) for name in flags}
    if theirs != flags:
        raise OptionsError(f"--init-head {path} has flags {theirs}, but this run trains {flags}; pick the "
                           "preset the head was trained with (--eagle31 or --eagle3)")
    resolved = model.config.resolved_capture_indices(int(target.config.get_text_config().num_hidden_layers))
    if capture_indices is not None and tuple(capture_indices) != tuple(resolved):
        raise OptionsError(f"--init-head {path} taps capture indices {list(resolved)}, but "
                           f"--capture-indices {list(capture_indices)} was given; drop --capture-indices")
    model.lm_head.weight.requires_grad_(not freeze_lm_head)
    model.tie_target_embedding(target)
    return model.train()


def save_head(model: EagleDraftModel, path: str | Path, dtype: torch.dtype | None = None) -> Path:
    """``config.json`` (flags included) + ``model.safetensors`` in the official EAGLE-3 layout."""
    if dtype is not None and dtype != model.lm_head.weight.dtype:
        model = copy.deepcopy(model).to(dtype)
    save_draft(model, path, layout="eagle3")
    return Path(path)
