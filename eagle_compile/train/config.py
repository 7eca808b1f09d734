"""`TrainConfig`: every knob of `eagle31 train`, in one frozen, validated dataclass (EAGLE31_SPEC.md §6).

Defaults train an EAGLE 3.1 head (``fc_norm`` + ``norm_output``) for the embedded default target
(SmolLM2-135M-Instruct) on ``../shared/data/train/instruct_mix.jsonl`` with the official TTT recipe: 7 unrolled
steps, per-step soft cross-entropy weighted ``0.8**i``, AdamW (0.9, 0.95), linear warmup then cosine decay,
gradient clipping at 0.5.

The training data folder is ``$EAGLE_COMPILE_TRAIN_DATA`` if set, else ``<repo>/../shared/data/train``. The
evaluation sets next to it (Spec-Bench, MT-bench, the EAGLE eval sets, long-context) are refused as training
data: a head trained on its own benchmark measures nothing.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_compile.errors import OptionsError

TRAIN_DATA_ENV = "EAGLE_COMPILE_TRAIN_DATA"
DEFAULT_DATA_FILES = ("instruct_mix.jsonl",)
#: Folders of ../shared/data that hold evaluation data only (shared/data/README.md §1-§3, §5).
EVAL_ONLY_DIRS = ("spec_bench", "mt_bench", "eagle_eval", "long_context")
#: EAGLE 3.1 = per-feature fc_norm + post-norm feedback (EAGLE31_SPEC.md §2); EAGLE-3 = neither.
PRESETS = {
    "eagle31": {"fc_norm": True, "norm_output": True},
    "eagle3": {"fc_norm": False, "norm_output": False},
}
_CHOICES = {
    "preset": tuple(PRESETS),
    "feature_mode": ("online", "offline"),
    "cache_dtype": ("float16", "bfloat16", "float32"),
    "lm_head_init": ("target", "random"),
    "amp": ("none", "bf16"),
    "target_dtype": ("float32", "bfloat16", "float16"),
    "save_dtype": ("float32", "bfloat16", "float16"),
}
#: Fields that do not change what is computed: they may differ between a run and its resumption.
RUNTIME_FIELDS = frozenset({
    "output_dir", "feature_cache", "save_every", "keep_checkpoints", "eval_every", "log_every", "progress",
    "num_threads", "device", "save_dtype", "resume", "time_budget_s",
})


def default_train_dir() -> Path:
    """``$EAGLE_COMPILE_TRAIN_DATA``, else ``../shared/data/train`` next to this repository."""
    from_env = os.environ.get(TRAIN_DATA_ENV)
    if from_env:
        return Path(from_env).expanduser()
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "train"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What to train, on what, and how (see the module docstring for the defaults' origin).

    Data: ``data_files`` inside ``data_dir`` (jsonl with instruction/input/output/source), ``sources`` keeps
    only those sources, ``responses`` replaces the replies by regenerated ones (self-distillation: one or
    more jsonl files written by `regenerate_responses`, read in order). Conversations longer than ``max_len``
    tokens are dropped (as the official trainer does) unless ``truncate``. ``eval_samples`` conversations are
    held out for evaluation.

    Head: ``preset`` picks the EAGLE 3.1 or EAGLE-3 flags; ``draft_vocab_size`` most frequent assistant tokens
    form the draft vocabulary (``None``: the whole target vocabulary). ``lm_head_init="random"`` (official
    EAGLE-3 trainer) starts the draft's lm_head fresh; ``"target"`` copies the target's lm_head rows of the
    draft vocabulary (speculators does, and freezes them). Measured on SmolLM2-135M, the copy starts further
    from the teacher (step-0 loss 13.2 vs 9.9 nats, gradient norm ~700 vs ~25) because the untrained draft's
    residual stream is not yet the target's, so it is not the default. ``init_head`` starts from a trained
    head instead (fine-tuning, e.g. on self-distilled replies): its weights, draft vocabulary and capture
    indices are kept, and its flags must be the preset's.

    Schedule: ``max_steps`` optimizer steps if given, else ``epochs`` passes; each step takes ``grad_accum``
    batches of ``batch_size`` conversations. Warmup is ``warmup_steps`` if given, else ``warmup_ratio`` of
    the steps; the learning rate then decays along a cosine to ``min_lr_ratio * lr``.

    Target: ``target_dtype`` is the dtype the target runs in to make features and soft targets; the teacher's
    lm_head rows stay float32 either way. On a CPU with avx512_bf16, ``"bfloat16"`` with ``amp="bf16"`` trained
    SmolLM2-135M at 378 tokens/s against 232 in float32 (batch 8, 512 tokens, 4 TTT steps: stages 4 and 3 of the
    shipped head's MODEL_CARD.md, tokens seen / wall time).

    Features: ``online`` runs the target every batch; ``offline`` first writes them to ``feature_cache``
    (default ``<output_dir>/features``) in ``cache_dtype``, resumable, then trains from disk.

    Run: a training-state checkpoint every ``save_every`` steps (and when stopped); ``resume`` continues from
    the newest one in ``output_dir`` (with ``resume=False`` an ``output_dir`` holding checkpoints is refused).
    ``time_budget_s`` caps the wall time of this invocation's training loop: no step starts that would end past
    it (judged by the previous step's time); the run then ends as a finished one (held-out evaluation, head,
    ``summary.json`` with ``stopped_by_budget``) at the step it reached. The schedule is still the one of
    ``max_steps``, so pick ``max_steps`` to fit the budget (benchmarks/gpu_train.py measures it); running the
    same command again resumes the remaining steps.
    """

    # data
    data_dir: str = dataclasses.field(default_factory=lambda: str(default_train_dir()))
    data_files: tuple[str, ...] = DEFAULT_DATA_FILES
    sources: tuple[str, ...] | None = None
    responses: tuple[str, ...] | None = None
    max_len: int = 512
    truncate: bool = False
    eval_samples: int = 128
    max_samples: int | None = None
    # target and head
    target: str | None = None
    target_dtype: str = "float32"
    preset: str = "eagle31"
    draft_vocab_size: int | None = 32000
    capture_indices: tuple[int, ...] | None = None
    init_head: str | None = None
    lm_head_init: str = "random"
    freeze_lm_head: bool = False
    # training-time test
    ttt_steps: int = 7
    step_decay: float = 0.8
    # optimisation
    epochs: int = 10
    max_steps: int | None = None
    batch_size: int = 4
    grad_accum: int = 1
    lr: float = 1e-4
    min_lr_ratio: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_ratio: float = 0.015
    warmup_steps: int | None = None
    grad_clip: float = 0.5
    seed: int = 0
    data_start_step: int = 0
    amp: str = "none"
    # target features
    feature_mode: str = "online"
    feature_cache: str | None = None
    cache_dtype: str = "float16"
    shard_samples: int = 128
    pad_multiple: int = 64
    # run
    output_dir: str = "runs/eagle31-smollm2"
    save_every: int = 200
    keep_checkpoints: int = 2
    eval_every: int = 1000
    log_every: int = 1
    progress: bool = True
    num_threads: int | None = None
    device: str = "auto"
    save_dtype: str = "float32"
    resume: bool = True
    time_budget_s: float | None = None

    def __post_init__(self) -> None:
        put = self._put
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise OptionsError(f"{name}={getattr(self, name)!r}; valid values: {list(allowed)}")
        for name in ("max_len", "ttt_steps", "epochs", "batch_size", "grad_accum", "shard_samples",
                     "pad_multiple", "save_every", "keep_checkpoints", "eval_every", "log_every"):
            _positive_int(name, getattr(self, name))
        for name in ("max_steps", "warmup_steps", "draft_vocab_size", "num_threads", "max_samples"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise OptionsError(f"time_budget_s={self.time_budget_s!r}: give seconds > 0, or None for no budget")
        if not isinstance(self.data_start_step, int) or self.data_start_step < 0:
            raise OptionsError(f"data_start_step={self.data_start_step!r}: give an int >= 0 (the optimizer step of "
                               "the seed's data plan this run starts at; 0 = its beginning)")
        if not isinstance(self.eval_samples, int) or self.eval_samples < 0:
            raise OptionsError(f"eval_samples={self.eval_samples!r}: give an int >= 0 (0 = no held-out set)")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.weight_decay >= 0 and self.grad_clip > 0):
            raise OptionsError(
                f"lr={self.lr}, min_lr_ratio={self.min_lr_ratio}, weight_decay={self.weight_decay}, "
                f"grad_clip={self.grad_clip}: need lr > 0, 0 <= min_lr_ratio <= 1, weight_decay >= 0, "
                "grad_clip > 0"
            )
        if not 0 <= self.warmup_ratio < 1:
            raise OptionsError(f"warmup_ratio={self.warmup_ratio}: give a fraction in [0, 1)")
        if not 0 < self.step_decay <= 1:
            raise OptionsError(f"step_decay={self.step_decay}: the TTT step weight decay must be in (0, 1]")
        betas = tuple(float(b) for b in self.betas)
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise OptionsError(f"betas={self.betas!r}: give two AdamW betas in [0, 1)")
        put("betas", betas)
        put("data_files", tuple(self.data_files))
        if not self.data_files:
            raise OptionsError("data_files is empty; name at least one jsonl file in data_dir")
        if self.sources is not None:
            put("sources", tuple(self.sources))
        if self.responses is not None:
            put("responses", (self.responses,) if isinstance(self.responses, (str, Path)) else
                tuple(str(r) for r in self.responses))
            if not self.responses:
                raise OptionsError("responses is empty; name at least one jsonl of regenerated replies, or none")
        if self.capture_indices is not None:
            put("capture_indices", tuple(int(i) for i in self.capture_indices))
        for path in self.data_paths() + self.response_paths():
            refuse_eval_data(path)

    def _put(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    # -- derived ---------------------------------------------------------------------------------------
    def data_paths(self) -> list[Path]:
        return [Path(self.data_dir) / name for name in self.data_files]

    def response_paths(self) -> list[Path]:
        return [Path(r) for r in self.responses or ()]

    @property
    def flags(self) -> dict[str, bool]:
        """The draft-config flags of the preset (``fc_norm``, ``norm_output``)."""
        return dict(PRESETS[self.preset])

    @property
    def step_weights(self) -> tuple[float, ...]:
        """``step_decay**i`` for TTT steps ``i = 0..ttt_steps-1`` (0.8^i, EAGLE31_SPEC.md §6.3)."""
        return tuple(self.step_decay**i for i in range(self.ttt_steps))

    def feature_cache_dir(self) -> Path:
        return Path(self.feature_cache) if self.feature_cache else Path(self.output_dir) / "features"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise OptionsError(f"unknown TrainConfig fields {unknown}; valid: {sorted(known)}")
        return cls(**d)

    def trajectory_differences(self, other: TrainConfig) -> list[str]:
        """Fields (outside `RUNTIME_FIELDS`) whose values differ: a resumed run must not change them."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [k for k in mine if k not in RUNTIME_FIELDS and _norm(mine[k]) != _norm(theirs[k])]


def refuse_eval_data(path: Path) -> None:
    """Raise if ``path`` lies in an evaluation-only folder of shared/data (never train on a benchmark)."""
    parts = set(Path(path).expanduser().resolve().parts)
    hit = sorted(parts.intersection(EVAL_ONLY_DIRS))
    if hit:
        raise OptionsError(
            f"{path} is inside the evaluation-only folder {hit[0]!r} (shared/data/README.md): Spec-Bench, "
            "MT-bench, the EAGLE eval sets and the long-context sets are for measuring acceptance and speed "
            "only. Train on ../shared/data/train/ (instruct_mix.jsonl) instead."
        )


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise OptionsError(f"{name}={value!r}: give a positive int")


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, (tuple, list)) else value
