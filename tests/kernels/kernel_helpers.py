"""Helpers of the kernel tests: poisoned output buffers and a range-relative comparison."""

from __future__ import annotations

import torch

POISON_FLOAT = float("nan")
POISON_INT = -777

#: max |kernel - reference| allowed, relative to max(1, max |reference|). The oracle is the reference run on
#: fp32 copies of the inputs, so fp32 kernels differ only by summation order; fp16/bf16 kernels also round
#: their inputs to the tile dtype (P in attention, normalised features in fc_norm_fuse) and their output.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def poisoned(shape, dtype, device="cpu") -> torch.Tensor:
    """An output buffer whose every element fails the comparison unless the kernel writes it."""
    if dtype.is_floating_point:
        return torch.full(shape, POISON_FLOAT, dtype=dtype, device=device)
    return torch.full(shape, POISON_INT, dtype=dtype, device=device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Range-relative check against the oracle; NaN anywhere (an unwritten poisoned element) fails."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert not actual.isnan().any(), "unwritten (poisoned) or NaN output elements"
    scale = max(1.0, expected.abs().max().item())
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, f"max |err| {err:.3g} > {TOLERANCE[dtype]} * {scale:.3g}"
