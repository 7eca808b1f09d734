"""fc_norm_fuse: the Triton kernel (interpreter on CPU) against per-chunk RMSNorm + concat + fc in torch."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import assert_close, poisoned

from eagle_compile.kernels.fc_norm_fuse import fc_norm_fuse_reference, fc_norm_fuse_triton

pytest.importorskip("triton")


def inputs(rows, features, width, hidden, dtype, *, norm=True, seed=0):
    """Chunks at very different scales (1, 10, 100, ...), as low/mid/high target layers are."""
    g = torch.Generator().manual_seed(seed)
    scale = (10.0 ** torch.arange(features)).repeat_interleave(width)
    x = (torch.randn(rows, features * width, generator=g) * scale).to(dtype)
    norm_weight = torch.rand(features, width, generator=g) + 0.5 if norm else None
    fc_weight = (torch.randn(hidden, features * width, generator=g) / (features * width) ** 0.5).to(dtype)
    return x, norm_weight, fc_weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [True, False], ids=["fc_norm", "plain_fc"])
def test_matches_reference(dtype, norm):
    # N=5, Ht=20, H=19 against 16-wide tiles: every dimension has a partial tile
    x, nw, w = inputs(5, 3, 20, 19, dtype, norm=norm)
    out = fc_norm_fuse_triton(x, nw, 1e-5, w, out=poisoned((5, 19), dtype), block_m=16, block_n=16,
                              block_k=16)
    expected = fc_norm_fuse_reference(x, nw, 1e-5, w)  # same dtype: the normalised features round alike
    assert_close(out.float(), expected.float(), dtype)
    if norm:  # and close to the fp32 computation
        assert_close(out.float(), fc_norm_fuse_reference(x.float(), nw, 1e-5, w.float()), dtype)


@pytest.mark.parametrize("features", [1, 2, 4])
def test_feature_counts_and_leading_dims(features):
    x, nw, w = inputs(6, features, 12, 10, torch.float32, seed=features)
    x = x.view(2, 3, -1)
    out = fc_norm_fuse_triton(x, nw, 1e-6, w, out=poisoned((2, 3, 10), torch.float32), block_k=16, block_n=16)
    assert_close(out, fc_norm_fuse_reference(x, nw, 1e-6, w), torch.float32)


def test_default_tiles_and_non_contiguous_features():
    x, nw, w = inputs(7, 3, 40, 70, torch.float16)
    x_t = x.t().contiguous().t()  # same values, column-major strides
    out = fc_norm_fuse_triton(x_t, nw, 1e-5, w, out=poisoned((7, 70), torch.float16))
    assert_close(out.float(), fc_norm_fuse_reference(x, nw, 1e-5, w).float(), torch.float16)


def test_bf16_runs_with_fp32_dots_in_the_interpreter():
    x, nw, w = inputs(3, 3, 16, 16, torch.bfloat16)
    out = fc_norm_fuse_triton(x, nw, 1e-5, w, out=poisoned((3, 16), torch.bfloat16))
    assert_close(out.float(), fc_norm_fuse_reference(x, nw, 1e-5, w).float(), torch.bfloat16)


def test_reference_is_per_feature_rmsnorm_then_fc():
    x, nw, w = inputs(4, 3, 8, 5, torch.float64)
    chunks = [nw[i] * c / torch.sqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5)
              for i, c in enumerate(x.chunk(3, -1))]
    torch.testing.assert_close(fc_norm_fuse_reference(x, nw, 1e-5, w), torch.cat(chunks, -1) @ w.T)
    torch.testing.assert_close(fc_norm_fuse_reference(x, None, 1e-5, w), x @ w.T)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_is_bitwise_the_draft_modules_fuse(dtype):
    # the per-feature norms of eagle_compile/draft/model.py (HF-style RMSNorm: cast back before the weight)
    from eagle_compile.draft.model import RMSNorm

    x, nw, w = inputs(4, 3, 16, 8, dtype)
    norms = [RMSNorm(16, 1e-5).to(dtype) for _ in range(3)]
    for norm, weight in zip(norms, nw, strict=True):
        norm.weight.data.copy_(weight)
    with torch.no_grad():
        normed = torch.cat([norm(c) for norm, c in zip(norms, x.chunk(3, -1), strict=True)], -1)
        module = torch.nn.functional.linear(normed, w)
    assert torch.equal(fc_norm_fuse_reference(x, nw.to(dtype), 1e-5, w), module)


def test_bad_shapes_are_refused():
    x, nw, w = inputs(2, 3, 8, 5, torch.float32)
    with pytest.raises(ValueError, match="do not fit fc_weight"):
        fc_norm_fuse_reference(x[:, :-1], None, 1e-5, w)
    with pytest.raises(ValueError, match=r"norm_weight \(2, 8\)"):
        fc_norm_fuse_reference(x, nw[:2], 1e-5, w)
    with pytest.raises(ValueError, match="one dtype"):
        fc_norm_fuse_reference(x.half(), nw, 1e-5, w)
