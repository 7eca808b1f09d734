"""Custom ops of eagle31 (`torch.ops.eagle31.*`): a Triton kernel for CUDA and a torch reference for the rest.

Importing this package registers every op with `torch.library` (real and fake implementations, so dynamo,
inductor and export see them) without importing Triton. Each op lives in `kernels/<name>.py` beside its Triton
kernel, host wrapper and `<name>_reference`; the op picks the implementation per call with
`_dispatch.choose` (CUDA: Triton when importable; CPU: the reference, or the Triton interpreter when
`EAGLE31_TRITON_INTERPRET=1`; float64 compute runs the reference). `kernel_choices` reports the choice and
its reason for `eagle_compile.explain`.
"""

from __future__ import annotations

import torch

from eagle_compile.kernels import (
    _dispatch,
    accept,
    batch_invariant,
    draft_topk,
    fc_norm_fuse,
    kv_compact,
    kv_write,
    tree_attention,
)

batch_invariant._TREE_ATTENTION.update({torch.ops.eagle31.tree_attention, torch.ops.eagle31.tree_attention.default})

#: op name -> (what it does, whether it takes only fp16/bf16/fp32 compute tensors)
KERNELS: dict[str, tuple[str, bool]] = {
    "tree_attention": ("a block of queries over the live slots of the cache (prefix + causal/tree block), GQA",
                       True),
    "fc_norm_fuse": ("EAGLE 3.1 per-feature RMSNorms + concat + fc in one pass", True),
    "draft_topk": ("draft lm_head + log-softmax top-k + d2t without materialising the logits", True),
    "kv_compact": ("moves the accepted path's K/V into place (in place)", False),
    "kv_write": ("new K/V into their cache slots (in place, so lowerings never copy the cache)", False),
    "accept_greedy": ("greedy path matching and bonus token", False),
    "accept_sample": ("lossless tree sampling (deterministic drafts) and bonus token", False),
}


def kernel_choices(device: torch.device | str = "cuda",
                   dtype: torch.dtype | None = None) -> dict[str, tuple[str, str]]:
    """For every op: (implementation, reason) that a call with tensors on `device` (and `dtype`) would use.

    The implementation is "triton", "triton-interpreter" or "reference".
    """
    choices = {}
    for name, (_, float_only) in KERNELS.items():
        if name in TORCH_ONLY:
            choices[name] = (_dispatch.REFERENCE, TORCH_ONLY[name])
            continue
        c = _dispatch.choose(device, dtype, dtypes=_dispatch.FLOAT_DTYPES if float_only else None)
        choices[name] = (c.impl, c.reason)
    if torch.device(device).type == "cpu" and choices["tree_attention"][0] == _dispatch.REFERENCE:
        choices["tree_attention"] = (_dispatch.REFERENCE, "CPU: torch's flash attention over the prefix and the "
                                                          "block, merged by log-sum-exp (live slots only)")
    return choices


def eager_calls() -> dict:
    """op overload -> its Python implementation, for graphs that run as FX code (`Lowering` "eager"): a call
    through the dispatcher costs ~20 us on top of the implementation, and these ops run once per layer."""
    ops = torch.ops.eagle31
    impls = {ops.tree_attention: tree_attention.tree_attention_impl, ops.kv_write: kv_write.kv_write_reference,
             ops.bi_linear: batch_invariant.linear}     # bi_linear reads packed weights there (same bits)
    return {**impls, **{packet.default: fn for packet, fn in impls.items()}}


#: ops that run torch code on every device, and why
TORCH_ONLY = {"kv_write": "a scatter of the new rows; torch's runs on every device (no Triton kernel)"}


__all__ = ["KERNELS", "accept", "batch_invariant", "draft_topk", "fc_norm_fuse", "kernel_choices", "kv_compact",
           "kv_write", "tree_attention"]
