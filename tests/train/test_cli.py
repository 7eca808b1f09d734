"""`eagle31 train`: options map onto TrainConfig, and a whole run (self-distillation, online features,
training, evaluation, head) on a tiny target saved as an HF folder; the same command again resumes."""

from __future__ import annotations

import json

import pytest
from tiny import tiny_target, tiny_tokenizer

from eagle_compile.cli import main as eagle31
from eagle_compile.draft import load_draft
from eagle_compile.train.cli import build_parser, config_from_args
from eagle_compile.train.config import TrainConfig


def test_options_map_onto_the_config():
    args = build_parser().parse_args(["--eagle3", "--ttt-steps", "5", "--draft-vocab-size", "full",
                                      "--sources", "a,b", "--capture-indices", "1,4,6", "--truncate",
                                      "--features", "offline", "--no-resume", "--time-budget-s", "90"])
    cfg = config_from_args(args)
    assert cfg.time_budget_s == 90.0
    assert cfg.preset == "eagle3" and cfg.flags == {"fc_norm": False, "norm_output": False}
    assert cfg.ttt_steps == 5 and cfg.draft_vocab_size is None and cfg.sources == ("a", "b")
    assert cfg.capture_indices == (1, 4, 6) and cfg.truncate and cfg.feature_mode == "offline" and not cfg.resume
    assert cfg.lr == TrainConfig().lr and cfg.grad_clip == 0.5 and cfg.betas == (0.9, 0.95)   # defaults kept
    default = config_from_args(build_parser().parse_args([]))
    assert default == TrainConfig() and default.preset == "eagle31" and default.ttt_steps == 7
    assert default.flags == {"fc_norm": True, "norm_output": True}


def test_train_subcommand_end_to_end(tmp_path, capsys):
    tok = tiny_tokenizer()
    folder = tmp_path / "target"
    tiny_target("llama", vocab=len(tok)).float().save_pretrained(folder)
    tok.save_pretrained(folder)
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"id": f"r{i}", "source": "math" if i % 3 else "chat", "instruction": f"add {i} and {i + 1}",
             "input": "", "output": f"{2 * i + 1}."} for i in range(9)]
    (data / "mix.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    command = ["train", "--target", str(folder), "--data-dir", str(data), "--data-files", "mix.jsonl",
               "--sources", "math", "--eagle3", "--regenerate", "--regen-max-new-tokens", "6",
               "--draft-vocab-size", "32", "--eval-samples", "2", "--batch-size", "2", "--max-steps", "2",
               "--pad-multiple", "32", "--output-dir", str(out), "--no-progress", "--threads", "1"]
    assert eagle31(command) == 0
    assert "regenerated 6 replies" in capsys.readouterr().out
    assert len((out / "responses.jsonl").read_text().splitlines()) == 6
    head = load_draft(out / "head", num_target_layers=8)
    assert head.config.draft_vocab_size == 32
    assert not head.config.fc_norm and not head.config.norm_output
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 2]                                        # two train steps, then the evaluation
    assert eagle31(command) == 0                                     # again: everything resumes, nothing redone
    assert "regenerated 0 replies (6 already done" in capsys.readouterr().out
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == steps
    with pytest.raises(SystemExit):
        eagle31(["train", "--eagle3", "--eagle31"])                  # mutually exclusive presets


def test_regen_dtype_generates_with_a_copy_and_trains_the_original(tmp_path, monkeypatch):
    """--regen-dtype bfloat16: the replies come from a bfloat16 copy; training gets the float32 target."""
    import torch

    import eagle_compile.train.regenerate as regenerate
    from eagle_compile.train.cli import _regenerate
    from eagle_compile.train.regenerate import RegenerateStats

    tok = tiny_tokenizer()
    target = tiny_target("llama", vocab=len(tok)).float()
    data = tmp_path / "data"
    data.mkdir()
    (data / "mix.jsonl").write_text(json.dumps({"id": "r0", "source": "s", "instruction": "hi", "output": "x"}) + "\n")
    seen = []
    monkeypatch.setattr(regenerate, "regenerate_responses",
                        lambda model, *a, **k: seen.append(next(model.parameters()).dtype) or RegenerateStats())
    args = build_parser().parse_args(["--data-dir", str(data), "--data-files", "mix.jsonl", "--regenerate",
                                      "--regen-dtype", "bfloat16", "--output-dir", str(tmp_path / "run")])
    config, kwargs = _regenerate(config_from_args(args), args, lambda config, device: (target, tok))
    assert seen == [torch.bfloat16]
    assert kwargs["target"] is target and next(target.parameters()).dtype == torch.float32
    assert config.responses == (str(tmp_path / "run" / "responses.jsonl"),)


def test_responses_from_several_files_in_order_and_regenerate_writes_one(tmp_path):
    """--responses a,b trains on both files' replies (a's first); --regenerate refuses two files; a config saved
    with one path as a string (older runs) reads back as the same one-file tuple."""
    from eagle_compile.errors import OptionsError
    from eagle_compile.train.cli import _regenerate
    from eagle_compile.train.trainer import load_samples

    tok = tiny_tokenizer()
    files = []
    for name, ids in (("a", (0, 1)), ("b", (2,))):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": f"r{i}", "source": "s", "instruction": f"q{i}", "input": "",
                                            "output": f"reply {i}"}) + "\n" for i in ids))
        files.append(str(path))
    args = build_parser().parse_args(["--responses", ",".join(files)])
    config = config_from_args(args)
    assert config.responses == tuple(files)
    samples, _ = load_samples(config, tok)
    assert [s.id for s in samples] == ["r0", "r1", "r2"]
    with pytest.raises(OptionsError, match="writes one file"):
        _regenerate(config, build_parser().parse_args(["--regenerate"]), lambda config, device: None)
    assert TrainConfig.from_dict({**TrainConfig().to_dict(), "responses": files[0]}).responses == (files[0],)
