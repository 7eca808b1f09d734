"""Bad input refused before anything runs, naming the row, the position, the value and the fix: ids outside the
target's vocabulary where the attention mask keeps them (padding under mask 0 may hold any id), ids that are
not integers, and shapes `generate` cannot split into rows."""

from __future__ import annotations

import pytest
import torch
from tiny import greedy_reference, ragged, tiny_target

import eagle_compile
from eagle_compile.runtime import generate as generate_module

LENGTHS = [6, 8, 5]
MAX_NEW = 8


@pytest.fixture(scope="module")
def setup():
    model = tiny_target("llama", seed=5)
    ids, mask = ragged(LENGTHS, seed=2)
    return model, ids, mask


# -- ids refused before anything runs -----------------------------------------------------------------------------
@pytest.mark.parametrize(("row", "pos", "bad"), [(1, 3, -5), (0, 4, 96), (2, 7, 10_000)])
def test_ids_outside_the_vocabulary_are_refused_naming_row_position_and_id(setup, row, pos, bad):
    model, ids, mask = setup
    ids = ids.clone()
    ids[row, pos] = bad
    assert mask[row, pos] == 1
    # Without the check the id reaches the embedding inside the captured forward: an IndexError on CPU, a
    # device-side assert that ends the CUDA context on a GPU.
    with pytest.raises(IndexError):
        model(ids[row:row + 1])
    decoders_before = dict(generate_module._decoders.get(model, {}))
    for call in (lambda: eagle_compile.generate(model, ids, attention_mask=mask, options={"speculate": False}),
                 lambda: torch.compile(model, backend="eagle31", options={"speculate": False}).generate(
                     ids, attention_mask=mask)):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        for word in (f"input_ids[{row}, {pos}] = {bad}", f"row {row}", f"position {pos}", "[0, 96)", "tokenizer"):
            assert word in message, (word, message)
    assert generate_module._decoders.get(model, {}) == decoders_before      # refused before any program was built


def test_many_bad_ids_are_counted_and_their_rows_named(setup):
    model, ids, mask = setup
    ids = ids.clone()
    ids[0, -1], ids[2, -2] = -1, 200
    with pytest.raises(ValueError, match=r"input_ids\[0, 7\] = -1 .*2 such ids, in rows \[0, 2\]"):
        eagle_compile.generate(model, ids, attention_mask=mask, options={"speculate": False})


def test_padding_may_hold_any_id_under_mask_zero(setup):
    model, ids, mask = setup
    odd = ids.masked_fill(mask == 0, -100)       # left padding of -100: never read, so not refused
    odd[0, 0], odd[2, 1] = 96, 10_000
    assert not ((odd < 0) | (odd >= 96))[mask.bool()].any() and ((odd < 0) | (odd >= 96)).any()
    out = eagle_compile.generate(model, odd, attention_mask=mask, options={"speculate": False, "prefill_chunk": 16},
                                 max_new_tokens=MAX_NEW)
    width = ids.shape[1]
    for i, n in enumerate(LENGTHS):
        alone = greedy_reference(model, ids[i:i + 1, width - n:], max_new_tokens=MAX_NEW)[0, n:]
        assert torch.equal(out[i, width:], alone)
    assert torch.equal(out[:, :width], odd)          # the padding comes back as it was given


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_ids_that_are_not_integers_are_refused(setup, dtype):
    model, ids, mask = setup
    # Without the check `_split_rows` casts with .long(): 3.7 would run as token 3 and True as token 1.
    with pytest.raises(ValueError, match=rf"input_ids has dtype {dtype}; token ids must be an integer tensor"):
        eagle_compile.generate(model, ids.to(dtype), attention_mask=mask, options={"speculate": False})


def test_wrong_shapes_are_refused_with_the_fix(setup):
    model, ids, mask = setup
    plain = {"speculate": False}
    # 1-D ids would otherwise be read as a batch of one-token rows; a [0, L] batch crashes on prompts[0]
    with pytest.raises(ValueError, match=r"shape \(8,\).*input_ids\[None\]"):
        eagle_compile.generate(model, ids[1], options=plain)
    with pytest.raises(ValueError, match=r"shape \(0, 8\)"):
        eagle_compile.generate(model, ids[:0], options=plain)
    with pytest.raises(ValueError, match=r"attention_mask shape \(3, 7\) differs from input_ids \(3, 8\)"):
        eagle_compile.generate(model, ids, attention_mask=mask[:, 1:], options=plain)
    empty = mask.clone()
    empty[2] = 0
    with pytest.raises(ValueError, match="row 2 has an all-zero attention_mask"):
        eagle_compile.generate(model, ids, attention_mask=empty, options=plain)
