"""In a ragged batch each row's tokens *and* acceptance lengths equal those of the row decoded alone (float32,
batch-invariant numerics, a fixed tree): a row's draft tree and verify do not depend on its neighbours."""

from __future__ import annotations

import pytest
import torch
from tiny import ragged, random_head, tiny_target

import eagle_compile

# Random heads are rarely accepted; the copy branch is: tiny random targets fall into loops that prompt lookup
# predicts, so acceptance lengths vary from cycle to cycle and row to row.
TREE = {"depth": 3, "top_k": 2, "total_tokens": 6, "copy": 4}


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", dtype=torch.float32)
    return target, random_head(target, flags=True, seed=3, reduced=False).float()


def test_rows_of_a_batch_decode_as_if_alone(setup):
    target, head, tree = *setup, TREE
    ids, mask = ragged([5, 17, 30, 2], seed=11)
    with torch.no_grad():
        batch = eagle_compile.generate(target, ids, attention_mask=mask, draft=head, options=tree,
                                       max_new_tokens=24, return_dict_in_generate=True)
        alone = []
        for b in range(ids.shape[0]):
            row = ids[b:b + 1, -int(mask[b].sum()):]
            alone.append(eagle_compile.generate(target, row, draft=head, options=tree, max_new_tokens=24,
                                                return_dict_in_generate=True))
    assert "batch_invariant" in batch.stats.lowering
    accepted = 0
    for b, out in enumerate(alone):
        assert torch.equal(batch.sequences[b, ids.shape[1]:], out.sequences[0, out.sequences.shape[1] - 24:]), b
        assert batch.stats.row_acceptance[b] == out.stats.row_acceptance[0], b
        accepted += sum(n - 1 for n in out.stats.row_acceptance[0])
    assert accepted >= 10, "drafts must be accepted for the acceptance lengths to say anything"
