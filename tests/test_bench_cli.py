"""`eagle31 bench`: lists the checkout's benchmark scripts and runs one by name with the arguments after it."""

from __future__ import annotations

import json

from eagle_compile.cli import main


def test_lists_the_benchmarks_of_the_checkout(capsys):
    assert main(["bench", "--list"]) == 0
    listed = dict(line.split(maxsplit=1) for line in capsys.readouterr().out.splitlines())
    assert {"spec_bench", "verify_cost", "calibration", "plain_path", "gpu_check"} <= set(listed)
    assert "common" not in listed                                    # the scripts' helpers are not a benchmark
    assert listed["verify_cost"].startswith("Verify cost c(N)/c(1)")


def test_runs_a_benchmark_with_its_arguments_and_returns_its_status(tmp_path, monkeypatch, capsys):
    record = str(tmp_path / "argv.json")
    (tmp_path / "echo_args.py").write_text('"""Writes its arguments."""\nimport json, sys\n'
                                           f'open({record!r}, "w").write(json.dumps(sys.argv[1:]))\nsys.exit(3)\n')
    monkeypatch.setenv("EAGLE_COMPILE_BENCHMARKS", str(tmp_path))
    assert main(["bench", "echo_args", "--threads", "2", "--out", "x y"]) == 3
    assert json.loads((tmp_path / "argv.json").read_text()) == ["--threads", "2", "--out", "x y"]
    assert main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'nope'" in err and "echo_args" in err                  # the error lists what exists


def test_errors_name_the_problem_and_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLE_COMPILE_BENCHMARKS", str(tmp_path / "missing"))
    assert main(["bench", "--list"]) == 2
    assert "EAGLE_COMPILE_BENCHMARKS" in capsys.readouterr().err
