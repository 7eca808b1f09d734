"""Hugging Face streamers (`streamer=`): the prompt first, then each cycle's kept tokens, then `end()` once; the
streamed tokens are exactly the returned new tokens, also when a stop cuts a block (TESTING.md invariant 3).

The oracle drafter makes a cycle emit depth + 1 tokens at once, so an EOS or a stop string chosen inside a block
leaves tokens of that block after the stop: a stream fed from the emitted block instead of the kept one fails.
"""

from __future__ import annotations

import threading

import pytest
import torch
from tiny import ScriptedDrafter, greedy_reference, rotate_programs, tiny_target, tiny_tokenizer
from transformers import TextIteratorStreamer, TextStreamer
from transformers.generation.streamers import BaseStreamer

import eagle_compile
from eagle_compile.errors import UnsupportedGenerationError

TREE = {"depth": 4, "top_k": 3, "total_tokens": 10, "prefill_chunk": 8}
MAX_NEW = 24


class RecordingStreamer(BaseStreamer):
    """Keeps every put (a copy) and counts the calls of `end`."""

    def __init__(self) -> None:
        self.puts: list[torch.Tensor] = []
        self.ends = 0

    def put(self, value) -> None:
        assert self.ends == 0, "put after end"
        self.puts.append(value.clone())

    def end(self) -> None:
        self.ends += 1

    @property
    def new_tokens(self) -> list[int]:
        return torch.cat(self.puts[1:], 1)[0].tolist()


@pytest.fixture(scope="module")
def setup():
    """A target over the tiny tokenizer's vocabulary, a prompt, its greedy continuation and an oracle drafter."""
    tok = tiny_tokenizer()
    model = tiny_target("llama", seed=3, vocab=len(tok))
    ids = torch.tensor([tok("hello world, ")["input_ids"]])
    free = greedy_reference(model, ids, max_new_tokens=MAX_NEW)
    drafter = ScriptedDrafter([free[0].tolist()], len(tok), "oracle")
    return model, tok, ids, free, drafter


def _check_stream(rec: RecordingStreamer, ids: torch.Tensor, out) -> None:
    """The contract: prompt, one put per cycle after the prefill's first token, exactly the returned tokens."""
    stats = out.stats
    assert torch.equal(rec.puts[0], ids) and rec.puts[0].device.type == "cpu"
    assert all(p.dim() == 2 and p.shape[0] == 1 and p.dtype == torch.long for p in rec.puts)
    assert len(rec.puts) == 2 + stats.cycles                    # prompt, the prefill's first token, each cycle
    assert rec.new_tokens == out.sequences[0, ids.shape[1]:].tolist()
    sizes = [p.shape[1] for p in rec.puts[2:]]
    assert sizes[:-1] == stats.acceptance_lengths[:-1] and 1 <= sizes[-1] <= stats.acceptance_lengths[-1]
    assert rec.ends == 1


def _stop_position(free: list[int], rec: RecordingStreamer, first_of) -> int:
    """A new-token index strictly inside a streamed block (not its last token) at which `first_of(k)` holds."""
    start = 1
    for put in rec.puts[2:]:
        for k in range(start, start + put.shape[1] - 1):
            if first_of(k):
                return k
        start += put.shape[1]
    raise AssertionError("no block has a usable stop position; pick another prompt or seed")


@pytest.mark.parametrize("mode", ["tree", "plain", "calibrated"])
def test_a_recording_streamer_gets_the_prompt_then_one_block_per_cycle(setup, mode, monkeypatch):
    model, _, ids, free, drafter = setup
    options = {"tree": TREE, "plain": {"speculate": False, "prefill_chunk": 8},
               "calibrated": {"prefill_chunk": 8, "calibration_cache": "memory"}}[mode]
    if mode == "calibrated":
        rotate_programs(monkeypatch)           # every menu program in turn, plain steps and re-syncs included
    rec = RecordingStreamer()
    out = eagle_compile.generate(model, ids, draft=None if mode == "plain" else drafter, options=options,
                                 max_new_tokens=MAX_NEW, streamer=rec, return_dict_in_generate=True)
    assert torch.equal(out.sequences, free)
    _check_stream(rec, ids, out)
    sizes = {p.shape[1] for p in rec.puts[1:]}
    if mode == "plain":
        assert sizes == {1} and out.stats.cycles == MAX_NEW - 1
    else:
        assert max(sizes) > 1, "no cycle streamed a block of several tokens"
    if mode == "calibrated":
        assert out.stats.calibration["policy"]["chosen"].get("plain", 0) > 0   # plain cycles streamed too
    if mode == "tree":                       # max_new_tokens cut the last block: only the kept part streamed
        assert sum(out.stats.acceptance_lengths) + 1 > MAX_NEW


def test_text_iterator_streamer_in_a_thread_joins_to_the_returned_text(setup):
    model, tok, ids, free, drafter = setup
    compiled = torch.compile(model, backend="eagle31", options={"draft": drafter, **TREE})
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=120)
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        out=compiled.generate(ids, max_new_tokens=MAX_NEW, streamer=streamer)))
    worker.start()
    chunks = list(streamer)
    worker.join()
    assert torch.equal(result["out"], free)
    text = tok.decode(free[0, ids.shape[1]:])
    assert "".join(chunks) == text and len(text) >= MAX_NEW
    assert len(chunks) > 2                                  # a piece per put, not all the text at end()


def test_text_streamer_prints_the_returned_text(setup, capsys):
    model, tok, ids, free, drafter = setup
    out = eagle_compile.generate(model, ids, draft=drafter, options=TREE, max_new_tokens=MAX_NEW,
                                 streamer=TextStreamer(tok, skip_prompt=True))
    assert torch.equal(out, free)
    assert capsys.readouterr().out == tok.decode(free[0, ids.shape[1]:]) + "\n"


def test_nothing_after_an_eos_inside_a_block_is_streamed(setup):
    model, _, ids, free, drafter = setup
    new = free[0, ids.shape[1]:].tolist()
    probe = RecordingStreamer()
    eagle_compile.generate(model, ids, draft=drafter, options=TREE, max_new_tokens=MAX_NEW, streamer=probe)
    k = _stop_position(new, probe, lambda k: new.index(new[k]) == k)
    ref = greedy_reference(model, ids, max_new_tokens=MAX_NEW, eos_token_id=new[k])
    rec = RecordingStreamer()
    out = eagle_compile.generate(model, ids, draft=drafter, options=TREE, max_new_tokens=MAX_NEW,
                                 eos_token_id=new[k], streamer=rec, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and ref.shape[1] == ids.shape[1] + k + 1
    assert sum(out.stats.acceptance_lengths) + 1 > out.stats.new_tokens       # the stop cut a block
    _check_stream(rec, ids, out)
    assert rec.new_tokens[-1] == new[k]


def test_nothing_after_a_stop_string_inside_a_block_is_streamed(setup):
    model, tok, ids, free, drafter = setup
    new = free[0, ids.shape[1]:].tolist()
    probe = RecordingStreamer()
    eagle_compile.generate(model, ids, draft=drafter, options=TREE, max_new_tokens=MAX_NEW, streamer=probe)
    text = [tok.decode(new[:j]) for j in range(len(new) + 1)]   # characters: one token, one character

    def first_of(k: int) -> bool:           # two plain characters ending at token k, nowhere earlier
        stop = text[k + 1][-2:]
        return k >= 1 and min(new[k - 1:k + 1]) >= 4 and text[k + 1].find(stop) == len(text[k + 1]) - 2

    k = _stop_position(new, probe, first_of)
    stop = text[k + 1][-2:]
    ref = greedy_reference(model, ids, max_new_tokens=MAX_NEW, stop_strings=[stop], tokenizer=tok)
    rec = RecordingStreamer()
    out = eagle_compile.generate(model, ids, draft=drafter, options=TREE, max_new_tokens=MAX_NEW,
                                 stop_strings=[stop], tokenizer=tok, streamer=rec, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and ref.shape[1] == ids.shape[1] + k + 1
    assert sum(out.stats.acceptance_lengths) + 1 > out.stats.new_tokens
    _check_stream(rec, ids, out)
    assert tok.decode(rec.new_tokens).endswith(stop)


def test_max_new_tokens_1_streams_the_first_token_only(setup):
    model, _, ids, free, drafter = setup
    rec = RecordingStreamer()
    out = eagle_compile.generate(model, ids, draft=drafter, options=TREE, max_new_tokens=1, streamer=rec,
                                 return_dict_in_generate=True)
    assert out.stats.cycles == 0 and len(rec.puts) == 2 and rec.ends == 1
    assert rec.new_tokens == free[0, ids.shape[1]:ids.shape[1] + 1].tolist()


def test_hf_custom_generate_door_keeps_the_streamer(setup):
    """transformers 5.24 puts the prompt itself and hands a custom decoding function only the arguments of its
    signature that `_sample` lacks, so `streamer` never reaches us. If this starts failing, transformers now
    forwards it: `generate` must then skip its own prompt put on this door (HF has made it)."""
    model, _, ids, free, drafter = setup
    rec = RecordingStreamer()
    out = model.generate(ids, custom_generate=eagle_compile.generate, draft=drafter, options=TREE,
                         max_new_tokens=MAX_NEW, do_sample=False, streamer=rec)
    assert torch.equal(out, free)
    assert len(rec.puts) == 1 and torch.equal(rec.puts[0], ids) and rec.ends == 0


@pytest.mark.parametrize("kind", ["recording", "text"])
def test_a_batch_is_refused_before_anything_streams(setup, kind):
    model, tok, ids, _, drafter = setup
    streamer = RecordingStreamer() if kind == "recording" else TextIteratorStreamer(tok, timeout=1)
    with pytest.raises(UnsupportedGenerationError, match=r"batch size 1.*2 rows.*once per prompt"):
        eagle_compile.generate(model, ids.repeat(2, 1), draft=drafter, options=TREE, max_new_tokens=4,
                               streamer=streamer)
    if kind == "recording":
        assert streamer.puts == [] and streamer.ends == 0
    else:
        assert streamer.text_queue.empty()
