"""The training loop on a tiny random target: optimisation works, an interrupted run resumed equals an
uninterrupted one bit for bit, the head loads with load_draft with its flags, wrong resumptions are refused."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import pytest
import torch
from tiny import tiny_target
from train_helpers import hand_samples

from eagle_compile.draft import build_vocab_mapping, load_draft
from eagle_compile.errors import OptionsError
from eagle_compile.train import TrainConfig, Trainer
from eagle_compile.train.features import FeatureBatch, FeatureExtractor, TeacherHead
from eagle_compile.train.head import build_head, save_head
from eagle_compile.train.loss import batch_loss
from eagle_compile.train.schedule import WarmupCosine, build_optimizer


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def _config(tmp_path, name, **kw):
    """Offline features in one cache shared by the runs (the cache folder may differ between runs)."""
    base = dict(output_dir=str(tmp_path / name), max_steps=5, batch_size=2, grad_accum=2, eval_samples=2,
                draft_vocab_size=48, pad_multiple=32, save_every=2, progress=False, lr=1e-2, warmup_steps=1,
                feature_mode="offline", feature_cache=str(tmp_path / "features"), shard_samples=6)
    return TrainConfig(**{**base, **kw})


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch(target):
    d2t, t2d = torch.zeros(96, dtype=torch.int64), torch.ones(96, dtype=torch.bool)
    model = build_head(target, d2t=d2t, t2d=t2d, flags={"fc_norm": True, "norm_output": True},
                       capture_indices=None, lm_head_init="random", freeze_lm_head=False, dtype=torch.float64,
                       seed=0)
    gen = torch.Generator().manual_seed(0)
    sample = hand_samples(2, vocab=96, min_len=16, max_len=16)
    from eagle_compile.train.data import collate

    tokens = collate(sample)
    last = torch.randn(2, 16, 32, generator=gen, dtype=torch.float64)
    teacher = TeacherHead(target, model.t2d)
    fb = FeatureBatch(tokens, torch.randn(2, 16, 96, generator=gen, dtype=torch.float64), last,
                      teacher(last).argmax(-1))
    opt = build_optimizer(model, 1e-2, (0.9, 0.95), 0.0)
    excess = []  # Σ_i w_i (CE_i - H(p)_i): the part of the loss the head can remove (KL to the teacher)
    for _ in range(40):
        opt.zero_grad()
        result, targets = batch_loss(model, teacher, fb, 3, [1.0, 0.8, 0.64])
        result.total.backward()
        opt.step()
        entropy = [-(p * p.log()).sum(-1).mean() for p in
                   (targets.probs[targets.column >= 1 + i] for i in range(3))]
        excess.append(sum(w * (loss.item() - h.item())
                          for w, loss, h in zip([1.0, 0.8, 0.64], result.losses, entropy, strict=True)))
    assert excess[-1] < 0.3 * excess[0]


def test_warmup_then_cosine():
    sched = WarmupCosine(warmup=4, total=14, min_ratio=0.1)
    assert [sched(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert sched(4) == 1.0 and abs(sched(9) - (0.1 + 0.9 * 0.5)) < 1e-12 and abs(sched(14) - 0.1) < 1e-12


def test_resume_equals_uninterrupted_run_and_head_loads(target, tmp_path):
    samples = hand_samples(12, vocab=96)
    full = Trainer(_config(tmp_path, "full"), target=target, samples=samples)
    # 10 training samples in shards of 6: 3 + 2 batches of 2 (batches stay in a shard), 2 batches a step
    assert full.steps_per_epoch == 3 and full.total_steps == 5
    full.train()
    assert full.extractor.graphs_captured == 1

    first = Trainer(_config(tmp_path, "split"), target=target, samples=samples)
    assert first.train(stop_after=2) is None and first.step == 2
    second = Trainer(_config(tmp_path, "split"), target=target, samples=samples)
    assert second.step == 2
    real_step = second.train_step

    def ctrl_c_during_step(batches):                              # Ctrl-C arrives in the middle of step 3
        os.kill(os.getpid(), signal.SIGINT)
        return real_step(batches)

    second.train_step = ctrl_c_during_step
    assert second.train() is None                                 # the step finished, then it stopped
    assert second.step == 3 and not (tmp_path / "split" / "head").exists()
    resumed = Trainer(_config(tmp_path, "split"), target=target, samples=samples)
    assert resumed.step == 3                                      # mid-epoch 2
    resumed.train()
    assert resumed.extractor is None                              # the cache was complete: target not run

    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.scheduler.get_last_lr() == full.scheduler.get_last_lr()
    lines = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["split"] == "train"] == [1, 2, 3, 4, 5]
    assert lines[-1]["split"] == "eval" and len(lines[-1]["accuracies"]) == 7

    head = tmp_path / "full" / "head"
    config = json.loads((head / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert config["draft_vocab_size"] == 48 and config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    loaded = load_draft(head, target=target, dtype=torch.float64)
    trained = full.model.state_dict()
    for k, v in loaded.state_dict().items():  # saved as float32 (save_dtype), trained in float64
        torch.testing.assert_close(v, trained[k].to(v.dtype), rtol=1e-6, atol=1e-7)
    assert torch.equal(loaded.d2t, full.model.d2t) and torch.equal(loaded.t2d, full.model.t2d)
    summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["eval"]["samples"] == 2

    with pytest.raises(OptionsError, match="different"):
        Trainer(dataclasses.replace(_config(tmp_path, "split"), lr=5e-3), target=target, samples=samples)
    with pytest.raises(OptionsError, match="already holds"):
        Trainer(_config(tmp_path, "split", resume=False), target=target, samples=samples)
    with pytest.raises(OptionsError, match="conversations changed"):
        Trainer(_config(tmp_path, "split"), target=target, samples=hand_samples(12, vocab=96, seed=1))


def test_init_head_fine_tunes_a_trained_head_and_keeps_its_vocabulary(target, tmp_path):
    """--init-head: step 0 is the given head (weights, d2t/t2d; not the vocabulary this data would pick), the
    run trains it further, and a head whose flags or capture indices differ from the run's is refused."""
    d2t, t2d = build_vocab_mapping(torch.arange(96), 40)      # the 40 highest ids, not what the data picks
    head = build_head(target, d2t=d2t, t2d=t2d, flags={"fc_norm": True, "norm_output": True},
                      capture_indices=None, lm_head_init="random", freeze_lm_head=False, dtype=torch.float64,
                      seed=3)
    save_head(head, tmp_path / "start", dtype=torch.float64)
    samples = hand_samples(12, vocab=96)
    cfg = _config(tmp_path, "tune", init_head=str(tmp_path / "start"), feature_mode="online", max_steps=3)
    tuner = Trainer(cfg, target=target, samples=samples)
    start = head.state_dict()
    assert all(torch.equal(v, start[k]) for k, v in tuner.model.state_dict().items())
    assert tuner.model.config.draft_vocab_size == 40 != cfg.draft_vocab_size
    tuner.train()
    tuned = load_draft(tmp_path / "tune" / "head", target=target, dtype=torch.float64)
    assert torch.equal(tuned.d2t, head.d2t) and torch.equal(tuned.t2d, head.t2d)
    assert not torch.allclose(tuned.fc.weight, head.fc.weight)                # it did train

    with pytest.raises(OptionsError, match="--init-head .* has flags"):
        Trainer(_config(tmp_path, "wrong", init_head=str(tmp_path / "start"), preset="eagle3"), target=target,
                samples=samples)
    with pytest.raises(OptionsError, match="capture indices"):
        Trainer(_config(tmp_path, "wrong2", init_head=str(tmp_path / "start"), capture_indices=(1, 2, 3)),
                target=target, samples=samples)


def test_eagle3_head_has_its_flags_off(target, tmp_path):
    d2t, t2d = torch.zeros(96, dtype=torch.int64), torch.ones(96, dtype=torch.bool)
    model = build_head(target, d2t=d2t, t2d=t2d, flags={"fc_norm": False, "norm_output": False},
                       capture_indices=None, lm_head_init="target", freeze_lm_head=False, dtype=torch.float64,
                       seed=0)
    torch.testing.assert_close(model.lm_head.weight, target.lm_head.weight, rtol=0, atol=0)  # init from target
    save_head(model, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["fc_norm"] is False and config["norm_output"] is False
    assert not hasattr(load_draft(tmp_path / "head", target=target), "fc_norm")


def test_bf16_autocast_stays_out_of_the_target_program(tmp_path):
    """amp="bf16" autocasts the head only: the target's captured program keeps its one float32 graph (a float64
    target would hide a leak: autocast leaves float64 alone)."""
    cfg = _config(tmp_path, "amp", feature_mode="online", amp="bf16", max_steps=2, grad_accum=1)
    trainer = Trainer(cfg, target=tiny_target("llama").float(), samples=hand_samples(8, vocab=96))
    result = trainer.train()
    assert trainer.extractor.graphs_captured == 1
    assert result is not None and all(0.0 <= a <= 1.0 for a in result.accuracies) and result.loss > 0


def test_bfloat16_target_makes_features_and_the_teacher_keeps_float32_rows(tmp_path):
    """target_dtype="bfloat16": the target runs in bfloat16 (features, argmax), the head trains in float32 and
    the teacher's soft targets come from float32 copies of the lm_head rows."""
    target = tiny_target("llama").to(torch.bfloat16)
    cfg = _config(tmp_path, "bf16", feature_mode="online", target_dtype="bfloat16", amp="bf16", max_steps=2,
                  grad_accum=1)
    trainer = Trainer(cfg, target=target, samples=hand_samples(8, vocab=96))
    assert trainer.teacher.weight.dtype == torch.float32 and trainer.model.lm_head.weight.dtype == torch.float32
    fb = trainer.features(trainer.step_batches(0)[0])
    assert fb.features.dtype == torch.bfloat16
    result = trainer.train()
    assert result is not None and result.loss > 0 and all(0.0 <= a <= 1.0 for a in result.accuracies)
    with pytest.raises(OptionsError, match="target_dtype"):
        TrainConfig(target_dtype="int8")


def _slow_steps(trainer: Trainer, seconds: float) -> None:
    """Every optimizer step of ``trainer`` takes at least ``seconds``: a budget test must not hang on the speed of
    the machine."""
    real_step = trainer.train_step

    def slow(batches):
        stats = real_step(batches)
        time.sleep(seconds)
        return stats

    trainer.train_step = slow


def test_time_budget_ends_the_run_as_a_finished_one_and_without_it_every_step_runs(target, tmp_path):
    """time_budget_s: no step starts that would end past the budget (judged by the previous step's time); the run
    then ends with evaluation, head and summary at the step it reached. Steps of at least 0.6 s under a 1 s budget:
    step 1 runs (nothing measured yet), step 2 would end past 1 s. Negative control: the same run without a
    budget takes all four steps; it reuses the first run's extractor (extractor=), so the target's graph is
    captured once for both."""
    samples = hand_samples(12, vocab=96)
    budgeted = Trainer(_config(tmp_path, "budget", feature_mode="online", max_steps=4, grad_accum=1,
                               time_budget_s=1.0), target=target, samples=samples)
    _slow_steps(budgeted, 0.6)
    result = budgeted.train()
    assert budgeted.stopped_by_budget and budgeted.step == 1 and result is not None
    summary = json.loads((tmp_path / "budget" / "summary.json").read_text())
    assert (summary["steps"], summary["planned_steps"], summary["stopped_by_budget"]) == (1, 4, True)
    assert summary["eval"]["samples"] == 2
    load_draft(tmp_path / "budget" / "head", target=target)

    control = Trainer(_config(tmp_path, "control", feature_mode="online", max_steps=4, grad_accum=1),
                      target=target, samples=samples, extractor=budgeted.extractor)
    _slow_steps(control, 0.6)
    control.train()
    assert not control.stopped_by_budget and control.step == 4
    assert json.loads((tmp_path / "control" / "summary.json").read_text())["stopped_by_budget"] is False
    assert control.extractor is budgeted.extractor and control.extractor.graphs_captured == 1
    with pytest.raises(OptionsError, match="time_budget_s"):
        TrainConfig(time_budget_s=0)


def test_an_extractor_for_another_target_capture_indices_or_batch_size_is_refused(target, tmp_path):
    samples = hand_samples(12, vocab=96)
    extractor = FeatureExtractor(target, (2, 4, 5), rows=2)

    def run(match=None, *, other_target=None, **kw):
        cfg = _config(tmp_path, "extractor", feature_mode="online", **kw)
        if match is None:
            return Trainer(cfg, target=target, samples=samples, extractor=extractor)
        with pytest.raises(OptionsError, match=match):
            Trainer(cfg, target=other_target or target, samples=samples, extractor=extractor)

    assert run().extractor is extractor
    run("another target", other_target=tiny_target("llama"))
    run("capture indices", capture_indices=(1, 2, 3))
    run("rows", batch_size=3)


def test_data_start_step_continues_an_earlier_runs_data_order(target, tmp_path):
    """data_start_step=k: step s consumes what step s+k of the same seed's plan consumes, across the epoch
    boundary too, so a later stage can train on exactly the conversations an earlier k-step stage did not see."""
    samples = hand_samples(14, vocab=96)
    first = Trainer(_config(tmp_path, "first", feature_mode="online"), target=target, samples=samples)
    later = Trainer(_config(tmp_path, "later", feature_mode="online", data_start_step=2), target=target,
                    samples=samples)
    assert first.steps_per_epoch == 3          # 12 training conversations, 2 x 2 per step
    plan = [first.step_batches(s) for s in range(6)]
    assert [later.step_batches(s) for s in range(4)] == plan[2:6]
    seen = {i for step in plan[:2] for batch in step for i in batch}
    rest = {i for step in plan[2:3] for batch in step for i in batch}
    assert seen.isdisjoint(rest) and seen | rest == set(first.train_idx)   # the rest of epoch 0, nothing twice
    with pytest.raises(OptionsError, match="data_start_step"):
        TrainConfig(data_start_step=-1)
