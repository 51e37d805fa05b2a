// specpipe's CPU kernel, the MLP's silu(gate) * up in one call over all threads (silu_gate, engine.kernel_gate), with
// ATen's own vector exp (Sleef's, which libtorch_cpu exports) and its order of roundings: bitwise F.silu(gate) * up
// where ATen runs that silu in vectors on one thread (specpipe.engine.cpu_kernel_checks.serves_gate; checked over every bf16
// value when the kernel loads).
//
// Why: for a verify's few rows ATen runs the two elementwise ops one after the other on one thread.
// A part of kernel.cpp's one translation unit (see there).

#pragma once

#include "lanes.h"

// ---- the MLP's SiLU gate in one call ----
namespace {

// ATen's own vector exp (Vectorized<float>::exp is Sleef's, which libtorch_cpu exports): the gate must
// round as F.silu does, bit for bit. Weak: a torch that does not export it still loads the extension, and
// silu_gate then refuses to run (the load-time check says so).
#ifdef __AVX512F__
extern "C" __m512 Sleef_expf16_u10(__m512) __attribute__((weak));
inline bool has_aten_exp() { return &Sleef_expf16_u10 != nullptr; }
inline Lanes aten_exp(Lanes x) { return Sleef_expf16_u10(x); }
inline Lanes lanes_negated(Lanes x) {  // the sign bit flipped, as Vectorized<float>::neg
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}
inline Lanes lanes_div(Lanes a, Lanes b) { return _mm512_div_ps(a, b); }
// the bf16 nearest to each lane (ties to even, NaN quiet), as c10::BFloat16 rounds: as the upper halves
// of fp32 lanes
inline __m512i bf16_bits(Lanes v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7fc0));
}
inline Lanes bf16_rounded(Lanes v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
inline void store_bf16(uint16_t* p, Lanes v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}
#else
extern "C" __m256 Sleef_expf8_u10(__m256) __attribute__((weak));
inline bool has_aten_exp() { return &Sleef_expf8_u10 != nullptr; }
inline Lanes aten_exp(Lanes x) { return Sleef_expf8_u10(x); }
inline Lanes lanes_negated(Lanes x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }
inline Lanes lanes_div(Lanes a, Lanes b) { return _mm256_div_ps(a, b); }
inline __m256i bf16_bits(Lanes v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline Lanes bf16_rounded(Lanes v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16)); }
inline void store_bf16(uint16_t* p, Lanes v) {
  const __m256i bits = bf16_bits(v);  // each below 2^16: packing saturates nothing
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}
#endif
inline Lanes rounded_as(const uint16_t*, Lanes v) { return bf16_rounded(v); }
inline Lanes rounded_as(const float*, Lanes v) { return v; }
inline void store_lanes(uint16_t* p, Lanes v) { store_bf16(p, v); }
inline void store_lanes(float* p, Lanes v) { lanes_store(p, v); }

// out[r] = silu(gate_up[r, :n]) * gate_up[r, n:], each op rounded to T as F.silu(gate) * up rounds: silu
// as ATen's vector kernel computes it (x / (1 + e^-x)), then the product. Units of 256 values spread over
// the threads (ATen runs such a gate on one thread below 32768 values).
template <typename T>
void gate_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  constexpr int64_t kUnit = 256;
  const int64_t units_per_row = (n + kUnit - 1) / kUnit;
  at::parallel_for(0, rows * units_per_row, 2048 / kUnit, [&](int64_t begin, int64_t end) {
    const Lanes one = lanes_set(1.0f);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t r = unit / units_per_row, start = (unit % units_per_row) * kUnit;
      const int64_t stop = std::min(n, start + kUnit);
      const T* gate = gate_up + r * 2 * n;
      const T* up = gate + n;
      for (int64_t i = start; i < stop; i += kLanes) {
        const Lanes g = load_weights(gate + i);
        const Lanes silu = rounded_as(gate, lanes_div(g, lanes_add(one, aten_exp(lanes_negated(g)))));
        store_lanes(out + r * n + i, lanes_mul(silu, load_weights(up + i)));
      }
    }
  });
}

}  // namespace

// gate_up [..., 2n] fp32 or bf16, contiguous -> silu(gate) * up [..., n] in its dtype, bitwise F.silu(gate) *
// up where ATen runs that silu wholly in vectors (n a multiple of its two-vector step; checked when the
// kernel loads): the lean MLP's two elementwise ops, which ATen runs on one thread for a verify's few rows, in one
// pass over all threads.
torch::Tensor silu_gate(torch::Tensor gate_up) {
  const auto dtype = gate_up.scalar_type();
  TORCH_CHECK(has_aten_exp(), "this torch does not export Sleef's vector exp, which ATen's silu uses");
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "gate_up: fp32 or bf16");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.is_contiguous() && gate_up.size(-1) % (2 * kLanes) == 0,
              "gate_up: contiguous [..., 2n], n a multiple of ", kLanes);
  const int64_t n = gate_up.size(-1) / 2, rows = n ? gate_up.numel() / (2 * n) : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = n;
  auto out = torch::empty(sizes, gate_up.options());
  if (dtype == torch::kBFloat16)
    gate_rows(reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>()),
              reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), rows, n);
  else
    gate_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), rows, n);
  return out;
}
