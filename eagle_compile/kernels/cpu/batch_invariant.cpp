// Batch-invariant CPU kernels for float32: eagle31::bi_linear and eagle31::bi_tree_attention.
//
// "Batch-invariant" means every output element is computed by one fixed sequence of floating-point operations
// that depends only on that element's own inputs, never on how many rows (tokens) the call carries, which row or
// tile a token lands in, how the work is split over threads, or how long the cache is. Then a token's logits are
// bit-identical whether it is decoded alone, verified inside a tree of N nodes, or computed in a prefill chunk
// (see kernels/batch_invariant.py for the contract and the tests that prove it).
//
// The rules every loop below follows:
//   * a dot product over K is 8 lanes (lane = k mod 8, k < K8 = K - K % 8) accumulated by FMA in ascending k,
//     the lanes reduced by one fixed tree (hsum), then the K % 8 tail by scalar FMA in ascending k;
//   * tiles over rows (M) and columns (N) only choose which independent accumulators share loads: they never
//     change an element's operations (every tile shape runs the same per-accumulator sequence);
//   * threads split independent outputs (columns of a GEMM, query rows of attention), never a reduction;
//   * attention reduces over the visible keys in list order (the committed prefix in slot order, then the
//     visible block slots in slot order, which for a tree is the path from the root), so a tree node and the
//     same token in a one-token step see the same sequence of keys and values.
// Compiled with -ffp-contract=off: only the FMAs written here are fused.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EAGLE31_AVX2 1
#endif

namespace {

constexpr int64_t kLanes = 8;

#ifdef EAGLE31_AVX2
using Vec = __m256;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float hsum(Vec v) {  // ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#else
struct Vec {
  float l[kLanes];
};
inline Vec vload(const float* p) {
  Vec v;
  for (int i = 0; i < kLanes; ++i) v.l[i] = p[i];
  return v;
}
inline void vstore(float* p, Vec v) {
  for (int i = 0; i < kLanes; ++i) p[i] = v.l[i];
}
inline Vec vzero() { return Vec{}; }
inline Vec vset1(float x) {
  Vec v;
  for (int i = 0; i < kLanes; ++i) v.l[i] = x;
  return v;
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.l[i] = std::fma(a.l[i], b.l[i], c.l[i]);
  return c;
}
inline float hsum(Vec v) {
  float a = v.l[0] + v.l[4], b = v.l[1] + v.l[5], c = v.l[2] + v.l[6], d = v.l[3] + v.l[7];
  return (a + c) + (b + d);
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// bi_linear: y[m, n] = dot(x[m, :], w[n, :]) (+ bias[n]), every element by the fixed dot above.
//
// The weight may be float32, float16 or bfloat16 (x, bias and y stay float32): a 16-bit weight is widened to
// float32 exactly as it is loaded, so a float32 weight holding the same values gives bit-identical outputs
// while the 16-bit one streams half the bytes (kernels/batch_invariant.py keeps such copies of a draft head's
// weights when every value fits).

inline Vec wload(const float* p) { return vload(p); }
inline float wget(const float* p) { return *p; }
inline float wget(const at::Half* p) { return static_cast<float>(*p); }       // exact: every half is a float
inline float wget(const at::BFloat16* p) { return static_cast<float>(*p); }   // exact: the top 16 bits
#ifdef EAGLE31_AVX2
inline Vec wload(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vec wload(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#else
template <typename W>
inline Vec wload(const W* p) {
  Vec v;
  for (int i = 0; i < kLanes; ++i) v.l[i] = wget(p + i);
  return v;
}
#endif

template <int MR, int NR, typename W>
inline void linear_tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, const float* bias,
                        float* y, int64_t ldy) {
  Vec acc[MR][NR];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  const int64_t k8 = K - K % kLanes;
  for (int64_t k = 0; k < k8; k += kLanes) {
    Vec wv[NR];
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) wv[j] = wload(w + j * ldw + k);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const Vec xv = vload(x + i * ldx + k);
#pragma GCC unroll 16
      for (int j = 0; j < NR; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t k = k8; k < K; ++k) s = std::fma(x[i * ldx + k], wget(w + j * ldw + k), s);
      if (bias != nullptr) s = s + bias[j];
      y[i * ldy + j] = s;
    }
}

// Columns [n0, n1) of rows [m0, m0 + MR): NR-wide tiles, then narrower ones for the rest.
template <int MR, int NR, typename W>
inline void linear_rows(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K, const float* bias,
                        float* y, int64_t ldy, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR)
    linear_tile<MR, NR, W>(x, ldx, w + n * ldw, ldw, K, bias ? bias + n : nullptr, y + n, ldy);
  for (; n < n1; ++n) linear_tile<MR, 1, W>(x, ldx, w + n * ldw, ldw, K, bias ? bias + n : nullptr, y + n, ldy);
}

// Row pairs in 2 x 4 tiles (8 accumulators and 6 loads per 8 FMAs fit AVX2's 16 registers), a last single row in
// 1 x 8 tiles (a one-token step: eight weight rows stream at once).
template <typename W>
void linear_block(const float* x, int64_t M, int64_t K, const W* w, const float* bias, float* y, int64_t N,
                  int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) linear_rows<2, 4, W>(x + m * K, K, w, K, K, bias, y + m * N, N, n0, n1);
  if (m < M) linear_rows<1, 8, W>(x + m * K, K, w, K, K, bias, y + m * N, N, n0, n1);
}

// What bi_linear and bi_linear_packed share: the argument checks, the [M, K] input, the bias, the [M, N] output
// and the empty cases (`done`: nothing left to compute), then one call of `run` per weight dtype.
struct LinearCall {
  at::Tensor x, b, y;
  std::vector<int64_t> out_shape;
  int64_t M = 0;
  bool done = false;
  const float* xp() const { return x.data_ptr<float>(); }
  const float* bp() const { return b.defined() ? b.data_ptr<float>() : nullptr; }
  float* yp() { return y.data_ptr<float>(); }
};

LinearCall linear_call(const char* op, const at::Tensor& input, at::ScalarType wt, int64_t K, int64_t N,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && (wt == at::kFloat || wt == at::kHalf || wt == at::kBFloat16),
              op, ": float32 input and a float32, float16 or bfloat16 weight required, got ", input.scalar_type(),
              " and ", wt);
  LinearCall c;
  c.M = c10::multiply_integers(input.sizes().begin(), input.sizes().end() - 1);
  c.x = input.reshape({c.M, K}).contiguous();
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, op, ": bias must be float32 [N] = [", N,
                "], got ", bias->sizes());
    c.b = bias->contiguous();
  }
  c.out_shape.assign(input.sizes().begin(), input.sizes().end());
  c.out_shape.back() = N;
  c.y = at::empty({c.M, N}, c.x.options());
  c.done = c.M == 0 || N == 0 || K == 0;
  if (K == 0 && c.M > 0 && N > 0) {   // an empty sum: the bias, or zeros
    if (c.b.defined()) c.y.copy_(c.b.expand({c.M, N})); else c.y.zero_();
  }
  return c;
}

template <typename F>
void by_weight_type(const at::Tensor& w, F&& run) {
  if (w.scalar_type() == at::kHalf)
    run(w.data_ptr<at::Half>());
  else if (w.scalar_type() == at::kBFloat16)
    run(w.data_ptr<at::BFloat16>());
  else
    run(w.data_ptr<float>());
}

at::Tensor bi_linear(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && input.dim() >= 1 && input.size(-1) == weight.size(1),
              "eagle31::bi_linear: input [..., K] and weight [N, K] expected, got ", input.sizes(), " and ",
              weight.sizes());
  const int64_t K = weight.size(1), N = weight.size(0);
  LinearCall c = linear_call("eagle31::bi_linear", input, weight.scalar_type(), K, N, bias);
  if (c.done) return c.y.reshape(c.out_shape);
  const at::Tensor w = weight.contiguous();
  // Column blocks of a multiple of 8 (the tile widths 4 and 8) whose weights (~128 KiB) stay in L2
  // while every row tile passes over them.
  const int64_t block = std::max<int64_t>(8, (32768 / std::max<int64_t>(K, 1)) / 8 * 8);
  const int64_t blocks = (N + block - 1) / block;
  const float* xp = c.xp();
  const float* bp = c.bp();
  float* yp = c.yp();
  const int64_t M = c.M;
  by_weight_type(w, [&](const auto* wp) {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t i = b0; i < b1; ++i)
        linear_block(xp, M, K, wp, bp, yp, N, i * block, std::min(N, (i + 1) * block));
    });
  });
  return c.y.reshape(c.out_shape);
}

// ---------------------------------------------------------------------------------------------------------------
// bi_linear_packed: bi_linear over a weight repacked as panels of 4 columns, [N/4][K/8][4][8]: for each 8-wide
// k block, the 8 values of column 0, then of columns 1, 2, 3. A tile of 4 columns then reads one contiguous
// stream instead of four rows K floats apart (a one-token step streams its weights from DRAM: SmolLM2's step
// 1.39x faster at 1 thread, benchmarks/packed_weights.py). Every output element runs bi_linear's very
// sequence (the same 8 lanes of k, the same FMAs in ascending k, the same hsum), so the two give identical bits;
// K must be a multiple of 8 and N of 4 (kernels/batch_invariant.py packs only such weights).

// `ahead` (or null) walks beside `panel` and is only prefetched, never read by the arithmetic: in a call of several
// rows, the first row tile streams the panel from memory and the others compute from L1, so the last one
// prefetches the next panel (and the others a little ahead in their own) to keep memory busy meanwhile. A
// one-row call is a pure stream, which the hardware prefetcher follows by itself (null: no prefetch).
inline void prefetch(const void* p, size_t bytes) {
#ifdef EAGLE31_AVX2
  for (size_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(p) + b, _MM_HINT_T0);
#endif
}

template <int MR, typename W>
inline void packed_tile(const float* x, int64_t K, const W* panel, const float* bias, float* y, int64_t ldy,
                        const W* ahead) {
  Vec acc[MR][4];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[i][j] = vzero();
  for (int64_t k = 0; k < K; k += kLanes, panel += 4 * kLanes) {
    if (ahead != nullptr) {
      prefetch(ahead, 4 * kLanes * sizeof(W));
      ahead += 4 * kLanes;
    }
    Vec wv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) wv[j] = wload(panel + j * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Vec xv = vload(x + i * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      float s = hsum(acc[i][j]);
      if (bias != nullptr) s = s + bias[j];
      y[i * ldy + j] = s;
    }
}

constexpr int64_t kPrefetchAhead = 512;   // weights ahead (2 KiB of float32) within a panel

at::Tensor bi_linear_packed(const at::Tensor& input, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 4 && packed.size(3) == kLanes && input.dim() >= 1 &&
                  input.size(-1) == packed.size(1) * kLanes,
              "eagle31::bi_linear_packed: input [..., K] and a weight packed as [N/4, K/8, 4, 8] expected, got ",
              input.sizes(), " and ", packed.sizes());
  const int64_t K = input.size(-1), N = packed.size(0) * 4;
  LinearCall c = linear_call("eagle31::bi_linear_packed", input, packed.scalar_type(), K, N, bias);
  if (c.done) return c.y.reshape(c.out_shape);
  const at::Tensor w = packed.contiguous();
  const float* xp = c.xp();
  const float* bp = c.bp();
  float* yp = c.yp();
  const int64_t M = c.M, panels = N / 4;
  by_weight_type(w, [&](const auto* wp) {
    // threads split panels (output columns); each panel (K x 4 weights) is read by every row tile in turn
    at::parallel_for(0, panels, 16, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const auto* panel = wp + p * K * 4;
        const float* pb = bp ? bp + p * 4 : nullptr;
        const auto* next = M > 1 ? panel + K * 4 : nullptr;   // the last row tile prefetches the next panel
        const auto* within = panel + kPrefetchAhead;          // the others a little ahead in their own
        int64_t m = 0;
        for (; m + 2 <= M; m += 2)
          packed_tile<2>(xp + m * K, K, panel, pb, yp + m * N + p * 4, N, m + 2 < M ? within : next);
        if (m < M) packed_tile<1>(xp + m * K, K, panel, pb, yp + m * N + p * 4, N, next);
      }
    });
  });
  return c.y.reshape(c.out_shape);
}

// ---------------------------------------------------------------------------------------------------------------
// bi_linear_panels: bi_linear over a float32 weight repacked as [N/16][8][K/8][16]: panel p holds columns
// 16p .. 16p+15, and within it lane l's weights w[n, 8j + l] for ascending j, the 16 columns side by side.
// The loops run the other way round from bi_linear's: a vector spans 16 output columns (one broadcast of x
// feeds 16 FMAs) instead of 8 values of k, and the eight lanes of k are eight passes over j, each into its own
// accumulators, added at the end by hsum's tree. Every output element still runs bi_linear's very sequence --
// lane l = FMAs of x[m, 8j + l] * w[n, 8j + l] in ascending j from zero, then ((l0+l4)+(l2+l6)) +
// ((l1+l5)+(l3+l7)), then the bias -- so the bits are identical, while a many-row call (a prefill chunk) runs at
// the full width of AVX-512 (32 FMA lanes a cycle on this project's CPUs, against 16 for bi_linear's AVX2 tiles).
// K must be a multiple of 8 and N of 16 (kernels/batch_invariant.py packs only such weights).

constexpr int64_t kPanel = 16;

#ifdef __AVX512F__
struct V16 {
  __m512 v;
};
inline V16 z16() { return {_mm512_setzero_ps()}; }
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store16(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 add16(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 fma16(float x, V16 w, V16 acc) { return {_mm512_fmadd_ps(_mm512_set1_ps(x), w.v, acc.v)}; }
#else
struct V16 {
  float l[kPanel];
};
inline V16 z16() { return V16{}; }
inline V16 load16(const float* p) {
  V16 a;
  for (int i = 0; i < kPanel; ++i) a.l[i] = p[i];
  return a;
}
inline void store16(float* p, V16 a) {
  for (int i = 0; i < kPanel; ++i) p[i] = a.l[i];
}
inline V16 add16(V16 a, V16 b) {
  for (int i = 0; i < kPanel; ++i) a.l[i] = a.l[i] + b.l[i];
  return a;
}
inline V16 fma16(float x, V16 w, V16 acc) {
  for (int i = 0; i < kPanel; ++i) acc.l[i] = std::fma(x, w.l[i], acc.l[i]);
  return acc;
}
#endif

// Rows [0, MR) of x (row stride K) against P adjacent panels (`pstride` floats apart): y[i, 16p + c].
template <int MR, int P>
inline void panel_tile(const float* x, int64_t K, const float* w, int64_t pstride, const float* bias, float* y,
                       int64_t ldy) {
  const int64_t J = K / kLanes;
  V16 part[kLanes][MR][P];
  for (int l = 0; l < kLanes; ++l) {
    V16 acc[MR][P];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) acc[i][p] = z16();
    const float* wl = w + l * J * kPanel;
    const float* xl = x + l;
    for (int64_t j = 0; j < J; ++j) {
      V16 wv[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) wv[p] = load16(wl + p * pstride + j * kPanel);
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) {
        const float xi = xl[i * K + j * kLanes];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) acc[i][p] = fma16(xi, wv[p], acc[i][p]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) part[l][i][p] = acc[i][p];
  }
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < P; ++p) {
      const V16 lo = add16(add16(part[0][i][p], part[4][i][p]), add16(part[2][i][p], part[6][i][p]));
      const V16 hi = add16(add16(part[1][i][p], part[5][i][p]), add16(part[3][i][p], part[7][i][p]));
      V16 s = add16(lo, hi);
      if (bias != nullptr) s = add16(s, load16(bias + p * kPanel));
      store16(y + i * ldy + p * kPanel, s);
    }
}

// Every row of x against P panels: tiles of 8 rows (24 accumulators of the 32 AVX-512 registers at P = 3),
// then 4, 2, 1 for the rest.
template <int P>
void panel_rows(const float* x, int64_t M, int64_t K, const float* w, int64_t pstride, const float* bias, float* y,
                int64_t N) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) panel_tile<8, P>(x + m * K, K, w, pstride, bias, y + m * N, N);
  if (m + 4 <= M) panel_tile<4, P>(x + m * K, K, w, pstride, bias, y + m * N, N), m += 4;
  if (m + 2 <= M) panel_tile<2, P>(x + m * K, K, w, pstride, bias, y + m * N, N), m += 2;
  if (m < M) panel_tile<1, P>(x + m * K, K, w, pstride, bias, y + m * N, N);
}

constexpr int64_t kPanelGroup = 3;   // panels per work item: 48 columns

at::Tensor bi_linear_panels(const at::Tensor& input, const at::Tensor& panels, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(panels.dim() == 4 && panels.size(1) == kLanes && panels.size(3) == kPanel && input.dim() >= 1 &&
                  input.size(-1) == panels.size(2) * kLanes && panels.scalar_type() == at::kFloat,
              "eagle31::bi_linear_panels: input [..., K] and a float32 weight packed as [N/16, 8, K/8, 16] "
              "expected, got ", input.sizes(), " and ", panels.sizes(), " ", panels.scalar_type());
  const int64_t K = input.size(-1), N = panels.size(0) * kPanel;
  LinearCall c = linear_call("eagle31::bi_linear_panels", input, at::kFloat, K, N, bias);
  if (c.done) return c.y.reshape(c.out_shape);
  const at::Tensor w = panels.contiguous();
  const float* wp = w.data_ptr<float>();
  const float* xp = c.xp();
  const float* bp = c.bp();
  float* yp = c.yp();
  const int64_t M = c.M, count = N / kPanel, pstride = K * kPanel;
  const int64_t groups = (count + kPanelGroup - 1) / kPanelGroup;
  // threads split groups of panels (output columns); each group's weights stay in L2 while every row tile
  // passes over them
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * kPanelGroup, P = std::min(kPanelGroup, count - p);
      const float* gw = wp + p * pstride;
      const float* gb = bp ? bp + p * kPanel : nullptr;
      float* gy = yp + p * kPanel;
      if (P == 3)
        panel_rows<3>(xp, M, K, gw, pstride, gb, gy, N);
      else if (P == 2)
        panel_rows<2>(xp, M, K, gw, pstride, gb, gy, N);
      else
        panel_rows<1>(xp, M, K, gw, pstride, gb, gy, N);
    }
  });
  return c.y.reshape(c.out_shape);
}

// ---------------------------------------------------------------------------------------------------------------
// bi_tree_attention: the visibility of kernels/tree_attention.py (prefix slots [0, base[b]), then block slot
// base[b] + j when causal j <= t, or local[b, t, j]), computed per (batch, query head, query) row:
//   s_i = dot(q, k_i) * scale over the visible keys i in list order; m = max s_i; p_i = exp(s_i - m);
//   l = sum p_i and acc = sum p_i v_i, both sequential in list order; out = acc / l (0 when nothing is visible).

// exp for x <= 0 (x = s - max; NaN stays NaN): Cody-Waite reduction by ln 2 and a degree-6 polynomial (~1 ulp); the same
// operations for every element, vector or not.
#ifdef EAGLE31_AVX2
inline Vec vexp(Vec x) {
  const Vec lo = vset1(-87.0f);
  const __m256 too_small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, x);   // NaN stays NaN (max_ps returns its second operand when either is NaN)
  const Vec n = _mm256_round_ps(_mm256_mul_ps(x, vset1(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = vfma(n, vset1(-0.693359375f), x);
  r = vfma(n, vset1(2.12194440e-4f), r);
  Vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, vset1(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const Vec out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(too_small, out);
}
#else
inline Vec vexp(Vec x) {
  Vec out;
  for (int i = 0; i < kLanes; ++i) {
    float v = x.l[i];
    if (v != v) {
      out.l[i] = v;
      continue;
    }
    if (v < -87.0f) {
      out.l[i] = 0.0f;
      continue;
    }
    const float n = std::nearbyint(v * 1.44269504088896341f);
    float r = std::fma(n, -0.693359375f, v);
    r = std::fma(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = std::fma(p, r, 1.3981999507e-3f);
    p = std::fma(p, r, 8.3334519073e-3f);
    p = std::fma(p, r, 4.1665795894e-2f);
    p = std::fma(p, r, 1.6666665459e-1f);
    p = std::fma(p, r, 5.0000001201e-1f);
    p = std::fma(p, r * r, r);
    p = p + 1.0f;
    out.l[i] = std::ldexp(p, static_cast<int>(n));
  }
  return out;
}
#endif

inline float dot(const float* a, const float* b, int64_t D) {
  Vec acc = vzero();
  const int64_t d8 = D - D % kLanes;
  for (int64_t d = 0; d < d8; d += kLanes) acc = vfma(vload(a + d), vload(b + d), acc);
  float s = hsum(acc);
  for (int64_t d = d8; d < D; ++d) s = std::fma(a[d], b[d], s);
  return s;
}

// dot(q, k_j) for four keys at once: four independent accumulator chains (one FMA chain alone waits on its own
// latency), each running `dot`'s very sequence, so out[j] == dot(q, k_j, D) bit for bit.
inline void dot4(const float* q, const float* const* k, int64_t D, float* out) {
  Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  const int64_t d8 = D - D % kLanes;
  for (int64_t d = 0; d < d8; d += kLanes) {
    const Vec qv = vload(q + d);
    a0 = vfma(qv, vload(k[0] + d), a0);
    a1 = vfma(qv, vload(k[1] + d), a1);
    a2 = vfma(qv, vload(k[2] + d), a2);
    a3 = vfma(qv, vload(k[3] + d), a3);
  }
  out[0] = hsum(a0);
  out[1] = hsum(a1);
  out[2] = hsum(a2);
  out[3] = hsum(a3);
  for (int j = 0; j < 4; ++j)
    for (int64_t d = d8; d < D; ++d) out[j] = std::fma(q[d], k[j][d], out[j]);
}

struct AttentionArgs {
  const float* q;
  const float* k;
  const float* v;
  const int64_t* base;
  const bool* local;
  float* out;
  int64_t B, Hq, Hkv, T, D, S, W;
  int64_t sq[4], sk[4], sv[4], sl[3], so[4];
  float scale;

  bool sees(int64_t b, int64_t t, int64_t j) const {   // block offset j visible to query t of row b
    return local == nullptr ? j <= t : local[b * sl[0] + t * sl[1] + j * sl[2]];
  }
};

constexpr int64_t kKeyBlock = 64;   // keys per block: a block of K or V (16 KiB at head dim 64) stays in L1
constexpr int64_t kMaxVec = 32;     // head dims up to 256

// acc[0 .. D) += p * v (vectors of 8, then the scalar tail): the same sequence for every caller.
template <int64_t DV>
inline void accumulate(Vec* acc, float* tail, float p, const float* v, int64_t dv, int64_t D) {
  const int64_t n = DV > 0 ? DV : dv;
  const Vec pv = vset1(p);
#pragma GCC unroll 16
  for (int64_t c = 0; c < n; ++c) acc[c] = vfma(pv, vload(v + c * kLanes), acc[c]);
  for (int64_t d = n * kLanes; d < D; ++d) tail[d - n * kLanes] = std::fma(p, v[d], tail[d - n * kLanes]);
}

struct Scratch {
  std::vector<float> p;     // per row: the scores, then the probabilities, in list order
  std::vector<float> acc;   // per row: the output accumulator (D floats)
  std::vector<float> l, m;  // per row: the running sum of probabilities and the max score
  std::vector<int64_t> n;   // per row: how many keys it has seen so far (its list index)
};

// The queries t in [t0, t1) of the query heads [h0, h1) (all sharing KV head h0 / G) of batch row b. Every key
// block is loaded once for all of these rows; each row walks its own visible keys in list order, so its
// arithmetic is what it would be alone.
template <int64_t DV>
void attention_tile(const AttentionArgs& a, int64_t b, int64_t h0, int64_t h1, int64_t t0, int64_t t1,
                    Scratch& sc) {
  const int64_t base = a.base[b], end = base + a.W, D = a.D, dv = D / kLanes;
  const int64_t kvh = h0 / (a.Hq / a.Hkv);
  const int64_t rows = (h1 - h0) * (t1 - t0);
  const int64_t cap = (end + kLanes - 1) / kLanes * kLanes;
  sc.p.assign(rows * cap, -std::numeric_limits<float>::infinity());
  sc.acc.assign(rows * D, 0.0f);
  sc.l.assign(rows, 0.0f);
  sc.m.assign(rows, -std::numeric_limits<float>::infinity());
  sc.n.assign(rows, 0);
  const float* kb = a.k + b * a.sk[0] + kvh * a.sk[1];
  const float* vb = a.v + b * a.sv[0] + kvh * a.sv[1];
  auto query = [&](int64_t r) { return a.q + b * a.sq[0] + (h0 + r / (t1 - t0)) * a.sq[1] + (t0 + r % (t1 - t0)) * a.sq[2]; };
  auto query_t = [&](int64_t r) { return t0 + r % (t1 - t0); };
  // Pass 1: scores in list order, and each row's max.
  for (int64_t s0 = 0; s0 < end; s0 += kKeyBlock) {
    const int64_t s1 = std::min(end, s0 + kKeyBlock);
    for (int64_t r = 0; r < rows; ++r) {
      const float* q = query(r);
      const int64_t t = query_t(r);
      float* p = &sc.p[r * cap];
      int64_t n = sc.n[r];
      float m = sc.m[r];
      const float* keys[kKeyBlock];     // the block's visible keys, in list order
      int64_t count = 0;
      for (int64_t s = s0; s < s1; ++s)
        if (s < base || a.sees(b, t, s - base)) keys[count++] = kb + s * a.sk[2];
      int64_t i = 0;
      for (; i + 4 <= count; i += 4) dot4(q, keys + i, D, p + n + i);
      for (; i < count; ++i) p[n + i] = dot(q, keys[i], D);
      for (i = 0; i < count; ++i) {
        const float x = p[n + i] * a.scale;
        p[n + i] = x;
        m = (x > m || x != x) ? x : m;   // a NaN score makes the row's max (and output) NaN, like the reference
      }
      sc.n[r] = n + count;
      sc.m[r] = m;
    }
  }
  // Probabilities (elementwise, so independent of the vector grouping); padding stays -inf -> 0.
  for (int64_t r = 0; r < rows; ++r) {
    float* p = &sc.p[r * cap];
    const Vec mv = vset1(sc.m[r]);
    for (int64_t i = 0; i < sc.n[r]; i += kLanes) {
#ifdef EAGLE31_AVX2
      vstore(p + i, vexp(_mm256_sub_ps(vload(p + i), mv)));
#else
      Vec x = vload(p + i);
      for (int e = 0; e < kLanes; ++e) x.l[e] = x.l[e] - mv.l[e];
      vstore(p + i, vexp(x));
#endif
    }
    sc.n[r] = 0;
  }
  // Pass 2: l = sum p_i and acc = sum p_i v_i, sequential in list order.
  Vec acc[kMaxVec];
  float tail[kLanes];
  for (int64_t s0 = 0; s0 < end; s0 += kKeyBlock) {
    const int64_t s1 = std::min(end, s0 + kKeyBlock);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = query_t(r);
      const float* p = &sc.p[r * cap];
      float* keep = &sc.acc[r * D];
      for (int64_t c = 0; c < dv; ++c) acc[c] = vload(keep + c * kLanes);
      for (int64_t d = dv * kLanes; d < D; ++d) tail[d - dv * kLanes] = keep[d];
      int64_t n = sc.n[r];
      float l = sc.l[r];
      for (int64_t s = s0; s < s1; ++s) {
        if (s >= base && !a.sees(b, t, s - base)) continue;
        const float pi = p[n++];
        l = l + pi;
        accumulate<DV>(acc, tail, pi, vb + s * a.sv[2], dv, D);
      }
      for (int64_t c = 0; c < dv; ++c) vstore(keep + c * kLanes, acc[c]);
      for (int64_t d = dv * kLanes; d < D; ++d) keep[d] = tail[d - dv * kLanes];
      sc.n[r] = n;
      sc.l[r] = l;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = a.out + b * a.so[0] + (h0 + r / (t1 - t0)) * a.so[1] + query_t(r) * a.so[2];
    const float l = sc.l[r];
    for (int64_t d = 0; d < D; ++d) out[d * a.so[3]] = sc.n[r] == 0 ? 0.0f : sc.acc[r * D + d] / l;
  }
}

#ifdef __AVX512F__
// ---------------------------------------------------------------------------------------------------------------
// The wide path of bi_tree_attention (AVX-512 builds, head dims a multiple of 16, calls of many queries: prefill
// chunks and large trees). Per row it runs attention_tile's very arithmetic -- each score is `dot`'s sequence
// (lane l = FMAs of q[8j + l] * k[8j + l] in ascending j from zero, then ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)))
// times the scale; the max over the visible scores; p = exp(s - m) by vexp's operations; l = sum p and
// acc = sum p v over the visible keys in list order -- so the two paths give identical bits, and which one runs
// is a matter of speed only. What changes is which values share a vector:
//   * scores: a vector spans 16 keys, not 8 values of the head dim. K is transposed once per call (kt: [D][keys]
//     per batch row and KV head), and lane l of the dot is its own pass over j into its own accumulators, added
//     by hsum's tree at the end (as bi_linear_panels does for a linear): no horizontal sum per score;
//   * values: a vector spans 16 head dims (two AVX2 vectors' worth), and each V row loaded feeds several rows'
//     accumulators.
// List order is slot order restricted to the visible slots (the prefix, then the visible block slots), so the
// scores stay indexed by slot; a row skips the slots it does not see.

constexpr int64_t kWideQueries = 8;    // queries per work item: G x 8 rows share every K and V block
constexpr int64_t kWideKeys = 64;      // keys per block: 4 vectors of scores; a block of V (16 KiB) stays in L1
constexpr int64_t kWideRowGroup = 6;   // score rows computed together: 6 x 4 accumulators of the 32 registers

using Z = __m512;

inline Z zset1(float x) { return _mm512_set1_ps(x); }

// vexp's operations on 16 lanes (the same IEEE operations per element, so the same bits as the AVX2 vexp).
inline Z vexp16(Z x) {
  const Z lo = zset1(-87.0f);
  const __mmask16 too_small = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(lo, x);   // NaN stays NaN (max_ps returns its second operand when either is NaN)
  const Z n = _mm512_roundscale_ps(_mm512_mul_ps(x, zset1(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Z r = _mm512_fmadd_ps(n, zset1(-0.693359375f), x);
  r = _mm512_fmadd_ps(n, zset1(2.12194440e-4f), r);
  Z p = zset1(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, zset1(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, zset1(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, zset1(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, zset1(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, zset1(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, zset1(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~too_small), _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

// dst[c * ldd + r] = src[r * lds + c] for a 16 x 16 block; rows >= `rows` of src read as zeros.
inline void transpose16(const float* src, int64_t lds, int64_t rows, float* dst, int64_t ldd) {
  Z r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = i < rows ? _mm512_loadu_ps(src + i * lds) : _mm512_setzero_ps();
  for (int i = 0; i < 16; i += 2) {   // per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3]
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {   // u[i + k], 128-bit lane L: column 4L + k of rows i .. i+3
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int h = 0; h < 16; h += 8)     // lanes [col k | col 8+k | col k | col 8+k] of rows h..h+3, h+4..h+7
    for (int k = 0; k < 4; ++k) {
      t[h + k] = _mm512_shuffle_f32x4(r[h + k], r[h + 4 + k], 0x88);
      t[h + 4 + k] = _mm512_shuffle_f32x4(r[h + k], r[h + 4 + k], 0xdd);
    }
  for (int k = 0; k < 4; ++k) {
    _mm512_storeu_ps(dst + k * ldd, _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88));
    _mm512_storeu_ps(dst + (8 + k) * ldd, _mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd));
    _mm512_storeu_ps(dst + (4 + k) * ldd, _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0x88));
    _mm512_storeu_ps(dst + (12 + k) * ldd, _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0xdd));
  }
}

// kt[d * ldk + s] = k[s * sk + d] for s < end, zeros for end <= s < ldk (a whole number of key blocks).
void transpose_keys(const float* k, int64_t sk, int64_t end, int64_t D, float* kt, int64_t ldk) {
  for (int64_t s0 = 0; s0 < ldk; s0 += 16)
    for (int64_t d0 = 0; d0 < D; d0 += 16)
      transpose16(k + s0 * sk + d0, sk, std::max<int64_t>(0, std::min<int64_t>(16, end - s0)), kt + d0 * ldk + s0,
                  ldk);
}

// Scores of RG rows (queries q[i], head dim D) against the kWideKeys keys of kt (row stride ldk), times `scale`,
// into out[i][0 .. kWideKeys).
template <int RG>
inline void wide_scores(const float* const* q, const float* kt, int64_t ldk, int64_t D, float scale,
                        float* const* out) {
  constexpr int KV = kWideKeys / 16;
  const int64_t J = D / kLanes;
  Z part[kLanes][RG][KV];
  for (int c = 0; c < kLanes; ++c) {
    Z acc[RG][KV];
#pragma GCC unroll 8
    for (int i = 0; i < RG; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < KV; ++v) acc[i][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < J; ++j) {
      const int64_t d = j * kLanes + c;
      Z kv[KV];
#pragma GCC unroll 4
      for (int v = 0; v < KV; ++v) kv[v] = _mm512_loadu_ps(kt + d * ldk + 16 * v);
#pragma GCC unroll 8
      for (int i = 0; i < RG; ++i) {
        const Z qd = zset1(q[i][d]);
#pragma GCC unroll 4
        for (int v = 0; v < KV; ++v) acc[i][v] = _mm512_fmadd_ps(qd, kv[v], acc[i][v]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < RG; ++i)
#pragma GCC unroll 4
      for (int v = 0; v < KV; ++v) part[c][i][v] = acc[i][v];
  }
  const Z sv = zset1(scale);
  for (int i = 0; i < RG; ++i)
    for (int v = 0; v < KV; ++v) {
      const Z lo = _mm512_add_ps(_mm512_add_ps(part[0][i][v], part[4][i][v]),
                                 _mm512_add_ps(part[2][i][v], part[6][i][v]));
      const Z hi = _mm512_add_ps(_mm512_add_ps(part[1][i][v], part[5][i][v]),
                                 _mm512_add_ps(part[3][i][v], part[7][i][v]));
      _mm512_storeu_ps(out[i] + 16 * v, _mm512_mul_ps(_mm512_add_ps(lo, hi), sv));
    }
}

template <int RG>
inline void wide_scores_rows(const float* const* q, int64_t rows, const float* kt, int64_t ldk, int64_t D,
                             float scale, float* const* out) {
  int64_t i = 0;
  for (; i + RG <= rows; i += RG) wide_scores<RG>(q + i, kt, ldk, D, scale, out + i);
  switch (rows - i) {
    case 5: wide_scores<5>(q + i, kt, ldk, D, scale, out + i); break;
    case 4: wide_scores<4>(q + i, kt, ldk, D, scale, out + i); break;
    case 3: wide_scores<3>(q + i, kt, ldk, D, scale, out + i); break;
    case 2: wide_scores<2>(q + i, kt, ldk, D, scale, out + i); break;
    case 1: wide_scores<1>(q + i, kt, ldk, D, scale, out + i); break;
    default: break;
  }
}

// acc[i] += p[i][s] * v_s and l[i] = l[i] + p[i][s] for the slots s in [s0, s1) (every row sees them), in order.
template <int DV, int RB>
inline void wide_values(const float* const* p, const float* v, int64_t sv, int64_t s0, int64_t s1, float* const* acc,
                        float* l) {
  Z a[RB][DV];
  float li[RB];
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i) {
    li[i] = l[i];
#pragma GCC unroll 16
    for (int c = 0; c < DV; ++c) a[i][c] = _mm512_loadu_ps(acc[i] + 16 * c);
  }
  for (int64_t s = s0; s < s1; ++s) {
    Z vv[DV];
#pragma GCC unroll 16
    for (int c = 0; c < DV; ++c) vv[c] = _mm512_loadu_ps(v + s * sv + 16 * c);
#pragma GCC unroll 8
    for (int i = 0; i < RB; ++i) {
      const float pi = p[i][s];
      li[i] = li[i] + pi;
      const Z pv = zset1(pi);
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) a[i][c] = _mm512_fmadd_ps(pv, vv[c], a[i][c]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i) {
    l[i] = li[i];
#pragma GCC unroll 16
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(acc[i] + 16 * c, a[i][c]);
  }
}

// The same update for one row and one slot (the block slots, which rows see selectively).
inline void wide_value(float p, const float* v, int64_t D, float* acc, float& l) {
  l = l + p;
  const Z pv = zset1(p);
  for (int64_t d = 0; d < D; d += 16)
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + d), _mm512_loadu_ps(acc + d)));
}

struct WideScratch {
  std::vector<float> s;                    // [rows][cap]: scores by slot, then probabilities
  std::vector<float> acc;                  // [rows][D]
  std::vector<float> l;                    // [rows]
  std::vector<int64_t> n;                  // [rows]: visible slots
  std::vector<const float*> q;             // [rows]: query vectors
  std::vector<float*> srow, arow;          // [rows]: rows of s and acc
  std::vector<const float*> prow;
};

// One work item of the wide path: queries [t0, t1) of query heads [h0, h1) (sharing one KV head) of batch row b,
// against kt (this row's and KV head's transposed keys, row stride ldk).
template <int DV>
void wide_tile(const AttentionArgs& a, const float* kt, int64_t ldk, int64_t b, int64_t h0, int64_t h1, int64_t t0,
               int64_t t1, WideScratch& sc) {
  constexpr int RB = DV >= 16 ? 1 : 16 / DV;
  const int64_t base = a.base[b], D = a.D, nq = t1 - t0, rows = (h1 - h0) * nq;
  const bool causal = a.local == nullptr;
  const int64_t kend = causal ? base + t1 : base + a.W;          // no row sees a slot at or past this
  const int64_t common = causal ? base + t0 + 1 : base;          // every row sees the slots before this
  const int64_t cap = (kend + kWideKeys - 1) / kWideKeys * kWideKeys;
  sc.s.resize(rows * cap);
  sc.acc.assign(rows * D, 0.0f);
  sc.l.assign(rows, 0.0f);
  sc.n.assign(rows, 0);
  sc.q.resize(rows);
  sc.srow.resize(rows);
  sc.arow.resize(rows);
  sc.prow.resize(rows);
  auto head = [&](int64_t r) { return h0 + r / nq; };
  auto query_t = [&](int64_t r) { return t0 + r % nq; };
  for (int64_t r = 0; r < rows; ++r) {
    sc.q[r] = a.q + b * a.sq[0] + head(r) * a.sq[1] + query_t(r) * a.sq[2];
    sc.srow[r] = &sc.s[r * cap];
    sc.arow[r] = &sc.acc[r * D];
    sc.prow[r] = sc.srow[r];
  }
  // Pass 1: every row's scores over [0, kend), by key block.
  for (int64_t s0 = 0; s0 < kend; s0 += kWideKeys) {
    float* out[kWideRowGroup * 8];
    for (int64_t r0 = 0; r0 < rows; r0 += kWideRowGroup * 8) {
      const int64_t n = std::min<int64_t>(rows - r0, kWideRowGroup * 8);
      for (int64_t i = 0; i < n; ++i) out[i] = sc.srow[r0 + i] + s0;
      wide_scores_rows<kWideRowGroup>(sc.q.data() + r0, n, kt + s0, ldk, D, a.scale, out);
    }
  }
  // The slots a row does not see score -inf (so the max skips them); each row's count, max and probabilities.
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* s = sc.srow[r];
    const int64_t t = query_t(r);
    int64_t n = common;
    for (int64_t j = common; j < kend; ++j) {
      if (a.sees(b, t, j - base)) ++n; else s[j] = ninf;
    }
    sc.n[r] = n;
    Z vm = zset1(ninf);
    __mmask16 nan = 0;
    int64_t j = 0;
    for (; j + 16 <= kend; j += 16) {
      const Z x = _mm512_loadu_ps(s + j);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      vm = _mm512_max_ps(vm, x);
    }
    float mr = _mm512_reduce_max_ps(vm);
    for (; j < kend; ++j) {
      nan |= s[j] != s[j];
      mr = s[j] > mr ? s[j] : mr;
    }
    // a NaN score makes the row's max (and output) NaN, like attention_tile
    const Z mv = zset1(nan ? std::numeric_limits<float>::quiet_NaN() : mr);
    for (j = 0; j < kend; j += 16) _mm512_storeu_ps(s + j, vexp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
  }
  // Pass 2: l and acc over [0, common) for every row, by key block and groups of RB rows; then the block slots.
  const float* vb = a.v + b * a.sv[0] + (h0 / (a.Hq / a.Hkv)) * a.sv[1];
  for (int64_t s0 = 0; s0 < common; s0 += kWideKeys) {
    const int64_t s1 = std::min(common, s0 + kWideKeys);
    int64_t r = 0;
    for (; r + RB <= rows; r += RB)
      wide_values<DV, RB>(sc.prow.data() + r, vb, a.sv[2], s0, s1, sc.arow.data() + r, sc.l.data() + r);
    for (; r < rows; ++r)
      wide_values<DV, 1>(sc.prow.data() + r, vb, a.sv[2], s0, s1, sc.arow.data() + r, sc.l.data() + r);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = query_t(r);
    for (int64_t j = common; j < kend; ++j)
      if (a.sees(b, t, j - base)) wide_value(sc.srow[r][j], vb + j * a.sv[2], D, sc.arow[r], sc.l[r]);
    float* out = a.out + b * a.so[0] + head(r) * a.so[1] + t * a.so[2];
    const float l = sc.l[r];
    for (int64_t d = 0; d < D; ++d) out[d * a.so[3]] = sc.n[r] == 0 ? 0.0f : sc.arow[r][d] / l;
  }
}

// Whether a call runs the wide path: a head dim it vectorises, and enough query rows per KV head for the
// transposed keys to pay: at least 12 per thread (SmolLM2's 3 query heads per KV head: 4 queries at 1 thread,
// 8 at 2). Measured per layer, 9 query / 3 KV heads, head dim 64, against attention_tile: 1 thread T = 4 at
// prefixes 512 / 2048 / 6144 81 / 290 / 914 us against 128 / 502 / 1724; 2 threads T = 8 133 / 442 / 1255
// against 141 / 550 / 1690, T = 2 80 / 229 / 675 against 43 / 161 / 475 (one-token steps stay on attention_tile).
inline bool wide_path(const AttentionArgs& a) {
  return a.D % 16 == 0 && (a.D <= 128 || a.D == 256) && a.T * (a.Hq / a.Hkv) >= 12 * at::get_num_threads();
}

std::atomic<int64_t> wide_calls{0};   // calls that ran the wide path (tests prove it ran: bi_attention_wide_calls)

void wide_attention(const AttentionArgs& a) {
  wide_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t group = a.Hq / a.Hkv;
  int64_t ldk = 0;
  for (int64_t b = 0; b < a.B; ++b) ldk = std::max(ldk, a.base[b] + a.W);
  ldk = (ldk + kWideKeys - 1) / kWideKeys * kWideKeys;
  // [B, Hkv, D, ldk], kept per calling thread between calls: a fresh buffer of this size costs its page faults
  // again on every call (as much as the transposition itself)
  thread_local std::vector<float> keys;
  if (keys.size() < static_cast<size_t>(a.B * a.Hkv * a.D * ldk)) keys.resize(a.B * a.Hkv * a.D * ldk);
  float* kt = keys.data();
  at::parallel_for(0, a.B * a.Hkv, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / a.Hkv, h = i % a.Hkv;
      transpose_keys(a.k + b * a.sk[0] + h * a.sk[1], a.sk[2], a.base[b] + a.W, a.D, kt + i * a.D * ldk, ldk);
    }
  });
  const int64_t tiles = (a.T + kWideQueries - 1) / kWideQueries;
  const int64_t heads_per_item = a.B * a.Hkv * tiles >= 2 * at::get_num_threads() ? group : 1;
  const int64_t head_items = a.Hq / heads_per_item;
  // Items by descending work (a causal chunk's later queries see more keys), dealt round-robin to the threads.
  struct Item { int64_t b, h0, t0, work; };
  std::vector<Item> items;
  items.reserve(a.B * head_items * tiles);
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t hi = 0; hi < head_items; ++hi)
      for (int64_t tile = 0; tile < tiles; ++tile) {
        const int64_t t0 = tile * kWideQueries, t1 = std::min(a.T, t0 + kWideQueries);
        items.push_back({b, hi * heads_per_item, t0, a.base[b] + (a.local == nullptr ? t1 : a.W)});
      }
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.work > y.work; });
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  at::parallel_for(0, threads, 1, [&](int64_t w0, int64_t w1) {
    WideScratch sc;
    for (int64_t w = w0; w < w1; ++w)
      for (size_t i = w; i < items.size(); i += threads) {
        const Item& it = items[i];
        const float* k = kt + (it.b * a.Hkv + it.h0 / group) * a.D * ldk;
        const int64_t t1 = std::min(a.T, it.t0 + kWideQueries), h1 = it.h0 + heads_per_item;
        switch (a.D / 16) {
          case 1: wide_tile<1>(a, k, ldk, it.b, it.h0, h1, it.t0, t1, sc); break;
          case 2: wide_tile<2>(a, k, ldk, it.b, it.h0, h1, it.t0, t1, sc); break;
          case 3: wide_tile<3>(a, k, ldk, it.b, it.h0, h1, it.t0, t1, sc); break;
          case 4: wide_tile<4>(a, k, ldk, it.b, it.h0, h1, it.t0, t1, sc); break;
          case 5: wide_tile<5>(a, k, ldk, it.b, it.h0, h1, it.t0, t1, sc); break;
          case 6: wide_tile<6>(a, k, ldk, it.b, it.h0, h1, it.t0, t1, sc); break;
          case 7: wide_tile<7>(a, k, ldk, it.b, it.h0, h1, it.t0, t1, sc); break;
          case 8: wide_tile<8>(a, k, ldk, it.b, it.h0, h1, it.t0, t1, sc); break;
          default: wide_tile<16>(a, k, ldk, it.b, it.h0, h1, it.t0, t1, sc); break;   // D = 256
        }
      }
  });
}
#endif  // __AVX512F__

at::Tensor bi_tree_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& base, const std::optional<at::Tensor>& local, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "eagle31::bi_tree_attention: float32 q, k_cache and v_cache required");
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "eagle31::bi_tree_attention: expected q [B,Hq,T,hd], k_cache and v_cache [B,Hkv,S,hd]; got q ",
              q.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes());
  TORCH_CHECK(k_cache.size(0) == q.size(0) && k_cache.size(3) == q.size(3) && k_cache.size(1) > 0 &&
                  q.size(1) % k_cache.size(1) == 0,
              "eagle31::bi_tree_attention: q ", q.sizes(), " does not fit k_cache ", k_cache.sizes(),
              ": batch and head_dim must match and Hq must be a multiple of Hkv");
  TORCH_CHECK(base.dim() == 1 && base.size(0) == q.size(0) && base.scalar_type() == at::kLong,
              "eagle31::bi_tree_attention: base must be [B] int64, got ", base.sizes(), " ", base.scalar_type());
  if (local.has_value() && local->defined())
    TORCH_CHECK(local->dim() == 3 && local->size(0) == q.size(0) && local->size(1) == q.size(2) &&
                    local->scalar_type() == at::kBool,
                "eagle31::bi_tree_attention: local must be [B, T, W] bool, got ", local->sizes(), " ",
                local->scalar_type());
  TORCH_CHECK(q.size(3) <= 256, "eagle31::bi_tree_attention: head_dim ", q.size(3), " > 256");
  // The head dim must be contiguous for the vector loads; other strides are free.
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor kc = k_cache.stride(3) == 1 ? k_cache : k_cache.contiguous();
  const at::Tensor vc = v_cache.stride(3) == 1 ? v_cache : v_cache.contiguous();
  const at::Tensor bc = base.contiguous();
  at::Tensor lc;
  if (local.has_value() && local->defined()) lc = *local;
  at::Tensor out = at::empty_like(q);
  AttentionArgs a{};
  a.q = qc.data_ptr<float>();
  a.k = kc.data_ptr<float>();
  a.v = vc.data_ptr<float>();
  a.base = bc.data_ptr<int64_t>();
  a.local = lc.defined() ? lc.data_ptr<bool>() : nullptr;
  a.out = out.data_ptr<float>();
  a.B = q.size(0);
  a.Hq = q.size(1);
  a.T = q.size(2);
  a.D = q.size(3);
  a.Hkv = k_cache.size(1);
  a.S = k_cache.size(2);
  a.W = lc.defined() ? lc.size(2) : a.T;
  for (int i = 0; i < 4; ++i) {
    a.sq[i] = qc.stride(i);
    a.sk[i] = kc.stride(i);
    a.sv[i] = vc.stride(i);
    a.so[i] = out.stride(i);
  }
  if (lc.defined())
    for (int i = 0; i < 3; ++i) a.sl[i] = lc.stride(i);
  a.scale = static_cast<float>(scale);
  for (int64_t b = 0; b < a.B; ++b)
    TORCH_CHECK(a.base[b] >= 0 && a.base[b] + a.W <= a.S, "eagle31::bi_tree_attention: row ", b, " block [",
                a.base[b], ", ", a.base[b] + a.W, ") is outside the cache's ", a.S, " slots");
#ifdef __AVX512F__
  if (wide_path(a)) {
    wide_attention(a);
    return out;
  }
#endif
  // Work items: (batch row, KV head, tile of queries), each loading a key block once for its G query heads x
  // kQueryTile queries; when that leaves too few items for the threads, the query heads split too. Neither
  // choice changes any row's arithmetic.
  constexpr int64_t kQueryTile = 8;
  const int64_t group = a.Hq / a.Hkv;
  const int64_t tiles = (a.T + kQueryTile - 1) / kQueryTile;
  const int64_t heads_per_item = a.B * a.Hkv * tiles >= 2 * at::get_num_threads() ? group : 1;
  const int64_t head_items = a.Hq / heads_per_item;
  const int64_t items = a.B * head_items * tiles;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    Scratch sc;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t tile = i % tiles, hi = (i / tiles) % head_items, b = i / (tiles * head_items);
      const int64_t h0 = hi * heads_per_item, t0 = tile * kQueryTile;
      const int64_t t1 = std::min(a.T, t0 + kQueryTile);
      if (a.D == 64)
        attention_tile<8>(a, b, h0, h0 + heads_per_item, t0, t1, sc);
      else if (a.D == 128)
        attention_tile<16>(a, b, h0, h0 + heads_per_item, t0, t1, sc);
      else
        attention_tile<0>(a, b, h0, h0 + heads_per_item, t0, t1, sc);
    }
  });
  return out;
}

int64_t bi_attention_wide_calls() {
#ifdef __AVX512F__
  return wide_calls.load(std::memory_order_relaxed);
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eagle31, m) {
  m.def("bi_attention_wide_calls() -> int", &bi_attention_wide_calls);
}

TORCH_LIBRARY_IMPL(eagle31, CPU, m) {
  m.impl("bi_linear", &bi_linear);
  m.impl("bi_linear_packed", &bi_linear_packed);
  m.impl("bi_linear_panels", &bi_linear_panels);
  m.impl("bi_tree_attention", &bi_tree_attention);
}
