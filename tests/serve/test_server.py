"""`eagle31 serve` end to end: the real `openai` client against uvicorn on 127.0.0.1 (a free port), a tiny float64
target (argmax ties cannot flip) and a random EAGLE 3.1 head. Greedy answers must be exactly
`eagle_compile.generate`'s for the request alone, whatever else the batch holds."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx2")        # what openai==3.51.0 ships with

import torch  # noqa: E402
from tiny import random_head, tiny_target, tiny_tokenizer  # noqa: E402

import eagle_compile  # noqa: E402
from eagle_compile.serve.engine import Engine  # noqa: E402
from eagle_compile.serve.server import BackgroundServer  # noqa: E402

MODEL = "tiny-llama"
OPTIONS = {"calibration_cache": "memory", "batch_buckets": [1, 8]}
PROMPTS = ["the sky is", "hello world, how are you?", "1+1=", "a", "why is the sea blue? because",
           "list: one, two,", "q: what is 7*6? a:", "once upon a time there was"]
EOS = 2                                          # tiny_tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def setup():
    tok = tiny_tokenizer()
    model = tiny_target("llama", vocab=len(tok))
    head = random_head(model, flags=True, seed=0, reduced=False)
    engine = Engine(model, tok, head, OPTIONS, model_name=MODEL)
    with BackgroundServer(engine) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        yield {"tok": tok, "model": model, "head": head, "engine": engine, "server": server, "client": client}


def reference(s, ids: list[int], max_tokens: int) -> str:
    """What eagle_compile.generate gives for this prompt alone (greedy, the server's EOS), as the server's text."""
    out = eagle_compile.generate(s["model"], torch.tensor([ids]), draft=s["head"],
                                 options={"calibrate": "on", **OPTIONS}, max_new_tokens=max_tokens, eos_token_id=EOS)
    new = out[0, len(ids):].tolist()
    new = new[:new.index(EOS)] if EOS in new else new
    return s["tok"].decode(new, skip_special_tokens=True)


def ids_of(s, prompt: str) -> list[int]:
    return s["tok"](prompt)["input_ids"]


def chat_ids(s, content: str) -> list[int]:
    return s["tok"].apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]


def sample_value(engine, name: str, labels: dict | None = None) -> float:
    return engine.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def invalid_count(engine) -> float:
    return sum(sample_value(engine, "eagle31_invalid_requests_total", {"endpoint": k}) for k in ("completion", "chat"))


def test_concurrent_clients_equal_single_request_greedy(setup):
    s = setup
    lengths = [6 + 2 * i for i in range(len(PROMPTS))]           # rows leave the batch at different cycles
    want = [reference(s, ids_of(s, p), n) for p, n in zip(PROMPTS, lengths, strict=True)]

    def ask(i):
        return s["client"].completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(ask, range(len(PROMPTS))))
    assert [r.choices[0].text for r in got] == want
    for r, n in zip(got, lengths, strict=True):
        assert r.choices[0].finish_reason in ("length", "stop")
        if r.choices[0].finish_reason == "length":
            assert r.usage.completion_tokens == n
        extra = r.usage.model_extra
        assert extra["tau"] >= 1.0 and extra["cycles"] >= 1 and extra["decode_time"] > 0
    assert max(r.usage.model_extra["batch_rows"] for r in got) > 1        # the requests did share a batch


def test_streaming_chunks_join_to_the_whole_text(setup):
    s = setup
    prompt = "tell me about the moon"
    whole = s["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert whole.choices[0].text == reference(s, ids_of(s, prompt), 20)
    chunks = list(s["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                 stream=True))
    assert len(chunks) > 2                                   # several cycles, several chunks
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi there"}], max_tokens=15, temperature=0)
    full = s["client"].chat.completions.create(**chat)
    assert full.choices[0].message.content == reference(s, chat_ids(s, "hi there"), 15)
    parts = list(s["client"].chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == full.choices[0].message.content
    assert parts[-1].usage.completion_tokens == full.usage.completion_tokens and not parts[-1].choices


def test_stop_string_cuts_text_and_stream(setup):
    s = setup
    prompt = "the sky is"
    text = reference(s, ids_of(s, prompt), 24)
    stop = text[5:7]
    assert len(stop) == 2
    r = s["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == text[:text.find(stop)] and r.choices[0].finish_reason == "stop"
    streamed = s["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                                              stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text


def test_max_tokens_one(setup):
    s = setup
    r = s["client"].completions.create(model=MODEL, prompt="1+1=", max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text == reference(s, ids_of(s, "1+1="), 1)
    assert r.usage.model_extra["cycles"] == 0               # the prefill's token only: no cycle ran
    chunks = list(s["client"].completions.create(model=MODEL, prompt="1+1=", max_tokens=1, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def _eos_first_prompt(s) -> str:
    """A prompt whose greedy first token is EOS (searched over a fixed set of random strings, one forward)."""
    g = torch.Generator().manual_seed(0)
    chars = "abcdefghijklmnopqrstuvwxyz "
    prompts = ["".join(chars[i] for i in torch.randint(0, len(chars), (6,), generator=g).tolist()) for _ in range(400)]
    ids = torch.tensor([ids_of(s, p) for p in prompts])
    with torch.no_grad():
        first = s["model"](ids).logits[:, -1].argmax(-1)
    hits = (first == EOS).nonzero()[:, 0].tolist()
    assert hits, "no prompt among 400 starts with EOS: change the search seed"
    return prompts[hits[0]]


def test_eos_as_first_token(setup):
    s = setup
    prompt = _eos_first_prompt(s)
    r = s["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)
    chunks = list(s["client"].completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "" and chunks[-1].choices[0].finish_reason == "stop"
    # a stop_token_id at the first token works the same way (vLLM's extra field)
    with torch.no_grad():
        first = int(s["model"](torch.tensor([ids_of(s, "a")])).logits[0, -1].argmax())
    r = s["client"].completions.create(model=MODEL, prompt="a", max_tokens=10, temperature=0,
                                       extra_body={"stop_token_ids": [first]})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("", "stop", 1)


def test_aborted_stream_frees_its_row(setup):
    s = setup
    engine = s["engine"]
    before = sample_value(engine, "eagle31_requests_total", {"endpoint": "completion", "finish_reason": "abort"})
    with s["client"].completions.with_streaming_response.create(model=MODEL, prompt="count with me:",
                                                                 max_tokens=400, temperature=0, stream=True) as resp:
        lines = resp.iter_lines()
        got = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert got and json.loads(got[0][6:])["choices"][0]["text"] is not None
    deadline = time.monotonic() + 120
    while sample_value(engine, "eagle31_requests_total", {"endpoint": "completion", "finish_reason": "abort"}) \
            == before:
        assert time.monotonic() < deadline, "the aborted request's row was never freed"
        time.sleep(0.1)
    assert engine.running == [] or all(r.request.prompt != "count with me:" for r in engine.running)
    r = s["client"].completions.create(model=MODEL, prompt="after the abort", max_tokens=5, temperature=0)
    assert r.choices[0].text == reference(s, ids_of(s, "after the abort"), 5)


def test_seeded_sampling_is_reproducible_with_a_fixed_tree(setup):
    """The README's contract: a seeded request decodes alone with its own generator, and with a fixed tree in the
    options (calibration off) the same seed repeats exactly. Under calibration the program of each cycle follows
    estimates and observed costs that carry over between calls, so the uniforms a cycle consumes, and the sample,
    may differ (the calibrated server above gave two texts for one seed, 2026-12-07)."""
    s = setup
    engine = Engine(s["model"], s["tok"], s["head"], {**OPTIONS, "calibrate": "off"}, model_name=MODEL)
    with BackgroundServer(engine) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        ask = dict(model=MODEL, prompt="the sky is", max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
        a, b = client.completions.create(**ask), client.completions.create(**ask)
        other = client.completions.create(**{**ask, "seed": 99})
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens >= 1
    assert other.choices[0].text != a.choices[0].text       # the seed is what decides (negative control)


BAD = [
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"prompt": "x"}, 400, "model"),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": 5}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": 3}, 400, "stop"),
    ("completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400,
     "stream"),
]


def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(setup):
    s = setup
    engine = s["engine"]
    before = invalid_count(engine)
    with httpx.Client(base_url=s["server"].url, timeout=60) as http:
        for path, body, status, param in BAD:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = http.post(f"/v1/{path}", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert isinstance(error["message"], str) and error["message"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, (body, error)
    assert invalid_count(engine) - before == len(BAD)
    with pytest.raises(openai.BadRequestError, match="at least 1"):
        s["client"].completions.create(model=MODEL, prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        s["client"].completions.create(model="nope", prompt="x", max_tokens=2)
    r = s["client"].completions.create(model=MODEL, prompt="still here", max_tokens=4, temperature=0)
    assert r.choices[0].text == reference(s, ids_of(s, "still here"), 4)


def test_models_health_and_metrics(setup):
    s = setup
    assert [m.id for m in s["client"].models.list().data] == [MODEL]
    with httpx.Client(base_url=s["server"].url, timeout=60) as http:
        health = http.get("/health").json()
        assert health["status"] == "ok" and health["calibrate"] == "on" and health["speculate"] is True
        s["client"].completions.create(model=MODEL, prompt="metrics please", max_tokens=6, temperature=0)
        text = http.get("/metrics").text
    assert "eagle31_request_tau_bucket" in text and "eagle31_time_to_first_token_seconds_count" in text
    engine = s["engine"]
    assert sample_value(engine, "eagle31_generation_tokens_total") >= 6
    assert sample_value(engine, "eagle31_cycles_total") >= 5
    programs = [m for m in engine.metrics.registry.collect() if m.name == "eagle31_cycles_by_program"][0]
    assert sum(x.value for x in programs.samples if x.name.endswith("_total")) == \
        sample_value(engine, "eagle31_cycles_total")


def test_a_failing_batch_answers_500_and_the_server_keeps_serving(setup, monkeypatch):
    s = setup

    def broken(*args, **kwargs):
        raise RuntimeError("injected decoder failure")

    monkeypatch.setattr(s["engine"].decoder, "session", broken)
    with pytest.raises(openai.InternalServerError, match="injected decoder failure"):
        s["client"].completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    monkeypatch.undo()
    assert s["engine"].alive
    r = s["client"].completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0)
    assert r.choices[0].text == reference(s, ids_of(s, "x"), 3)
