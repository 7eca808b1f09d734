"""The training loop of `eagle31 train` (EAGLE31_SPEC.md §6, DESIGN.md §5).

    setup   target -> conversations -> held-out split -> draft vocabulary -> head -> AdamW + warmup/cosine
            -> target features (online extractor, or the offline cache, built or finished first)
    step s  batches of plan(epoch(s)) -> TTT forward, L steps -> Σ_i 0.8^i loss_i -> backward
            -> clip -> AdamW -> scheduler -> one metrics line, progress bar
    save    every ``save_every`` steps and when stopped (Ctrl-C / SIGTERM finish the current step first)
    end     held-out evaluation, the head in the official EAGLE-3 layout, summary.json (also when
            ``time_budget_s`` stopped the loop early: no step starts that would end past the budget)

Everything a step consumes is a function of (config, step): the epoch plans come from the seed, so a run
resumed from the checkpoint of step s replays steps s+1.. exactly as an uninterrupted run would.

Output folder: ``head/`` (config.json + model.safetensors), ``checkpoints/``, ``metrics.jsonl`` (one JSON
object per step, ``"split": "train"`` or ``"eval"``), ``train_config.json``, ``summary.json``, and
``features/`` in offline mode.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from eagle_compile.errors import OptionsError
from eagle_compile.train.config import TrainConfig
from eagle_compile.train.data import (
    DataStats,
    Sample,
    collate,
    fingerprint,
    plan_epoch,
    read_records,
    split_eval,
    tokenize_records,
)
from eagle_compile.train.draft_vocab import count_reply_tokens, select_draft_vocab, vocab_coverage
from eagle_compile.train.evaluate import EvalResult, evaluate
from eagle_compile.train.feature_cache import FeatureCache, build_feature_cache
from eagle_compile.train.features import FeatureBatch, FeatureExtractor, TeacherHead
from eagle_compile.train.head import build_head, load_head_for_training, save_head
from eagle_compile.train.loss import batch_loss
from eagle_compile.train.schedule import build_optimizer, build_scheduler
from eagle_compile.train.state import checkpoints, load_state, rng_state, save_state, set_rng_state

METRICS = "metrics.jsonl"


@dataclass
class StepStats:
    loss: float = 0.0
    losses: list[float] = field(default_factory=list)
    correct: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    tokens: int = 0
    feature_time: float = 0.0

    @property
    def accuracies(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.correct, self.counts, strict=True)]


def load_target(config: TrainConfig, device: torch.device):
    """The target (frozen, eval mode, in ``config.target_dtype``) and its tokenizer: the embedded default or
    an HF folder."""
    dtype = getattr(torch, config.target_dtype)
    if config.target is None:
        from eagle_compile.targets import load_default_target

        model, tokenizer = load_default_target(dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(config.target, dtype=dtype,
                                                     attn_implementation="sdpa").eval()
        tokenizer = AutoTokenizer.from_pretrained(config.target)
    return model.to(device).requires_grad_(False), tokenizer


def load_samples(config: TrainConfig, tokenizer) -> tuple[list[Sample], DataStats]:
    """Tokenized training conversations of ``config`` (regenerated replies when ``config.responses``)."""
    paths = config.response_paths() or config.data_paths()
    records = read_records(paths, config.sources)
    if config.max_samples is not None:
        records = records[: config.max_samples]
    return tokenize_records(tokenizer, records, max_len=config.max_len, truncate=config.truncate)


class MetricsLog:
    """``metrics.jsonl``: appended line by line; on resume, lines past the resumed step are dropped."""

    def __init__(self, path: Path, resume_step: int) -> None:
        self.path = path
        if path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


class Trainer:
    """One training run. ``target``/``tokenizer``/``samples`` may be given (tests); else they are loaded.

    ``extractor`` reuses the `FeatureExtractor` of an earlier run on the same target (same capture indices and
    batch rows), with the graphs it already captured: a short measuring run before the real one
    (benchmarks/gpu_train.py) then pays for the target's dynamo captures once.
    """

    def __init__(self, config: TrainConfig, *, target=None, tokenizer=None, samples: list[Sample] | None = None,
                 target_name: str | None = None, extractor: FeatureExtractor | None = None) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = _device(config.device)
        if target is None:
            target, tokenizer = load_target(config, self.device)
        self.target = target.to(self.device).eval().requires_grad_(False)
        self.target_name = target_name or config.target or "HuggingFaceTB/SmolLM2-135M-Instruct"
        self.data_stats = None
        if samples is None:
            samples, self.data_stats = load_samples(config, tokenizer)
        if len(samples) <= config.eval_samples:
            raise OptionsError(f"{len(samples)} conversations, but eval_samples={config.eval_samples} are held "
                               "out; give more data or lower eval_samples")
        self.samples = samples
        self.data_fingerprint = fingerprint(samples)
        self.train_idx, self.eval_idx = split_eval(samples, config.eval_samples)

        text_config = self.target.config.get_text_config()
        vocab_size, self.hidden_size = int(text_config.vocab_size), int(text_config.hidden_size)
        train_samples = [samples[i] for i in self.train_idx]
        dtype = torch.float64 if next(self.target.parameters()).dtype == torch.float64 else torch.float32
        if config.init_head is not None:
            self.model = load_head_for_training(config.init_head, self.target, flags=config.flags,
                                                capture_indices=config.capture_indices,
                                                freeze_lm_head=config.freeze_lm_head, dtype=dtype)
            counts = count_reply_tokens(train_samples, vocab_size)
        else:
            d2t, t2d, counts = select_draft_vocab(train_samples, vocab_size, config.draft_vocab_size or vocab_size)
            self.model = build_head(self.target, d2t=d2t, t2d=t2d, flags=config.flags,
                                    capture_indices=config.capture_indices, lm_head_init=config.lm_head_init,
                                    freeze_lm_head=config.freeze_lm_head, dtype=dtype, seed=config.seed)
        self.vocab_coverage = vocab_coverage(counts, self.model.t2d.cpu())
        self.capture_indices = self.model.config.resolved_capture_indices(int(text_config.num_hidden_layers))
        self.teacher = TeacherHead(self.target, self.model.t2d)
        self.extractor = self._check_extractor(extractor)
        self.cache: FeatureCache | None = None
        self._plan_epoch: int | None = None
        self._plan_batches: list[list[int]] = []
        self.grad_norm = 0.0

        self.steps_per_epoch = math.ceil(len(self._plan(0)) / config.grad_accum)
        self.total_steps = config.max_steps or config.epochs * self.steps_per_epoch
        warmup = config.warmup_steps if config.warmup_steps is not None else int(config.warmup_ratio *
                                                                                  self.total_steps)
        self.optimizer = build_optimizer(self.model, config.lr, config.betas, config.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, warmup, self.total_steps, config.min_lr_ratio)
        self.step = 0
        self.output_dir = Path(config.output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._resume()
        self.metrics = MetricsLog(self.output_dir / METRICS, self.step)
        (self.output_dir / "train_config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        self._stop_requested = False
        self.stopped_by_budget = False

    # -- features ------------------------------------------------------------------------------------------
    def _check_extractor(self, extractor: FeatureExtractor | None) -> FeatureExtractor | None:
        if extractor is None:
            return None
        given = (extractor.target is self.target, tuple(extractor.capture_indices), extractor.rows)
        wanted = (True, tuple(self.capture_indices), self.config.batch_size)
        if given != wanted:
            raise OptionsError(
                f"extractor= runs {'this' if given[0] else 'another'} target with capture indices "
                f"{list(given[1])} and {given[2]} rows, but this run needs this target, capture indices "
                f"{list(wanted[1])} and {wanted[2]} rows (batch_size); pass the extractor of a run with the "
                "same target, head and batch size, or none"
            )
        return extractor

    def _extractor(self) -> FeatureExtractor:
        if self.extractor is None:
            self.extractor = FeatureExtractor(self.target, self.capture_indices, rows=self.config.batch_size)
        return self.extractor

    def build_features(self) -> FeatureCache:
        """Offline mode: write (or finish) the feature cache of all conversations."""
        if self.cache is None:
            self.cache = build_feature_cache(
                self.config.feature_cache_dir(), self._extractor, self.samples,
                capture_indices=self.capture_indices, hidden_size=self.hidden_size,
                target_name=self.target_name,
                batch_size=self.config.batch_size, shard_samples=self.config.shard_samples,
                dtype=self.config.cache_dtype, pad_multiple=self.config.pad_multiple,
                progress=self.config.progress)
        return self.cache

    def features(self, indices: Sequence[int]) -> FeatureBatch:
        """The `FeatureBatch` of samples ``indices`` (online: run the target now; offline: read the cache)."""
        if self.config.feature_mode == "offline":
            return self.build_features().batch(indices).to(self.device)
        batch = collate([self.samples[i] for i in indices], self.config.pad_multiple)
        return self._extractor()(batch)

    # -- plan ----------------------------------------------------------------------------------------------
    def _plan(self, epoch: int) -> list[list[int]]:
        """Batches (sample indices) of ``epoch``; offline batches stay inside one cache shard."""
        cfg = self.config
        lengths = [len(self.samples[i]) for i in self.train_idx]
        groups = [i // cfg.shard_samples for i in self.train_idx] if cfg.feature_mode == "offline" else None
        plan = plan_epoch(lengths, cfg.batch_size, cfg.seed, epoch, groups)
        return [[self.train_idx[j] for j in batch] for batch in plan]

    def step_batches(self, step: int) -> list[list[int]]:
        """The batches (sample indices, ``grad_accum`` of them) of optimizer step ``step`` (0-based), taken
        ``data_start_step`` steps into the seed's data plan."""
        epoch, j = divmod(step + self.config.data_start_step, self.steps_per_epoch)
        if self._plan_epoch != epoch:
            self._plan_batches, self._plan_epoch = self._plan(epoch), epoch
        accum = self.config.grad_accum
        return self._plan_batches[j * accum : (j + 1) * accum]

    # -- one step ------------------------------------------------------------------------------------------
    def _autocast(self):
        if self.config.amp == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, batches: Sequence[Sequence[int]]) -> StepStats:
        """One optimizer step over ``batches`` (gradient accumulation); returns its statistics."""
        cfg = self.config
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        stats = StepStats(losses=[0.0] * cfg.ttt_steps, correct=[0] * cfg.ttt_steps, counts=[0] * cfg.ttt_steps)
        for indices in batches:
            t0 = time.perf_counter()
            fb = self.features(indices)
            stats.feature_time += time.perf_counter() - t0
            with self._autocast():
                result, _ = batch_loss(self.model, self.teacher, fb, cfg.ttt_steps, cfg.step_weights)
            (result.total / len(batches)).backward()
            stats.loss += result.total.item() / len(batches)
            for i in range(cfg.ttt_steps):
                stats.losses[i] += result.losses[i].item() / len(batches)
                stats.correct[i] += result.correct[i]
                stats.counts[i] += result.counts[i]
            stats.tokens += int(fb.tokens.attention_mask.sum())
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        return stats

    # -- loop ----------------------------------------------------------------------------------------------
    def train(self, *, stop_after: int | None = None) -> EvalResult | None:
        """Train to ``total_steps`` (or until step ``stop_after``: a simulated interruption); returns the
        final held-out evaluation when training completed."""
        cfg = self.config
        summary = self.output_dir / "summary.json"
        if self.step >= self.total_steps and summary.is_file():  # finished before: nothing to redo
            done = json.loads(summary.read_text()).get("eval")
            return EvalResult(**done) if done else None
        if cfg.feature_mode == "offline":
            self.build_features()
        self._stop_requested = self.stopped_by_budget = False
        loop_start, last_step_s = time.perf_counter(), 0.0
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {cfg.preset}", unit="step",
                   disable=not cfg.progress, dynamic_ncols=True)
        with self._stop_on_signal():
            while self.step < self.total_steps and not self._stop_requested:
                if stop_after is not None and self.step >= stop_after:
                    break
                if cfg.time_budget_s is not None and (time.perf_counter() - loop_start + last_step_s
                                                      > cfg.time_budget_s):
                    self.stopped_by_budget = True
                    tqdm.write(f"time budget of {cfg.time_budget_s:.0f} s spent at step {self.step} of "
                               f"{self.total_steps}: ending the run here")
                    break
                lr = self.scheduler.get_last_lr()[0]
                t0 = time.perf_counter()
                stats = self.train_step(self.step_batches(self.step))
                elapsed = last_step_s = time.perf_counter() - t0
                self.step += 1
                self._log_step(stats, lr, elapsed, bar)
                if self.step % cfg.save_every == 0:
                    self.save_checkpoint()
                if self.eval_idx and self.step % cfg.eval_every == 0 and self.step < self.total_steps:
                    self._log_eval(self.evaluate())
        bar.close()
        self.save_checkpoint()
        if self.step < self.total_steps and not self.stopped_by_budget:
            return None
        result = self.evaluate() if self.eval_idx else None
        if result is not None:
            self._log_eval(result)
        save_head(self.model, self.output_dir / "head", getattr(torch, cfg.save_dtype))
        self._write_summary(result)
        return result

    def evaluate(self) -> EvalResult:
        """Per-depth loss and accuracy and the acceptance estimate on the held-out conversations."""
        order = sorted(self.eval_idx, key=lambda i: len(self.samples[i]))
        bs = self.config.batch_size
        batches = (self.features(order[i : i + bs]) for i in range(0, len(order), bs))
        return evaluate(self.model, self.teacher, batches, self.config.ttt_steps, self.config.step_weights,
                        autocast=self._autocast)

    def _log_step(self, stats: StepStats, lr: float, elapsed: float, bar) -> None:
        record = {
            "split": "train", "step": self.step, "epoch": round(self.step / self.steps_per_epoch, 4), "lr": lr,
            "loss": stats.loss, "loss_steps": stats.losses, "acc_steps": stats.accuracies,
            "grad_norm": self.grad_norm, "tokens": stats.tokens, "loss_positions": stats.counts[0],
            "step_time_s": elapsed, "feature_time_s": stats.feature_time,
            "tokens_per_s": stats.tokens / elapsed if elapsed else 0.0,
        }
        if self.step % self.config.log_every == 0 or self.step == self.total_steps:
            self.metrics.write(record)
        acc = "/".join(f"{a:.2f}" for a in stats.accuracies)
        bar.set_postfix_str(f"loss {stats.loss:.3f} acc {acc} {record['tokens_per_s']:.0f} tok/s")
        bar.update(1)

    def _log_eval(self, result: EvalResult) -> None:
        self.metrics.write({"split": "eval", "step": self.step, **result.to_dict()})
        acc = "/".join(f"{a:.2f}" for a in result.accuracies)
        tqdm.write(f"eval @ step {self.step}: loss {result.loss:.3f} acc {acc} "
                   f"accept~{result.accept_estimate:.2f}")

    @contextlib.contextmanager
    def _stop_on_signal(self) -> Iterator[None]:
        """First Ctrl-C / SIGTERM: finish the step, checkpoint, stop. A second Ctrl-C interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum, frame):
            self._stop_requested = True
            signal.signal(signal.SIGINT, signal.default_int_handler)
            tqdm.write("stopping after this step (checkpoint follows); Ctrl-C again to abort at once")

        previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    # -- checkpoints ---------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        return save_state(self.output_dir, self.step, {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_state(),
            "config": self.config.to_dict(),
            "data_fingerprint": self.data_fingerprint,
        }, keep=self.config.keep_checkpoints)

    def _resume(self) -> None:
        found = checkpoints(self.output_dir)
        if not found:
            return
        if not self.config.resume:
            raise OptionsError(
                f"{self.output_dir} already holds training checkpoints ({found[-1].name}); resume them (drop "
                "--no-resume) or choose another --output-dir"
            )
        state = load_state(found[-1])
        saved = TrainConfig.from_dict(state["config"])
        changed = self.config.trajectory_differences(saved)
        if changed:
            raise OptionsError(
                f"cannot resume {found[-1]}: the run was started with different {changed} "
                f"({ {k: saved.to_dict()[k] for k in changed} }); use the same settings or another --output-dir"
            )
        if state["data_fingerprint"] != self.data_fingerprint:
            raise OptionsError(f"cannot resume {found[-1]}: the training conversations changed since it was saved")
        self.model.load_state_dict(state["model"])
        self.teacher = TeacherHead(self.target, self.model.t2d)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        tqdm.write(f"resuming from {found[-1]} (step {self.step} of {self.total_steps})")

    def _write_summary(self, result: EvalResult | None) -> None:
        summary = {
            "head": str(self.output_dir / "head"),
            "steps": self.step,
            "planned_steps": self.total_steps,
            "stopped_by_budget": self.stopped_by_budget,
            "preset": self.config.preset,
            "flags": self.config.flags,
            "capture_indices": list(self.capture_indices),
            "draft_vocab_size": self.model.config.draft_vocab_size,
            "vocab_coverage": self.vocab_coverage,
            "train_samples": len(self.train_idx),
            "eval_samples": len(self.eval_idx),
            "data": vars(self.data_stats) if self.data_stats else None,
            "eval": result.to_dict() if result else None,
        }
        (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def train(config: TrainConfig, **kwargs) -> Trainer:
    """Run (or resume) the training described by ``config``; returns the finished `Trainer`."""
    trainer = Trainer(config, **kwargs)
    trainer.train()
    return trainer
