"""The EAGLE-3 / EAGLE 3.1 draft head: config, module, vocabulary mapping, checkpoints."""

from eagle_compile.draft.checkpoint import load_draft, save_draft
from eagle_compile.draft.config import DraftConfig
from eagle_compile.draft.model import DraftKV, DraftStepOutput, EagleDraftModel
from eagle_compile.draft.vocab import build_vocab_mapping, validate_vocab_mapping

__all__ = [
    "DraftConfig",
    "DraftKV",
    "DraftStepOutput",
    "EagleDraftModel",
    "build_vocab_mapping",
    "load_draft",
    "save_draft",
    "validate_vocab_mapping",
]
