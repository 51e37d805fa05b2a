// specpipe's CPU kernel, its vector layer: `Lanes`, kLanes fp32 lanes, and what the other parts do with them (load,
// fused multiply-add, horizontal sums, a softmax's exp), with loads of bf16, fp32 and int8 weights widened to fp32.
//
// Why: the products, the attention and the gate are written once over these names, and the build's flags pick the
// vectors: 16 lanes in 32 registers where it is compiled for AVX-512 (-mavx512f, where ATen itself runs AVX-512),
// else 8 lanes in 16 registers (AVX2/FMA). Also the includes every part needs.
// A part of kernel.cpp's one translation unit (see there).

#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>
#include <cmath>
#include <type_traits>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

// The product's vectors: 16 fp32 lanes in 32 registers where the extension is built for AVX-512, else 8
// lanes in 16 registers (AVX2). Which one is built follows the ISA ATen runs (CpuKernel.isa).
#ifdef __AVX512F__
using Lanes = __m512;
constexpr int kLanes = 16;
constexpr int kRegisters = 32;
inline Lanes lanes_zero() { return _mm512_setzero_ps(); }
inline Lanes lanes_load(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes lanes_fma(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
inline Lanes lanes_add(Lanes a, Lanes b) { return _mm512_add_ps(a, b); }
inline float lanes_sum(Lanes v) { return _mm512_reduce_add_ps(v); }
// 16 weights as fp32: bf16 ones widened (a bf16 is the upper half of an fp32), fp32 ones as they are
inline Lanes load_weights(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline Lanes load_weights(const float* p) { return _mm512_loadu_ps(p); }
// 16 int8 weights as fp32 (exact: every int8 is an fp32); the row's scale multiplies the finished sum
inline Lanes load_weights(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Lanes lanes_set(float v) { return _mm512_set1_ps(v); }
inline Lanes lanes_mul(Lanes a, Lanes b) { return _mm512_mul_ps(a, b); }
inline Lanes lanes_sub(Lanes a, Lanes b) { return _mm512_sub_ps(a, b); }
inline Lanes lanes_min(Lanes a, Lanes b) { return _mm512_min_ps(a, b); }
inline Lanes lanes_max(Lanes a, Lanes b) { return _mm512_max_ps(a, b); }
inline Lanes lanes_floor(Lanes v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// 2^n for integral n in [-126, 127]: the exponent field of an fp32
inline Lanes lanes_pow2(Lanes n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// v where `score` > -inf, else exactly 0 (a masked key adds nothing)
inline Lanes lanes_where_finite(Lanes v, Lanes score) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(score, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), v);
}
inline void lanes_store(float* p, Lanes v) { _mm512_storeu_ps(p, v); }
// out[0..4) = the sums of a's, b's, c's and d's lanes, in fewer shuffles than four reductions
inline void lanes_sum4(Lanes a, Lanes b, Lanes c, Lanes d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 blocks = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  blocks = _mm512_add_ps(blocks, _mm512_permute_ps(blocks, 0x4E));
  blocks = _mm512_add_ps(blocks, _mm512_permute_ps(blocks, 0xB1));  // every lane of block k: the k-th sum
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, blocks);
  out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
}
#else
using Lanes = __m256;
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
inline Lanes lanes_zero() { return _mm256_setzero_ps(); }
inline Lanes lanes_load(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes lanes_fma(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
inline Lanes lanes_add(Lanes a, Lanes b) { return _mm256_add_ps(a, b); }
inline float lanes_sum(Lanes v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// 8 weights as fp32: bf16 ones widened (a bf16 is the upper half of an fp32), fp32 ones as they are
inline Lanes load_weights(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline Lanes load_weights(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes load_weights(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Lanes lanes_set(float v) { return _mm256_set1_ps(v); }
inline Lanes lanes_mul(Lanes a, Lanes b) { return _mm256_mul_ps(a, b); }
inline Lanes lanes_sub(Lanes a, Lanes b) { return _mm256_sub_ps(a, b); }
inline Lanes lanes_min(Lanes a, Lanes b) { return _mm256_min_ps(a, b); }
inline Lanes lanes_max(Lanes a, Lanes b) { return _mm256_max_ps(a, b); }
inline Lanes lanes_floor(Lanes v) { return _mm256_floor_ps(v); }
// 2^n for integral n in [-126, 127]: the exponent field of an fp32
inline Lanes lanes_pow2(Lanes n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
// v where `score` > -inf, else exactly 0 (a masked key adds nothing)
inline Lanes lanes_where_finite(Lanes v, Lanes score) {
  return _mm256_and_ps(v, _mm256_cmp_ps(score, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
}
inline void lanes_store(float* p, Lanes v) { _mm256_storeu_ps(p, v); }
// out[0..4) = the sums of a's, b's, c's and d's lanes, in fewer shuffles than four reductions
inline void lanes_sum4(Lanes a, Lanes b, Lanes c, Lanes d, float* out) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
}
#endif

// e^x for x <= 0 (softmax weights), within ~2 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7
// polynomial (the Taylor series' coefficients adjusted for the interval, as in Cephes' expf), times 2^n.
// Below -87.3 the result is clamped to ~2^-126 instead of denormals: weights that small vanish beside
// the row's largest, which is 1.
inline Lanes lanes_exp(Lanes x) {
  x = lanes_max(lanes_min(x, lanes_set(88.3f)), lanes_set(-87.3f));
  const Lanes n = lanes_floor(lanes_fma(x, lanes_set(1.44269504088896341f), lanes_set(0.5f)));
  // r = x - n ln2, ln2 in two parts so that n * 0.693359375 is exact
  Lanes r = lanes_sub(x, lanes_mul(n, lanes_set(0.693359375f)));
  r = lanes_sub(r, lanes_mul(n, lanes_set(-2.12194440e-4f)));
  Lanes y = lanes_set(1.9875691500e-4f);
  y = lanes_fma(y, r, lanes_set(1.3981999507e-3f));
  y = lanes_fma(y, r, lanes_set(8.3334519073e-3f));
  y = lanes_fma(y, r, lanes_set(4.1665795894e-2f));
  y = lanes_fma(y, r, lanes_set(1.6666665459e-1f));
  y = lanes_fma(y, r, lanes_set(5.0000001201e-1f));
  y = lanes_fma(y, lanes_mul(r, r), lanes_add(r, lanes_set(1.0f)));
  return lanes_mul(y, lanes_pow2(n));
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float as_float(uint16_t v) { return bf16_to_float(v); }
inline float as_float(float v) { return v; }
inline float as_float(int8_t v) { return static_cast<float>(v); }

}  // namespace
