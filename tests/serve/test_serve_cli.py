"""`eagle31 serve` as a user starts it: a subprocess on a free port of 127.0.0.1, a saved tiny target and head."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")        # what openai==3.51.0 ships with

from tiny import save_random_head, save_tiny_folder, tiny_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_eagle31_serve_answers_health_models_and_a_completion(tmp_path):
    target, head = tmp_path / "target", tmp_path / "head"
    save_random_head(head, save_tiny_folder(target, tiny_tokenizer()))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "eagle_compile.cli", "serve", "--target", str(target), "--draft", str(head),
           "--port", str(port), "--model-name", "tiny", "--options", json.dumps({"calibration_cache": "memory"})]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "eagle31 serve did not come up in 180 s"
            try:
                health = httpx.get(url + "/health", timeout=5).json()
                break
            except httpx.TransportError:
                time.sleep(0.5)
        assert health["model"] == "tiny" and health["calibrate"] == "on" and health["speculate"] is True
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        r = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("length", "stop")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def test_bad_options_json_is_refused_with_the_fix():
    from eagle_compile.cli import main

    assert main(["serve", "--options", "{nope"]) == 2
