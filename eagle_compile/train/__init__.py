"""Training EAGLE-3 / EAGLE 3.1 draft heads (EAGLE31_SPEC.md §6, DESIGN.md §5): ``eagle31 train``.

    config = TrainConfig(preset="eagle31", output_dir="runs/smollm2")   # defaults: the embedded target
    trainer = Trainer(config); trainer.train()                           # resumable; head in runs/smollm2/head

Pieces: `data` (conversations, loss mask, batches), `draft_vocab` (d2t/t2d from reply-token counts),
`regenerate` (self-distillation), `features` (target features through the captured program),
`feature_cache` (offline shards), `ttt` (the unrolled training-time test), `loss` (per-step soft CE),
`schedule`, `state` (resumable checkpoints), `evaluate`, `head`, `trainer`, `cli`.
"""

from eagle_compile.train.config import TrainConfig
from eagle_compile.train.data import Sample, read_records, tokenize_records
from eagle_compile.train.draft_vocab import select_draft_vocab
from eagle_compile.train.evaluate import EvalResult, evaluate
from eagle_compile.train.feature_cache import FeatureCache, build_feature_cache
from eagle_compile.train.features import FeatureBatch, FeatureExtractor, TeacherHead
from eagle_compile.train.loss import batch_loss, teacher_targets, ttt_loss
from eagle_compile.train.regenerate import regenerate_responses
from eagle_compile.train.trainer import Trainer, train
from eagle_compile.train.ttt import ttt_attention_mask, ttt_forward

__all__ = [
    "EvalResult",
    "FeatureBatch",
    "FeatureCache",
    "FeatureExtractor",
    "Sample",
    "TeacherHead",
    "TrainConfig",
    "Trainer",
    "batch_loss",
    "build_feature_cache",
    "evaluate",
    "read_records",
    "regenerate_responses",
    "select_draft_vocab",
    "teacher_targets",
    "tokenize_records",
    "train",
    "ttt_attention_mask",
    "ttt_forward",
    "ttt_loss",
]
