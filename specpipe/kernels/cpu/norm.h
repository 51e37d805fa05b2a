// specpipe's CPU kernel, LlamaRMSNorm in one call (rms_norm): the mean of squares summed in ATen's own order (its
// cascade sum over 8-lane vectors), then each op rounded as torch's separate ops round it, so the output is bitwise
// transformers' norm (specpipe.engine.cpu_kernel checks that when the kernel loads, and leaves the norm unused where
// this torch sums otherwise).
//
// Why: torch runs an RMSNorm as several small ops, and a small model's forward has dozens of norms; the lean forward
// (engine.kernel_norm) makes each one call.
// A part of kernel.cpp's one translation unit (see there).

#pragma once

#include "lanes.h"

namespace {

// ATen's cascade sum (SumKernel.cpp's multi_row_sum) of `size` elements of `nrows` interleaved
// accumulators: element (i, k) is at(i * nrows + k). The same chunking, in the same order, so the
// sum is bitwise ATen's: 16 or more elements per chunk, chunk sums added level by level.
template <typename Acc, int nrows, typename At>
void cascade_sum(Acc (&out)[nrows], int64_t size, At at) {
  constexpr int num_levels = 4;
  const int64_t ceil_log2 = size <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(size - 1));
  const int64_t level_power = std::max<int64_t>(4, ceil_log2 / num_levels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  Acc acc[num_levels][nrows];
  for (int j = 0; j < num_levels; ++j)
    for (int k = 0; k < nrows; ++k) acc[j][k] = Acc::zero();
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < nrows; ++k) acc[0][k] = acc[0][k] + at(i * nrows + k);
    for (int j = 1; j < num_levels; ++j) {
      for (int k = 0; k < nrows; ++k) {
        acc[j][k] = acc[j][k] + acc[j - 1][k];
        acc[j - 1][k] = Acc::zero();
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < nrows; ++k) acc[0][k] = acc[0][k] + at(i * nrows + k);
  for (int j = 1; j < num_levels; ++j)
    for (int k = 0; k < nrows; ++k) acc[0][k] = acc[0][k] + acc[j][k];
  for (int k = 0; k < nrows; ++k) out[k] = acc[0][k];
}

struct Lanes8 {  // ATen's AVX2 Vectorized<float>: adds lane by lane
  __m256 v;
  static Lanes8 zero() { return {_mm256_setzero_ps()}; }
  Lanes8 operator+(const Lanes8& other) const { return {_mm256_add_ps(v, other.v)}; }
};

struct Scalar {
  float v;
  static Scalar zero() { return {0.0f}; }
  Scalar operator+(const Scalar& other) const { return {v + other.v}; }
};

// sum(square(x[0..n))) in ATen's order for a contiguous last-dimension sum of fp32 values:
// vectors of 8 lanes summed by row_sum (4 interleaved cascades), the scalar tail summed from 0, then
// the 8 lanes added to it one by one; rows shorter than 8 take the scalar row_sum. `squares` holds
// x * x already rounded to fp32, as torch's pow(2) leaves it.
float sum_of_squares(const float* squares, int64_t n) {
  if (n >= 8) {
    const int64_t vectors = n / 8, interleaved = vectors / 4;
    Lanes8 partial[4];
    cascade_sum<Lanes8, 4>(partial, interleaved, [&](int64_t v) { return Lanes8{_mm256_loadu_ps(squares + 8 * v)}; });
    for (int64_t v = interleaved * 4; v < vectors; ++v) partial[0] = partial[0] + Lanes8{_mm256_loadu_ps(squares + 8 * v)};
    for (int k = 1; k < 4; ++k) partial[0] = partial[0] + partial[k];
    float total = 0.0f;
    for (int64_t k = vectors * 8; k < n; ++k) total += squares[k];
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, partial[0].v);
    for (int k = 0; k < 8; ++k) total += lanes[k];
    return total;
  }
  const int64_t interleaved = n / 4;
  Scalar partial[4];
  cascade_sum<Scalar, 4>(partial, interleaved, [&](int64_t i) { return Scalar{squares[i]}; });
  for (int64_t i = interleaved * 4; i < n; ++i) partial[0] = partial[0] + Scalar{squares[i]};
  for (int k = 1; k < 4; ++k) partial[0] = partial[0] + partial[k];
  return partial[0].v;
}

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(n), squares(n);
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * n;
      for (int64_t k = 0; k < n; ++k) {
        widened[k] = to_float(row[k]);
        squares[k] = widened[k] * widened[k];
      }
      // mean, + eps, rsqrt: each rounded to fp32 as torch's separate ops round them
      const float mean = sum_of_squares(squares.data(), n) / static_cast<float>(n);
      const float inverse_rms = 1.0f / std::sqrt(mean + eps);
      for (int64_t k = 0; k < n; ++k) {
        const float normalized = widened[k] * inverse_rms;
        // fp32: weight * normalized; bf16: normalized rounded to bf16, then times the weight, rounded
        out[r * n + k] = static_cast<T>(to_float(weight[k]) * to_float(static_cast<T>(normalized)));
      }
    }
  });
}

}  // namespace

// LlamaRMSNorm.forward in one call: x [..., n] fp32 or bf16, weight [n] of x's dtype -> [..., n].
// The normalization runs in fp32 with torch's own order of sums and roundings (bitwise equal to
// transformers' norm, checked when the kernel loads), in place of the several small ops of torch.rms_norm
// over a few hundred values each.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == torch::kFloat32, "x: fp32 or bf16 [..., n]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "weight: [n] of x's dtype");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  auto out = torch::empty_like(x);
  const float eps32 = static_cast<float>(eps);  // torch adds eps as a scalar of the tensor's dtype
  if (bf16)
    rms_norm_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), rows, n,
                  eps32);
  else
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, n, eps32);
  return out;
}
