"""Lossless greedy decoding with scripted drafters (TESTING.md invariants 1, 3, 7).

The oracle proposes the target's own greedy continuation (every draft token must be accepted: depth + 1 tokens
per cycle); the adversarial drafter never proposes it (nothing accepted). Both must leave the output exactly
equal to `model.generate`.
"""

from __future__ import annotations

import pytest
import torch
from tiny import ScriptedDrafter, continuations, greedy_reference, ragged, tiny_target
from transformers import StoppingCriteria

import eagle_compile

TREE = {"depth": 4, "top_k": 3, "total_tokens": 10, "prefill_chunk": 8}


@pytest.mark.parametrize("mode", ["oracle", "adversarial"])
def test_scripted_drafters_ragged_batch(mode):
    model = tiny_target("llama", seed=3)
    ids, mask = ragged([4, 13, 9], seed=1)
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=17)
    drafter = ScriptedDrafter(continuations(ids, mask, ref), 96, mode)
    out = eagle_compile.generate(model, ids, attention_mask=mask, draft=drafter, options=TREE, max_new_tokens=17,
                                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    lengths = out.stats.acceptance_lengths
    if mode == "oracle":
        # every cycle accepts the whole depth except where the known continuation runs out at the end
        assert lengths.count(TREE["depth"] + 1) >= len(lengths) - 3
        assert out.stats.cycles <= 17 // (TREE["depth"] + 1) + 2
    else:
        assert set(lengths) == {1} and out.stats.cycles == 16   # 1 token from prefill + 16 cycles of 1


def test_eos_inside_an_accepted_block_ends_the_row_there():
    model = tiny_target("qwen2", seed=5)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    free = greedy_reference(model, ids, max_new_tokens=24)[0, 6:].tolist()
    eos = free[6]                     # 7th new token: inside the 2nd oracle block of 5
    first = free.index(eos)
    ref = greedy_reference(model, ids, max_new_tokens=24, eos_token_id=eos)
    assert ref.shape[1] == 6 + first + 1
    drafter = ScriptedDrafter([ids[0].tolist() + free], 96, "oracle")
    out = eagle_compile.generate(model, ids, draft=drafter, options=TREE, max_new_tokens=24, eos_token_id=eos,
                                 return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.sequences[0, -1] == eos
    assert sum(out.stats.acceptance_lengths) + 1 > out.stats.new_tokens   # a block was cut after the EOS


def test_eos_in_a_batch_pads_finished_rows_like_hf():
    model = tiny_target("mistral", seed=1)
    ids, mask = ragged([5, 8], seed=4)
    free = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=15)
    eos = int(free[0, 8 + 3])
    ref = greedy_reference(model, ids, attention_mask=mask, max_new_tokens=15, eos_token_id=eos)
    drafter = ScriptedDrafter(continuations(ids, mask, free), 96, "oracle")
    out = eagle_compile.generate(model, ids, attention_mask=mask, draft=drafter, options=TREE, max_new_tokens=15,
                                 eos_token_id=eos, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.attention_mask.shape == ref.shape
    assert out.attention_mask[0].sum() < out.attention_mask.shape[1]   # row 0 stopped early: padding masked


@pytest.mark.parametrize("max_new", [1, 2, 6])
def test_max_new_tokens_is_exact(max_new):
    model = tiny_target("qwen3", seed=2)
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(7))
    ref = greedy_reference(model, ids, max_new_tokens=max_new)
    free = greedy_reference(model, ids, max_new_tokens=20)
    drafter = ScriptedDrafter([r.tolist() for r in free], 96, "oracle")
    out = eagle_compile.generate(model, ids, draft=drafter, options=TREE, max_new_tokens=max_new)
    assert out.shape == (2, 5 + max_new)
    assert torch.equal(out, ref)


def test_user_stopping_criteria_apply_token_by_token():
    class StopAfterToken(StoppingCriteria):
        def __init__(self, token):
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    model = tiny_target("llama", seed=9)
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(3))
    free = greedy_reference(model, ids, max_new_tokens=20)
    stop_token = int(free[0, 7 + 5])
    ref = model.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=[StopAfterToken(stop_token)])
    drafter = ScriptedDrafter([free[0].tolist()], 96, "oracle")
    out = model.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=eagle_compile.generate,
                         draft=drafter, options=TREE, stopping_criteria=[StopAfterToken(stop_token)])
    assert torch.equal(out, ref)
    assert out.shape[1] < free.shape[1]


def test_identical_rows_give_identical_outputs():
    model = tiny_target("qwen2", seed=8)
    row = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(5))
    ids = row.repeat(4, 1)
    ref = greedy_reference(model, row, max_new_tokens=12)
    drafter = ScriptedDrafter([ref[0].tolist()] * 4, 96, "adversarial")
    out = eagle_compile.generate(model, ids, draft=drafter, options=TREE, max_new_tokens=12)
    assert torch.equal(out, ref.repeat(4, 1))
