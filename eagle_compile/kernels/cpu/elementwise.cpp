// Fused elementwise CPU kernels for float32: eagle31::rope and eagle31::rms_scale.
//
// Each replaces a chain of torch elementwise ops that a traced decoder layer runs one by one (each its own
// Python line and dispatch in a graph that runs as FX code) with one loop that performs the very same
// floating-point operations in the same order, each rounded to float32 as torch rounds it: the outputs are
// bit-identical to the chain's (passes/fuse_elementwise.py swaps them in; tests compare bit for bit).
// Compiled with -ffp-contract=off, so no multiply-add is fused.
//
//   rope(x, cos, sin)            = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., h:], x[..., :h])
//   rms_scale(x, var, w, eps)    = w * (x * rsqrt(var + eps)), rsqrt(v) = 1 / sqrt(v) (torch's CPU rsqrt: a
//                                  correctly rounded square root, then a correctly rounded division)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// The [rows, D] view of a tensor of up to 4 dims broadcast to `sizes` (last dim D): the element offset of row r.
struct Rows {
  const float* p;
  int64_t size[3] = {1, 1, 1}, stride[3] = {0, 0, 0}, last = 1;

  Rows(const at::Tensor& t, at::IntArrayRef sizes) : p(t.data_ptr<float>()) {
    const at::Tensor e = t.expand(sizes);
    const int64_t lead = static_cast<int64_t>(sizes.size()) - 1;
    for (int64_t i = 0; i < lead; ++i) {
      size[3 - lead + i] = sizes[i];
      stride[3 - lead + i] = e.stride(i);
    }
    last = e.stride(lead);
  }
  const float* row(int64_t r) const {
    const int64_t i2 = r % size[2], i1 = (r / size[2]) % size[1], i0 = r / (size[2] * size[1]);
    return p + i0 * stride[0] + i1 * stride[1] + i2 * stride[2];
  }
};

void check_float(const char* op, std::initializer_list<at::Tensor> ts) {
  for (const auto& t : ts)
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), op, ": float32 CPU tensors expected, got ",
                t.scalar_type(), " on ", t.device());
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_float("eagle31::rope", {x, cos, sin});
  TORCH_CHECK(x.dim() >= 1 && x.dim() <= 4 && x.size(-1) % 2 == 0, "eagle31::rope: x [..., D] with even D and at "
              "most 4 dims expected, got ", x.sizes());
  const int64_t D = x.size(-1), h = D / 2, rows = x.numel() / std::max<int64_t>(D, 1);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (rows == 0 || D == 0) return out;
  const Rows xr(x, x.sizes()), cr(cos, x.sizes()), sr(sin, x.sizes());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *a = xr.row(r), *c = cr.row(r), *s = sr.row(r);
      float* y = op + r * D;
      for (int64_t d = 0; d < D; ++d) {
        const float rot = d < h ? -a[(d + h) * xr.last] : a[(d - h) * xr.last];
        const float first = a[d * xr.last] * c[d * cr.last];
        const float second = rot * s[d * sr.last];
        y[d] = first + second;
      }
    }
  });
  return out;
}

at::Tensor rms_scale(const at::Tensor& x, const at::Tensor& variance, const at::Tensor& weight, double eps) {
  check_float("eagle31::rms_scale", {x, variance, weight});
  TORCH_CHECK(x.dim() >= 1 && x.dim() <= 4 && variance.dim() == x.dim() && variance.size(-1) == 1 &&
                  weight.dim() == 1 && weight.size(0) == x.size(-1),
              "eagle31::rms_scale: x [..., D], variance [..., 1] and weight [D] expected, got ", x.sizes(), ", ",
              variance.sizes(), ", ", weight.sizes());
  const int64_t D = x.size(-1), rows = x.numel() / std::max<int64_t>(D, 1);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (rows == 0 || D == 0) return out;
  const at::Tensor w = weight.contiguous();
  std::vector<int64_t> row_sizes(x.sizes().begin(), x.sizes().end());
  row_sizes.back() = 1;
  const Rows xr(x, x.sizes()), vr(variance, row_sizes);
  const float e = static_cast<float>(eps);   // torch adds a Python float to a float32 tensor in float32
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* a = xr.row(r);
      const float v = *vr.row(r) + e;
      const float inv = 1.0f / std::sqrt(v);
      float* y = op + r * D;
      for (int64_t d = 0; d < D; ++d) {
        const float scaled = a[d * xr.last] * inv;
        y[d] = wp[d] * scaled;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(eagle31, CPU, m) {
  m.impl("rope", &rope);
  m.impl("rms_scale", &rms_scale);
}
