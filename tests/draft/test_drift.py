"""Drift monitors (DESIGN.md §4): collected inside the host-loop step per draft depth, summed on the device and
read once per call; they never change the output."""

from __future__ import annotations

import pytest
import torch
from tiny import ScriptedDrafter, greedy_reference, random_head, tiny_target

import eagle_compile
from eagle_compile.draft.drift import DriftProbe, DriftTotals
from eagle_compile.errors import OptionsError

TREE = {"depth": 3, "top_k": 2, "total_tokens": 6, "prefill_chunk": 8}


def test_monitors_per_depth_with_a_real_head():
    model = tiny_target("llama", seed=0)
    head = random_head(model, flags=True, seed=0, reduced=False)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    ref = greedy_reference(model, ids, max_new_tokens=12)
    out = eagle_compile.generate(model, ids, draft=head, max_new_tokens=12, return_dict_in_generate=True,
                                 options={**TREE, "drift_monitors": True})
    assert torch.equal(out.sequences, ref)
    drift = out.stats.drift
    assert set(drift) == {"rms_ratio", "sink_mass", "draft_mass", "top1"}
    assert all(len(v) == TREE["depth"] for v in drift.values())
    assert drift["rms_ratio"][0] is None and drift["rms_ratio"][1] == pytest.approx(1.0)   # depth 2: the seed
    for d in (1, 2):
        assert 0.0 < drift["sink_mass"][d] < 1.0 and 0.0 < drift["draft_mass"][d] < 1.0
        assert drift["sink_mass"][d] + drift["draft_mass"][d] <= 1.0 + 1e-6
    assert all(0.0 < p <= 1.0 for p in drift["top1"])
    plain = eagle_compile.generate(model, ids, draft=head, max_new_tokens=12, return_dict_in_generate=True,
                                   options=TREE)
    assert plain.stats.drift is None                            # off by default


def test_attention_mass_of_a_probe_matches_a_direct_computation():
    from eagle_compile.core.masks import SlotMask

    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 2, 8, generator=g, dtype=torch.float64)
    keys = torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64)
    mask = SlotMask.tree(torch.tensor([[[True, False], [True, True]]]), torch.tensor([10]), 16)
    probe = DriftProbe()
    probe.attention(q, keys, mask, 8 ** -0.5)
    k = keys.repeat_interleave(2, dim=1)
    w = torch.softmax((q @ k.transpose(-1, -2)) * 8 ** -0.5 + torch.where(mask.visible(2)[:, None], 0.0, -torch.inf),
                      -1)
    assert probe.sink[0].item() == pytest.approx(w[..., :4].sum(-1).mean().item())
    assert probe.drafted[0].item() == pytest.approx(w[..., 10:12].sum(-1).mean().item())


def test_totals_skip_rows_that_did_not_draft_and_depths_never_measured():
    totals = DriftTotals()
    drift = torch.tensor([[[float("nan"), 2.0]] * 4, [[float("nan"), 10.0]] * 4])          # [B=2, 4, D=2]
    totals.add(drift, torch.tensor([True, False]))
    totals.add(torch.ones(1, 4, 3), torch.tensor([True]))                                  # a deeper program
    read = totals.read()
    assert read["top1"] == [1.0, 1.5, 1.0]


def test_scripted_drafters_have_no_attention_to_monitor():
    model = tiny_target("qwen2", seed=1)
    ids = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(3))
    ref = greedy_reference(model, ids, max_new_tokens=8)
    cont = [ids[0].tolist() + ref[0, 5:].tolist()]
    out = eagle_compile.generate(model, ids, draft=ScriptedDrafter(cont, 96, "oracle"), max_new_tokens=8,
                                 options={**TREE, "drift_monitors": True}, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats.drift["sink_mass"] == [None, None, None] and out.stats.drift["top1"][0] > 0.5


def test_drift_monitors_refuse_the_step_program():
    with pytest.raises(OptionsError, match="host-loop"):
        eagle_compile.options.parse_options({"drift_monitors": True, "step_program": True})
